package kvpipe

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/kvpipe/kvpipe/internal/snapshot"
)

// A Store keeps a pipeline's newest saved state (SaveSnapshot,
// LoadSnapshot): a FileStore, or a relay's object store.
type Store interface {
	// Save replaces the kept state with data, whole or not at all.
	Save(ctx context.Context, data []byte) error
	// Load appends the kept state's bytes to dst and returns the result;
	// its error wraps ErrNoSnapshot when none has been saved.
	Load(ctx context.Context, dst []byte) ([]byte, error)
}

// ErrNoSnapshot: the Store holds no saved state.
var ErrNoSnapshot = snapshot.ErrNotFound

// FileStore is a Store in one file at Path, replaced atomically and
// durably by each Save, private to its owner (mode 0600).
type FileStore struct {
	Path string
	// MaxSize bounds the file Load reads (default 16 GiB, some 600 M
	// blocks): a wrong path must fail with an error, not take the
	// process's memory.
	MaxSize int64
}

// Save writes data to f.Path atomically and durably.
func (f FileStore) Save(ctx context.Context, data []byte) error {
	return snapshot.File(f).Save(ctx, data)
}

// Load appends the file's bytes to dst.
func (f FileStore) Load(ctx context.Context, dst []byte) ([]byte, error) {
	return snapshot.File(f).Load(ctx, dst)
}

// Snapshot is a pipeline's saved state: the index and, per engine worker,
// what it needs to go on from it (its block mapping, last seq and that
// batch's fingerprint), in kvpipe's own versioned, checksummed format
// (docs/FORMAT.md §12). Pipeline.Snapshot and LoadSnapshot fill one,
// Restore starts workers from one; its bytes can be kept anywhere. The zero
// Snapshot holds no workers.
type Snapshot struct {
	s snapshot.Snapshot
}

// AppendBinary appends s's encoded form to dst and returns the result.
func (s *Snapshot) AppendBinary(dst []byte) ([]byte, error) {
	return snapshot.Append(dst, &s.s)
}

// UnmarshalBinary decodes and checks data into s, reusing s's slices; s
// does not keep data. On an error, s's contents are unspecified.
func (s *Snapshot) UnmarshalBinary(data []byte) error {
	return snapshot.Decode(data, &s.s)
}

// Workers returns the number of workers s holds, those Absent names among
// them.
func (s *Snapshot) Workers() int { return len(s.s.Workers) }

// Absent names the workers whose state Pipeline.Snapshot could not take in
// time: s records them by name alone, and Restore starts them afresh.
func (s *Snapshot) Absent() []string {
	var names []string
	for i := range s.s.Workers {
		if w := &s.s.Workers[i]; w.Absent {
			names = append(names, string(w.Name))
		}
	}
	return names
}

// Blocks returns the number of engine blocks s holds, over all workers.
func (s *Snapshot) Blocks() int { return s.s.Blocks() }

// LoadSnapshot reads and checks the state st keeps, for Restore.
func LoadSnapshot(ctx context.Context, st Store) (*Snapshot, error) {
	s := new(Snapshot)
	if _, err := snapshot.Load(ctx, st, &s.s, nil); err != nil {
		return nil, err
	}
	return s, nil
}

// SaveSnapshot takes a Snapshot and saves it in st.
func (p *Pipeline) SaveSnapshot(ctx context.Context, st Store) error {
	var s Snapshot
	if err := p.Snapshot(ctx, &s); err != nil {
		return err
	}
	_, err := snapshot.Save(ctx, st, &s.s, nil)
	return err
}

// Snapshot fills dst with the state of every engine worker, reusing dst's
// slices. Each worker's part is taken in its own goroutine between two
// batches, so that its entries, last seq and fingerprint agree. A worker in
// the middle of a replay or a restart cannot answer until it is done, which
// may take longer than the caller can wait: when ctx has a deadline, each
// worker gets until half the time left (the rest is for saving the
// snapshot), and one that has not answered by then, or whose Tap could not
// flush, is recorded absent (Snapshot.Absent; a restore starts it afresh)
// and warned about, while the others are kept; it fails if every worker
// would be absent. Without a deadline it waits for every worker, and fails
// when ctx ends or a Tap cannot flush. A worker removed
// meanwhile is left out, and ErrClosed returned when the pipeline stops
// meanwhile. A Source's workers are not in it: their state is their
// stream's. It must not be called from Observe or a Tap, which run in the
// goroutines it waits for.
func (p *Pipeline) Snapshot(ctx context.Context, snap *Snapshot) error {
	list, waiting, runCtx, err := p.snapshotWorkers()
	if err != nil {
		return err
	}
	dst := &snap.s
	*dst = snapshot.Snapshot{Version: snapshot.Version, BlockSize: p.cfg.BlockSize, KeySeed: index.Seed, Created: time.Now().UnixNano(),
		Workers: growWorkers(dst.Workers, len(list))}
	takeCtx, cancel := takeContext(ctx)
	defer cancel()
	outcomes := make([]taken, len(list))
	errs := make([]error, len(list))
	var wg sync.WaitGroup
	for i, w := range list {
		wg.Go(func() { outcomes[i], errs[i] = w.capture(takeCtx, p.cfg.Tap, &dst.Workers[i]) })
	}
	wg.Wait()
	if runCtx.Err() != nil { // stopping: workers left for that, not for a removal
		return ErrClosed
	}
	_, bounded := ctx.Deadline()
	n, absent := 0, 0 // keep the workers taken or absent, in order
	for i := range dst.Workers {
		switch outcomes[i] {
		case takenGone:
			continue
		case takenAbsent:
			if err := ctx.Err(); err != nil { // the caller gave up, not the take's deadline
				return fmt.Errorf("kvpipe: snapshot: worker %q: %w", list[i].name, err)
			}
			if !bounded { // a Tap that could not flush: no time limit asks to give it up
				return fmt.Errorf("kvpipe: snapshot: worker %q: %w", list[i].name, errs[i])
			}
			p.cfg.Logger.Warn("kvpipe: snapshot: worker recorded absent, a restore starts it afresh", "worker", list[i].name, "err", errs[i])
			dst.Workers[i].SetAbsent(list[i].name)
			absent++
		}
		dst.Workers[n], dst.Workers[i] = dst.Workers[i], dst.Workers[n]
		n++
	}
	if absent > 0 && absent == n {
		// Every worker would start afresh: an older snapshot is worth more.
		return fmt.Errorf("kvpipe: snapshot: none of the %d workers answered in time", n)
	}
	dst.Workers = append(dst.Workers[:n], waiting...)
	return nil
}

// takeContext bounds the wait for the workers' parts of a snapshot: half
// of what is left of ctx's time, when it has a deadline.
func takeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	d, ok := ctx.Deadline()
	if !ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, time.Until(d)/2)
}

// snapshotWorkers returns the engine workers running, copies of the
// restored ones not added yet (a snapshot taken meanwhile must not lose
// them), and Run's context.
func (p *Pipeline) snapshotWorkers() (list []*worker, waiting []snapshot.Worker, runCtx context.Context, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch p.phase {
	case idle:
		return nil, nil, nil, ErrNotRunning
	case draining, closed:
		return nil, nil, nil, ErrClosed
	}
	for _, w := range p.read.workers.all() {
		if w.fed == nil && w.done != nil {
			list = append(list, w)
		}
	}
	slices.SortFunc(list, byWorkerName)
	waiting = make([]snapshot.Worker, 0, len(p.restored))
	for _, ws := range p.restored {
		waiting = append(waiting, ws.Clone())
	}
	return list, waiting, p.runCtx, nil
}

// taken is what became of one worker's part of a snapshot.
type taken uint8

const (
	takenAbsent taken = iota // not answered in time, or its Tap's position unknown
	takenDone
	takenGone // removed meanwhile: left out
)

// capture takes w's part of a snapshot into ws, in w's goroutine, waiting
// until ctx ends; the error says why a part is absent.
func (w *worker) capture(ctx context.Context, tap seam.Tap, ws *snapshot.Worker) (taken, error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(w.ctx, cancel)() // removed meanwhile: leave it out
	done := false
	var flushErr error
	err := w.sub.Checkpoint(wctx, func() {
		w.actor.Load().Export(ws)
		ws.StreamSeq = w.tap.streamSeq
		ws.Name = append(ws.Name[:0], w.name...)
		ws.Seq, ws.Fingerprint, ws.HasSeq = w.sub.Position()
		if tap != nil {
			// Nothing is tapped while this runs: what Flush returns covers
			// exactly the state just captured.
			if ws.StreamSeq, flushErr = tap.Flush(wctx, w.name); flushErr != nil {
				return
			}
		}
		done = true
	})
	switch {
	case done:
		return takenDone, nil
	case w.ctx.Err() != nil:
		return takenGone, nil
	case flushErr != nil:
		return takenAbsent, fmt.Errorf("flushing its Tap: %w", flushErr)
	case err != nil:
		return takenAbsent, fmt.Errorf("not answered in time: %w", err)
	}
	return takenAbsent, errors.New("not answered") // Checkpoint returns nil only after f ran
}

// republish is the seam.Republish New binds a Tap to: the relay's alone,
// so unexported, as Pipeline's methods are the router's.
func (p *Pipeline) republish(ctx context.Context, name string) error {
	p.mu.Lock()
	w, ok := p.workers[name]
	var wCtx context.Context
	if ok {
		wCtx = w.ctx // written under p.mu when the worker starts
	}
	p.mu.Unlock()
	switch {
	case !ok:
		return fmt.Errorf("%w: %q", ErrNoWorker, name)
	case w.fed != nil:
		return fmt.Errorf("kvpipe: worker %q is the Source's", name)
	case wCtx == nil:
		return fmt.Errorf("%w: worker %q has not started", ErrNotRunning, name)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(wCtx, cancel)()
	var scratch snapshot.Worker
	done := false
	err := w.sub.Checkpoint(wctx, func() {
		w.tap.republish(&scratch)
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

// Restore makes the workers named in s start from it: their entries are
// rebuilt from its mapping, and each one's continuity is proven from its
// last seq through its engine's replay endpoint (a worker whose continuity
// cannot be proven is resynced, as on any reconnect); until proven, a
// worker's restored entries stay out of answers and it is partial. A
// worker s records absent starts afresh, as one it does not name. It must
// be called before Run, and s is checked whole first: on an error nothing
// of it is used. The pipeline keeps a copy of each worker until it is
// added (also after Run), and Snapshot includes those not added yet.
func (p *Pipeline) Restore(snap *Snapshot) error {
	s := &snap.s
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
