package index

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe/internal/predict"
)

// predictions are the predicted keys of a shard's workers, kept beside its
// index: Shards.Predict adds them, the engines' ops (in the shard
// goroutine) confirm or end them, a sweep expires them. Its writers take
// mu, so that a router sees its prediction as soon as Predict returns (a
// burst of requests routed within microseconds must see the first one's);
// readers take nothing.
type predictions struct {
	mu   sync.Mutex
	any  atomic.Bool               // sets is not empty: the shard takes mu only then
	sets map[WorkerID]*predict.Set // guarded by mu
	// list holds the workers with predictions, for readers; nil when
	// none has any, so that a read costs one load then.
	list atomic.Pointer[[]predicted]
}

type predicted struct {
	w WorkerID
	s *predict.Set
}

// add applies a prediction batch.
func (p *predictions) add(w WorkerID, b *predict.Batch) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.sets[w]
	if s == nil {
		if p.sets == nil {
			p.sets = make(map[WorkerID]*predict.Set)
		}
		s = predict.NewSet(b.Counts)
		p.sets[w] = s
		p.any.Store(true)
	}
	had := s.Len() > 0
	s.Add(b)
	if !had && s.Len() > 0 {
		p.publish()
	}
}

// observe ends w's predictions its applied ops settle: a device store
// confirms one (the block is held now), a device remove, a clear or the
// worker's removal ends them.
func (p *predictions) observe(w WorkerID, ops []Op) {
	if !p.any.Load() {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.sets[w]
	if s == nil || s.Len() == 0 && ops[len(ops)-1].Kind != OpRemoveWorker {
		return
	}
	c := s.Counts()
	for _, op := range ops {
		switch {
		case op.Kind == OpStore && op.Tier == TierDevice:
			if s.End(op.Hash) {
				c.Confirmed.Add(1)
			}
		case op.Kind == OpRemove && op.Tier == TierDevice:
			if s.End(op.Hash) {
				c.Ended.Add(1)
			}
		case op.Kind == OpClearWorker, op.Kind == OpClearTier && op.Tier == TierDevice, op.Kind == OpRemoveWorker:
			c.Ended.Add(uint64(s.Clear()))
		}
	}
	if ops[len(ops)-1].Kind == OpRemoveWorker {
		p.remove(w)
	}
	if s.Len() == 0 {
		p.publish()
	}
}

// sweep expires the predictions due by now.
func (p *predictions) sweep(now int64) {
	if !p.any.Load() {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	changed := false
	for w, s := range p.sets {
		if s.Len() == 0 {
			p.remove(w) // idle: a worker predicted again gets a new set
			continue
		}
		if n := s.Expire(now); n > 0 {
			s.Counts().Expired.Add(uint64(n))
			changed = changed || s.Len() == 0
		}
	}
	if changed {
		p.publish()
	}
}

// remove forgets w's set; mu is held.
func (p *predictions) remove(w WorkerID) {
	delete(p.sets, w)
	p.any.Store(len(p.sets) > 0)
}

// publish replaces the readers' list of workers with predictions.
func (p *predictions) publish() {
	var l []predicted
	for w, s := range p.sets {
		if s.Len() > 0 {
			l = append(l, predicted{w, s})
		}
	}
	if l == nil {
		p.list.Store(nil)
		return
	}
	p.list.Store(&l)
}

// match sets Predicted in scores (a shard's, in dst[from:]) for the
// workers with predictions: their device blocks and the predicted keys
// right after them. A worker predicted to hold hashes[0] that holds
// nothing is appended.
func (p *predictions) match(dst []Score, from int, hashes []uint64) []Score {
	l := p.list.Load()
	if l == nil || len(hashes) == 0 {
		return dst
	}
	for _, e := range *l {
		i := from
		for i < len(dst) && dst[i].Worker != e.w {
			i++
		}
		if i < len(dst) {
			if held := dst[i].Blocks; held < len(hashes) {
				dst[i].Predicted = held + e.s.Run(hashes, held)
			}
		} else if n := e.s.Run(hashes, 0); n > 0 {
			dst = append(dst, Score{Worker: e.w, Predicted: n})
		}
	}
	return dst
}

// Predict adds a router's prediction of blocks worker w will hold (kvpipe's
// Pipeline.Routed) beside w's shard: FindMatches sees it once Predict
// returns. It may be called from any goroutine at any time, also after
// Close; it waits only for another writer of the shard's predictions (a
// Predict, or the shard settling predictions with a batch's ops).
func (s *Shards) Predict(w WorkerID, b *predict.Batch) {
	s.shards[int(w)%len(s.shards)].preds.add(w, b)
}

// Sweep ends, in every shard, the predictions due by now, and returns once
// they are. Like Sync's, its calls must end before Close.
func (s *Shards) Sweep(ctx context.Context, now time.Time) error {
	for _, sh := range s.shards {
		if sh.preds.any.Load() {
			return s.mark(ctx, &Batch{sweep: now.UnixNano()})
		}
	}
	return nil // no prediction anywhere: no marker through the queues
}
