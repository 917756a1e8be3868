package opstream

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvpipe/kvpipe/index"
)

// everyOp has each kind in each tier, with hashes of every byte width.
func everyOp() []index.Op {
	var ops []index.Op
	h := uint64(1)
	for k := index.OpStore; k <= index.OpClearTier; k++ {
		for t := range index.Tier(index.NumTiers) {
			ops = append(ops, index.Op{Kind: k, Tier: t, Hash: h})
			h = h<<7 | 0x5a
		}
	}
	return append(ops, index.Op{Kind: index.OpStore, Hash: ^uint64(0)})
}

func TestMessageRoundTrip(t *testing.T) {
	for _, partial := range []bool{false, true} {
		ops := everyOp()
		msg, err := AppendMessage([]byte("prefix"), partial, ops)
		if err != nil {
			t.Fatal(err)
		}
		if string(msg[:6]) != "prefix" || len(msg) != 6+2+9*len(ops) {
			t.Fatalf("message of %d bytes, want the prefix kept and 2+9×%d more", len(msg), len(ops))
		}
		got, gotPartial, err := DecodeMessage(msg[6:], nil)
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(ops, got); diff != "" || gotPartial != partial {
			t.Errorf("partial %v: round trip differs (partial %v): %s", partial, gotPartial, diff)
		}
	}
}

// The layout is the documented one, byte for byte.
func TestMessageLayout(t *testing.T) {
	msg, err := AppendMessage(nil, true, []index.Op{{Kind: index.OpRemove, Tier: index.TierDisk, Hash: 0x0102030405060708}})
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{MessageVersion, FlagPartial, byte(index.OpRemove) | byte(index.TierDisk)<<4, 8, 7, 6, 5, 4, 3, 2, 1}
	if diff := cmp.Diff(want, msg); diff != "" {
		t.Error(diff)
	}
}

func TestMessageErrors(t *testing.T) {
	good, err := AppendMessage(nil, false, []index.Op{{Kind: index.OpStore, Hash: 7}, {Kind: index.OpClearWorker}})
	if err != nil {
		t.Fatal(err)
	}
	with := func(i int, b byte) []byte {
		m := append([]byte(nil), good...)
		m[i] = b
		return m
	}
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "shorter than the 2-byte header"},
		{"version only", good[:1], "shorter than the 2-byte header"},
		{"no ops", good[:2], "no ops"},
		{"unknown version", with(0, 2), "version 2, this build reads 1"},
		{"version zero", with(0, 0), "version 0"},
		{"unknown flag", with(1, 0x82), "unknown flags 0x82"},
		{"truncated op", good[:len(good)-1], "truncated: 17 bytes"},
		{"one byte of an op", good[:3], "truncated: 1 bytes"},
		{"unknown kind", with(2+9, 5), "op 1: unknown kind 5"},
		{"kind in the high range", with(2, 0x0f), "op 0: unknown kind 15"},
		{"bad tier", with(2, byte(index.NumTiers)<<4), "op 0: tier 4, there are 4"},
	} {
		ops, _, err := DecodeMessage(tc.data, make([]index.Op, 0, 4))
		if !errors.Is(err, errMessage) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want errMessage saying %q", tc.name, err, tc.want)
		}
		_ = ops
	}
	for _, op := range []index.Op{{Kind: index.OpClearTier + 1}, {Kind: index.OpStore, Tier: index.NumTiers}} {
		dst := []byte("keep")
		got, err := AppendMessage(dst, false, []index.Op{{Kind: index.OpStore}, op})
		if err == nil || string(got) != "keep" {
			t.Errorf("op %+v: appendMessage = %q, %v; want an error and dst as it was", op, got, err)
		}
	}
}

func TestDecodeMessageReusesDst(t *testing.T) {
	msg, _ := AppendMessage(nil, false, everyOp())
	dst := make([]index.Op, 3, 64)
	ops, _, err := DecodeMessage(msg, dst)
	if err != nil || &ops[0] != &dst[:1][0] {
		t.Errorf("decoded into another array (err %v): want dst reused", err)
	}
}

func TestMessageAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	ops := everyOp()
	buf, _ := AppendMessage(nil, true, ops)
	dst, _, _ := DecodeMessage(buf, nil)
	if n := testing.AllocsPerRun(100, func() { buf, _ = AppendMessage(buf[:0], true, ops) }); n != 0 {
		t.Errorf("appendMessage allocates %.1f times, want 0", n)
	}
	if n := testing.AllocsPerRun(100, func() { dst, _, _ = DecodeMessage(buf, dst) }); n != 0 {
		t.Errorf("decodeMessage allocates %.1f times, want 0", n)
	}
}
