package kvpipe

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/conf"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/kvpipe/kvpipe/supervisor"
	"github.com/kvpipe/kvpipe/wire"
)

// Pipeline is the one type a router embeds: it runs one subscriber and actor
// per worker, the index shards, and their supervision. New starts nothing;
// Run owns every goroutine until it returns. Its methods fall in three
// roles: the workers (AddWorker, RemoveWorker, Run, Shutdown), the read path
// (FindMatches and its variants, Sync, Stats), and saved state (Snapshot,
// SaveSnapshot, Restore).
type Pipeline struct {
	cfg  Config
	read readPath

	// mu guards the worker table and the lifecycle. Nothing holds it while
	// waiting: workers start and stop outside it.
	mu      sync.Mutex
	workers map[string]*worker
	nextID  index.WorkerID
	phase   phase
	group   *supervisor.Group // the workers and the Source, while running
	runCtx  context.Context   // ends when Run stops the workers
	stopRun context.CancelFunc
	// removing waits for removed workers to leave their shards; syncing for
	// Sync calls under way; feeding for Feed.Apply calls. All end before the
	// shards close.
	removing, syncing, feeding sync.WaitGroup

	stop    chan struct{} // closed by the first Shutdown
	stopped chan struct{} // closed once every goroutine has stopped
	// wrap, when set (by tests), wraps every worker's handler.
	wrap func(wire.Handler) wire.Handler
	// restored holds the snapshot's workers not yet started (Restore).
	restored map[string]*snapshot.Worker
	// now is the predictions' clock (time.Now; tests set their own).
	now func() time.Time
	// leaving: workers being removed, whose names cannot be taken again
	// until their removal is queued (and tapped) behind their last ops.
	leaving map[string]bool
}

type phase uint8

const (
	idle     phase = iota // built, Run not yet called
	running               // Run is supervising
	draining              // Run is stopping the workers and draining the shards
	closed                // stopped: every call gets ErrClosed
)

// New validates cfg and returns a Pipeline. It starts nothing and
// registers nothing: workers added before Run start when Run is called,
// and metrics.NewCollector exposes it to Prometheus.
func New(cfg Config) (*Pipeline, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	p := &Pipeline{
		cfg:     cfg,
		workers: make(map[string]*worker),
		leaving: make(map[string]bool),
		stop:    make(chan struct{}),
		stopped: make(chan struct{}),
		now:     time.Now,
	}
	p.read.scores.New = func() any { return new([]index.Score) }
	p.read.hashers.New = func() any { return new(index.Hasher) }
	p.read.weights = cfg.TierWeights
	if cfg.Tap != nil {
		cfg.Tap.Bind(p.republish)
	}
	return p, nil
}

// check validates c and applies its defaults.
func (c *Config) check() error {
	switch {
	case c.BlockSize <= 0:
		return fmt.Errorf("kvpipe: BlockSize must be positive, got %d", c.BlockSize)
	case c.Shards < 0:
		return fmt.Errorf("kvpipe: Shards must not be negative, got %d", c.Shards)
	case c.ShardQueue < 0 || c.MaxWorkerBlocks < 0 || c.MaxWorkerPredictions < 0 || c.ApproximateTTL < 0:
		return fmt.Errorf("kvpipe: ShardQueue, MaxWorkerBlocks, MaxWorkerPredictions and ApproximateTTL must not be negative")
	case c.RemovalTimeout < 0 || c.RestartMin < 0 || c.RestartMax < 0:
		return fmt.Errorf("kvpipe: RemovalTimeout, RestartMin and RestartMax must not be negative")
	case c.Backpressure != Block && c.Backpressure != Drop:
		return fmt.Errorf("kvpipe: unknown Backpressure %d", c.Backpressure)
	case c.Tap != nil && c.Backpressure == Drop:
		// A batch tapped and then dropped here would resync the worker,
		// and that resync would clear it in the stream too.
		return fmt.Errorf("kvpipe: a Tap needs Backpressure Block")
	}
	if c.TierWeights == (Weights{}) {
		c.TierWeights = DefaultWeights
	}
	for t, w := range c.TierWeights {
		if w < 0 || math.IsNaN(w) || math.IsInf(w, 0) || t == int(TierDevice) && w == 0 {
			return fmt.Errorf("kvpipe: TierWeights[%s] = %v: weights must be finite and not negative, and device's positive", Tier(t), w)
		}
	}
	c.Shards = conf.Or(c.Shards, 2)
	c.ShardQueue = conf.Or(c.ShardQueue, 256)
	c.RemovalTimeout = conf.Or(c.RemovalTimeout, defaultRemovalTimeout)
	c.PredictionTTL = conf.Or(c.PredictionTTL, defaultPredictionTTL)
	c.ApproximateTTL = conf.Or(c.ApproximateTTL, defaultApproximateTTL)
	c.MaxWorkerPredictions = conf.Or(c.MaxWorkerPredictions, defaultMaxPredictions)
	c.Logger = conf.Or(c.Logger, slog.New(slog.DiscardHandler))
	return nil
}

// Run starts the index shards and the workers and supervises them until ctx
// ends or Shutdown is called; then it stops the workers, lets the shards
// apply what is queued, and returns once every goroutine it started has
// stopped. It returns nil after Shutdown, ctx's cause when ctx ended, and
// ErrClosed or ErrRunning when it cannot start. The pipeline cannot be run
// again.
func (p *Pipeline) Run(ctx context.Context) error {
	shards, err := p.begin(ctx)
	if err != nil {
		return err
	}
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
	p.stopRun()
	if werr := p.group.Stop(); err == nil && ctx.Err() == nil && werr != nil {
		err = werr
	}
	p.removing.Wait()
	p.syncing.Wait()
	p.feeding.Wait()
	shards.Close()
	p.mu.Lock()
	p.phase = closed
	close(p.stopped)
	p.mu.Unlock()
	return err
}

// begin starts the shards, the workers added so far and the Source.
func (p *Pipeline) begin(ctx context.Context) (*index.Shards, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch p.phase {
	case running, draining:
		return nil, ErrRunning
	case closed:
		return nil, ErrClosed
	}
	shards := index.NewShards(p.cfg.Shards, p.cfg.ShardQueue)
	p.read.shards.Store(shards)
	p.runCtx, p.stopRun = context.WithCancel(ctx)
	p.group = supervisor.New(p.runCtx, supervisor.Config{RestartMin: p.cfg.RestartMin, RestartMax: p.cfg.RestartMax, Logger: p.cfg.Logger})
	p.phase = running
	for _, w := range p.workers {
		if !w.approx {
			p.start(w)
		}
	}
	p.group.Go(supervisor.Member{Name: "predictions", Run: func(ctx context.Context) error { return sweep(ctx, shards, sweepInterval(&p.cfg), p.now) }})
	if src := p.cfg.Source; src != nil {
		f := &Feed{p: p}
		p.group.Go(supervisor.Member{Name: "source", Run: func(ctx context.Context) error { return src.Run(ctx, f) }})
	}
	return shards, nil
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
			p.phase = closed
			close(p.stopped)
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
