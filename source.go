package kvpipe

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/index"
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

// FedState is what a Source says of its worker as of a Feed.Apply call's
// ops.
type FedState struct {
	Partial bool // Match.Partial: its entries may lack blocks its engine holds
	// Eagle: its keys are over EAGLE windows, so that requests are matched
	// against it with EAGLE keys (WorkerConfig.Eagle, Match.Eagle).
	Eagle bool
}

// fedWorker is what the pipeline knows of a Source's worker: written by the
// Source's goroutine, read by scrapes and the read path.
type fedWorker struct {
	partial atomic.Bool
	eagle   atomic.Bool
	batches atomic.Uint64
	stored  atomic.Uint64
	removed atomic.Uint64
	// tierBlocks is kept by the shard (index.Batch.Held): a Source's worker
	// may remove blocks it never stored here (it joined its stream late),
	// which only the index can tell.
	tierBlocks [index.NumTiers]atomic.Int64
}

func (f *fedWorker) stats() actor.Stats {
	st := actor.Stats{Batches: f.batches.Load(), BlocksStored: f.stored.Load(), BlocksRemoved: f.removed.Load(),
		Partial: f.partial.Load(), Eagle: f.eagle.Load()}
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
// behind or until ctx ends. st is the worker's state as of them. Ops after
// an OpRemoveWorker belong to a new worker of that name. The ops' links
// (index.Op.Link) are trusted as an actor's: a wrong LinkChild makes jump
// search claim blocks a prompt does not reach.
// An op of an unknown kind, tier or link fails the call before any of its
// ops is applied, and so does a name an engine worker has (ErrNameTaken);
// a call that ctx ends may have applied some. Calls for one worker must not
// run concurrently.
func (f *Feed) Apply(ctx context.Context, worker string, st FedState, ops []index.Op) error {
	for i, op := range ops {
		if op.Kind > index.OpClearTier || op.Tier >= index.NumTiers || op.Link > index.LinkChild {
			return fmt.Errorf("kvpipe: source worker %q: op %d has kind %d, tier %d, link %d: none of its ops applied", worker, i, op.Kind, op.Tier, op.Link)
		}
	}
	for len(ops) > 0 {
		w, err := f.worker(worker)
		if err != nil {
			return err
		}
		n, err := f.send(ctx, w, st, ops)
		f.p.feeding.Done()
		if err != nil {
			return err
		}
		ops = ops[n:]
	}
	return nil
}

// send queues ops for w up to and with the first OpRemoveWorker, and
// returns how many that was. w's mode is set before its ops are queued,
// so that a match that reads them reads them with their own keys.
func (f *Feed) send(ctx context.Context, w *worker, st FedState, ops []index.Op) (int, error) {
	n := len(ops)
	for i, op := range ops {
		if op.Kind == index.OpRemoveWorker {
			n = i + 1
			break
		}
	}
	if w.fed.eagle.Load() != st.Eagle { // the Source's goroutine alone writes it: no write per call
		w.fed.eagle.Store(st.Eagle)
		f.p.read.eagleChanged()
	}
	queue := f.p.read.shards.Load().Queue(w.id)
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
		f.drop(w)
	} else {
		w.fed.partial.Store(st.Partial)
	}
	return n, nil
}

// maxFedOps bounds a fed batch, as the actor bounds its own.
const maxFedOps = 256

// BlockSize is the pipeline's router block size.
func (f *Feed) BlockSize() int { return f.p.cfg.BlockSize }

// worker returns the Source's worker of that name, made on first use,
// with p.feeding counting the caller in (the shards stay open until Done).
func (f *Feed) worker(name string) (*worker, error) {
	p := f.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.phase != running {
		return nil, ErrClosed
	}
	if w, ok := p.workers[name]; ok {
		if w.fed == nil {
			return nil, fmt.Errorf("%w: source worker %q", ErrNameTaken, name)
		}
		p.feeding.Add(1)
		return w, nil
	}
	if name == "" {
		return nil, errors.New("kvpipe: source worker name must not be empty")
	}
	if p.leaving[name] {
		return nil, fmt.Errorf("%w: source worker %q: it is being removed", ErrNameTaken, name)
	}
	p.feeding.Add(1)
	w := &worker{name: name, id: p.nextID, fed: new(fedWorker)}
	w.fed.partial.Store(true) // until its ops say otherwise
	p.nextID++
	p.workers[name] = w
	p.read.workers.add(w)
	return w, nil
}

// drop forgets a Source's worker once its OpRemoveWorker is queued.
func (f *Feed) drop(w *worker) {
	p := f.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.workers[w.name] == w {
		delete(p.workers, w.name)
		p.read.workers.remove(w)
	}
}
