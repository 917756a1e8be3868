package kvpipe

import (
	"context"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/kvpipe/kvpipe/wire"
)

// tapPart is one call of a Tap's Ops.
type tapPart struct {
	ops []index.Op
	o   seam.Origin
}

// tapFingerprint stands for the subscriber's fingerprint of the batch a
// tapped handler gets: the origin must carry it, not a hash of its own.
const tapFingerprint = 0xf19e7

// newTapped returns an actor of worker 1 whose ops go to shard and, with
// their origin, to parts; the Tap returns how many parts it has.
func newTapped(shard chan *index.Batch, parts *[]tapPart) (*tapped, wire.Handler) {
	t := &tapped{ctx: context.Background(), name: "w"}
	t.tap = tapFuncs{ops: func(_ context.Context, _ string, ops []index.Op, o seam.Origin) uint64 {
		*parts = append(*parts, tapPart{slices.Clone(ops), o})
		return uint64(100 + len(*parts))
	}}
	t.a = actor.New(actor.Config{Worker: 1, BlockSize: 16, Sink: tapSink{index.NewSender(1, shard, nil), t}})
	return t, tappedHandler{t.a, t, func() (uint64, uint64, bool) { return 0, tapFingerprint, false }}
}

// drain applies what shard holds to held.
func drain(shard chan *index.Batch, held map[index.Tier]map[uint64]int) map[index.Tier]map[uint64]int {
	for {
		select {
		case b := <-shard:
			held = apply(held, b.Ops)
		default:
			return held
		}
	}
}

// The Tap sees every batch of ops with where it came from, and what it
// returns is the worker's stream position in its snapshot.
func TestTapSeesEachBatchsOrigin(t *testing.T) {
	var parts []tapPart
	ch := make(chan *index.Batch, 16)
	tp, h := newTapped(ch, &parts)
	toks := make([]uint32, 300*16)
	for i := range toks {
		toks[i] = uint32(i)
	}
	big := codec.Event{Type: codec.BlockStored, BlockHashes: make([]uint64, 300), TokenIDs: toks, BlockSize: 16}
	for i := range big.BlockHashes {
		big.BlockHashes[i] = uint64(i + 1)
	}
	payload := engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{big}}, engineenc.CurrentVLLM)
	h.HandleBatch(7, payload)
	drain(ch, nil)
	h.HandleReset(wire.ResetRestart)
	drain(ch, nil)
	const fp = tapFingerprint
	want := []seam.Origin{
		{Batch: true, Seq: 7, Fingerprint: fp, Part: 0, Partial: true},
		{Batch: true, Seq: 7, Fingerprint: fp, Part: 1, Partial: true},
		{Partial: true},
	}
	var got []seam.Origin
	for _, p := range parts {
		got = append(got, p.o)
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("origins (-want +got):\n%s", d)
	}
	if tp.streamSeq != 103 {
		t.Errorf("stream seq kept = %d, want 103, what the Tap last returned", tp.streamSeq)
	}
}

// Republish hands the Tap, and not the shard, a clear and then every block
// the worker holds in each tier: applied from nothing, the stream's copy
// is again what the shard holds. Parts are partial until the last, which
// carries the worker's own flag.
func TestRepublishHandsTheTapTheWholeState(t *testing.T) {
	for _, partial := range []bool{false, true} {
		var parts []tapPart
		ch := make(chan *index.Batch, 1024)
		tp, h := newTapped(ch, &parts)
		e := sim.NewEngine(32, 80, sim.WithCPUOffload(60), sim.WithLoRA()) // split blocks, two tiers, evictions
		reqs := sim.SyntheticTrace(120, 5)
		var evs []codec.Event
		var held map[index.Tier]map[uint64]int
		for i := range reqs {
			if partial && i == 60 {
				h.HandleReset(wire.ResetGapLost) // what the engine held then is unknown: partial
			}
			evs, _ = e.ServeResult(evs[:0], &reqs[i], sim.InputTokens(nil, &reqs[i]))
			if len(evs) > 0 {
				h.HandleBatch(uint64(i), engineenc.AppendBatch(nil, &codec.Batch{Events: evs}, engineenc.CurrentVLLM))
			}
			held = drain(ch, held)
		}
		parts = parts[:0]

		var scratch snapshot.Worker
		tp.republish(&scratch)
		if len(ch) != 0 {
			t.Fatalf("partial first %v: the shard got %d batches from Republish, want none", partial, len(ch))
		}
		if len(parts) < 2 || parts[0].ops[0].Kind != index.OpClearWorker {
			t.Fatalf("partial first %v: %d parts, want a clear first and more than one part", partial, len(parts))
		}
		var all []index.Op
		for i, p := range parts {
			last := i == len(parts)-1
			if len(p.ops) > republishPart || !p.o.Whole || p.o.Batch || p.o.Partial != (!last || tp.a.Partial()) {
				t.Errorf("partial first %v: part %d of %d: %d ops, origin %+v; want at most %d ops, Whole, partial until the last, then %v",
					partial, i, len(parts), len(p.ops), p.o, republishPart, tp.a.Partial())
			}
			all = append(all, p.ops...)
		}
		if tp.a.Partial() != partial {
			t.Errorf("worker partial %v, want %v", tp.a.Partial(), partial)
		}
		if d := cmp.Diff(held, apply(map[index.Tier]map[uint64]int{index.TierDevice: {99: 1}}, all)); d != "" {
			t.Errorf("partial first %v: the republished state differs from the shard's (-shard +republished):\n%s", partial, d)
		}
		if want := uint64(100 + len(parts)); tp.streamSeq != want {
			t.Errorf("stream seq %d after Republish, want %d: what the Tap last returned", tp.streamSeq, want)
		}
	}
}

// apply applies ops to per-tier key counts, as a shard would for one worker.
func apply(held map[index.Tier]map[uint64]int, ops []index.Op) map[index.Tier]map[uint64]int {
	if held == nil {
		held = map[index.Tier]map[uint64]int{}
	}
	for _, op := range ops {
		switch op.Kind {
		case index.OpClearWorker:
			clear(held)
		case index.OpStore:
			if held[op.Tier] == nil {
				held[op.Tier] = map[uint64]int{}
			}
			held[op.Tier][op.Hash]++
		case index.OpRemove:
			if held[op.Tier][op.Hash]--; held[op.Tier][op.Hash] <= 0 {
				delete(held[op.Tier], op.Hash)
			}
		}
	}
	for t, keys := range held {
		if len(keys) == 0 {
			delete(held, t)
		}
	}
	return held
}
