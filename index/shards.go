package index

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
)

// OpKind is what one Op does to a worker's blocks.
type OpKind uint8

const (
	OpStore        OpKind = iota // the worker holds Hash in Tier (as well as in any other tier it holds it in)
	OpRemove                     // the worker no longer holds Hash in Tier
	OpClearWorker                // the worker holds nothing in any tier (its cache was cleared)
	OpRemoveWorker               // the worker is gone: free all of its entries
	OpClearTier                  // the worker holds nothing in Tier (that medium's cache was cleared)
)

// Op is one change to a worker's blocks, by router hash. The zero Tier is
// TierDevice, so an Op without one means a device block; an op with a Tier
// from NumTiers on is ignored.
//
// A store may say where its block sits in a chain (Link, and Parent for a
// LinkChild), as the router hashed it: the parent's key, the key before
// Hash in a prompt's keys. A worker whose device stores all say so, and
// whose engine holds every block's parent, is answered by jump search
// (see Link); ops without links are answered exactly as well, key by key.
type Op struct {
	Kind   OpKind
	Tier   Tier
	Link   Link
	Hash   uint64
	Parent uint64 // with LinkChild: the key Hash is chained from
}

// Batch carries one worker's ops to its shard, in order. A Sender's
// batches go back to it once applied.
type Batch struct {
	Worker WorkerID
	Ops    []Op
	// IndexOnly: the ops bring the index back to the worker's history
	// rather than add to it (an imported snapshot's blocks, the clear a
	// dropped batch owes it): a history of the worker's ops (a Tap) has
	// them already.
	IndexOnly bool
	// Held, when set, is kept by the shard as the worker's blocks per tier
	// (a store adds one, a remove of a block the worker holds takes one): the
	// count of a worker whose ops are made elsewhere (a relay's follower),
	// which may remove blocks it never stored here.
	Held   *[NumTiers]atomic.Int64
	free   chan<- *Batch   // the Sender's, which reuses it once applied
	synced chan<- struct{} // a Sync or Sweep marker, not ops
	sweep  int64           // a Sweep marker's time, unix nanoseconds
}

// ErrClosed is returned by a Shards that has been closed.
var ErrClosed = errors.New("index: shards closed")

// Shards runs N shard goroutines. A worker is pinned to shard WorkerID % N
// for its lifetime, and each shard goroutine is the only writer of its
// workers' index, so a worker's batches are applied in order. FindMatches
// reads every shard's index on the caller's goroutine: it never waits for a
// shard, nor a shard for it.
//
// Consistency: an answer may mix states from before and after a batch being
// applied while it reads. It reads keys in order, each key's holders (per
// shard and per 64 workers) at one instant, later keys at later instants, all
// between the call's start and its return; a worker's score is the number
// of leading keys it was seen holding that way. (A closed worker, see Link,
// is seen holding a run of keys at the instant it is seen holding the last
// of them: what holds it closed guarantees the others.) So a worker that held
// hashes[0..k-1] throughout the call scores at least k, a worker that held
// hashes[0] at no point of the call is left out, and a batch applied
// meanwhile (a store, a remove, a cleared or removed worker) may be seen in
// part. A shard that applies nothing during the call answers exactly for
// the batches it has applied; after Sync returns, answers are exact for
// every batch queued before it, until more batches are sent. Tiers are read
// the same way, each key's holders per tier at one instant: a worker that
// held hashes[0..k-1] each in a tier <= t throughout the call has
// Tiers[t] >= k, and a block moved between tiers meanwhile (stored in one,
// removed from the other) may be seen in both or neither.
type Shards struct {
	shards []*shard
	wg     sync.WaitGroup
	closed atomic.Bool
	once   sync.Once
}

type shard struct {
	in    chan *Batch
	ix    *writer
	preds predictions
	// Read by metrics from any goroutine; written by the shard alone after
	// every batch, so off the line of what lookups read.
	_              lineGap
	nodes          [NumTiers]atomic.Int64 // per tier
	unknownRemoves atomic.Int64
}

// NewShards starts n shards with input queues of depth batches each.
func NewShards(n, depth int) *Shards { return newShards(n, depth, minCap) }

func newShards(n, depth, capacity int) *Shards {
	s := &Shards{}
	for range max(n, 1) {
		sh := &shard{in: make(chan *Batch, depth), ix: newWriter(capacity)}
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

// Nodes reports how many blocks some worker of shard i holds on device, as
// of its last applied batch.
func (s *Shards) Nodes(i int) int64 { return s.shards[i].nodes[TierDevice].Load() }

// tierNodes reports how many blocks some worker of shard i holds in tier t
// (tierNodes(i, TierDevice) is Nodes(i)), as of its last applied batch; 0
// for an invalid tier.
func (s *Shards) tierNodes(i int, t Tier) int64 {
	if t >= NumTiers {
		return 0
	}
	return s.shards[i].nodes[t].Load()
}

// UnknownRemoves reports shard i's removes of blocks their worker did not hold.
func (s *Shards) UnknownRemoves(i int) int64 { return s.shards[i].unknownRemoves.Load() }

// FindMatches appends to dst the score of every worker holding at least
// hashes[0] in some tier, or predicted to (Predict), sorted by Worker, as
// of what the shards have applied (see Shards for how a batch being
// applied meanwhile shows). A worker's predictions are read after its
// held blocks, key by key from the first it does not hold on device. It allocates
// nothing when dst has room for the scores. ctx is only checked on entry:
// the call does not block.
//
// hashes are a prompt's keys (Hasher.Prompt, RequestKeys), each chained from
// the one before: a worker whose stores carry links is scored by jump search
// over them, which relies on each key's parent being the key before it, as
// the links say. Its cost grows with the jumps (a key in jumpStep) and the
// workers dropping out, not with every key matched.
func (s *Shards) FindMatches(ctx context.Context, dst []Score, hashes []uint64) ([]Score, error) {
	if s.closed.Load() {
		return dst, ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return dst, err
	}
	start := len(dst)
	for i := 0; i < len(s.shards); i += shardGroup {
		dst = matchGroup(dst, hashes, s.shards[i:min(i+shardGroup, len(s.shards))])
	}
	sortByWorker(dst[start:])
	return mergeByWorker(dst, start), nil
}

// mergeByWorker makes one Score of each worker's in dst[start:], sorted by
// Worker: the larger count of each. A worker removed and added again during
// a call has two slots in the version read, its old one's bits going and its
// new one's coming; read at other instants (another tier's table, another
// word), both can be seen, each as a state of the worker in the call.
func mergeByWorker(dst []Score, start int) []Score {
	out := start
	for i := start; i < len(dst); i++ {
		if out > start && dst[i].Worker == dst[out-1].Worker {
			m := &dst[out-1]
			m.Blocks, m.Predicted = max(m.Blocks, dst[i].Blocks), max(m.Predicted, dst[i].Predicted)
			if m.Predicted > 0 {
				m.Predicted = max(m.Predicted, m.Blocks) // its Blocks, and the predicted keys after them
			}
			for t := range m.Tiers {
				m.Tiers[t] = max(m.Tiers[t], dst[i].Tiers[t])
			}
			continue
		}
		dst[out] = dst[i]
		out++
	}
	return dst[:out]
}

// sortByWorker sorts scores by Worker. A lookup's scores are few (the
// workers holding its first key): slices.SortFunc, a compare func call a
// step, took two fifths of FindMatches' own time on 16 of them (4 shards
// under ingest), an insertion sort on Worker far less; many go to
// SortFunc.
func sortByWorker(scores []Score) {
	if len(scores) > 32 {
		slices.SortFunc(scores, func(a, b Score) int { return cmp.Compare(a.Worker, b.Worker) })
		return
	}
	for i := 1; i < len(scores); i++ {
		for j := i; j > 0 && scores[j].Worker < scores[j-1].Worker; j-- {
			scores[j], scores[j-1] = scores[j-1], scores[j]
		}
	}
}

// shardGroup is how many shards a lookup reads the first step of together.
const shardGroup = 8

// matchGroup appends the scores of group's workers. Most matches end in the
// first jump step, and its loads are most of a lookup: the first key's and
// the step end's entries, and the closed masks. Those are loaded in every
// shard before any is walked, so that the shards' cache misses overlap
// instead of adding up, and the version pinned for them is the one walked.
func matchGroup(dst []Score, hashes []uint64, group []*shard) []Score {
	var pinned [shardGroup]*table // device-only shards' versions
	if len(hashes) > 1 && len(group) > 1 {
		k := hashes[min(jumpStep, len(hashes)-1)]
		for i, sh := range group {
			t := sh.ix.pin() // the device's version: tiers come to it too
			t.touch(hashes[0])
			t.touch(k)
			t.closed[0].Load()
			if sh.ix.lowerSet.Load() == 0 {
				pinned[i] = t
			} else {
				unpin(t) // findMatches pins every tier's
			}
		}
	}
	for i, sh := range group {
		from := len(dst)
		if t := pinned[i]; t != nil {
			dst = t.match(dst, hashes, &sh.ix.opened)
			unpin(t)
		} else {
			dst = sh.ix.findMatches(dst, hashes)
		}
		dst = sh.preds.match(dst, from, hashes)
	}
	return dst
}

// Sync returns once every shard has applied every batch queued before the
// call. Like a sender's, its calls must end before Close.
func (s *Shards) Sync(ctx context.Context) error { return s.mark(ctx, &Batch{}) }

// mark queues a copy of marker in every shard and waits until each has
// taken it.
func (s *Shards) mark(ctx context.Context, marker *Batch) error {
	done := make(chan struct{}, len(s.shards))
	for _, sh := range s.shards {
		m := *marker
		m.synced = done
		select {
		case sh.in <- &m:
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
// Every sender must have stopped first. FindMatches returns ErrClosed after.
func (s *Shards) Close() {
	s.once.Do(func() {
		s.closed.Store(true)
		for _, sh := range s.shards {
			close(sh.in)
		}
		s.wg.Wait()
	})
}

// count sets b.Held to what the index holds of b's worker per tier, now
// that b is applied.
func (sh *shard) count(b *Batch) {
	for t := range Tier(NumTiers) {
		b.Held[t].Store(int64(sh.ix.heldIn(b.Worker, t)))
	}
}

func (sh *shard) run() {
	for b := range sh.in {
		sh.apply(b)
	}
}

func (sh *shard) apply(b *Batch) {
	if b.synced != nil {
		if b.sweep != 0 {
			sh.preds.sweep(b.sweep)
		}
		b.synced <- struct{}{}
		return
	}
	ix := sh.ix
	h := ix.holders[b.Worker] // nil before its first store: no prefetch then
	for i, op := range b.Ops {
		if j := i + prefetchAhead; h != nil && j < len(b.Ops) {
			prefetch(ix, h, &b.Ops[j])
		}
		ix.apply(b.Worker, op)
	}
	if b.Held != nil {
		sh.count(b)
	}
	if len(b.Ops) > 0 {
		sh.preds.observe(b.Worker, b.Ops)
	}
	sh.nodes[TierDevice].Store(int64(ix.tierNodes(TierDevice)))
	if ix.lowerSet.Load() != 0 {
		for t := TierHost; t < NumTiers; t++ {
			sh.nodes[t].Store(int64(ix.tierNodes(t)))
		}
	}
	sh.unknownRemoves.Store(int64(ix.unknownRemoves))
	if b.free != nil {
		b.Ops = b.Ops[:0]
		b.free <- b
	}
}
