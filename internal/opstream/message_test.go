package opstream

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvpipe/kvpipe/index"
)

// everyOp has each kind in each tier, with hashes of every byte width,
// then stores of every link: a root, a chain from the op before, a child
// of another key, one of unknown link, and a remove chained as a store.
func everyOp() []index.Op {
	var ops []index.Op
	h := uint64(1)
	for k := index.OpStore; k <= index.OpClearTier; k++ {
		for t := range index.Tier(index.NumTiers) {
			ops = append(ops, index.Op{Kind: k, Tier: t, Hash: h})
			h = h<<7 | 0x5a
		}
	}
	return append(ops,
		index.Op{Kind: index.OpStore, Hash: ^uint64(0), Link: index.LinkRoot},
		index.Op{Kind: index.OpStore, Hash: 11, Link: index.LinkChild, Parent: ^uint64(0)},
		index.Op{Kind: index.OpStore, Tier: index.TierHost, Hash: 12, Link: index.LinkChild, Parent: 0x0102030405060708},
		index.Op{Kind: index.OpStore, Hash: 13, Link: index.LinkNone},
		index.Op{Kind: index.OpRemove, Tier: index.TierRemote, Hash: 14, Link: index.LinkChild, Parent: 13},
	)
}

func TestMessageRoundTrip(t *testing.T) {
	for _, h := range []Header{{}, {Partial: true}, {Eagle: true}, {Partial: true, Eagle: true}} {
		ops := everyOp()
		msg, err := AppendMessage([]byte("prefix"), h, ops)
		if err != nil {
			t.Fatal(err)
		}
		// One op names a parent that is not the op before's key: 8 more bytes.
		if string(msg[:6]) != "prefix" || len(msg) != 6+2+9*len(ops)+8 {
			t.Fatalf("message of %d bytes, want the prefix kept and 2+9×%d+8 more", len(msg), len(ops))
		}
		got, gotH, err := DecodeMessage(msg[6:], nil)
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(ops, got); diff != "" || gotH != h {
			t.Errorf("%+v: round trip differs (header %+v): %s", h, gotH, diff)
		}
	}
}

// The layout is the documented one, byte for byte.
func TestMessageLayout(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    Header
		ops  []index.Op
		want []byte
	}{
		{"a remove on disk", Header{Partial: true}, []index.Op{{Kind: index.OpRemove, Tier: index.TierDisk, Hash: 0x0102030405060708}},
			[]byte{MessageVersion, FlagPartial, byte(index.OpRemove) | byte(index.TierDisk)<<4, 8, 7, 6, 5, 4, 3, 2, 1}},
		{"a root, its child, a child of another key", Header{Eagle: true}, []index.Op{
			{Kind: index.OpStore, Hash: 5, Link: index.LinkRoot},
			{Kind: index.OpStore, Hash: 6, Link: index.LinkChild, Parent: 5},
			{Kind: index.OpStore, Tier: index.TierHost, Hash: 7, Link: index.LinkChild, Parent: 9},
		}, []byte{MessageVersion, FlagEagle,
			1 << 6, 5, 0, 0, 0, 0, 0, 0, 0,
			3 << 6, 6, 0, 0, 0, 0, 0, 0, 0,
			2<<6 | 1<<4, 7, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0}},
	} {
		msg, err := AppendMessage(nil, tc.h, tc.ops)
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(tc.want, msg); diff != "" {
			t.Errorf("%s: %s", tc.name, diff)
		}
	}
}

// A version 1 message, as relays before links wrote them, still decodes:
// its ops carry no links, and its flags byte knows only FlagPartial.
func TestVersion1MessagesStillRead(t *testing.T) {
	v1 := []byte{1, FlagPartial,
		byte(index.OpStore) | byte(index.TierDisk)<<4, 8, 7, 6, 5, 4, 3, 2, 1,
		byte(index.OpClearWorker), 0, 0, 0, 0, 0, 0, 0, 0}
	ops, h, err := DecodeMessage(v1, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := []index.Op{{Kind: index.OpStore, Tier: index.TierDisk, Hash: 0x0102030405060708}, {Kind: index.OpClearWorker}}
	if diff := cmp.Diff(want, ops); diff != "" || h != (Header{Partial: true}) {
		t.Errorf("header %+v: %s", h, diff)
	}
	for _, bad := range [][]byte{
		{1, FlagEagle, byte(index.OpClearWorker), 0, 0, 0, 0, 0, 0, 0, 0},  // no EAGLE flag in version 1
		{1, 0, byte(index.OpStore) | 3<<6, 0, 0, 0, 0, 0, 0, 0, 0},         // its high nibble is a tier: 12
		{1, 0, byte(index.OpStore), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, // 9 + 7 bytes
	} {
		if _, _, err := DecodeMessage(bad, nil); !errors.Is(err, errMessage) {
			t.Errorf("%x: error %v, want errMessage", bad, err)
		}
	}
}

func TestMessageErrors(t *testing.T) {
	good, err := AppendMessage(nil, Header{}, []index.Op{{Kind: index.OpStore, Hash: 7}, {Kind: index.OpClearWorker}})
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
		{"unknown version", with(0, 3), "version 3, this build reads 1 and 2"},
		{"version zero", with(0, 0), "version 0"},
		{"unknown flag", with(1, 0x86), "unknown flags 0x84 for version 2"},
		{"truncated op", good[:len(good)-1], "op 1 truncated: 8 bytes"},
		{"one byte of an op", good[:3], "op 0 truncated: 1 bytes"},
		{"a parent cut short", append(append([]byte(nil), good[:2+9]...), 1, 2, 3), "op 1 truncated: 3 bytes"},
		{"a parent missing", []byte{MessageVersion, 0, 2 << 6, 7, 0, 0, 0, 0, 0, 0, 0}, "op 0 truncated: its parent has 0 of 8 bytes"},
		{"a parent of 3 bytes", []byte{MessageVersion, 0, 2 << 6, 7, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3}, "op 0 truncated: its parent has 3 of 8 bytes"},
		{"a parent read from the op after", with(2, 2<<6), "op 1 truncated: 1 bytes"},
		{"the first op chained from the one before", with(2, 3<<6), "op 0 is chained from the op before"},
		{"unknown kind", with(2+9, 5), "op 1: unknown kind 5"},
		{"kind in the high range", with(2, 0x0f), "op 0: unknown kind 15"},
		{"version 1, bad tier", append([]byte{1, 0}, with(2, byte(index.NumTiers)<<4)[2:]...), "op 0: tier 4, there are 4"},
	} {
		ops, _, err := DecodeMessage(tc.data, make([]index.Op, 0, 4))
		if !errors.Is(err, errMessage) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want errMessage saying %q", tc.name, err, tc.want)
		}
		_ = ops
	}
	for _, op := range []index.Op{{Kind: index.OpClearTier + 1}, {Kind: index.OpStore, Tier: index.NumTiers}, {Kind: index.OpStore, Link: index.LinkChild + 1}} {
		dst := []byte("keep")
		got, err := AppendMessage(dst, Header{}, []index.Op{{Kind: index.OpStore}, op})
		if err == nil || string(got) != "keep" {
			t.Errorf("op %+v: appendMessage = %q, %v; want an error and dst as it was", op, got, err)
		}
	}
}

func TestDecodeMessageReusesDst(t *testing.T) {
	msg, _ := AppendMessage(nil, Header{}, everyOp())
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
	buf, _ := AppendMessage(nil, Header{Partial: true}, ops)
	dst, _, _ := DecodeMessage(buf, nil)
	if n := testing.AllocsPerRun(100, func() { buf, _ = AppendMessage(buf[:0], Header{Partial: true}, ops) }); n != 0 {
		t.Errorf("appendMessage allocates %.1f times, want 0", n)
	}
	if n := testing.AllocsPerRun(100, func() { dst, _, _ = DecodeMessage(buf, dst) }); n != 0 {
		t.Errorf("decodeMessage allocates %.1f times, want 0", n)
	}
}
