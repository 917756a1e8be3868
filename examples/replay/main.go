// Command replay is a router in miniature. It starts simulated engines (real
// ZMQ publishers with replay sockets on loopback) and replays the Mooncake
// request trace through them: each request goes to the worker kvpipe's
// FindMatchesRequest and the load say is cheapest, that engine's LRU block
// cache stores and evicts blocks and publishes the KV events, and the kvpipe
// Pipeline ingests them. The engines behave as real ones do: partial tail
// blocks, a sliding-window group beside the full-attention one, CPU offload
// of evicted blocks, and some conversations on LoRA adapters (each can be
// switched off); the last --eagle engines are SGLang ones with EAGLE
// speculative decoding (bigram events, keys over EAGLE windows), routed
// beside the plain ones. At the end it compares the prefix-hit rate of that routing,
// per tier, with random routing of the same requests.
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
	"os"
	"os/signal"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/metricsserve"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/kvpipe/kvpipe/metrics"
	"github.com/prometheus/client_golang/prometheus"
)

type options struct {
	workers, capacity, blockSize, requests, shards int
	speedup                                        float64
	tracePath, metricsAddr                         string
	progress                                       time.Duration
	// How real the engines are.
	partialTails, lora        bool
	slidingWindow, hostBlocks int
	// eagle: the last this many engines run SGLang with EAGLE.
	eagle int
	// restartAt > 0: restart the router at that fraction of the trace, with
	// and without a snapshot, and compare.
	restartAt float64
	// failoverAt > 0 (with nats): the leading relay stops at that fraction
	// of the trace and its standby takes over.
	failoverAt float64
	// bufferSteps is each engine's replay buffer, in batches.
	bufferSteps int
	// nats: through a relay and an in-process JetStream server.
	nats bool
	// burst > 0: every request becomes that many sharing its prompt as a
	// new prefix, at once, replayed with and without predictions.
	burst int
	// prefillRate (tokens/s) models each engine's event lag: its events
	// are published once its prefills before them and theirs are done.
	prefillRate float64
	// loadWeight weighs a worker's recent work against the blocks it
	// lacks (default 1; 0.5 in burst mode).
	loadWeight float64
	ttl        time.Duration // PredictionTTL, in trace time (0: kvpipe's default)
	// predict: the router tells the pipeline where it sent each request
	// (Pipeline.Routed) and credits predicted blocks; approximate: its
	// workers have no events, only those predictions.
	predict, approximate bool
}

// isEagle reports whether engine i runs SGLang with EAGLE.
func (o options) isEagle(i int) bool { return i >= o.workers-o.eagle }

// engineOptions are the behaviours o asks for of engine i.
func (o options) engineOptions(i int) []sim.Option {
	var opts []sim.Option
	if o.isEagle(i) {
		opts = append(opts, sim.WithEagle())
	}
	if o.partialTails {
		opts = append(opts, sim.WithPartialTails())
	}
	if o.slidingWindow > 0 {
		opts = append(opts, sim.WithSlidingWindow(o.slidingWindow))
	}
	if o.hostBlocks > 0 {
		opts = append(opts, sim.WithCPUOffload(o.hostBlocks))
	}
	if o.lora {
		opts = append(opts, sim.WithLoRA())
	}
	return opts
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
	flag.BoolVar(&o.partialTails, "partial-tails", true, "engines publish each prompt's partial last block, as vLLM with a hash unit below its block size does")
	flag.IntVar(&o.slidingWindow, "sliding-window", 4096, "engines run a hybrid model whose second group is a sliding window of this many tokens (0: none)")
	flag.IntVar(&o.hostBlocks, "host-capacity", 100_000, "blocks each engine's CPU offload tier holds (0: no offload)")
	flag.BoolVar(&o.lora, "lora", true, "some conversations run on LoRA adapters")
	flag.IntVar(&o.eagle, "eagle", 1, "the last N engines run SGLang with EAGLE speculative decoding: bigram events, blocks keyed over EAGLE windows (not with --nats)")
	flag.Float64Var(&o.restartAt, "restart-at", 0, "restart the router at this fraction of the trace, once from its snapshot and once without, and compare their hit rates (0: no restart)")
	flag.IntVar(&o.bufferSteps, "buffer-steps", 1000, "batches each engine keeps for replay (a simulated batch is a whole prompt, so fewer than vLLM's 10,000)")
	flag.Float64Var(&o.failoverAt, "failover-at", 0.5, "with --nats: stop the leading relay at this fraction of the trace, for its standby to take over (0: no failover)")
	flag.IntVar(&o.burst, "burst", 0, "burst mode: each request becomes N requests sharing its prompt as a new prefix, at once; compares routing with predictions, without, approximate-only and random (0: off)")
	flag.Float64Var(&o.prefillRate, "prefill-rate", 20_000, "with --burst: tokens each engine prefills per second (an 8B model on one H100, roughly), which delays its events by its queued and own prefill")
	flag.DurationVar(&o.ttl, "prediction-ttl", 0, "with --burst: PredictionTTL in trace time (0: kvpipe's default, 10s)")
	flag.Float64Var(&o.loadWeight, "load-weight", 0, "weight of a worker's recent work against the blocks it lacks (0: 1, or 0.5 with --burst)")
	flag.BoolVar(&o.nats, "nats", false, "replay through a relay into an in-process NATS JetStream server, with two router replicas following its stream, and check that their indexes agree")
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
	requests chan job
	done     chan struct{}
	// Read after done is closed.
	hits             hits
	base, onAdapters claims
	results          []sim.Result // by request; shared, each request written by its engine
	servedBy         []int        // by request: its engine's index; shared as results is
	idx              int
	// lag, when set (burst mode), publishes each batch once the engine's
	// prefills up to it are done.
	lag *lagModel
}

// hits counts a routing's prefix hits in blocks.
type hits struct {
	device, host, blocks int
}

func (h *hits) add(r sim.Result) {
	h.device += r.DeviceHits
	h.host += r.HostHits
	h.blocks += r.Blocks
}

func (h hits) String() string {
	pct := func(n int) float64 { return 100 * float64(n) / float64(max(h.blocks, 1)) }
	return fmt.Sprintf("%.1f%% (device %.1f%%, host %.1f%%)", pct(h.device+h.host), pct(h.device), pct(h.host))
}

func (e *engine) serve() {
	defer close(e.done)
	var events []codec.Event
	var tokens []uint32
	var payload []byte
	for j := range e.requests {
		if j.served != nil {
			close(j.served)
			continue
		}
		r := j.r
		tokens = sim.InputTokens(tokens[:0], r)
		var res sim.Result
		events, res = e.cache.ServeResult(events[:0], r, tokens)
		e.hits.add(res)
		e.results[j.i] = res
		e.servedBy[j.i] = e.idx
		if e.cache.Options().LoRA && r.Lora != "" {
			e.onAdapters.add(j, res.DeviceHits)
		} else {
			e.base.add(j, res.DeviceHits)
		}
		if len(events) > 0 {
			l := engineenc.CurrentVLLM
			if e.cache.Options().Eagle {
				l = sglang
			}
			// The publisher keeps the payload for replay: a fresh one each time.
			payload = engineenc.AppendBatch(nil, &codec.Batch{TS: float64(r.TimestampMs) / 1000, Events: events}, l)
			if e.lag != nil {
				e.lag.queue(payload, res, j.routedAt)
				continue
			}
			e.pub.Publish(payload)
		}
	}
}

// sglang is how SGLang publishes: map events, signed hashes, a cache_salt key.
var sglang = engineenc.Layout{SignedHashes: true, SaltKey: true}

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

// check validates o and applies its defaults.
func (o *options) check() error {
	switch {
	case o.workers <= 0 || o.capacity <= 0 || o.blockSize <= 0 || sim.TraceBlockTokens%o.blockSize != 0:
		return errors.New("--workers and --capacity must be positive, --block-size a divisor of 512")
	case o.restartAt < 0 || o.restartAt >= 1 || o.failoverAt < 0 || o.failoverAt >= 1:
		return errors.New("--restart-at and --failover-at must be in [0, 1)")
	case o.restartAt > 0 && o.nats, o.burst > 0 && (o.nats || o.restartAt > 0):
		return errors.New("--restart-at, --nats and --burst are separate runs")
	}
	if o.bufferSteps <= 0 {
		o.bufferSteps = 1000
	}
	if o.nats {
		o.eagle = 0 // a relay's ops do not carry a worker's mode: its followers would score EAGLE workers with plain keys
	}
	o.eagle = min(max(o.eagle, 0), o.workers)
	if o.loadWeight <= 0 {
		o.loadWeight = 1
		if o.burst > 0 {
			o.loadWeight = 0.5 // see runBurst
		}
	}
	return nil
}

func run(ctx context.Context, o options, stdout, stderr io.Writer) error {
	if err := o.check(); err != nil {
		return err
	}
	reqs, source, err := loadTrace(o, stderr)
	if err != nil {
		return err
	}
	if o.restartAt > 0 {
		return runRestart(ctx, o, reqs, source, stdout, stderr)
	}
	if o.burst > 0 {
		return runBurst(ctx, o, reqs, source, stdout, stderr)
	}
	if o.nats {
		return runNATS(ctx, o, reqs, source, stdout, stderr)
	}
	reg := prometheus.NewRegistry()
	if o.metricsAddr != "" {
		stopMetrics, err := metricsserve.Serve(o.metricsAddr, reg)
		if err != nil {
			return err
		}
		defer stopMetrics()
	}
	engines, err := startEngines(o, len(reqs))
	if err != nil {
		return err
	}
	defer stopEngines(engines)
	r, err := startRouter(ctx, o, engines, reg, nil, stderr)
	if err != nil {
		return err
	}
	defer r.stop() // on early returns; a second stop does nothing
	start := time.Now()
	routed := route(ctx, o, reqs, 0, r.p, engines, stderr, start)
	drainEngines(engines)
	settle(r.p, engines)
	wall := time.Since(start)
	// Read before the stop: a batch a stopping worker cannot hand to its
	// shard is dropped, and its held-block counts with it.
	total := r.p.Stats().Total()
	if err := r.stop(); err != nil {
		return err
	}
	return report(stdout, o, source, reqs[:routed], engines, total, wall)
}

// startEngines starts o.workers simulated engines for a trace of n requests.
func startEngines(o options, n int) ([]*engine, error) {
	results := make([]sim.Result, n) // each request's, written by the engine serving it
	servedBy := make([]int, n)
	engines := make([]*engine, 0, o.workers)
	for i := range o.workers {
		pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: o.bufferSteps})
		if err != nil {
			stopEngines(engines)
			return nil, err
		}
		e := &engine{name: fmt.Sprintf("engine-%d", i), cache: sim.NewEngine(o.blockSize, o.capacity, o.engineOptions(i)...), pub: pub,
			requests: make(chan job, 64), done: make(chan struct{}), results: results, servedBy: servedBy, idx: i}
		if o.burst > 0 {
			e.lag = newLagModel(o, pub)
		}
		engines = append(engines, e)
		go e.serve()
	}
	return engines, nil
}

// drainEngines stops the engines' goroutines once they have served every
// request routed to them; their publishers stay up.
func drainEngines(engines []*engine) {
	for _, e := range engines {
		if e.requests != nil {
			close(e.requests)
			e.requests = nil
			<-e.done
			if e.lag != nil {
				e.lag.stop() // every batch published
			}
		}
	}
}

func stopEngines(engines []*engine) {
	drainEngines(engines)
	for _, e := range engines {
		e.pub.Close()
	}
}

// router is a kvpipe Pipeline subscribed to every engine, and its Run.
type router struct {
	p       *kvpipe.Pipeline
	runDone chan error
	err     error
	stopped bool
}

// startRouter runs a Pipeline on the engines, restored from snap when it
// is not nil, and waits until it is connected to each of them.
func startRouter(ctx context.Context, o options, engines []*engine, reg prometheus.Registerer, snap *kvpipe.Snapshot, stderr io.Writer) (*router, error) {
	cfg := kvpipe.Config{BlockSize: o.blockSize, Shards: o.shards,
		Logger: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if o.burst > 0 { // the TTLs are of trace time too
		cfg.PredictionTTL = time.Duration(float64(o.predictionTTL()) / o.speedup)
		cfg.ApproximateTTL = time.Duration(float64(approximateTTL) / o.speedup)
	}
	p, err := kvpipe.New(cfg)
	if err != nil {
		return nil, err
	}
	if reg != nil {
		if err := reg.Register(metrics.NewCollector(p.Stats)); err != nil {
			return nil, err
		}
	}
	if snap != nil {
		if err := p.Restore(snap); err != nil {
			p.Shutdown(context.Background())
			return nil, err
		}
	}
	for _, e := range engines {
		// EAGLE is known in advance here; without it the worker's mode is
		// learned from its first bigram event.
		wc := kvpipe.WorkerConfig{Endpoint: "tcp://" + e.pub.Addr(), ReplayEndpoint: "tcp://" + e.pub.ReplayAddr(),
			Eagle: e.cache.Options().Eagle, CacheBlocks: o.capacity}
		if o.approximate { // no events: an LRU of its cache's size, of the router's own decisions
			wc = kvpipe.WorkerConfig{CacheBlocks: o.capacity, Eagle: wc.Eagle}
		}
		if err := p.AddWorker(e.name, wc); err != nil {
			p.Shutdown(context.Background())
			return nil, err
		}
	}
	r := &router{p: p, runDone: make(chan error, 1)}
	go func() { r.runDone <- p.Run(context.Background()) }()
	connect := len(engines)
	if o.approximate {
		connect = 0
	}
	if err := waitConnected(ctx, p, connect); err != nil {
		r.stop()
		return nil, err
	}
	return r, nil
}

// stop shuts the pipeline down and returns Run's error; once.
func (r *router) stop() error {
	if !r.stopped {
		r.stopped = true
		r.p.Shutdown(context.Background())
		r.err = <-r.runDone
	}
	return r.err
}

// waitConnected publishes nothing: it waits until every SUB is connected, so
// that the first batches are not lost to the PUB/SUB slow start. It gives
// up after connectWait without a new connection: a loaded machine connects
// slowly, a wrong endpoint never.
func waitConnected(ctx context.Context, p *kvpipe.Pipeline, n int) error {
	best := -1
	for deadline := time.Now(); ; {
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
		if connected > best {
			best, deadline = connected, time.Now().Add(connectWait)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d engines connected, none more within %v", connected, n, connectWait)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// connectWait is how long waitConnected waits for one more engine.
const connectWait = 30 * time.Second

// job is a request routed to an engine, with what kvpipe claimed the engine
// holds of it on device, and (for a request on an adapter) what keys of the
// tokens alone would have claimed.
type job struct {
	r              *sim.Request
	i              int // its index in the trace
	claimed, plain int
	predicted      int // with predictions: blocks held or predicted (Match.Predicted)
	routedAt       time.Time
	served         chan struct{} // not a request: closed once the ones before it are served
}

// quiesce waits until the engines have served every request routed to them.
func quiesce(engines []*engine) {
	for _, e := range engines {
		j := job{served: make(chan struct{})}
		e.requests <- j
		<-j.served
	}
}

// claims compares the router's claims with what the engine had when the
// request reached it: blocks claimed beyond that were not there (late news
// of an eviction, or a key that names the wrong blocks).
type claims struct {
	requests, claimed, over int
	// predicted: blocks claimed by predictions alone (Match.Predicted past
	// Blocks); wrong: those of them the engine did not hold when served.
	predicted, wrong int
	// across: blocks token-only keys would have credited on top, which the
	// engine holds only under another adapter or the base model.
	across int
}

func (c *claims) add(j job, held int) {
	c.requests++
	c.claimed += j.claimed
	c.over += max(j.claimed-held, 0)
	c.predicted += max(j.predicted-j.claimed, 0)
	c.wrong += max(j.predicted-max(j.claimed, held), 0)
	c.across += max(j.plain-j.claimed, 0)
}

// route sends each request, at its trace time, to the worker with the least
// prefill work (blocks it does not hold, weighed by tier, per
// FindMatchesRequest) plus queued work.
// The requests are the trace's from first on; it returns how many it routed.
func route(ctx context.Context, o options, reqs []sim.Request, first int, p *kvpipe.Pipeline, engines []*engine, stderr io.Writer, start time.Time) int {
	load := make([]float64, len(engines)) // blocks of recent work, decaying
	const tau = 5000.0                    // trace milliseconds for load to decay by e
	pk := newPicker(o, engines)
	var tokens []uint32
	lastTS := int64(0)
	nextProgress := start.Add(o.progress)
	for i := first; i < len(reqs); i++ {
		r := &reqs[i]
		if !waitDue(ctx, o, start, r) {
			return i
		}
		decay := math.Exp(-float64(r.TimestampMs-lastTS) / tau)
		lastTS = r.TimestampMs
		for w := range load {
			load[w] *= decay
		}
		tokens = sim.InputTokens(tokens[:0], r)
		req := kvpipe.Request{Tokens: tokens}
		if o.lora {
			req.Lora = r.Lora
		}
		best, work := pk.pick(ctx, p, &req, load)
		load[best] += work
		if o.predict {
			keys := pk.keys
			if o.isEagle(best) {
				keys = pk.eagleKeys
			}
			p.Routed(engines[best].name, keys) // errors only for a worker unknown or a pipeline stopped: not here
		}
		j := job{r: r, i: i, claimed: pk.device[best], predicted: pk.predicted[best], routedAt: time.Now()}
		if req.Lora != "" {
			pk.plain = pk.h.Prompt(pk.plain[:0], tokens, o.blockSize)
			pk.eaglePlain = pk.h.EaglePrompt(pk.eaglePlain[:0], tokens, o.blockSize)
			j.plain = blocksOf(ctx, p, engines[best].name, pk.plain, pk.eaglePlain)
		}
		engines[best].requests <- j
		if now := time.Now(); now.After(nextProgress) {
			nextProgress = now.Add(o.progress)
			progress(stderr, p, i+1, len(reqs), now.Sub(start))
		}
	}
	return len(reqs)
}

// waitDue waits for r's trace time, and reports false once ctx ended.
func waitDue(ctx context.Context, o options, start time.Time, r *sim.Request) bool {
	if o.speedup > 0 {
		due := start.Add(time.Duration(float64(r.TimestampMs) / o.speedup * float64(time.Millisecond)))
		if d := time.Until(due); d > 0 {
			select {
			case <-ctx.Done():
				return false
			case <-time.After(d):
			}
		}
	}
	return ctx.Err() == nil
}

// picker chooses a request's worker; it keeps its scratch between requests.
type picker struct {
	o                                  options
	h                                  kvpipe.Hasher
	byName                             map[string]int
	keys, eagleKeys, plain, eaglePlain []uint64
	score                              []float64
	device, predicted                  []int
}

func newPicker(o options, engines []*engine) *picker {
	pk := &picker{o: o, byName: map[string]int{}, score: make([]float64, len(engines)), device: make([]int, len(engines)),
		predicted: make([]int, len(engines))}
	for i, e := range engines {
		pk.byName[e.name] = i
	}
	return pk
}

// pick returns the worker with the least prefill work for req (blocks it
// does not hold, weighed by tier) plus load, and that work. Each kind of
// worker is scored with its own kind of keys.
func (pk *picker) pick(ctx context.Context, p *kvpipe.Pipeline, req *kvpipe.Request, load []float64) (best int, work float64) {
	pk.keys = pk.h.RequestKeys(pk.keys[:0], req, pk.o.blockSize)
	pk.eagleKeys = pk.h.EagleKeys(pk.eagleKeys[:0], req, pk.o.blockSize)
	clear(pk.score)
	clear(pk.device)
	clear(pk.predicted)
	if matches, err := p.AppendMatchesKeys(ctx, nil, pk.keys, pk.eagleKeys); err == nil {
		for _, m := range matches {
			w := pk.byName[m.Worker]
			pk.score[w], pk.device[w], pk.predicted[w] = m.Score, m.Blocks, m.Predicted
			if pk.o.predict { // a block predicted counts as one held on device
				pk.score[w] = max(m.Score, float64(m.Predicted))
			}
		}
	}
	bestCost := math.Inf(1)
	for w := range pk.score {
		blocks := float64(len(pk.keys))
		if pk.o.isEagle(w) {
			blocks = float64(len(pk.eagleKeys))
		}
		if cost := blocks - pk.score[w] + pk.o.loadWeight*load[w]; cost < bestCost {
			best, bestCost, work = w, cost, blocks-pk.score[w]
		}
	}
	return best, work
}

// blocksOf is how many leading device blocks of keys (eagleKeys for an
// EAGLE worker) the index gives worker.
func blocksOf(ctx context.Context, p *kvpipe.Pipeline, worker string, keys, eagleKeys []uint64) int {
	ms, _ := p.AppendMatchesKeys(ctx, nil, keys, eagleKeys)
	for _, m := range ms {
		if m.Worker == worker {
			return m.Blocks
		}
	}
	return 0
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
	// A bound for a pipeline that cannot catch up, generous for a loaded
	// machine: a snapshot taken before the last batches are applied would
	// be proven against batches the engines' buffers may no longer hold.
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
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

// randomHits replays the same requests on fresh engines routed at random.
func randomHits(o options, reqs []sim.Request) hits {
	rng := rand.New(rand.NewPCG(1, 2))
	caches := make([]*sim.Engine, o.workers)
	for i := range caches {
		caches[i] = sim.NewEngine(o.blockSize, o.capacity, o.engineOptions(i)...)
	}
	var h hits
	var tokens []uint32
	var events []codec.Event
	for i := range reqs {
		tokens = sim.InputTokens(tokens[:0], &reqs[i])
		var res sim.Result
		events, res = caches[rng.IntN(len(caches))].ServeResult(events[:0], &reqs[i], tokens)
		h.add(res)
	}
	return h
}

func report(w io.Writer, o options, source string, reqs []sim.Request, engines []*engine, t kvpipe.WorkerStats, wall time.Duration) error {
	var routed, eagle hits
	var base, onAdapters claims
	for i, e := range engines {
		routed.device += e.hits.device
		routed.host += e.hits.host
		routed.blocks += e.hits.blocks
		if o.isEagle(i) {
			eagle.device += e.hits.device
			eagle.host += e.hits.host
			eagle.blocks += e.hits.blocks
		}
		for _, c := range []struct{ sum, of *claims }{{&base, &e.base}, {&onAdapters, &e.onAdapters}} {
			c.sum.requests += c.of.requests
			c.sum.claimed += c.of.claimed
			c.sum.over += c.of.over
			c.sum.across += c.of.across
		}
	}
	a, ws := t.Actor, t.Wire
	events, stored := a.Stored+a.Removed+a.Cleared, a.BlocksStored
	lost, gaps, replayed, resyncs, batches := ws.Lost, ws.Gaps, ws.Replayed, a.Resyncs, ws.Batches
	filtered := a.Filtered
	fmt.Fprintf(w, "replay summary (%s, %d workers, capacity %d blocks of %d tokens, host tier %d blocks)\n",
		source, o.workers, o.capacity, o.blockSize, o.hostBlocks)
	fmt.Fprintf(w, "  engines            partial tails %v, sliding window %d, LoRA %v, EAGLE %d\n", o.partialTails, o.slidingWindow, o.lora, o.eagle)
	fmt.Fprintf(w, "  requests           %d in %s (%d on adapters)\n", len(reqs), wall.Round(time.Millisecond), onAdapters.requests)
	fmt.Fprintf(w, "  events             %d in %d batches (%.0f events/s, %.0f blocks/s)\n", events, batches,
		float64(events)/wall.Seconds(), float64(stored)/wall.Seconds())
	fmt.Fprint(w, "  blocks held        ")
	for tier, n := range a.TierBlocks {
		fmt.Fprintf(w, " %s=%d", kvpipe.Tier(tier), n)
	}
	fmt.Fprintf(w, " (%d stored in all)\n", stored)
	fmt.Fprintf(w, "  prefix-hit rate    kvpipe routing %s\n", routed)
	fmt.Fprintf(w, "                     random routing %s\n", randomHits(o, reqs))
	if o.eagle > 0 {
		fmt.Fprintf(w, "                     EAGLE engines (%d, SGLang bigram events) %s\n", o.eagle, eagle)
	}
	fmt.Fprintf(w, "  device claims      base model: %d blocks claimed, %d not held when served; adapters: %d claimed, %d not held\n",
		base.claimed, base.over, onAdapters.claimed, onAdapters.over)
	if onAdapters.requests > 0 {
		fmt.Fprintf(w, "                     token-only keys would have credited at least %d more blocks, which the worker holds for the base model, not the adapter\n",
			onAdapters.across)
	}
	fmt.Fprintf(w, "  gaps               %d (%d batches replayed, %d lost, %d resyncs)\n", gaps, replayed, lost, resyncs)
	fmt.Fprint(w, "  filtered          ")
	for r := range actor.NumReasons {
		fmt.Fprintf(w, " %s=%d", r, filtered[r])
	}
	fmt.Fprintln(w)
	return nil
}
