package supervisor

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/snapshot"
	"github.com/kvpipe/kvpipe/wire"
)

// A Source feeds the index with ops normalised by another kvpipe process
// (relay.Follower consumes a relay's JetStream stream) instead of, or beside,
// the pipeline's own workers. Run runs it beside the workers until the
// pipeline stops, restarting it with backoff when it returns.
type Source interface {
	Run(ctx context.Context, f *Feed) error
}

// Feed is how a Source hands its ops to the pipeline. Its workers are
// named by the Source, created on their first ops and removed by an
// index.OpRemoveWorker; they have no subscriber of their own.
type Feed struct {
	p *Pipeline
}

// fedWorker is what the pipeline knows of a Source's worker: written by the
// Source's goroutine, read by scrapes and the read path.
type fedWorker struct {
	partial atomic.Bool
	batches atomic.Uint64
	stored  atomic.Uint64
	removed atomic.Uint64
	// tierBlocks is kept by the shard (index.Batch.Held): a Source's worker
	// may remove blocks it never stored here (it joined its stream late),
	// which only the index can tell.
	tierBlocks [index.NumTiers]atomic.Int64
}

func (f *fedWorker) stats() actor.Stats {
	st := actor.Stats{Batches: f.batches.Load(), BlocksStored: f.stored.Load(), BlocksRemoved: f.removed.Load(), Partial: f.partial.Load()}
	for t := range st.TierBlocks {
		st.TierBlocks[t] = f.tierBlocks[t].Load()
	}
	st.IndexedBlocks = st.TierBlocks[index.TierDevice]
	return st
}

// count keeps the worker's op counters.
func (f *fedWorker) count(op index.Op) {
	switch op.Kind {
	case index.OpStore:
		f.stored.Add(1)
	case index.OpRemove:
		f.removed.Add(1)
	}
}

// Apply hands ops to worker's shard, in order, waiting while the shard is
// behind or until ctx ends. partial is the worker's state after them
// (Match.Partial). Ops after an OpRemoveWorker belong to a new worker of
// that name. An op of an unknown kind or tier fails the call before any of
// its ops is applied; a call that ctx ends may have applied some. Calls for
// one worker must not run concurrently.
func (f *Feed) Apply(ctx context.Context, worker string, partial bool, ops []index.Op) error {
	for i, op := range ops {
		if op.Kind > index.OpClearTier || op.Tier >= index.NumTiers {
			return fmt.Errorf("kvpipe: source worker %q: op %d has kind %d, tier %d: none of its ops applied", worker, i, op.Kind, op.Tier)
		}
	}
	for len(ops) > 0 {
		w, err := f.p.fedWorker(worker)
		if err != nil {
			return err
		}
		n, err := f.send(ctx, w, partial, ops)
		f.p.feeding.Done()
		if err != nil {
			return err
		}
		ops = ops[n:]
	}
	return nil
}

// send queues ops for w up to and with the first OpRemoveWorker, and
// returns how many that was.
func (f *Feed) send(ctx context.Context, w *worker, partial bool, ops []index.Op) (int, error) {
	n := len(ops)
	for i, op := range ops {
		if op.Kind == index.OpRemoveWorker {
			n = i + 1
			break
		}
	}
	queue := f.p.shards.Load().Queue(w.id)
	for part := ops[:n]; len(part) > 0; part = part[min(len(part), maxFedOps):] {
		b := &index.Batch{Worker: w.id, Ops: append([]index.Op(nil), part[:min(len(part), maxFedOps)]...), Held: &w.fed.tierBlocks}
		select {
		case queue <- b:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
		for _, op := range b.Ops {
			w.fed.count(op)
		}
		w.fed.batches.Add(1)
	}
	if ops[n-1].Kind == index.OpRemoveWorker {
		f.p.dropFed(w)
	} else {
		w.fed.partial.Store(partial)
	}
	return n, nil
}

// maxFedOps bounds a fed batch, as the actor bounds its own.
const maxFedOps = 256

// BlockSize is the pipeline's router block size.
func (f *Feed) BlockSize() int { return f.p.cfg.BlockSize }

// fedWorker returns the Source's worker of that name, made on first use,
// with p.feeding counting the caller in (the shards stay open until Done).
func (p *Pipeline) fedWorker(name string) (*worker, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.phase != running {
		return nil, ErrClosed
	}
	if w, ok := p.workers[name]; ok {
		if w.fed == nil {
			return nil, fmt.Errorf("kvpipe: source worker %q: an engine worker has that name", name)
		}
		p.feeding.Add(1)
		return w, nil
	}
	if name == "" {
		return nil, errors.New("kvpipe: source worker name must not be empty")
	}
	if p.leaving[name] {
		return nil, fmt.Errorf("kvpipe: source worker %q: an engine worker of that name is being removed", name)
	}
	p.feeding.Add(1)
	w := &worker{name: name, id: p.nextID, fed: new(fedWorker)}
	w.fed.partial.Store(true) // until its ops say otherwise
	p.nextID++
	p.workers[name] = w
	p.publish()
	return w, nil
}

// dropFed forgets a Source's worker once its OpRemoveWorker is queued.
func (p *Pipeline) dropFed(w *worker) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.workers[w.name] == w {
		delete(p.workers, w.name)
		p.publish()
	}
}

// runSource runs the Source until ctx ends, restarting it with backoff.
func (p *Pipeline) runSource(ctx context.Context, f *Feed) {
	backoff := pace.Backoff{Min: p.cfg.RestartMin, Max: p.cfg.RestartMax}
	for {
		start := time.Now()
		err := p.runSourceOnce(ctx, f)
		if ctx.Err() != nil {
			return
		}
		p.cfg.Logger.Error("kvpipe: source stopped; restarting it", "err", err)
		if time.Since(start) > time.Minute {
			backoff.Reset()
		}
		if !pace.Sleep(ctx, backoff.Next()) {
			return
		}
	}
}

// runSourceOnce runs the Source once; a panic in it is its error, and
// restarts it like a worker's.
func (p *Pipeline) runSourceOnce(ctx context.Context, f *Feed) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("kvpipe: source panicked: %v", r)
		}
	}()
	return p.cfg.Source.Run(ctx, f)
}

// ErrNotRunning is returned by Snapshot before Run.
var ErrNotRunning = errors.New("kvpipe: pipeline not running")

// Snapshot fills dst with the state of every engine worker, reusing dst's
// slices. Each worker's part is taken in its own goroutine between two
// batches, so that its entries, last seq and fingerprint agree. It waits for
// a worker in the middle of a replay or a restart, until ctx ends, and then
// fails whole (try again later: a worker's old state is better than none);
// a worker removed meanwhile is left out, and ErrClosed returned when the
// pipeline stops meanwhile. A Source's workers are not in it: their state
// is their stream's. It must not be called from Observe or Publish, which
// run in the goroutines it waits for.
func (p *Pipeline) Snapshot(ctx context.Context, dst *snapshot.Snapshot) error {
	p.mu.Lock()
	switch p.phase {
	case idle:
		p.mu.Unlock()
		return ErrNotRunning
	case draining, closed:
		p.mu.Unlock()
		return ErrClosed
	}
	var list []*worker
	for _, w := range *p.list.Load() {
		if w.fed == nil && w.done != nil {
			list = append(list, w)
		}
	}
	runCtx := p.workerCtx
	// Restored workers not added yet keep their state: a snapshot taken
	// meanwhile must not lose it.
	waiting := make([]snapshot.Worker, 0, len(p.restored))
	for _, ws := range p.restored {
		waiting = append(waiting, ws.Clone())
	}
	p.mu.Unlock()
	*dst = snapshot.Snapshot{Version: snapshot.Version, BlockSize: p.cfg.BlockSize, KeySeed: index.Seed, Created: time.Now().UnixNano(),
		Workers: growWorkers(dst.Workers, len(list))}
	taken := make([]bool, len(list))
	errs := make([]error, len(list))
	var wg sync.WaitGroup
	for i, w := range list {
		wg.Go(func() {
			wctx, cancel := context.WithCancel(ctx)
			defer cancel()
			defer context.AfterFunc(w.ctx, cancel)() // removed meanwhile: leave it out
			ws := &dst.Workers[i]
			var flushErr error
			err := w.sub.Checkpoint(wctx, func(pos wire.Position) {
				w.actor.Load().Export(ws)
				ws.Name = append(ws.Name[:0], w.name...)
				ws.HasSeq, ws.Seq, ws.Fingerprint = pos.Known, pos.Seq, pos.Fingerprint
				if p.cfg.Flush != nil {
					// Nothing is published while this runs: what Flush
					// returns covers exactly the state just captured.
					if ws.StreamSeq, flushErr = p.cfg.Flush(wctx, w.name); flushErr != nil {
						return
					}
				}
				taken[i] = true
			})
			if ctx.Err() != nil {
				errs[i] = err
			}
			if flushErr != nil && w.ctx.Err() == nil {
				errs[i] = fmt.Errorf("worker %q: %w", w.name, flushErr)
			}
		})
	}
	wg.Wait()
	if runCtx.Err() != nil { // stopping: workers left for that, not for a removal
		return ErrClosed
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("kvpipe: snapshot: %w", err)
	}
	n := 0 // keep the workers taken, in order
	for i := range dst.Workers {
		if taken[i] {
			dst.Workers[n], dst.Workers[i] = dst.Workers[i], dst.Workers[n]
			n++
		}
	}
	dst.Workers = append(dst.Workers[:n], waiting...)
	return nil
}

// Republish makes a worker hand Publish its whole state again, from its
// own goroutine: a clear, then a store of every block it is indexed in, in
// parts of a shard batch's size (actor.Republish). A publisher that lost
// its place in its stream (a relay whose stream holds a worker's messages
// out of order) starts a true copy again from there, and the worker stays
// whole. It returns once the parts are published, or with ctx's error.
func (p *Pipeline) Republish(ctx context.Context, name string) error {
	if p.cfg.Publish == nil {
		return errors.New("kvpipe: Republish needs Publish")
	}
	p.mu.Lock()
	w, ok := p.workers[name]
	p.mu.Unlock()
	switch {
	case !ok:
		return fmt.Errorf("%w: %q", ErrNoWorker, name)
	case w.fed != nil:
		return fmt.Errorf("kvpipe: worker %q is the Source's", name)
	case w.done == nil:
		return fmt.Errorf("%w: worker %q has not started", ErrNotRunning, name)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(w.ctx, cancel)()
	var scratch snapshot.Worker
	done := false
	err := w.sub.Checkpoint(wctx, func(wire.Position) {
		w.actor.Load().Republish(&scratch)
		done = true
	})
	if err == nil && !done {
		err = errors.New("kvpipe: republish: the worker stopped first")
	}
	if err != nil {
		return fmt.Errorf("kvpipe: republish %q: %w", name, err)
	}
	return nil
}

// growWorkers returns ws with length n, reusing its elements' slices.
func growWorkers(ws []snapshot.Worker, n int) []snapshot.Worker {
	if cap(ws) < n {
		ws = append(ws[:cap(ws)], make([]snapshot.Worker, n-cap(ws))...)
	}
	return ws[:n]
}

// SaveSnapshot takes a Snapshot and saves it in st.
func (p *Pipeline) SaveSnapshot(ctx context.Context, st snapshot.Store) error {
	var s snapshot.Snapshot
	if err := p.Snapshot(ctx, &s); err != nil {
		return err
	}
	_, err := snapshot.Save(ctx, st, &s, nil)
	return err
}

// Restore makes the workers named in s start from it: their entries are
// rebuilt from its mapping, and each one's continuity is proven from its
// last seq through its engine's replay endpoint (a worker whose continuity
// cannot be proven is resynced, as on any reconnect); until proven, a
// worker's restored entries stay out of answers and it is partial. It must
// be called before Run, and s is checked whole first: on an error nothing
// of it is used. The pipeline keeps a copy of each worker until it is
// added (also after Run), and Snapshot includes those not added yet.
func (p *Pipeline) Restore(s *snapshot.Snapshot) error {
	if err := s.Check(); err != nil {
		return fmt.Errorf("kvpipe: restore: %w", err)
	}
	if s.BlockSize != p.cfg.BlockSize {
		return fmt.Errorf("kvpipe: restore: the snapshot's block size is %d, the pipeline's %d", s.BlockSize, p.cfg.BlockSize)
	}
	if s.KeySeed != index.Seed {
		return fmt.Errorf("kvpipe: restore: the snapshot's keys are hashed with seed %d, this kvpipe's with %d", s.KeySeed, index.Seed)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.phase != idle {
		return errors.New("kvpipe: restore: the pipeline has started")
	}
	p.restored = make(map[string]*snapshot.Worker, len(s.Workers))
	for i := range s.Workers {
		c := s.Workers[i].Clone()
		p.restored[string(c.Name)] = &c
	}
	return nil
}
