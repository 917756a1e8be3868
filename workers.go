package kvpipe

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/conf"
	"github.com/kvpipe/kvpipe/internal/predict"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/kvpipe/kvpipe/supervisor"
	"github.com/kvpipe/kvpipe/wire"
)

// defaultRemovalTimeout is Config.RemovalTimeout's default.
const defaultRemovalTimeout = 5 * time.Second

type worker struct {
	name     string
	id       index.WorkerID
	sub      *wire.Subscriber            // nil for a fed worker
	fed      *fedWorker                  // a Source's worker; nil for an engine's
	actor    atomic.Pointer[actor.Actor] // set once the worker starts
	restarts atomic.Uint64               // by its supervising goroutine; read by scrapes
	// ctx and done are set under p.mu when it starts, nil before: ctx ends
	// when it stops, done is closed once its goroutine has returned.
	ctx      context.Context
	done     <-chan struct{}
	eagleCfg bool   // WorkerConfig.Eagle: the mode until its actor runs
	tap      tapped // in its goroutine only
	// approx: no Endpoint, so no subscriber, actor nor goroutine: only
	// predictions.
	approx      bool
	cacheBlocks int            // the cap on its predictions
	preds       predict.Counts // kept by its shard
}

// eagle reports whether w's blocks are keyed over EAGLE windows.
func (w *worker) eagle() bool {
	if w.fed != nil {
		return w.fed.eagle.Load()
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

// stale reports that w's entries may hold blocks its engine no longer holds
// (actor.Actor.Stale): answers leave it out.
func (w *worker) stale() bool {
	if w.fed != nil {
		return false
	}
	a := w.actor.Load()
	return a != nil && a.Stale()
}

// member is w's name in the supervisor's group.
func (w *worker) member() string { return "worker " + w.name }

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
	w, err := newWorker(&p.cfg, p.nextID, name, wc)
	if err != nil {
		return err
	}
	p.nextID++
	p.workers[name] = w
	if p.phase == running && !w.approx {
		p.start(w)
	}
	p.read.workers.add(w)
	return nil
}

// newWorker makes the worker of wc, of that id: an approximate one without
// an Endpoint, else one with its subscriber.
func newWorker(cfg *Config, id index.WorkerID, name string, wc WorkerConfig) (*worker, error) {
	switch {
	case wc.CacheBlocks < 0:
		return nil, fmt.Errorf("kvpipe: worker %q: CacheBlocks must not be negative, got %d", name, wc.CacheBlocks)
	case wc.Endpoint == "" && (wc.ReplayEndpoint != "" || wc.SnapshotEndpoint != ""):
		return nil, fmt.Errorf("kvpipe: worker %q: an approximate worker (no Endpoint) has no replay nor snapshot endpoint", name)
	case wc.Endpoint == "":
		return &worker{name: name, id: id, eagleCfg: wc.Eagle, approx: true,
			cacheBlocks: conf.Or(wc.CacheBlocks, cfg.MaxWorkerPredictions)}, nil
	}
	sub, err := wire.NewSubscriber(wire.Config{ // validates and allocates: nothing to wait for
		Endpoint: wc.Endpoint, ReplayEndpoint: wc.ReplayEndpoint, SnapshotEndpoint: wc.SnapshotEndpoint, Topic: wc.Topic,
		Logger: cfg.Logger.With("worker", name), Options: cfg.Subscriber,
	})
	if err != nil {
		return nil, fmt.Errorf("kvpipe: worker %q: %w", name, err)
	}
	return &worker{name: name, id: id, sub: sub, eagleCfg: wc.Eagle,
		cacheBlocks: min(conf.Or(wc.CacheBlocks, cfg.MaxWorkerPredictions), cfg.MaxWorkerPredictions)}, nil
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
	p.read.workers.remove(w)
	if w.done == nil && !(w.approx && p.phase == running) { // never started, nothing in a shard
		p.mu.Unlock()
		return nil
	}
	if w.done != nil {
		p.group.Remove(w.member())
	}
	removed := make(chan struct{})
	shards, runCtx := p.read.shards.Load(), p.runCtx
	p.leaving[name] = true
	p.removing.Go(func() {
		defer close(removed)
		if w.done != nil {
			<-w.done // nothing of the worker can follow in its shard's queue, nor in a Tap
		}
		p.leave(runCtx, shards, w)
	})
	p.mu.Unlock()
	select {
	case <-removed:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// leave queues a stopped worker's removal behind its last ops, in the Tap
// first: even when the pipeline is stopping, so that the stream does not
// keep a worker that is gone, within Config.RemovalTimeout.
func (p *Pipeline) leave(runCtx context.Context, shards *index.Shards, w *worker) {
	ops := []index.Op{{Kind: index.OpRemoveWorker}} // which ends its predictions too
	if p.cfg.Tap != nil && !w.approx {              // a Tap never saw it
		ctx, cancel := context.WithTimeout(context.WithoutCancel(runCtx), p.cfg.RemovalTimeout)
		p.cfg.Tap.Ops(ctx, w.name, ops, seam.Origin{})
		cancel()
	}
	shards.Queue(w.id) <- &index.Batch{Worker: w.id, Ops: ops}
	p.mu.Lock()
	delete(p.leaving, w.name)
	p.mu.Unlock()
}

// start runs w in the group; p.mu is held.
func (p *Pipeline) start(w *worker) {
	from := p.restored[w.name] // once: a worker added again later starts afresh
	delete(p.restored, w.name)
	first := true
	m := supervisor.Member{Name: w.member(),
		Run: func(ctx context.Context) error {
			if first {
				first = false
				w.prepare(ctx, &p.cfg, p.read.shards.Load().Queue(w.id), from, p.read.eagleChanged)
			}
			var h wire.Handler = w.actor.Load()
			if w.tap.tap != nil {
				h = tappedHandler{h, &w.tap, w.sub.Position}
			}
			if p.cfg.Observe != nil {
				h = observed{h, w.name, p.cfg.Observe}
			}
			if p.wrap != nil {
				h = p.wrap(h)
			}
			return w.sub.Run(ctx, h)
		},
		Restart: func() {
			w.restarts.Add(1)
			w.actor.Load().Recover() // a restarted worker is resynced: its entries cannot be stale
		},
	}
	ctx, done, err := p.group.Go(m)
	if err != nil { // a removed worker of that name still stopping: leave kept the name
		panic(err)
	}
	w.ctx, w.done = ctx, done
}

// prepare makes w's actor, restored from a snapshot when there is one; it
// runs in w's goroutine, before its subscriber.
func (w *worker) prepare(ctx context.Context, cfg *Config, shard chan<- *index.Batch, from *snapshot.Worker, eagleChanged func()) {
	var sink actor.Sink = index.NewSender(w.id, shard, ctx.Done())
	w.tap = tapped{tap: cfg.Tap, ctx: ctx, name: w.name}
	if cfg.Tap != nil {
		sink = tapSink{sink, &w.tap}
	}
	a := actor.New(actor.Config{Worker: w.id, Name: w.name, BlockSize: cfg.BlockSize,
		Sink: sink, Drop: cfg.Backpressure == Drop, Weights: index.Weights(cfg.TierWeights), MaxBlocks: cfg.MaxWorkerBlocks,
		Logger: cfg.Logger, Eagle: w.eagleCfg, EagleChanged: eagleChanged})
	w.tap.a = a
	w.actor.Store(a)
	switch {
	case from != nil && from.HasSeq: // never an absent one (snapshot.Worker.Absent)
		a.Import(from)
		w.tap.streamSeq = from.StreamSeq
		if cfg.Tap != nil && from.StreamSeq == 0 {
			// The Tap holds nothing of it (a relay's stream made again
			// since the snapshot, or a router's snapshot): it gets the
			// worker's whole state, a clear first, before any op made
			// from here on; else those ops, applied to nothing, would
			// leave its followers without the restored blocks.
			w.tap.republish(new(snapshot.Worker))
		}
		w.sub.Resume(from.Seq, from.Fingerprint)
	case cfg.Tap != nil:
		// What the stream held of it is not this worker's: the Tap's first
		// op clears it there (the shard holds nothing of a new worker).
		cfg.Tap.Ops(ctx, w.name, []index.Op{{Kind: index.OpClearWorker}}, seam.Origin{Partial: a.Partial(), Eagle: a.Eagle()})
	}
}

// observed shows every batch to Config.Observe before the actor has it.
type observed struct {
	wire.Handler
	worker  string
	observe func(string, uint64, []byte)
}

func (o observed) HandleBatch(seq uint64, payload []byte) {
	o.observe(o.worker, seq, payload)
	o.Handler.HandleBatch(seq, payload)
}
