package actor

import (
	"context"
	"maps"
	"slices"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/snapshot"
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

// scoreOf applies ops to a one-shard index as worker 1 and matches keys.
func scoreOf(t *testing.T, ops []index.Op, keys []uint64) int {
	t.Helper()
	s := index.NewShards(1, 16)
	defer s.Close()
	for part := range slices.Chunk(ops, 64) {
		s.Queue(1) <- &index.Batch{Worker: 1, Ops: slices.Clone(part)}
	}
	if err := s.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, err := s.FindMatches(context.Background(), nil, keys)
	if err != nil {
		t.Fatal(err)
	}
	for _, sc := range got {
		if sc.Worker == 1 {
			return sc.Blocks
		}
	}
	return 0
}

// A block stored again under another key (its engine hash leaves out
// something the router's key has) leaves its children with keys hashed
// from its old one. Their stores must then claim no parent: a child linked
// to its parent's new key would close the worker, and jump search would
// claim the whole chain for a prompt that reaches only its root. Each way
// the mapping's blocks are indexed again (a snapshot's ops, an imported
// snapshot, a re-index after a reset) scores as the live ops do.
func TestRekeyedParentLinksNoChild(t *testing.T) {
	var hasher index.Hasher
	toks := tokens(1, 3, 16)
	keys := hasher.Prompt(nil, toks, 16)
	rekeyed := func(t *testing.T) *harness {
		h := newHarness(t)
		h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{49, 50, 51}, TokenIDs: toks, BlockSize: 16},
			codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{50}, ParentHash: 49, HasParent: true, TokenIDs: tokens(2, 1, 16), BlockSize: 16})
		return h
	}
	live := scoreOf(t, rekeyed(t).ops, keys)
	if live != 1 {
		t.Fatalf("live ops score %d, want 1: block 50's new key breaks the chain", live)
	}
	var w snapshot.Worker
	h := rekeyed(t)
	h.a.Export(&w)
	if !w.Rekeyed {
		t.Error("exported worker not Rekeyed")
	}
	if got := scoreOf(t, w.AppendOps([]index.Op{{Kind: index.OpClearWorker}}), keys); got != live {
		t.Errorf("the snapshot's ops score %d, the live ops %d", got, live)
	}
	imp := newHarness(t)
	imp.a.Import(&w)
	imp.a.HandleResumed()
	imp.collect()
	if got := scoreOf(t, imp.ops, keys); got != live {
		t.Errorf("an imported snapshot's ops score %d, the live ops %d", got, live)
	}
	h.a.HandleReset(wire.ResetHistoryMissing) // the mapping stays, its blocks out of the index
	h.collect()
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{52}, ParentHash: 51, HasParent: true, TokenIDs: tokens(3, 1, 16), BlockSize: 16})
	if got := scoreOf(t, h.ops, keys); got != live {
		t.Errorf("re-indexed after a reset, the ops score %d, the live ops %d", got, live)
	}
	h.send(codec.Event{Type: codec.AllBlocksCleared})
	h.a.Export(&w)
	if w.Rekeyed {
		t.Error("still Rekeyed after a clear")
	}
}

// snapshot.Worker.AppendOps, which rebuilds a worker's entries where no
// actor runs (a relay's republish, a follower loading a snapshot), links
// its device stores as the actor itself does when it indexes an imported
// snapshot: split blocks, a host copy, an evicted middle block, a resync.
func TestAppendOpsLinksAsTheActor(t *testing.T) {
	h := newHarness(t)
	toks := tokens(3, 4, 32) // engine blocks of 32, router blocks of 16: split
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1, 2, 3, 4}, TokenIDs: toks, BlockSize: 32, Medium: "GPU"})
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{5, 6}, ParentHash: 2, HasParent: true, TokenIDs: tokens(4, 2, 32), BlockSize: 32, Medium: "GPU"})
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{2, 3}, ParentHash: 1, HasParent: true, TokenIDs: toks[32:96], BlockSize: 32, Medium: "CPU"})
	h.send(codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{3}, Medium: "GPU"})
	h.a.HandleReset(wire.ResetHistoryMissing)
	h.collect()
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{7}, ParentHash: 5, HasParent: true, TokenIDs: tokens(5, 1, 32), BlockSize: 32, Medium: "GPU"})
	var w snapshot.Worker
	h.a.Export(&w)
	imp := newHarness(t)
	imp.a.Import(&w)
	imp.a.HandleResumed()
	imp.collect()
	type store struct {
		tier        index.Tier
		key, parent uint64
		link        index.Link
	}
	stores := func(ops []index.Op) map[store]int {
		m := map[store]int{}
		for _, op := range ops {
			if op.Kind == index.OpStore {
				m[store{op.Tier, op.Hash, op.Parent, op.Link}]++
			}
		}
		return m
	}
	want, got := stores(imp.ops), stores(w.AppendOps(nil))
	if len(want) < 8 || !maps.Equal(got, want) {
		t.Errorf("AppendOps' stores %v\nthe actor's %v", got, want)
	}
}
