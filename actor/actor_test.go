package actor

import (
	"context"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/wire"
)

// harness runs an actor against a plain channel, recording every op.
type harness struct {
	t     *testing.T
	a     *Actor
	shard chan *index.Batch
	ops   []index.Op
}

func newHarness(t *testing.T) *harness {
	ch := make(chan *index.Batch, 16)
	return &harness{t: t, a: New(Config{Worker: 1, Name: "w1", BlockSize: 16, Sink: index.NewSender(1, ch, nil)}), shard: ch}
}

func (h *harness) send(events ...codec.Event) {
	p := engineenc.AppendBatch(nil, &codec.Batch{Events: events}, engineenc.CurrentVLLM)
	h.a.HandleBatch(0, p)
	h.collect()
}

func (h *harness) collect() {
	for {
		select {
		case b := <-h.shard:
			h.ops = append(h.ops, b.Ops...)
		default:
			return
		}
	}
}

func (h *harness) stores() (n int) {
	for _, op := range h.ops {
		if op.Kind == index.OpStore {
			n++
		}
	}
	return n
}

// tokens returns n blocks of bs tokens, distinct per seed.
func tokens(seed, n, bs int) []uint32 {
	out := make([]uint32, n*bs)
	for i := range out {
		out[i] = uint32(seed*100_000 + i)
	}
	return out
}

func stored(hash uint64, bs int, mods ...func(*codec.Event)) codec.Event {
	e := codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{hash}, TokenIDs: tokens(int(hash), 1, bs), BlockSize: bs}
	for _, m := range mods {
		m(&e)
	}
	return e
}

func group(idx int, kind string) func(*codec.Event) {
	return func(e *codec.Event) { e.GroupIdx, e.HasGroupIdx, e.SpecKind = idx, true, kind }
}
func medium(m string) func(*codec.Event) { return func(e *codec.Event) { e.Medium = m } }

func cleared() codec.Event { return codec.Event{Type: codec.AllBlocksCleared} }

func TestNormalisationRules(t *testing.T) {
	cases := []struct {
		name     string
		events   []codec.Event
		stores   int
		filtered map[Reason]uint64
		warnings uint64
	}{
		{"partial tail after a full block is filtered",
			[]codec.Event{stored(1, 16), stored(2, 4)}, 1, map[Reason]uint64{PartialBlock: 1}, 0},
		{"undersized before any full block is converted and warns",
			[]codec.Event{stored(1, 4), stored(2, 16)}, 2, nil, 1},
		{"a filtered group does not prove the block size",
			[]codec.Event{stored(1, 16, group(1, "sliding_window")), stored(2, 4)}, 1, map[Reason]uint64{NonMainAttention: 1}, 1},
		{"AllBlocksCleared resets the history",
			[]codec.Event{stored(1, 16), cleared(), stored(2, 4)}, 2, nil, 1},
		{"an engine back with another block size warns again",
			[]codec.Event{stored(1, 16), cleared(), stored(2, 4), stored(3, 4)}, 3, nil, 2},
		{"a multiple of the router's size is split and proves the size",
			[]codec.Event{stored(1, 32), stored(2, 4)}, 2, map[Reason]uint64{PartialBlock: 1}, 0},
		{"a size neither a multiple nor a tail is left out, under its own reason",
			[]codec.Event{stored(1, 24), stored(2, 40), stored(3, 16)}, 1, map[Reason]uint64{BlockSizeMismatch: 2}, 0},
		{"a size beside the multiple already split is left out",
			[]codec.Event{stored(1, 32), stored(2, 48)}, 2, map[Reason]uint64{BlockSizeMismatch: 1}, 0},
		{"a learned non-main group is filtered without its kind",
			[]codec.Event{stored(1, 16, group(1, "mamba")), stored(2, 16, group(1, ""))}, 0, map[Reason]uint64{NonMainAttention: 2}, 0},
		{"a learned main group is indexed",
			[]codec.Event{stored(1, 16, group(2, "mla_attention")), stored(2, 16, group(2, ""))}, 2, nil, 0},
		{"an unlearned nonzero group is filtered",
			[]codec.Event{stored(1, 16, group(3, ""))}, 0, map[Reason]uint64{UnlearnedGroup: 1}, 0},
		{"group 0 without a kind is main",
			[]codec.Event{stored(1, 16, group(0, ""))}, 1, nil, 0},
		{"host, disk and remote tiers are indexed, an unknown medium is counted",
			[]codec.Event{stored(1, 16, medium("CPU")), stored(2, 16, medium("DISK")), stored(3, 16, medium("TAPE")), stored(4, 16, medium("GPU")),
				stored(5, 16, medium("EXTERNAL")), stored(6, 16, medium("CPU_PINNED")), stored(7, 16, medium("STORAGE"))},
			6, map[Reason]uint64{UnknownMedium: 1}, 0},
		{"tracking is per event kind: sliding window kind filtered even as group 0",
			[]codec.Event{stored(1, 16, group(0, "sliding_window"))}, 0, map[Reason]uint64{NonMainAttention: 1}, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.send(tc.events...)
			if got := h.stores(); got != tc.stores {
				t.Errorf("stores = %d, want %d", got, tc.stores)
			}
			st := h.a.Stats()
			for r := range NumReasons {
				if got := st.Filtered[r]; got != tc.filtered[r] {
					t.Errorf("filtered[%v] = %d, want %d", r, got, tc.filtered[r])
				}
			}
			if got := st.SizeWarnings; got != tc.warnings {
				t.Errorf("size warnings = %d, want %d", got, tc.warnings)
			}
		})
	}
}

func TestHistoryIsPerWorker(t *testing.T) {
	a, b := newHarness(t), newHarness(t)
	a.send(stored(1, 16), stored(2, 4))
	b.send(stored(3, 4))
	if a.a.Stats().Filtered[PartialBlock] != 1 || b.a.Stats().Filtered[PartialBlock] != 0 || b.stores() != 1 {
		t.Errorf("worker b was judged by worker a's history")
	}
}

func TestConversion(t *testing.T) {
	var hasher index.Hasher
	t.Run("chained to the parent, as a router hashes the prompt", func(t *testing.T) {
		h := newHarness(t)
		toks := tokens(7, 3, 16)
		h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{70, 71}, TokenIDs: toks[:32], BlockSize: 16},
			codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{72}, ParentHash: 71, HasParent: true, TokenIDs: toks[32:], BlockSize: 16})
		want := hasher.Prompt(nil, toks, 16)
		if len(h.ops) != 3 {
			t.Fatalf("ops %v", h.ops)
		}
		for i, op := range h.ops {
			if op.Kind != index.OpStore || op.Hash != want[i] {
				t.Errorf("op %d = %+v, want store of %x", i, op, want[i])
			}
		}
	})
	t.Run("a block with an unknown parent is left out, counted, and so are its children", func(t *testing.T) {
		h := newHarness(t)
		toks := tokens(8, 2, 16)
		h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{80}, ParentHash: 999, HasParent: true, TokenIDs: toks[:16], BlockSize: 16},
			codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{81}, ParentHash: 80, HasParent: true, TokenIDs: toks[16:], BlockSize: 16})
		if h.a.Stats().UnknownParent != 2 || len(h.ops) != 0 {
			t.Errorf("ops %v, unknown_parent %d; want none and 2", h.ops, h.a.Stats().UnknownParent)
		}
	})
	t.Run("tokens short of the blocks convert up to the last whole block", func(t *testing.T) {
		h := newHarness(t)
		h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1, 2, 3}, TokenIDs: tokens(1, 2, 16)[:20], BlockSize: 16})
		if h.stores() != 1 || h.a.Stats().TokenMismatch != 1 {
			t.Errorf("stores %d, token_mismatch %d; want 1 and 1", h.stores(), h.a.Stats().TokenMismatch)
		}
	})
	t.Run("removes map engine hashes to router hashes; unknown ones are counted", func(t *testing.T) {
		h := newHarness(t)
		h.send(stored(5, 16), codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{5, 6}})
		if len(h.ops) != 2 || h.ops[1].Kind != index.OpRemove || h.ops[1].Hash != h.ops[0].Hash {
			t.Fatalf("ops %v", h.ops)
		}
		if h.a.Stats().UnknownRemove != 1 {
			t.Errorf("unknown_remove = %d, want 1", h.a.Stats().UnknownRemove)
		}
	})
	t.Run("a remove from a tier that does not hold the block changes nothing", func(t *testing.T) {
		h := newHarness(t)
		h.send(stored(5, 16), codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{5}, Medium: "CPU"})
		if len(h.ops) != 1 || h.a.Stats().UnknownRemove != 0 || h.a.Stats().IndexedBlocks != 1 {
			t.Errorf("ops %v, unknown_remove %d, indexed %d", h.ops, h.a.Stats().UnknownRemove, h.a.Stats().IndexedBlocks)
		}
	})
}

func TestResetClearsTheWorker(t *testing.T) {
	h := newHarness(t)
	h.send(stored(1, 16))
	for _, why := range []wire.ResetReason{wire.ResetRestart, wire.ResetHistoryMissing, wire.ResetGapLost} {
		h.ops = nil
		h.a.HandleReset(why)
		h.collect()
		if len(h.ops) != 1 || h.ops[0].Kind != index.OpClearWorker {
			t.Errorf("%v: ops %v, want one clear", why, h.ops)
		}
	}
	h.send(stored(2, 4)) // history was reset: converted, with a warning
	if h.a.Stats().Resyncs != 3 || h.a.Stats().Filtered[PartialBlock] != 0 {
		t.Errorf("resyncs %d partial %d", h.a.Stats().Resyncs, h.a.Stats().Filtered[PartialBlock])
	}
}

func TestBadAndUnknownInput(t *testing.T) {
	h := newHarness(t)
	h.a.HandleBatch(0, []byte{0x93, 0x01})
	unknown := []byte{0x92, 0x00, 0x92, 0x91, 0xa3, 'F', 'o', 'o', 0x91, 0xa3, 'B', 'a', 'r'}
	h.a.HandleBatch(1, unknown)
	st := h.a.Stats()
	if st.DecodeErrors != 1 || st.Filtered[UnknownEvent] != 2 || st.Batches != 2 {
		t.Errorf("decode_errors %d unknown_event %d batches %d", st.DecodeErrors, st.Filtered[UnknownEvent], st.Batches)
	}
}

// A worker loses 30 batches while its system prompt stays cached in the
// engine. After the resync, a new request under that prompt stores only its
// own blocks (the prompt is a cache hit, never stored again); they must get
// their true keys and bring the prompt back, so the request matches in full.
// After a restart the mapping is gone: the same event is left out.
func TestResyncKeepsThePrefixOfTheSameEngine(t *testing.T) {
	for _, tc := range []struct {
		why     wire.ResetReason
		matched int // blocks of system prompt + question found for the worker
	}{
		{wire.ResetGapLost, 6},
		{wire.ResetHistoryMissing, 6},
		{wire.ResetRestart, 0},
		{wire.ResetUnproven, 0},
	} {
		t.Run(tc.why.String(), func(t *testing.T) {
			shards := index.NewShards(2, 4)
			defer shards.Close()
			a := New(Config{Worker: 3, BlockSize: 16, Sink: index.NewSender(3, shards.Queue(3), nil)})
			system, question := tokens(1, 4, 16), tokens(2, 2, 16)
			batch := func(events ...codec.Event) {
				a.HandleBatch(0, engineenc.AppendBatch(nil, &codec.Batch{Events: events}, engineenc.CurrentVLLM))
			}
			batch(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{100, 101, 102, 103}, TokenIDs: system, BlockSize: 16})
			for i := range 30 { // other conversations, then lost
				batch(stored(uint64(200+i), 16))
			}
			a.HandleReset(tc.why)
			batch(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{300, 301}, ParentHash: 103, HasParent: true,
				TokenIDs: question, BlockSize: 16})
			if err := shards.Sync(context.Background()); err != nil {
				t.Fatal(err)
			}
			var h index.Hasher
			keys := h.Prompt(nil, append(append([]uint32{}, system...), question...), 16)
			got, err := shards.FindMatches(context.Background(), nil, keys)
			if err != nil {
				t.Fatal(err)
			}
			matched := 0
			for _, m := range got {
				if m.Worker == 3 {
					matched = m.Blocks
				}
			}
			if matched != tc.matched {
				t.Errorf("after %v: worker matches %d blocks, want %d", tc.why, matched, tc.matched)
			}
			if want := int64(tc.matched); a.Stats().IndexedBlocks != want {
				t.Errorf("indexed_blocks %d, want %d", a.Stats().IndexedBlocks, want)
			}
			// The 30 lost conversations' blocks are not indexed again.
			probe := h.Prompt(nil, tokens(200, 1, 16), 16)
			if got, _ := shards.FindMatches(context.Background(), nil, probe); len(got) != 0 {
				t.Errorf("a block from before the resync, never stored again, matches: %v", got)
			}
		})
	}
}

// A worker is partial unless its stream since the start or the last reset
// began from an empty engine cache.
func TestPartial(t *testing.T) {
	batch := func(a *Actor, seq uint64, events ...codec.Event) {
		a.HandleBatch(seq, engineenc.AppendBatch(nil, &codec.Batch{Events: events}, engineenc.CurrentVLLM))
	}
	steps := []struct {
		name string
		do   func(a *Actor)
		want bool
	}{
		{"joined at seq 0: complete", func(a *Actor) { batch(a, 0, stored(1, 16)) }, false},
		{"a live gap reset", func(a *Actor) { a.HandleReset(wire.ResetGapLost) }, true},
		{"the stream goes on past the gap", func(a *Actor) { batch(a, 9, stored(2, 16)) }, true},
		{"the engine clears its cache", func(a *Actor) { batch(a, 10, cleared()) }, false},
		{"a restart", func(a *Actor) { a.HandleReset(wire.ResetRestart) }, true},
		{"the new incarnation from its first batch", func(a *Actor) { batch(a, 0, stored(3, 16)) }, false},
		{"a store under a parent never told of (a kept cache)", func(a *Actor) {
			batch(a, 1, stored(5, 16, func(e *codec.Event) { e.ParentHash, e.HasParent = 999, true }))
		}, true},
		{"a clear after it", func(a *Actor) { batch(a, 2, cleared()) }, false},
		{"a lower-tier clear does not make it complete", func(a *Actor) {
			a.HandleReset(wire.ResetHistoryMissing)
			batch(a, 4, codec.Event{Type: codec.AllBlocksCleared, Medium: "CPU"})
		}, true},
		{"a panic recovered", func(a *Actor) { batch(a, 5, cleared()); a.Recover() }, true},
	}
	ch := make(chan *index.Batch, 64)
	a := New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, nil)})
	go func() {
		for range ch {
		}
	}()
	defer close(ch)
	if !a.Stats().Partial {
		t.Fatal("a new actor is complete before any batch")
	}
	for _, st := range steps {
		st.do(a)
		if got := a.Stats().Partial; got != st.want {
			t.Errorf("%s: partial %v, want %v", st.name, got, st.want)
		}
	}
	late := New(Config{Worker: 2, BlockSize: 16, Sink: index.NewSender(2, ch, nil)})
	batch(late, 1234, stored(4, 16))
	if !late.Stats().Partial {
		t.Error("an actor that joined at seq 1234 is complete")
	}
}

func TestMainAttentionKinds(t *testing.T) {
	for kind, want := range map[string]bool{"full_attention": true, "mla_attention": true, "sink_full_attention": true,
		"sliding_window": false, "mamba": false, "chunked_local_attention": false, "": false} {
		if got := isMainAttention(kind); got != want {
			t.Errorf("isMainAttention(%q) = %v, want %v", kind, got, want)
		}
	}
}
