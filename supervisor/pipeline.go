package supervisor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/metrics"
	"github.com/kvpipe/kvpipe/wire"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
)

// Config configures a Pipeline.
type Config struct {
	BlockSize    int                // the router's block size (required), e.g. 16
	Shards       int                // index shards (default 2)
	ShardQueue   int                // batches each shard queue holds (default 256)
	Backpressure actor.Backpressure // when a shard is behind: Block (default) or Drop
	Topic        string             // default ZMQ topic of every worker
	// Wire is the template of every worker's subscriber settings (timeouts,
	// backoff, replay buffer); Endpoint, ReplayEndpoint and Topic are set per worker.
	Wire wire.Config
	// RestartMin and RestartMax bound the jittered exponential backoff before
	// a worker that panicked is restarted (defaults 100ms and 10s).
	RestartMin, RestartMax time.Duration
	Logger                 *slog.Logger
	// Registry receives the pipeline's collectors; nil registers nothing.
	Registry prometheus.Registerer
	// Observe, when set, sees every batch in the worker's goroutine before its
	// actor does (for tools such as kvpipe listen); payload is only valid
	// during the call.
	Observe func(worker string, seq uint64, payload []byte)
}

// Match is one worker's overlap with a request: its leading blocks cached.
type Match struct {
	Worker string
	Blocks int
	// Partial: the worker's entries may lack blocks its engine holds (it
	// was resynced, or kvpipe joined its stream late), so Blocks may be low;
	// a router may weigh it. It clears once the worker's history is whole
	// again (a new incarnation from its first batch, or a cache clear).
	Partial bool
}

// ErrClosed is returned once the pipeline is closed.
var ErrClosed = errors.New("kvpipe: pipeline closed")

// Pipeline is the one type a router embeds: it runs one subscriber and actor
// per worker, the index shards, and their supervision. Its loop goroutine owns
// the worker table; every method talks to it over a channel.
type Pipeline struct {
	cfg     Config
	shards  *index.Shards
	latency prometheus.Histogram
	cmds    chan func(*state)
	// names maps index ids to worker names for FindMatches, and workers
	// lists the workers for scrapes. The loop replaces both on every change,
	// so readers need no lock and never wait for the loop.
	names   atomic.Pointer[map[index.WorkerID]*worker]
	workers atomic.Pointer[[]*worker]
	// wrap, when set (by tests), wraps every worker's handler.
	wrap     func(wire.Handler) wire.Handler
	loopDone chan struct{} // the loop takes no more commands
	closed   chan struct{} // every goroutine has stopped
}

// state is owned by the loop goroutine.
type state struct {
	p       *Pipeline
	ctx     context.Context // workers' parent once running; nil before Run
	cancel  context.CancelFunc
	group   *errgroup.Group
	workers map[string]*worker
	nextID  index.WorkerID
	closing bool
	// removing waits for removed workers to stop and leave their shards;
	// syncing for Sync calls under way. Both end before the shards close.
	removing, syncing sync.WaitGroup
}

type worker struct {
	name     string
	id       index.WorkerID
	sub      *wire.Subscriber
	actor    *actor.Actor
	restarts atomic.Uint64 // by its supervising goroutine; read by scrapes
	cancel   context.CancelFunc
	done     chan struct{}
}

// New validates cfg and starts the index shards and the supervision loop.
// Workers added before Run start when Run is called.
func New(cfg Config) (*Pipeline, error) {
	switch {
	case cfg.BlockSize <= 0:
		return nil, fmt.Errorf("kvpipe: BlockSize must be positive, got %d", cfg.BlockSize)
	case cfg.Shards < 0:
		return nil, fmt.Errorf("kvpipe: Shards must not be negative, got %d", cfg.Shards)
	case cfg.ShardQueue < 0:
		return nil, fmt.Errorf("kvpipe: ShardQueue must not be negative, got %d", cfg.ShardQueue)
	case cfg.Backpressure != actor.Block && cfg.Backpressure != actor.Drop:
		return nil, fmt.Errorf("kvpipe: unknown Backpressure %d", cfg.Backpressure)
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
		cfg:      cfg,
		shards:   index.NewShards(cfg.Shards, cfg.ShardQueue),
		latency:  metrics.NewFindMatchesHistogram(),
		cmds:     make(chan func(*state)),
		loopDone: make(chan struct{}),
		closed:   make(chan struct{}),
	}
	if cfg.Registry != nil {
		collectors := []prometheus.Collector{metrics.NewCollector(p.snapshot), p.latency}
		for i, c := range collectors {
			if err := cfg.Registry.Register(c); err != nil {
				for _, done := range collectors[:i] {
					cfg.Registry.Unregister(done)
				}
				p.shards.Close()
				return nil, fmt.Errorf("kvpipe: registering metrics: %w", err)
			}
		}
	}
	st := &state{p: p, workers: make(map[string]*worker)}
	st.publishNames()
	go st.loop()
	return p, nil
}

// do runs f in the loop goroutine, waits for it and returns its error, or
// ErrClosed once the loop has stopped.
func (p *Pipeline) do(f func(*state) error) error {
	done := make(chan error, 1)
	select {
	case p.cmds <- func(s *state) { done <- f(s) }:
		return <-done
	case <-p.loopDone:
		return ErrClosed
	}
}

// WorkerOption sets one worker's own settings in AddWorker.
type WorkerOption func(*wire.Config)

// WithSnapshotEndpoint gives the worker its engine's snapshot ROUTER
// (SGLang's snapshot_endpoint), from which it is rebuilt after a loss.
func WithSnapshotEndpoint(ep string) WorkerOption {
	return func(c *wire.Config) { c.SnapshotEndpoint = ep }
}

// WithTopic subscribes the worker to its own topic instead of Config.Topic.
func WithTopic(topic string) WorkerOption {
	return func(c *wire.Config) { c.Topic = topic }
}

// AddWorker subscribes to one engine: endpoint is its PUB, replayEndpoint
// its ROUTER ("" when it has none).
func (p *Pipeline) AddWorker(name, endpoint, replayEndpoint string, opts ...WorkerOption) error {
	if name == "" {
		return errors.New("kvpipe: worker name must not be empty")
	}
	wcfg := p.cfg.Wire
	wcfg.Endpoint, wcfg.ReplayEndpoint, wcfg.Topic = endpoint, replayEndpoint, p.cfg.Topic
	for _, o := range opts {
		o(&wcfg)
	}
	wcfg.Logger = p.cfg.Logger.With("worker", name)
	sub, err := wire.NewSubscriber(wcfg)
	if err != nil {
		return fmt.Errorf("kvpipe: worker %q: %w", name, err)
	}
	return p.do(func(s *state) error {
		if s.closing {
			return ErrClosed
		}
		if _, dup := s.workers[name]; dup {
			return fmt.Errorf("kvpipe: worker %q already added", name)
		}
		id := s.nextID
		s.nextID++
		w := &worker{name: name, id: id, sub: sub}
		w.actor = actor.New(actor.Config{Worker: id, Name: name, BlockSize: p.cfg.BlockSize,
			Shard: p.shards.Queue(id), Backpressure: p.cfg.Backpressure, Logger: p.cfg.Logger})
		s.workers[name] = w
		s.publishNames()
		if s.ctx != nil {
			s.start(w)
		}
		return nil
	})
}

// RemoveWorker stops a worker and frees its index entries. The worker leaves
// FindMatches answers at once; RemoveWorker returns once its goroutine has
// stopped and its entries are freed, or with ctx's error when ctx ends first
// (the removal then completes in the background).
func (p *Pipeline) RemoveWorker(ctx context.Context, name string) error {
	var removed chan struct{}
	if err := p.do(func(s *state) error {
		w, ok := s.workers[name]
		if !ok {
			return fmt.Errorf("kvpipe: no worker %q", name)
		}
		delete(s.workers, name)
		s.publishNames()
		removed = s.remove(w)
		return nil
	}); err != nil {
		return err
	}
	select {
	case <-removed:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// FindMatches hashes a request's tokens into router blocks and returns, for
// every worker holding its first block, how many leading blocks it holds.
func (p *Pipeline) FindMatches(ctx context.Context, tokens []uint32) ([]Match, error) {
	var h index.Hasher
	return p.FindMatchesKeys(ctx, h.Prompt(nil, tokens, p.cfg.BlockSize))
}

// FindMatchesKeys is FindMatches for keys already hashed with index.Hasher.
func (p *Pipeline) FindMatchesKeys(ctx context.Context, keys []uint64) ([]Match, error) {
	start := time.Now()
	scores, err := p.shards.FindMatches(ctx, nil, keys)
	if errors.Is(err, index.ErrClosed) {
		return nil, ErrClosed
	}
	if err != nil {
		return nil, err
	}
	p.latency.Observe(time.Since(start).Seconds())
	if len(scores) == 0 {
		return nil, nil
	}
	names := *p.names.Load()
	matches := make([]Match, 0, len(scores))
	for _, sc := range scores {
		if w, ok := names[sc.Worker]; ok { // a worker removed meanwhile is left out
			matches = append(matches, Match{Worker: w.name, Blocks: sc.Blocks, Partial: w.actor.Stats().Partial.Load()})
		}
	}
	return matches, nil
}

// Sync waits until the shards have applied every batch the workers handed
// them so far: answers asked after it reflect at least those batches.
func (p *Pipeline) Sync(ctx context.Context) error {
	var inflight *sync.WaitGroup
	if err := p.do(func(s *state) error {
		if s.closing {
			return ErrClosed
		}
		s.syncing.Add(1) // the shards stay open until it is done
		inflight = &s.syncing
		return nil
	}); err != nil {
		return err
	}
	defer inflight.Done()
	return p.shards.Sync(ctx)
}

// Run starts the workers and supervises them until ctx is done or Close is
// called; then it drains and stops everything (as Close does) and returns.
func (p *Pipeline) Run(ctx context.Context) error {
	if err := p.do(func(s *state) error {
		if s.ctx != nil || s.closing {
			return errors.New("kvpipe: Run called twice or after Close")
		}
		s.ctx, s.cancel = context.WithCancel(context.Background())
		s.group = &errgroup.Group{}
		for _, w := range s.workers {
			s.start(w)
		}
		return nil
	}); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case <-p.closed:
	}
	p.Close()
	return nil
}

// Shutdown stops every worker, lets the shards apply what is queued, and
// waits for every goroutine, or returns ctx's error when ctx ends first (the
// shutdown then completes in the background). It is safe to call more than
// once, and concurrently.
func (p *Pipeline) Shutdown(ctx context.Context) error {
	p.do(func(s *state) error { s.closing = true; return nil })
	select {
	case <-p.closed:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close is Shutdown without a deadline.
func (p *Pipeline) Close() error { return p.Shutdown(context.Background()) }

// snapshot is the metrics collector's view; it reads the published worker
// list, so a scrape never waits for the loop.
func (p *Pipeline) snapshot() metrics.Snapshot {
	var snap metrics.Snapshot
	for _, w := range *p.workers.Load() {
		snap.Workers = append(snap.Workers, metrics.Worker{ID: w.name, Wire: w.sub.Stats(), Actor: w.actor.Stats(),
			Restarts: w.restarts.Load()})
	}
	for i := range p.shards.Len() {
		snap.Shards = append(snap.Shards, metrics.Shard{QueueDepth: p.shards.QueueDepth(i), Nodes: p.shards.Nodes(i),
			UnknownRemoves: p.shards.UnknownRemoves(i)})
	}
	return snap
}

// Stats is one worker's counters, for a router's own reporting.
type Stats struct {
	Wire     *wire.Stats
	Actor    *actor.Stats
	Restarts uint64
}

// WorkerStats returns every worker's counters by name.
func (p *Pipeline) WorkerStats() map[string]Stats {
	out := map[string]Stats{}
	for _, w := range p.snapshot().Workers {
		out[w.ID] = Stats{Wire: w.Wire, Actor: w.Actor, Restarts: w.Restarts}
	}
	return out
}

func (s *state) loop() {
	for f := range s.p.cmds {
		f(s)
		if s.closing {
			break
		}
	}
	// From here on every call gets ErrClosed at once, however long the
	// workers take to stop.
	close(s.p.loopDone)
	// Shutdown: workers first (they feed the shards), then the shards, which
	// apply everything still queued before they stop.
	if s.cancel != nil {
		s.cancel()
		s.group.Wait()
	}
	s.removing.Wait()
	s.syncing.Wait()
	s.p.shards.Close()
	close(s.p.closed)
}

func (s *state) publishNames() {
	names := make(map[index.WorkerID]*worker, len(s.workers))
	list := make([]*worker, 0, len(s.workers))
	for _, w := range s.workers {
		names[w.id] = w
		list = append(list, w)
	}
	s.p.names.Store(&names)
	s.p.workers.Store(&list)
}

func (s *state) start(w *worker) {
	ctx, cancel := context.WithCancel(s.ctx)
	w.cancel, w.done = cancel, make(chan struct{})
	s.group.Go(func() error {
		defer close(w.done)
		s.p.supervise(ctx, w)
		return nil
	})
}

// remove stops w without waiting for it: a goroutine waits for the worker
// to stop, then frees its entries in its shard (nothing of the worker can
// follow in the shard's queue by then). The returned channel closes then.
func (s *state) remove(w *worker) chan struct{} {
	removed := make(chan struct{})
	if w.cancel != nil {
		w.cancel()
	}
	s.removing.Go(func() {
		defer close(removed)
		if w.done != nil {
			<-w.done
		}
		s.p.shards.Queue(w.id) <- &index.Batch{Worker: w.id, Ops: []index.Op{{Kind: index.OpRemoveWorker}}}
	})
	return removed
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
		w.actor.Recover()
	}
}

func (p *Pipeline) runOnce(ctx context.Context, w *worker) (panicked bool) {
	defer func() {
		if r := recover(); r != nil {
			panicked = true
			p.cfg.Logger.Error("kvpipe: worker panicked; restarting it resynced", "worker", w.name, "panic", r)
		}
	}()
	var h wire.Handler = w.actor
	if p.cfg.Observe != nil {
		h = observed{w.actor, w.name, p.cfg.Observe}
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
