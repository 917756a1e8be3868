package opstream

import (
	"bytes"
	"encoding/binary"
	"errors"
	"slices"
	"testing"

	"github.com/kvpipe/kvpipe/index"
)

// FuzzMessage: any bytes either fail with errMessage or decode, and then
// encode to a message that decodes to the same ops and header, and that
// encodes to itself (a version 1 message, or a parent sent in full where
// it is the op before's key, encode shorter); nothing panics.
func FuzzMessage(f *testing.F) {
	good, _ := AppendMessage(nil, Header{Partial: true}, everyOp())
	f.Add(good)
	f.Add(good[:len(good)-3])
	f.Add([]byte{MessageVersion, 0})
	f.Add([]byte{MessageVersion, 0, byte(index.OpClearWorker), 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{1, 1, 0x30, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{2, 3, 1 << 6, 5, 0, 0, 0, 0, 0, 0, 0, 2 << 6, 6, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 3 << 6, 7, 0, 0, 0, 0, 0, 0, 0})
	var dst []index.Op
	f.Fuzz(func(t *testing.T, data []byte) {
		ops, h, err := DecodeMessage(data, dst)
		dst = ops
		if err != nil {
			if !errors.Is(err, errMessage) {
				t.Fatalf("error %v does not wrap errMessage", err)
			}
			return
		}
		again, err := AppendMessage(nil, h, ops)
		if err != nil {
			t.Fatalf("decoded ops do not encode: %v", err)
		}
		ops2, h2, err := DecodeMessage(again, nil)
		if err != nil || h2 != h || !slices.Equal(ops2, ops) {
			t.Fatalf("re-encoded %x decodes to %+v %v (%v), from %x: %+v %v", again, ops2, h2, err, data, ops, h)
		}
		if data[0] == MessageVersion && len(again) == len(data) && !bytes.Equal(again, data) {
			t.Fatalf("re-encoded %x, decoded from %x", again, data)
		}
		if third, _ := AppendMessage(nil, h2, ops2); !bytes.Equal(third, again) {
			t.Fatalf("encoding is not stable: %x, then %x", again, third)
		}
	})
}

// FuzzAppendMessage: any ops the encoder takes (made from the fuzzer's
// bytes, 18 a op) decode to themselves, but that a parent is kept only
// where the link is LinkChild (the index reads it nowhere else).
func FuzzAppendMessage(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add(bytes.Repeat([]byte{0x40, 0, 0, 2, 7, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0}, 3))
	f.Fuzz(func(t *testing.T, data []byte) {
		var ops []index.Op
		for ; len(data) >= 18; data = data[18:] {
			ops = append(ops, index.Op{Kind: index.OpKind(data[0] % 8), Tier: index.Tier(data[1] % 5), Link: index.Link(data[2] % 4),
				Hash: binary.LittleEndian.Uint64(data[2:]), Parent: binary.LittleEndian.Uint64(data[10:])})
		}
		if len(ops) == 0 {
			return
		}
		msg, err := AppendMessage(nil, Header{Eagle: true}, ops)
		valid := !slices.ContainsFunc(ops, func(op index.Op) bool {
			return op.Kind > index.OpClearTier || op.Tier >= index.NumTiers || op.Link > index.LinkChild
		})
		if (err == nil) != valid {
			t.Fatalf("ops %+v: error %v, want one iff an op is out of range", ops, err)
		}
		if err != nil {
			return
		}
		got, h, err := DecodeMessage(msg, nil)
		if err != nil || !h.Eagle || h.Partial {
			t.Fatalf("%x: %v, header %+v", msg, err, h)
		}
		for i := range ops {
			if ops[i].Link != index.LinkChild {
				ops[i].Parent = 0
			}
		}
		if !slices.Equal(got, ops) {
			t.Fatalf("decoded %+v, want %+v", got, ops)
		}
	})
}
