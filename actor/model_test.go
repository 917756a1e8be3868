package actor

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/wire"
)

// Simulated engines serve random requests, evict, clear and lose their
// history; their events go through actors and shards. After every step the
// index's answer for a random prompt must equal what the engines hold.
func TestPipelineAgainstEngines(t *testing.T) {
	for seed := range uint64(10) {
		rng := rand.New(rand.NewPCG(seed, 7))
		const workers, blockSize = 5, 64 // 8 engine blocks per trace block keep it quick
		reqs := sim.SyntheticTrace(250, seed)
		shards := index.NewShards(1+int(seed%3), 4)
		var engines [workers]*sim.Engine
		var actors [workers]*Actor
		for w := range workers {
			engines[w] = sim.NewEngine(blockSize, 40+rng.IntN(200))
			actors[w] = New(Config{Worker: index.WorkerID(w), BlockSize: blockSize, Sink: index.NewSender(index.WorkerID(w), shards.Queue(index.WorkerID(w)), nil)})
		}
		var h index.Hasher
		var evs []codec.Event
		for i := range reqs {
			w := rng.IntN(workers)
			switch r := rng.IntN(50); {
			case r == 0:
				evs = append(evs[:0], engines[w].Clear())
			case r == 1: // history lost: the index drops the worker until it refills
				engines[w].Clear()
				actors[w].HandleReset(wire.ResetGapLost)
				evs = evs[:0]
			default:
				evs, _ = engines[w].Serve(evs[:0], &reqs[i], sim.PromptTokens(nil, &reqs[i]))
			}
			if len(evs) > 0 {
				actors[w].HandleBatch(uint64(i), engineenc.AppendBatch(nil, &codec.Batch{Events: evs}, engineenc.CurrentVLLM))
			}
			if err := shards.Sync(context.Background()); err != nil {
				t.Fatal(err)
			}
			q := &reqs[rng.IntN(i+1)]
			keys := h.Prompt(nil, sim.PromptTokens(nil, q), blockSize)
			got, err := shards.FindMatches(context.Background(), nil, keys)
			if err != nil {
				t.Fatal(err)
			}
			gotBy := map[index.WorkerID]int{}
			for _, s := range got {
				gotBy[s.Worker] = s.Blocks
			}
			for ew, e := range engines {
				want, _ := e.Held(q)
				if gotBy[index.WorkerID(ew)] != want {
					t.Fatalf("seed %d step %d: worker %d scores %d, its engine holds %d leading blocks",
						seed, i, ew, gotBy[index.WorkerID(ew)], want)
				}
			}
		}
		shards.Close()
	}
}

// With Drop, a shard that is behind costs the batch, counted, and the
// worker is resynced (cleared) with the next batch that gets through.
func TestDropBackpressure(t *testing.T) {
	ch := make(chan *index.Batch) // no buffer and nobody reading: always full
	a := New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, nil), Drop: true})
	payload := engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{stored(1, 16)}}, engineenc.CurrentVLLM)
	a.HandleBatch(0, payload)
	a.HandleBatch(1, payload)
	if got := a.Stats().DroppedBatches; got != 2 {
		t.Fatalf("dropped batches = %d, want 2", got)
	}
	if got := a.Stats().IndexedBlocks; got != 0 {
		t.Errorf("indexed blocks = %d after the drops, want 0", got)
	}
	ch2 := make(chan *index.Batch, 1)
	a.cfg.Sink = index.NewSender(1, ch2, nil)
	a.HandleBatch(2, payload)
	b := <-ch2
	if len(b.Ops) != 2 || b.Ops[0].Kind != index.OpClearWorker || b.Ops[1].Kind != index.OpStore {
		t.Errorf("first batch after drops: %+v, want a clear then the store", b.Ops)
	}
}
