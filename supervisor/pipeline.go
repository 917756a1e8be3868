package supervisor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/metrics"
	"github.com/kvpipe/kvpipe/snapshot"
	"github.com/kvpipe/kvpipe/wire"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
)

// Config configures a Pipeline.
type Config struct {
	BlockSize int // the router's block size (required), e.g. 16
	Shards    int // index shards (default 2)
	// ShardQueue is how many batches each shard's queue holds, shared by the
	// shard's workers (default 256). A worker has at most ShardQueue+2
	// batches of at most 256 ops in flight (queued, being applied, being
	// filled), so a stalled shard holds at most 4 KiB per batch per worker.
	ShardQueue   int
	Backpressure Backpressure // when a shard is behind: Block (default) or Drop
	// TierWeights weigh a match's blocks by the tier holding them
	// (Match.Score). A tier weighted 0 is not indexed at all: its events
	// are filtered as lower_tier. The zero value means index.DefaultWeights
	// (device 1, host 0.8, disk 0.5, remote 0.3).
	TierWeights index.Weights
	// Subscriber tunes every worker's subscriber (timeouts, backoff, replay
	// buffer, limits); the zero value holds the defaults.
	Subscriber wire.Options
	// RestartMin and RestartMax bound the jittered exponential backoff before
	// a worker that panicked is restarted (defaults 100ms and 10s).
	RestartMin, RestartMax time.Duration
	Logger                 *slog.Logger
	// Registry receives the pipeline's collectors; nil registers nothing.
	Registry prometheus.Registerer
	// Observe, when set, sees every batch in the worker's goroutine before its
	// actor does (for tools such as kvpipe listen); payload is only valid
	// during the call. It must not block, nor call Shutdown or RemoveWorker:
	// both wait for the goroutine it runs on.
	Observe func(worker string, seq uint64, payload []byte)
	// Publish, when set, sees every batch of ops a worker hands its shard,
	// in the worker's goroutine and before the shard, and returns the
	// position it reached, kept in the worker's snapshot (a relay publishes
	// the ops and returns their stream sequence). ctx ends when the worker
	// stops. A removed worker's last call has the one op OpRemoveWorker.
	// It needs Backpressure Block.
	Publish func(ctx context.Context, worker string, ops []index.Op, o actor.Origin) uint64
	// Flush, when set with Publish, lets a Publish that returns before its
	// ops are stored (a relay keeps many in flight) give a snapshot the
	// position it covers: Snapshot calls it in the worker's goroutine, once
	// the worker's state is captured, and keeps what it returns instead of
	// Publish's last result. It waits until every batch given to Publish is
	// stored; an error fails the snapshot.
	Flush func(ctx context.Context, worker string) (uint64, error)
	// Source, when set, feeds the index with ops normalised elsewhere
	// (relay.Follower); Run runs it beside the workers.
	Source Source
}

// Backpressure says what a worker does when its shard is behind.
type Backpressure = actor.Backpressure

const (
	// Block waits for the shard, and so stops reading the engine's socket:
	// the loss, if any, shows as a seq gap, which replay recovers.
	Block = actor.Block
	// Drop discards the batch, counts it, and resyncs the worker.
	Drop = actor.Drop
)

// WorkerConfig is one engine's connection.
type WorkerConfig struct {
	Endpoint       string // its KV-events PUB, e.g. tcp://10.0.0.5:5557
	ReplayEndpoint string // its replay ROUTER; "" when it has none
	// SnapshotEndpoint is its snapshot ROUTER (SGLang's snapshot_endpoint),
	// from which the worker is rebuilt after a loss; "" when it has none.
	SnapshotEndpoint string
	Topic            string // ZMQ topic prefix; the engines' default is ""
	// Eagle: the engine runs EAGLE-family speculative decoding (SGLang
	// with --speculative-algorithm EAGLE, EAGLE3, NEXTN), whose blocks are
	// keyed over windows of BlockSize+1 tokens. Optional: the worker's mode
	// is learned from its events (bigram token ids) in any case; this sets
	// it before the first one.
	Eagle bool
}

// Match is one worker's overlap with a request: its leading blocks cached.
type Match struct {
	Worker string
	Blocks int // leading blocks on device
	// Tiers[t] is how many leading blocks the worker holds each in tier t or
	// a faster one: Tiers[TierDevice] is Blocks, Tiers[TierRemote] is how
	// far the prefix reaches in any tier.
	Tiers [index.NumTiers]int
	// Score weighs those blocks by the slowest tier each needed
	// (Config.TierWeights): a prefix wholly on device scores its length.
	Score float64
	// Partial: the worker's entries may lack blocks its engine holds (it
	// was resynced, or kvpipe joined its stream late), so Blocks may be low;
	// a router may weigh it. It clears once the worker's history is whole
	// again (a new incarnation from its first batch, or a cache clear).
	Partial bool
	// Eagle: the worker keys its blocks over EAGLE windows, and was
	// matched with the request's EAGLE keys (index.Hasher.EagleKeys).
	Eagle bool
}

// ErrClosed is returned once the pipeline has been shut down.
var ErrClosed = errors.New("kvpipe: pipeline closed")

// ErrRunning is returned by a second call of Run.
var ErrRunning = errors.New("kvpipe: pipeline already running")

// ErrNoWorker is returned by RemoveWorker for a name it does not know.
var ErrNoWorker = errors.New("kvpipe: no such worker")

// Pipeline is the one type a router embeds: it runs one subscriber and actor
// per worker, the index shards, and their supervision. New starts nothing;
// Run owns every goroutine until it returns.
type Pipeline struct {
	cfg        Config
	latency    prometheus.Histogram
	collectors []prometheus.Collector // registered by New, unregistered once stopped

	// mu guards the worker table and the lifecycle. Nothing holds it while
	// waiting: workers start and stop outside it.
	mu        sync.Mutex
	workers   map[string]*worker
	nextID    index.WorkerID
	phase     phase
	workerCtx context.Context // the workers' parent while running
	group     errgroup.Group  // the workers' supervising goroutines
	// removing waits for removed workers to leave their shards; syncing for
	// Sync calls under way. Both end before the shards close.
	removing, syncing sync.WaitGroup

	// What the read path needs, published on every change, so that
	// FindMatches and scrapes take no lock and never wait.
	shards  atomic.Pointer[index.Shards]
	names   atomic.Pointer[map[index.WorkerID]*worker]
	list    atomic.Pointer[[]*worker]
	scores  sync.Pool     // *[]index.Score: the read path's scratch
	stop    chan struct{} // closed by the first Shutdown
	stopped chan struct{} // closed once every goroutine has stopped
	// wrap, when set (by tests), wraps every worker's handler.
	wrap func(wire.Handler) wire.Handler
	// restored holds the snapshot's workers not yet started (Restore).
	restored map[string]*snapshot.Worker
	// leaving: workers being removed, whose names cannot be taken again
	// until their removal is queued (and published) behind their last ops.
	leaving map[string]bool
	// feeding counts Feed.Apply calls under way; they end before the
	// shards close.
	feeding sync.WaitGroup
}

type phase uint8

const (
	idle     phase = iota // built, Run not yet called
	running               // Run is supervising
	draining              // Run is stopping the workers and draining the shards
	closed                // stopped: every call gets ErrClosed
)

type worker struct {
	name     string
	id       index.WorkerID
	sub      *wire.Subscriber            // nil for a fed worker
	fed      *fedWorker                  // a Source's worker; nil for an engine's
	actor    atomic.Pointer[actor.Actor] // set once the worker starts
	restarts atomic.Uint64               // by its supervising goroutine; read by scrapes
	ctx      context.Context             // ends when it stops
	cancel   context.CancelFunc
	done     chan struct{} // nil until started
	eagleCfg bool          // WorkerConfig.Eagle: the mode until its actor runs
}

// eagle reports whether w's blocks are keyed over EAGLE windows.
func (w *worker) eagle() bool {
	if w.fed != nil {
		return false
	}
	if a := w.actor.Load(); a != nil {
		return a.Eagle()
	}
	return w.eagleCfg
}

// partial reports Match.Partial for w.
func (w *worker) partial() bool {
	if w.fed != nil {
		return w.fed.partial.Load()
	}
	a := w.actor.Load()
	return a != nil && a.Partial()
}

// New validates cfg and registers the pipeline's collectors. It starts
// nothing: workers added before Run start when Run is called.
func New(cfg Config) (*Pipeline, error) {
	switch {
	case cfg.BlockSize <= 0:
		return nil, fmt.Errorf("kvpipe: BlockSize must be positive, got %d", cfg.BlockSize)
	case cfg.Shards < 0:
		return nil, fmt.Errorf("kvpipe: Shards must not be negative, got %d", cfg.Shards)
	case cfg.ShardQueue < 0:
		return nil, fmt.Errorf("kvpipe: ShardQueue must not be negative, got %d", cfg.ShardQueue)
	case cfg.Backpressure != Block && cfg.Backpressure != Drop:
		return nil, fmt.Errorf("kvpipe: unknown Backpressure %d", cfg.Backpressure)
	case cfg.Publish != nil && cfg.Backpressure == Drop:
		// A batch published and then dropped here would resync the worker,
		// and that resync would clear it in the stream too.
		return nil, errors.New("kvpipe: Publish needs Backpressure Block")
	case cfg.Flush != nil && cfg.Publish == nil:
		return nil, errors.New("kvpipe: Flush needs Publish")
	}
	if cfg.TierWeights == (index.Weights{}) {
		cfg.TierWeights = index.DefaultWeights
	}
	for t, w := range cfg.TierWeights {
		if w < 0 || math.IsNaN(w) || math.IsInf(w, 0) || t == int(index.TierDevice) && w == 0 {
			return nil, fmt.Errorf("kvpipe: TierWeights[%s] = %v: weights must be finite and not negative, and device's positive", index.Tier(t), w)
		}
	}
	if cfg.Shards == 0 {
		cfg.Shards = 2
	}
	if cfg.ShardQueue == 0 {
		cfg.ShardQueue = 256
	}
	if cfg.RestartMin <= 0 {
		cfg.RestartMin = 100 * time.Millisecond
	}
	if cfg.RestartMax < cfg.RestartMin {
		cfg.RestartMax = max(10*time.Second, cfg.RestartMin)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p := &Pipeline{
		cfg:     cfg,
		latency: metrics.NewFindMatchesHistogram(),
		workers: make(map[string]*worker),
		leaving: make(map[string]bool),
		stop:    make(chan struct{}),
		stopped: make(chan struct{}),
	}
	p.scores.New = func() any { return new([]index.Score) }
	p.publish()
	if cfg.Registry != nil {
		for _, c := range []prometheus.Collector{metrics.NewCollector(p.Stats), p.latency} {
			if err := cfg.Registry.Register(c); err != nil {
				p.unregister()
				return nil, fmt.Errorf("kvpipe: registering metrics: %w", err)
			}
			p.collectors = append(p.collectors, c)
		}
	}
	return p, nil
}

// unregister takes the collectors off the registry, so that a Pipeline
// built after this one stopped can register its own.
func (p *Pipeline) unregister() {
	for _, c := range p.collectors {
		p.cfg.Registry.Unregister(c)
	}
	p.collectors = nil
}

// closeDown marks the pipeline stopped; p.mu is held.
func (p *Pipeline) closeDown() {
	p.phase = closed
	p.unregister()
	close(p.stopped)
}

// AddWorker subscribes to one engine. It may be called before Run (the
// worker starts with it) or while Run runs.
func (p *Pipeline) AddWorker(name string, wc WorkerConfig) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.phase >= draining {
		return ErrClosed
	}
	if name == "" {
		return errors.New("kvpipe: worker name must not be empty")
	}
	if _, dup := p.workers[name]; dup {
		return fmt.Errorf("kvpipe: worker %q already added", name)
	}
	if p.leaving[name] {
		return fmt.Errorf("kvpipe: worker %q is still being removed", name)
	}
	sub, err := wire.NewSubscriber(wire.Config{ // validates and allocates: nothing to wait for
		Endpoint: wc.Endpoint, ReplayEndpoint: wc.ReplayEndpoint, SnapshotEndpoint: wc.SnapshotEndpoint, Topic: wc.Topic,
		Logger: p.cfg.Logger.With("worker", name), Options: p.cfg.Subscriber,
	})
	if err != nil {
		return fmt.Errorf("kvpipe: worker %q: %w", name, err)
	}
	w := &worker{name: name, id: p.nextID, sub: sub, eagleCfg: wc.Eagle}
	p.nextID++
	p.workers[name] = w
	if p.phase == running {
		p.start(w)
	}
	p.publish()
	return nil
}

// RemoveWorker stops a worker and frees its index entries. The worker leaves
// FindMatches answers at once; RemoveWorker returns once its goroutine has
// stopped and its entries are freed, or with ctx's error when ctx ends first
// (the removal then completes in the background). It returns ErrNoWorker
// for an unknown name and ErrClosed once the pipeline is stopping, when
// every worker goes with it.
func (p *Pipeline) RemoveWorker(ctx context.Context, name string) error {
	p.mu.Lock()
	if p.phase >= draining {
		p.mu.Unlock()
		return ErrClosed
	}
	w, ok := p.workers[name]
	if !ok {
		p.mu.Unlock()
		return fmt.Errorf("%w: %q", ErrNoWorker, name)
	}
	if w.fed != nil {
		p.mu.Unlock()
		return fmt.Errorf("kvpipe: worker %q is the Source's: it removes it", name)
	}
	delete(p.workers, name)
	p.publish()
	if w.done == nil { // never started
		p.mu.Unlock()
		return nil
	}
	w.cancel()
	removed := make(chan struct{})
	shards, runCtx := p.shards.Load(), p.workerCtx
	p.leaving[name] = true
	p.removing.Go(func() {
		defer close(removed)
		<-w.done // nothing of the worker can follow in its shard's queue, nor in a Publish
		ops := []index.Op{{Kind: index.OpRemoveWorker}}
		if p.cfg.Publish != nil {
			// Published even when the pipeline is stopping, so that the
			// stream does not keep a worker that is gone; within a bound.
			ctx, cancel := context.WithTimeout(context.WithoutCancel(runCtx), removalPublishTimeout)
			p.cfg.Publish(ctx, w.name, ops, actor.Origin{})
			cancel()
		}
		shards.Queue(w.id) <- &index.Batch{Worker: w.id, Ops: ops}
		p.mu.Lock()
		delete(p.leaving, name)
		p.mu.Unlock()
	})
	p.mu.Unlock()
	select {
	case <-removed:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Request describes a request for FindMatchesRequest: its tokens, and the
// adapter, salt and multimodal inputs that make its blocks distinct.
type Request = index.Request

// FindMatches hashes a base-model request's tokens into router blocks and
// returns, for every worker holding its first block, how many leading
// blocks it holds. Workers keyed over EAGLE windows are matched with the
// prompt's EAGLE keys, the others with its plain keys: one hashing pass
// for each kind of worker the pipeline has.
func (p *Pipeline) FindMatches(ctx context.Context, tokens []uint32) ([]Match, error) {
	var h index.Hasher
	var keys, eagleKeys []uint64
	plain, eagle := kinds(*p.list.Load())
	if plain {
		keys = h.Prompt(nil, tokens, p.cfg.BlockSize)
	}
	if eagle {
		eagleKeys = h.EaglePrompt(nil, tokens, p.cfg.BlockSize)
	}
	return nilIfEmpty(p.AppendMatchesKeys(ctx, nil, keys, eagleKeys))
}

// FindMatchesRequest is FindMatches for a request on an adapter, with a
// cache salt, or with multimodal inputs: its keys are those the engines'
// blocks of that request get, and no other request's.
func (p *Pipeline) FindMatchesRequest(ctx context.Context, r *Request) ([]Match, error) {
	var h index.Hasher
	var keys, eagleKeys []uint64
	plain, eagle := kinds(*p.list.Load())
	if plain {
		keys = h.RequestKeys(nil, r, p.cfg.BlockSize)
	}
	if eagle {
		eagleKeys = h.EagleKeys(nil, r, p.cfg.BlockSize)
	}
	return nilIfEmpty(p.AppendMatchesKeys(ctx, nil, keys, eagleKeys))
}

// kinds reports whether ws has workers keyed plainly, and workers keyed
// over EAGLE windows.
func kinds(ws []*worker) (plain, eagle bool) {
	for _, w := range ws {
		if w.eagle() {
			eagle = true
		} else {
			plain = true
		}
	}
	return plain, eagle
}

func nilIfEmpty(matches []Match, err error) ([]Match, error) {
	if len(matches) == 0 {
		matches = nil
	}
	return matches, err
}

// FindMatchesKeys is FindMatches for keys already hashed with index.Hasher
// (Prompt or RequestKeys). Workers keyed over EAGLE windows are left out:
// FindMatchesKeys' keys are not theirs (see AppendMatchesKeys).
func (p *Pipeline) FindMatchesKeys(ctx context.Context, keys []uint64) ([]Match, error) {
	return nilIfEmpty(p.AppendMatches(ctx, nil, keys))
}

// AppendMatches is FindMatchesKeys appending to dst: with room in dst it
// allocates nothing. It reads the index on the calling goroutine and never
// waits for a worker or a shard; the README says what an answer reflects.
func (p *Pipeline) AppendMatches(ctx context.Context, dst []Match, keys []uint64) ([]Match, error) {
	return p.AppendMatchesKeys(ctx, dst, keys, nil)
}

// AppendMatchesKeys is AppendMatches for a router that hashes both kinds
// of keys itself: workers keyed plainly are matched with keys (Prompt,
// RequestKeys), workers keyed over EAGLE windows with eagleKeys
// (EaglePrompt, EagleKeys). A nil slice leaves its kind of worker out.
// Match.Eagle says which keys a worker's answer used.
func (p *Pipeline) AppendMatchesKeys(ctx context.Context, dst []Match, keys, eagleKeys []uint64) ([]Match, error) {
	shards := p.shards.Load()
	if shards == nil {
		select {
		case <-p.stopped: // shut down before Run
			return dst, ErrClosed
		default: // not running yet: no worker holds anything
			return dst, nil
		}
	}
	start := time.Now()
	var err error
	if keys != nil {
		dst, err = p.appendKind(ctx, shards, dst, keys, false)
	}
	if err == nil && eagleKeys != nil {
		dst, err = p.appendKind(ctx, shards, dst, eagleKeys, true)
	}
	if err == nil {
		p.latency.Observe(time.Since(start).Seconds())
	}
	return dst, err
}

// appendKind appends the matches of keys for the workers of one kind.
func (p *Pipeline) appendKind(ctx context.Context, shards *index.Shards, dst []Match, keys []uint64, eagle bool) ([]Match, error) {
	scratch := p.scores.Get().(*[]index.Score)
	defer p.scores.Put(scratch)
	scores, err := shards.FindMatches(ctx, (*scratch)[:0], keys)
	*scratch = scores[:0]
	if errors.Is(err, index.ErrClosed) {
		return dst, ErrClosed
	}
	if err != nil {
		return dst, err
	}
	names := *p.names.Load()
	for _, sc := range scores {
		// A worker removed meanwhile is left out, and so is one of the other kind.
		if w, ok := names[sc.Worker]; ok && w.eagle() == eagle {
			dst = append(dst, Match{Worker: w.name, Blocks: sc.Blocks, Tiers: sc.Tiers, Score: sc.Weighted(p.cfg.TierWeights),
				Partial: w.partial(), Eagle: eagle})
		}
	}
	return dst, nil
}

// Sync waits until the shards have applied every batch the workers handed
// them so far: answers asked after it reflect at least those batches.
func (p *Pipeline) Sync(ctx context.Context) error {
	p.mu.Lock()
	switch p.phase {
	case idle:
		p.mu.Unlock()
		return nil // nothing handed over yet
	case draining, closed:
		p.mu.Unlock()
		return ErrClosed
	}
	p.syncing.Add(1) // the shards stay open until it is done
	p.mu.Unlock()
	defer p.syncing.Done()
	return p.shards.Load().Sync(ctx)
}

// Run starts the index shards and the workers and supervises them until ctx
// ends or Shutdown is called; then it stops the workers, lets the shards
// apply what is queued, and returns once every goroutine it started has
// stopped. It returns nil after Shutdown, ctx's cause when ctx ended, and
// ErrClosed or ErrRunning when it cannot start. The pipeline cannot be run
// again.
func (p *Pipeline) Run(ctx context.Context) error {
	p.mu.Lock()
	switch p.phase {
	case running, draining:
		p.mu.Unlock()
		return ErrRunning
	case closed:
		p.mu.Unlock()
		return ErrClosed
	}
	shards := index.NewShards(p.cfg.Shards, p.cfg.ShardQueue)
	p.shards.Store(shards)
	workerCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	p.phase, p.workerCtx = running, workerCtx
	for _, w := range p.workers {
		p.start(w)
	}
	if p.cfg.Source != nil {
		p.group.Go(func() error {
			p.runSource(workerCtx, &Feed{p: p})
			return nil
		})
	}
	p.publish()
	p.mu.Unlock()

	var err error
	select {
	case <-ctx.Done():
		err = context.Cause(ctx)
		select {
		case <-p.stop: // both were ready when Run looked: Shutdown was asked, a clean stop
			err = nil
		default:
		}
	case <-p.stop:
	}
	// Workers first (they feed the shards), then the shards, which apply
	// everything still queued before they stop.
	p.mu.Lock()
	p.phase = draining
	p.mu.Unlock()
	cancel()
	p.group.Wait()
	p.removing.Wait()
	p.syncing.Wait()
	p.feeding.Wait()
	shards.Close()
	p.mu.Lock()
	p.closeDown()
	p.mu.Unlock()
	return err
}

// Shutdown stops the pipeline: Run stops every worker, lets the shards apply
// what is queued, and returns nil. Shutdown waits for that, or returns ctx's
// error when ctx ends first (the shutdown then completes in the
// background). It is safe to call more than once, concurrently, and before
// or without Run.
func (p *Pipeline) Shutdown(ctx context.Context) error {
	p.mu.Lock()
	select {
	case <-p.stop:
	default:
		close(p.stop)
		if p.phase == idle { // no Run to do it
			p.closeDown()
		}
	}
	p.mu.Unlock()
	select {
	case <-p.stopped:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Stats is a snapshot of every worker's counters and every shard's state.
type Stats = metrics.Snapshot

// WorkerStats is one worker's counters.
type WorkerStats = metrics.Worker

// Stats returns a snapshot of the pipeline's counters, workers by name; its
// Total method sums them. It reads the published worker list, so it never
// waits for a worker or the lifecycle.
func (p *Pipeline) Stats() Stats {
	var snap Stats
	for _, w := range *p.list.Load() {
		if w.fed != nil {
			snap.Workers = append(snap.Workers, WorkerStats{Name: w.name, Actor: w.fed.stats()})
			continue
		}
		ws := WorkerStats{Name: w.name, Wire: w.sub.Stats(), Restarts: w.restarts.Load()}
		if a := w.actor.Load(); a != nil {
			ws.Actor = a.Stats()
		} else {
			ws.Actor.Partial = true // never started: nothing of it is known
			ws.Actor.Eagle = w.eagleCfg
		}
		snap.Workers = append(snap.Workers, ws)
	}
	if shards := p.shards.Load(); shards != nil {
		for i := range shards.Len() {
			snap.Shards = append(snap.Shards, metrics.Shard{QueueDepth: shards.QueueDepth(i), Nodes: shards.Nodes(i),
				UnknownRemoves: shards.UnknownRemoves(i)})
		}
	}
	return snap
}

// publish replaces the read path's copies of the worker table; p.mu is held.
func (p *Pipeline) publish() {
	names := make(map[index.WorkerID]*worker, len(p.workers))
	list := make([]*worker, 0, len(p.workers))
	for _, w := range p.workers {
		names[w.id] = w
		list = append(list, w)
	}
	slices.SortFunc(list, func(a, b *worker) int { return strings.Compare(a.name, b.name) })
	p.names.Store(&names)
	p.list.Store(&list)
}

// removalPublishTimeout bounds the publish of a removed worker's
// OpRemoveWorker, which may run while the pipeline stops.
const removalPublishTimeout = 5 * time.Second

// start runs w under Run's group; p.mu is held.
func (p *Pipeline) start(w *worker) {
	ctx, cancel := context.WithCancel(p.workerCtx)
	w.ctx, w.cancel, w.done = ctx, cancel, make(chan struct{})
	ac := actor.Config{Worker: w.id, Name: w.name, BlockSize: p.cfg.BlockSize,
		Shard: p.shards.Load().Queue(w.id), Backpressure: p.cfg.Backpressure, Weights: p.cfg.TierWeights, Done: ctx.Done(),
		Logger: p.cfg.Logger, Eagle: w.eagleCfg}
	if publish := p.cfg.Publish; publish != nil {
		ac.Publish = func(ops []index.Op, o actor.Origin) uint64 { return publish(ctx, w.name, ops, o) }
	}
	w.actor.Store(actor.New(ac))
	from := p.restored[w.name] // once: a worker added again later starts afresh
	delete(p.restored, w.name)
	p.group.Go(func() error {
		defer close(w.done)
		switch a := w.actor.Load(); {
		case from != nil && from.HasSeq:
			a.Import(from)
			w.sub.Resume(from.Seq, from.Fingerprint)
		case p.cfg.Publish != nil:
			a.StartAfresh() // what the stream held of it is not this worker's
		}
		p.supervise(ctx, w)
		return nil
	})
}

// supervise runs a worker until ctx ends, restarting it with backoff when it
// panics; a restarted worker is resynced, so its entries cannot be stale.
func (p *Pipeline) supervise(ctx context.Context, w *worker) {
	backoff := pace.Backoff{Min: p.cfg.RestartMin, Max: p.cfg.RestartMax}
	for {
		start := time.Now()
		panicked := p.runOnce(ctx, w)
		if ctx.Err() != nil {
			return
		}
		if !panicked { // Run returns only with ctx; anything else is a bug worth a restart too
			p.cfg.Logger.Error("kvpipe: worker stopped unexpectedly", "worker", w.name)
		}
		w.restarts.Add(1)
		if time.Since(start) > time.Minute {
			backoff.Reset() // it ran well for a while
		}
		if !pace.Sleep(ctx, backoff.Next()) {
			return
		}
		w.actor.Load().Recover()
	}
}

func (p *Pipeline) runOnce(ctx context.Context, w *worker) (panicked bool) {
	defer func() {
		if r := recover(); r != nil {
			panicked = true
			p.cfg.Logger.Error("kvpipe: worker panicked; restarting it resynced", "worker", w.name, "panic", r)
		}
	}()
	a := w.actor.Load()
	var h wire.Handler = a
	if p.cfg.Observe != nil {
		h = observed{a, w.name, p.cfg.Observe}
	}
	if p.wrap != nil {
		h = p.wrap(h)
	}
	w.sub.Run(ctx, h)
	return false
}

// observed shows every batch to Config.Observe before the actor has it.
type observed struct {
	*actor.Actor
	worker  string
	observe func(string, uint64, []byte)
}

func (o observed) HandleBatch(seq uint64, payload []byte) {
	o.observe(o.worker, seq, payload)
	o.Actor.HandleBatch(seq, payload)
}
