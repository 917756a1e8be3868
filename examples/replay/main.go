// Command replay is a router in miniature. It starts simulated engines (real
// ZMQ publishers with replay sockets on loopback) and replays the Mooncake
// request trace through them: each request goes to the worker kvpipe's
// FindMatches and the load say is cheapest, that engine's LRU block cache
// stores and evicts blocks and publishes the KV events, and the kvpipe
// Pipeline ingests them. At the end it compares the prefix-hit rate of that
// routing with random routing of the same requests.
//
//	go run ./examples/replay [--workers 4] [--speedup 100] [--capacity 30000] [--metrics :9090]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/wire/wiretest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

type options struct {
	workers, capacity, blockSize, requests, shards int
	speedup                                        float64
	tracePath, metricsAddr                         string
	progress                                       time.Duration
}

func main() {
	var o options
	flag.IntVar(&o.workers, "workers", 4, "simulated engines")
	flag.IntVar(&o.capacity, "capacity", 100_000, "blocks each engine's cache holds")
	flag.IntVar(&o.blockSize, "block-size", 16, "tokens per block, engine and router (a divisor of 512)")
	flag.IntVar(&o.requests, "requests", 0, "replay only the first N requests (0: all)")
	flag.IntVar(&o.shards, "shards", 2, "index shards")
	flag.Float64Var(&o.speedup, "speedup", 100, "trace time runs this many times faster than real time (0: as fast as possible)")
	flag.StringVar(&o.tracePath, "trace", "", "the trace (default: ../shared/traces/mooncake_conversation_trace.jsonl, else a synthetic one)")
	flag.StringVar(&o.metricsAddr, "metrics", "", "serve Prometheus /metrics on this address, e.g. :9090")
	flag.DurationVar(&o.progress, "progress", time.Second, "progress line interval")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, o, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "replay:", err)
		os.Exit(1)
	}
}

// engine is one simulated engine; its goroutine owns the cache and the publisher.
type engine struct {
	name     string
	cache    *sim.Engine
	pub      *wiretest.Publisher
	requests chan *sim.Request
	done     chan struct{}
	// Read after done is closed.
	hitBlocks, blocks int
}

func (e *engine) serve() {
	defer close(e.done)
	var events []codec.Event
	var tokens []uint32
	var payload []byte
	for r := range e.requests {
		tokens = sim.PromptTokens(tokens[:0], r)
		var hit int
		events, hit = e.cache.Serve(events[:0], r, tokens)
		e.hitBlocks += hit
		e.blocks += len(tokens) / e.cache.BlockSize
		if len(events) > 0 {
			// The publisher keeps the payload for replay: a fresh one each time.
			payload = codec.AppendBatch(nil, &codec.Batch{TS: float64(r.TimestampMs) / 1000, Events: events}, codec.CurrentVLLM)
			e.pub.Publish(payload)
		}
	}
}

func loadTrace(o options, stderr io.Writer) ([]sim.Request, string, error) {
	path := o.tracePath
	if path == "" {
		if p, ok := sim.FindTrace(); ok {
			path = p
		}
	}
	if path == "" {
		fmt.Fprintln(stderr, "replay: ../shared/traces not found: replaying a synthetic Mooncake-shaped trace")
		n := o.requests
		if n <= 0 {
			n = 3000
		}
		reqs := sim.SyntheticTrace(n, 1)
		return reqs, "synthetic", nil
	}
	reqs, err := sim.LoadTrace(path, o.requests)
	return reqs, path, err
}

func run(ctx context.Context, o options, stdout, stderr io.Writer) error {
	if o.workers <= 0 || o.capacity <= 0 || o.blockSize <= 0 || sim.TraceBlockTokens%o.blockSize != 0 {
		return errors.New("--workers and --capacity must be positive, --block-size a divisor of 512")
	}
	reqs, source, err := loadTrace(o, stderr)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	p, err := kvpipe.New(kvpipe.Config{BlockSize: o.blockSize, Shards: o.shards, Registry: reg,
		Logger: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		return err
	}
	defer p.Shutdown(context.Background()) // on early returns; a second Shutdown does nothing
	if o.metricsAddr != "" {
		stopMetrics, err := serveMetrics(o.metricsAddr, reg)
		if err != nil {
			return err
		}
		defer stopMetrics()
	}
	engines := make([]*engine, o.workers)
	for i := range engines {
		// A simulated step carries a whole prompt (about 100 KB), so keep fewer
		// of them for replay than vLLM's 10,000.
		pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 1000})
		if err != nil {
			return err
		}
		e := &engine{name: fmt.Sprintf("engine-%d", i), cache: sim.NewEngine(o.blockSize, o.capacity), pub: pub,
			requests: make(chan *sim.Request, 64), done: make(chan struct{})}
		engines[i] = e
		defer pub.Close()
		if err := p.AddWorker(e.name, kvpipe.WorkerConfig{Endpoint: "tcp://" + pub.Addr(), ReplayEndpoint: "tcp://" + pub.ReplayAddr()}); err != nil {
			return err
		}
	}
	runDone := make(chan error, 1)
	go func() { runDone <- p.Run(context.Background()) }()
	if err := waitConnected(ctx, p, len(engines)); err != nil {
		p.Shutdown(context.Background())
		<-runDone
		return err
	}
	for _, e := range engines {
		go e.serve()
	}

	start := time.Now()
	routed := route(ctx, o, reqs, p, engines, stderr, start)
	for _, e := range engines {
		close(e.requests)
		<-e.done
	}
	settle(p, engines)
	wall := time.Since(start)
	p.Shutdown(context.Background())
	if err := <-runDone; err != nil {
		return err
	}
	return report(stdout, o, source, reqs[:routed], engines, p.Stats().Total(), wall) // the counters outlive the run
}

// waitConnected publishes nothing: it waits until every SUB is connected, so
// that the first batches are not lost to the PUB/SUB slow start.
func waitConnected(ctx context.Context, p *kvpipe.Pipeline, n int) error {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		connected := 0
		for _, s := range p.Stats().Workers {
			if s.Wire.Connected {
				connected++
			}
		}
		if connected == n {
			time.Sleep(50 * time.Millisecond) // and the subscriptions have reached the publishers
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return errors.New("engines not connected within 10s")
}

// route sends each request, at its trace time, to the worker with the least
// prefill work (blocks it does not hold, per FindMatches) plus queued work.
func route(ctx context.Context, o options, reqs []sim.Request, p *kvpipe.Pipeline, engines []*engine, stderr io.Writer, start time.Time) int {
	var h index.Hasher
	load := make([]float64, len(engines)) // blocks of recent work, decaying
	const tau = 5000.0                    // trace milliseconds for load to decay by e
	var tokens []uint32
	var keys []uint64
	overlap := make([]int, len(engines))
	lastTS := int64(0)
	nextProgress := start.Add(o.progress)
	byName := map[string]int{}
	for i, e := range engines {
		byName[e.name] = i
	}
	for i := range reqs {
		r := &reqs[i]
		if o.speedup > 0 {
			due := start.Add(time.Duration(float64(r.TimestampMs) / o.speedup * float64(time.Millisecond)))
			if d := time.Until(due); d > 0 {
				select {
				case <-ctx.Done():
					return i
				case <-time.After(d):
				}
			}
		}
		if ctx.Err() != nil {
			return i
		}
		decay := math.Exp(-float64(r.TimestampMs-lastTS) / tau)
		lastTS = r.TimestampMs
		for w := range load {
			load[w] *= decay
		}
		tokens = sim.PromptTokens(tokens[:0], r)
		keys = h.Prompt(keys[:0], tokens, o.blockSize)
		clear(overlap)
		if matches, err := p.FindMatchesKeys(ctx, keys); err == nil {
			for _, m := range matches {
				overlap[byName[m.Worker]] = m.Blocks
			}
		}
		best, bestCost := 0, math.Inf(1)
		for w := range engines {
			if cost := float64(len(keys)-overlap[w]) + load[w]; cost < bestCost {
				best, bestCost = w, cost
			}
		}
		load[best] += float64(len(keys) - overlap[best])
		engines[best].requests <- r
		if now := time.Now(); now.After(nextProgress) {
			nextProgress = now.Add(o.progress)
			progress(stderr, p, i+1, len(reqs), now.Sub(start))
		}
	}
	return len(reqs)
}

func progress(w io.Writer, p *kvpipe.Pipeline, done, total int, elapsed time.Duration) {
	a := p.Stats().Total().Actor
	events, indexed := a.Stored+a.Removed+a.Cleared, max(a.IndexedBlocks, 0)
	fmt.Fprintf(w, "replay: %d/%d requests, %d events (%.0f/s), %d blocks indexed, %s\n",
		done, total, events, float64(events)/elapsed.Seconds(), indexed, elapsed.Round(100*time.Millisecond))
}

// settle waits until the pipeline has received every batch the engines
// published, so the summary counts them all.
func settle(p *kvpipe.Pipeline, engines []*engine) {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		t := p.Stats().Total()
		got, gone := t.Actor.Batches, t.Wire.Lost
		published := uint64(0)
		for _, e := range engines {
			published += e.pub.Published()
		}
		if got+gone >= published {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// randomHitRate replays the same requests on fresh engines routed at random.
func randomHitRate(o options, reqs []sim.Request) float64 {
	rng := rand.New(rand.NewPCG(1, 2))
	caches := make([]*sim.Engine, o.workers)
	for i := range caches {
		caches[i] = sim.NewEngine(o.blockSize, o.capacity)
	}
	var hit, total int
	var tokens []uint32
	var events []codec.Event
	for i := range reqs {
		tokens = sim.PromptTokens(tokens[:0], &reqs[i])
		var h int
		events, h = caches[rng.IntN(len(caches))].Serve(events[:0], &reqs[i], tokens)
		hit += h
		total += len(tokens) / o.blockSize
	}
	return float64(hit) / float64(max(total, 1))
}

func report(w io.Writer, o options, source string, reqs []sim.Request, engines []*engine, t kvpipe.WorkerStats, wall time.Duration) error {
	var hit, blocks int
	for _, e := range engines {
		hit += e.hitBlocks
		blocks += e.blocks
	}
	a, ws := t.Actor, t.Wire
	events, stored, indexed := a.Stored+a.Removed+a.Cleared, a.BlocksStored, a.IndexedBlocks
	lost, gaps, replayed, resyncs, batches := ws.Lost, ws.Gaps, ws.Replayed, a.Resyncs, ws.Batches
	filtered := a.Filtered
	fmt.Fprintf(w, "replay summary (%s, %d workers, capacity %d blocks of %d tokens)\n", source, o.workers, o.capacity, o.blockSize)
	fmt.Fprintf(w, "  requests           %d in %s\n", len(reqs), wall.Round(time.Millisecond))
	fmt.Fprintf(w, "  events             %d in %d batches (%.0f events/s, %.0f blocks/s)\n", events, batches,
		float64(events)/wall.Seconds(), float64(stored)/wall.Seconds())
	fmt.Fprintf(w, "  blocks indexed     %d stored, %d held at the end\n", stored, indexed)
	fmt.Fprintf(w, "  prefix-hit rate    kvpipe routing %.1f%%, random routing %.1f%%\n",
		100*float64(hit)/float64(max(blocks, 1)), 100*randomHitRate(o, reqs))
	fmt.Fprintf(w, "  gaps               %d (%d batches replayed, %d lost, %d resyncs)\n", gaps, replayed, lost, resyncs)
	fmt.Fprint(w, "  filtered          ")
	for r := range actor.NumReasons {
		fmt.Fprintf(w, " %s=%d", r, filtered[r])
	}
	fmt.Fprintln(w)
	return nil
}

func serveMetrics(addr string, reg *prometheus.Registry) (stop func(), err error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() { srv.Serve(l); close(done) }()
	return func() { srv.Close(); <-done }, nil
}
