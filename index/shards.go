package index

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
)

// OpKind is what one Op does to a worker's blocks.
type OpKind uint8

const (
	OpStore        OpKind = iota // the worker holds Hash
	OpRemove                     // the worker no longer holds Hash
	OpClearWorker                // the worker holds nothing (its cache was cleared)
	OpRemoveWorker               // the worker is gone: free all of its entries
)

// Op is one change to a worker's blocks, by router hash.
type Op struct {
	Kind OpKind
	Hash uint64
}

// Batch carries one worker's ops to its shard, in order. The shard hands
// it back on Return once applied, so a worker cycles a few batches and the
// steady state allocates nothing.
type Batch struct {
	Worker WorkerID
	Ops    []Op
	Return chan<- *Batch   // nil: the shard drops the batch after applying it
	synced chan<- struct{} // a Sync marker, not ops
}

// ErrClosed is returned by a Shards that has been closed.
var ErrClosed = errors.New("index: shards closed")

// Shards runs N shard goroutines, each owning a Tree. A worker is pinned to
// shard WorkerID % N for its lifetime, so its batches are applied in order.
type Shards struct {
	shards []*shard
	wg     sync.WaitGroup
	closed chan struct{}
	once   sync.Once
}

type shard struct {
	in      chan *Batch
	queries chan *query
	tree    *Tree
	// Read by metrics from any goroutine; written by the shard alone.
	nodes, unknownRemoves atomic.Int64
}

type query struct {
	hashes []uint64
	scores []Score
	done   chan *query
}

// NewShards starts n shards with input queues of depth batches each.
func NewShards(n, depth int) *Shards {
	s := &Shards{closed: make(chan struct{})}
	for range max(n, 1) {
		sh := &shard{in: make(chan *Batch, depth), queries: make(chan *query), tree: NewTree()}
		s.shards = append(s.shards, sh)
		s.wg.Go(sh.run)
	}
	return s
}

// Len is the number of shards.
func (s *Shards) Len() int { return len(s.shards) }

// Queue returns the input queue of w's shard; senders must stop before Close.
func (s *Shards) Queue(w WorkerID) chan<- *Batch { return s.shards[int(w)%len(s.shards)].in }

// QueueDepth reports how many batches wait at shard i.
func (s *Shards) QueueDepth(i int) int { return len(s.shards[i].in) }

// Nodes reports shard i's live node count as of its last applied batch.
func (s *Shards) Nodes(i int) int64 { return s.shards[i].nodes.Load() }

// UnknownRemoves reports shard i's removes of blocks their worker did not hold.
func (s *Shards) UnknownRemoves(i int) int64 { return s.shards[i].unknownRemoves.Load() }

// FindMatches asks every shard for the workers holding a prefix of hashes
// and appends their scores to dst. Shards answer ahead of their queued
// batches, so the answer reflects what each had applied when asked (use
// Sync first to see everything sent before).
func (s *Shards) FindMatches(ctx context.Context, dst []Score, hashes []uint64) ([]Score, error) {
	done := make(chan *query, len(s.shards))
	for _, sh := range s.shards {
		select {
		case sh.queries <- &query{hashes: hashes, done: done}:
		case <-s.closed:
			return dst, ErrClosed
		case <-ctx.Done():
			return dst, ctx.Err()
		}
	}
	for range s.shards {
		select {
		case q := <-done:
			dst = append(dst, q.scores...)
		case <-ctx.Done():
			return dst, ctx.Err()
		}
	}
	return dst, nil
}

// Sync returns once every shard has applied every batch queued before the
// call. Like a sender's, its calls must end before Close.
func (s *Shards) Sync(ctx context.Context) error {
	done := make(chan struct{}, len(s.shards))
	for _, sh := range s.shards {
		select {
		case sh.in <- &Batch{synced: done}:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	for range s.shards {
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// Close stops the shards after they applied everything queued, and waits.
// Every sender must have stopped first.
func (s *Shards) Close() {
	s.once.Do(func() {
		close(s.closed)
		for _, sh := range s.shards {
			close(sh.in)
		}
		s.wg.Wait()
	})
}

func (sh *shard) run() {
	for {
		// Questions first: a router waits on them, while batches only wait
		// their turn. An answer reflects the batches applied so far.
		select {
		case q := <-sh.queries:
			sh.answer(q)
			continue
		default:
		}
		select {
		case b, ok := <-sh.in:
			if !ok {
				return
			}
			sh.apply(b)
		case q := <-sh.queries:
			sh.answer(q)
		}
	}
}

func (sh *shard) answer(q *query) {
	q.scores = sh.tree.FindMatches(nil, q.hashes)
	q.done <- q
}

func (sh *shard) apply(b *Batch) {
	if b.synced != nil {
		b.synced <- struct{}{}
		return
	}
	t := sh.tree
	for _, op := range b.Ops {
		switch op.Kind {
		case OpStore:
			t.Store(b.Worker, op.Hash)
		case OpRemove:
			t.Remove(b.Worker, op.Hash)
		case OpClearWorker:
			t.ClearWorker(b.Worker)
		case OpRemoveWorker:
			t.RemoveWorker(b.Worker)
		}
	}
	sh.nodes.Store(int64(t.Nodes()))
	sh.unknownRemoves.Store(int64(t.UnknownRemoves))
	if b.Return != nil {
		b.Ops = b.Ops[:0]
		b.Return <- b
	}
}
