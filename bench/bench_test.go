package bench

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/internal/wiretest"
)

const (
	workers   = 8
	blockSize = 16
	// traceRequests is the part of the trace replayed: about a quarter, so one
	// pass (about 2M blocks, 170 MB of frames) fits the benchmark's time.
	traceRequests = 3000
)

// workload is the trace as each worker's engine publishes it, pre-encoded,
// and the prompts a router asks about meanwhile.
type workload struct {
	frames         [workers][][]byte
	clear          []byte // AllBlocksCleared: ends a pass, so each starts empty
	prompts        [][]uint64
	events, blocks int
	bytes          int
	live           int // (block, worker) memberships the engines hold at the end
}

var (
	loadOnce sync.Once
	loaded   *workload
)

func load(b *testing.B) *workload {
	loadOnce.Do(func() {
		limit := traceRequests
		if testing.Short() {
			limit = sim.ShortTraceRequests
		}
		reqs, source, err := sim.Trace(limit)
		if err != nil {
			b.Fatal(err)
		}
		b.Logf("trace: %s, %d requests", source, len(reqs))
		w := &workload{clear: engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{{Type: codec.AllBlocksCleared}}}, engineenc.CurrentVLLM)}
		var engines [workers]*sim.Engine
		for i := range engines {
			engines[i] = sim.NewEngine(blockSize, 100_000)
		}
		var h index.Hasher
		var evs []codec.Event
		for i := range reqs {
			r := &reqs[i]
			tokens := sim.PromptTokens(nil, r)
			w.prompts = append(w.prompts, h.Prompt(nil, tokens, blockSize))
			wk := int(r.HashIDs[min(1, len(r.HashIDs)-1)] % workers) // sticky per conversation: every request starts with block 0
			evs, _ = engines[wk].Serve(evs[:0], r, tokens)
			for _, e := range evs {
				w.blocks += len(e.BlockHashes)
			}
			w.events += len(evs)
			f := engineenc.AppendBatch(nil, &codec.Batch{TS: float64(r.TimestampMs) / 1000, Events: evs}, engineenc.CurrentVLLM)
			w.bytes += len(f)
			w.frames[wk] = append(w.frames[wk], f)
		}
		for _, e := range engines {
			w.live += e.Len()
		}
		loaded = w
	})
	return loaded
}

// queryRates are the querier's paces: flat out (0), and a fixed rate of
// questions per second, as a router asking on every request would.
var queryRates = []int{0, 20_000}

type benchCase struct {
	name         string
	shards, rate int
}

// shardsAndRates crosses 1, 2 and 4 shards with every query rate; -short
// (CI's once-over) keeps one case, 2 shards asked flat out.
func shardsAndRates() []benchCase {
	if testing.Short() {
		return []benchCase{{"shards=2/query=flat", 2, 0}}
	}
	var out []benchCase
	for _, n := range []int{1, 2, 4} {
		for _, r := range queryRates {
			q := "query=flat"
			if r > 0 {
				q = fmt.Sprintf("query=%dk", r/1000)
			}
			out = append(out, benchCase{fmt.Sprintf("shards=%d/%s", n, q), n, r})
		}
	}
	return out
}

// measure runs pass once to warm up and once alone to count its
// allocations, then b.N times while a goroutine asks find (flat out, or at
// rate questions a second), and reports throughput, allocations per event,
// find's latency percentiles and the questions answered per second.
func measure(b *testing.B, w *workload, rate int, pass func(), find func([]uint64) error) {
	pass()
	before := mallocs()
	pass() // the querier's allocations are not the pipeline's
	perPass := mallocs() - before

	lat := make([]time.Duration, 0, 1<<20)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		start := time.Now()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if rate > 0 { // wait until question i is due; a late one goes at once
				if wait := time.Duration(float64(i)/float64(rate)*1e9) - time.Since(start); wait > 0 {
					time.Sleep(wait)
				}
			}
			t := time.Now()
			if find(w.prompts[i%len(w.prompts)]) != nil {
				return
			}
			lat = append(lat, time.Since(t))
		}
	}()
	b.SetBytes(int64(w.bytes))
	b.ResetTimer()
	for b.Loop() {
		pass()
	}
	b.StopTimer()
	close(stop)
	<-done

	sec := b.Elapsed().Seconds()
	b.ReportMetric(float64(w.events*b.N)/sec, "events/s")
	b.ReportMetric(float64(w.blocks*b.N)/sec, "blocks/s")
	b.ReportMetric(float64(perPass)/float64(w.events), "allocs/event")
	b.ReportMetric(float64(len(lat))/sec, "finds/s")
	if len(lat) > 0 {
		slices.Sort(lat)
		b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "find-p50-ns")
		b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "find-p99-ns")
	}
}

func mallocs() uint64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.Mallocs
}

// BenchmarkInProcess: frames -> codec -> actor -> shards, one goroutine per
// worker as in production, with FindMatches asked all along.
func BenchmarkInProcess(b *testing.B) {
	w := load(b)
	for _, bc := range shardsAndRates() {
		n, rate := bc.shards, bc.rate
		b.Run(bc.name, func(b *testing.B) {
			shards := index.NewShards(n, 256)
			defer shards.Close()
			var actors [workers]*actor.Actor
			for i := range actors {
				actors[i] = actor.New(actor.Config{Worker: index.WorkerID(i), BlockSize: blockSize, Sink: index.NewSender(index.WorkerID(i), shards.Queue(index.WorkerID(i)), nil)})
			}
			pass := func() {
				var wg sync.WaitGroup
				for i := range actors {
					wg.Go(func() {
						for _, f := range w.frames[i] {
							actors[i].HandleBatch(0, f)
						}
						actors[i].HandleBatch(0, w.clear)
					})
				}
				wg.Wait()
			}
			ctx := context.Background()
			var dst []index.Score
			measure(b, w, rate, pass, func(keys []uint64) (err error) {
				dst, err = shards.FindMatches(ctx, dst[:0], keys)
				return err
			})
		})
	}
}

// BenchmarkLoopback: the same frames published by 8 wiretest.Publishers over
// loopback TCP into a kvpipe.Pipeline; an iteration ends when the
// pipeline has applied every batch. allocs/event counts both ends.
func BenchmarkLoopback(b *testing.B) {
	w := load(b)
	for _, bc := range shardsAndRates() {
		n, rate := bc.shards, bc.rate
		b.Run(bc.name, func(b *testing.B) {
			p, pass := loopback(b, w, n, 0, runPipeline)
			ctx := context.Background()
			var dst []kvpipe.Match
			measure(b, w, rate, pass, func(keys []uint64) (err error) {
				dst, err = p.AppendMatchesKeys(ctx, dst[:0], keys, nil)
				return err
			})
			if lost := p.Stats().Total().Wire.Lost; lost != 0 {
				b.Errorf("%d batches lost over loopback", lost)
			}
		})
	}
}

// runPipeline runs p until the benchmark ends.
func runPipeline(b *testing.B, p *kvpipe.Pipeline) {
	runDone := make(chan error, 1)
	go func() { runDone <- p.Run(context.Background()) }()
	b.Cleanup(func() { p.Shutdown(context.Background()); <-runDone })
}

// loopback builds a pipeline of n shards, runs it with run, and subscribes
// it to 8 publishers on loopback; pass publishes the workload once, flat
// out or spread evenly over spread, and returns when the pipeline has
// applied all of it.
func loopback(b *testing.B, w *workload, n int, spread time.Duration, run func(*testing.B, *kvpipe.Pipeline)) (*kvpipe.Pipeline, func()) {
	p, err := kvpipe.New(kvpipe.Config{BlockSize: blockSize, Shards: n, ShardQueue: 256})
	if err != nil {
		b.Fatal(err)
	}
	run(b, p)
	var pubs [workers]*wiretest.Publisher
	for i := range pubs {
		pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", BufferSteps: 1})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { pub.Close() })
		pubs[i] = pub
		if err := p.AddWorker(fmt.Sprint("w", i), kvpipe.WorkerConfig{Endpoint: "tcp://" + pub.Addr()}); err != nil {
			b.Fatal(err)
		}
	}
	applied := func() uint64 { // or known lost: a pass must end either way
		t := p.Stats().Total()
		return t.Actor.Batches + t.Wire.Lost
	}
	// Warm up and make sure every subscription is in place.
	for deadline := time.Now().Add(10 * time.Second); ; {
		for _, pub := range pubs {
			pub.Publish(w.clear)
		}
		ready := 0
		for _, s := range p.Stats().Workers {
			if s.Actor.Batches > 0 {
				ready++
			}
		}
		if ready == workers {
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("subscribers not ready")
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // the probes still on the way arrive
	// Probes sent before a subscription was in place never arrive, so
	// count from what has arrived, not from what was published.
	var published atomic.Uint64
	published.Store(applied())
	return p, func() {
		var wg sync.WaitGroup
		for i, pub := range pubs {
			wg.Go(func() {
				start, frames := time.Now(), w.frames[i]
				for j, f := range frames {
					if due := spread * time.Duration(j) / time.Duration(len(frames)); spread > 0 && due > time.Since(start) {
						time.Sleep(due - time.Since(start))
					}
					pub.Publish(f)
				}
				pub.Publish(w.clear)
				published.Add(uint64(len(w.frames[i]) + 1))
			})
		}
		wg.Wait()
		for applied() < published.Load() { // every batch reached its actor
			time.Sleep(time.Millisecond)
		}
		if err := p.Sync(context.Background()); err != nil { // and its shard applied it
			b.Fatal(err)
		}
	}
}

// BenchmarkIndexMemory: the live heap, after GC, that the index (2 shards)
// and the 8 workers' actors (their engine hash -> router key mappings)
// take once the workload is applied, per (block, worker) membership the
// engines' caches hold at the end, once the actors have idled long enough
// to give back the batches the flood left spare (busy-bytes/block: before
// that). The frames are in the heap before and after, so they do not
// count.
func BenchmarkIndexMemory(b *testing.B) {
	w := load(b)
	var bytes, busy uint64
	for b.Loop() {
		before := liveHeap()
		shards := index.NewShards(2, 256)
		var actors [workers]*actor.Actor
		for i := range actors {
			actors[i] = actor.New(actor.Config{Worker: index.WorkerID(i), BlockSize: blockSize, Sink: index.NewSender(index.WorkerID(i), shards.Queue(index.WorkerID(i)), nil)})
		}
		var wg sync.WaitGroup
		for i := range actors {
			wg.Go(func() {
				for _, f := range w.frames[i] {
					actors[i].HandleBatch(0, f)
				}
			})
		}
		wg.Wait()
		if err := shards.Sync(context.Background()); err != nil {
			b.Fatal(err)
		}
		busy = liveHeap() - before
		idle(b, actors[:])
		bytes = liveHeap() - before
		runtime.KeepAlive(actors)
		shards.Close()
	}
	b.ReportMetric(float64(bytes)/float64(w.live), "bytes/block")
	b.ReportMetric(float64(busy)/float64(w.live), "busy-bytes/block")
	b.ReportMetric(float64(w.live), "memberships")
}

// idle calls each actor's HandleIdle, as its idle subscriber would, until
// none asks to be called again: the flood's spare batches are then given
// back (index.Sender.Trim). A subscriber asks again after 10 ms, backing
// off to 1 s; a tenth of a second is close enough.
func idle(b *testing.B, actors []*actor.Actor) {
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		again := false
		for _, a := range actors {
			again = a.HandleIdle() || again
		}
		if !again {
			return
		}
		if time.Now().After(deadline) {
			b.Fatal("idle actors still hold spare batches after 10 s")
		}
	}
}

// liveHeap is the heap in use after a full GC.
func liveHeap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}
