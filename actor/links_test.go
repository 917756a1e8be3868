package actor

import (
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/wire"
)

// Device stores say where their key sits in the prompt's chain: the first
// a root, each other chained from the key before it, split engine blocks
// and re-indexed parents included, as the index's jump search needs.
func TestStoresCarryTheirLinks(t *testing.T) {
	var hasher index.Hasher
	check := func(t *testing.T, ops []index.Op, want []uint64) {
		t.Helper()
		if len(ops) != len(want) {
			t.Fatalf("ops %v, want %d stores", ops, len(want))
		}
		for i, op := range ops {
			link, parent := index.LinkRoot, uint64(0)
			if i > 0 {
				link, parent = index.LinkChild, want[i-1]
			}
			if op.Kind != index.OpStore || op.Hash != want[i] || op.Link != link || op.Parent != parent {
				t.Errorf("op %d = %+v, want store of %x, link %d, parent %x", i, op, want[i], link, parent)
			}
		}
	}
	t.Run("chained events", func(t *testing.T) {
		h := newHarness(t)
		toks := tokens(7, 3, 16)
		h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{70, 71}, TokenIDs: toks[:32], BlockSize: 16},
			codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{72}, ParentHash: 71, HasParent: true, TokenIDs: toks[32:], BlockSize: 16})
		check(t, h.ops, hasher.Prompt(nil, toks, 16))
	})
	t.Run("split blocks", func(t *testing.T) {
		h := newHarness(t)
		toks := tokens(9, 4, 16)
		h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{90}, TokenIDs: toks[:32], BlockSize: 32},
			codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{91}, ParentHash: 90, HasParent: true, TokenIDs: toks[32:], BlockSize: 32})
		check(t, h.ops, hasher.Prompt(nil, toks, 16))
	})
	t.Run("a re-indexed parent", func(t *testing.T) {
		h := newHarness(t)
		toks := tokens(5, 2, 16)
		h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{50}, TokenIDs: toks[:16], BlockSize: 16})
		h.a.HandleReset(wire.ResetHistoryMissing) // keeps the mapping: the next store re-indexes its parent
		h.collect()
		h.ops = h.ops[:0]
		h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{51}, ParentHash: 50, HasParent: true, TokenIDs: toks[16:], BlockSize: 16})
		keys := hasher.Prompt(nil, toks, 16)
		var stores []index.Op
		for _, op := range h.ops {
			if op.Kind == index.OpStore {
				stores = append(stores, op)
			}
		}
		check(t, stores, keys)
	})
}
