package relaypub

import (
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/opstream"
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

func TestMessageIDs(t *testing.T) {
	msg, _ := opstream.AppendMessage(nil, opstream.Header{}, everyOp())
	other, _ := opstream.AppendMessage(nil, opstream.Header{Partial: true}, everyOp())
	fresh := freshLineage("w")
	id, l := appendBatchID(nil, "w", 42, 0xabc, 1, fresh, msg)
	if !strings.HasPrefix(string(id), "w.42.abc.1.") {
		t.Errorf("batch id %q, want w.42.abc.1.<lineage>", id)
	}
	if got, ok := lineageOf(string(id)); !ok || got != l {
		t.Errorf("lineageOf(%q) = %x, %v; want %x", id, got, ok, l)
	}
	// The same message after the same history: the same id, in any relay.
	if again, _ := appendBatchID(nil, "w", 42, 0xabc, 1, fresh, msg); string(again) != string(id) {
		t.Errorf("same batch, same lineage: ids %q and %q", id, again)
	}
	// Anything else differing: another id, and another lineage after it.
	for name, other := range map[string][]byte{
		"other ops":     mustID(appendBatchID(nil, "w", 42, 0xabc, 1, fresh, other)),
		"other history": mustID(appendBatchID(nil, "w", 42, 0xabc, 1, fresh+1, msg)),
		"other part":    mustID(appendBatchID(nil, "w", 42, 0xabc, 2, fresh, msg)),
		"other seq":     mustID(appendBatchID(nil, "w", 43, 0xabc, 1, fresh, msg)),
		"other worker":  mustID(appendBatchID(nil, "v", 42, 0xabc, 1, fresh, msg)),
	} {
		if string(other) == string(id) {
			t.Errorf("%s: same id %q", name, id)
		}
	}
	a, _ := appendOtherID(nil, "w", 0x77, 1, fresh, msg)
	b, _ := appendOtherID(nil, "w", 0x77, 2, fresh, msg)
	if !strings.HasPrefix(string(a), "w.r77.1.") || string(a) == string(b) {
		t.Errorf("other ids %q, %q: want w.r77.<counter>.<lineage>, distinct", a, b)
	}
	if _, ok := lineageOf("no-dot"); ok {
		t.Error("lineageOf found a lineage in an id without one")
	}
}

func mustID(id []byte, _ lineage) []byte { return id }
