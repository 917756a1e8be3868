package opstream

import (
	"bytes"
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
