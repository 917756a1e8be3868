package actor

import (
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/sim"
)

// BenchmarkActorPath: encoded engine steps of the Mooncake trace (8 workers,
// 16-token blocks) through decode, filters, hashing and the shard goroutines.
// Each iteration replays the whole trace and then an AllBlocksCleared per
// worker, so the state returns to empty and steady-state allocations show.
func BenchmarkActorPath(b *testing.B) {
	limit := 0
	if testing.Short() {
		limit = sim.ShortTraceRequests
	}
	reqs, source, err := sim.Trace(limit)
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("trace: %s, %d requests", source, len(reqs))
	const workers = 8
	type step struct {
		worker  int
		payload []byte
	}
	var steps []step
	events, blocks := 0, 0
	var engines [workers]*sim.Engine
	for w := range engines {
		engines[w] = sim.NewEngine(16, 40_000)
	}
	var evs []codec.Event
	for i := range reqs {
		r := &reqs[i]
		w := int(r.HashIDs[min(1, len(r.HashIDs)-1)] % workers) // sticky per conversation: every request starts with block 0
		evs, _ = engines[w].Serve(evs[:0], r, sim.PromptTokens(nil, r))
		for _, e := range evs {
			blocks += len(e.BlockHashes)
		}
		events += len(evs)
		steps = append(steps, step{w, engineenc.AppendBatch(nil, &codec.Batch{TS: float64(r.TimestampMs), Events: evs}, engineenc.CurrentVLLM)})
	}
	clearAll := engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{{Type: codec.AllBlocksCleared}}}, engineenc.CurrentVLLM)
	bytes := 0
	for _, s := range steps {
		bytes += len(s.payload)
	}

	for _, nShards := range []int{1, 2} {
		b.Run(map[int]string{1: "shards=1", 2: "shards=2"}[nShards], func(b *testing.B) {
			shards := index.NewShards(nShards, 64)
			defer shards.Close()
			var actors [workers]*Actor
			for w := range actors {
				actors[w] = New(Config{Worker: index.WorkerID(w), BlockSize: 16, Sink: index.NewSender(index.WorkerID(w), shards.Queue(index.WorkerID(w)), nil)})
			}
			pass := func() {
				for _, s := range steps {
					actors[s.worker].HandleBatch(0, s.payload)
				}
				for _, a := range actors {
					a.HandleBatch(0, clearAll)
				}
			}
			pass() // warm: maps and pools reach their size
			b.SetBytes(int64(bytes))
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				pass()
			}
			sec := b.Elapsed().Seconds()
			b.ReportMetric(float64(events)*float64(b.N)/sec, "events/s")
			b.ReportMetric(float64(blocks)*float64(b.N)/sec, "blocks/s")
			var decodeErrors, stored uint64
			for _, a := range actors {
				decodeErrors += a.Stats().DecodeErrors
				stored += a.Stats().BlocksStored
			}
			if decodeErrors != 0 || stored == 0 {
				b.Fatalf("decode errors %d, blocks stored %d", decodeErrors, stored)
			}
		})
	}
}
