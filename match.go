package kvpipe

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe/index"
)

// Match is one worker's overlap with a request: its leading blocks cached,
// and those predicted (Pipeline.Routed).
type Match struct {
	Worker string
	Blocks int // leading blocks on device
	// Predicted is how many leading blocks the worker holds on device or
	// is predicted to (its Blocks, and the blocks predicted right after
	// them): Predicted - Blocks are claims no event has confirmed yet. It
	// is Blocks for a worker with no predictions; an approximate worker's
	// Blocks are always 0.
	Predicted int
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
	// matched with the request's EAGLE keys (Hasher.EagleKeys).
	Eagle bool
}

// Request describes a request for FindMatchesRequest: its tokens, and the
// adapter, salt and multimodal inputs that make its blocks distinct.
type Request struct {
	Tokens []uint32
	// Lora names the request's adapter; an engine that publishes only
	// lora_id is matched by LoraID with HasLoraID set.
	Lora      string
	LoraID    int64
	HasLoraID bool
	Salt      string // the request's cache salt
	// MultiModal are its multimodal inputs, ordered by Offset.
	MultiModal []MultiModal
}

// MultiModal is one multimodal input of a Request: its content hash and
// the placeholder tokens it spans.
type MultiModal = index.MultiModal

// Hasher turns a request into router block keys, for AppendMatchesKeys and
// Routed, reusing what it allocated; its zero value is ready. One
// goroutine at a time may use it.
type Hasher struct{ h index.Hasher }

// Prompt appends to dst the keys of a base-model prompt's whole blocks.
func (h *Hasher) Prompt(dst []uint64, tokens []uint32, blockSize int) []uint64 {
	return h.h.Prompt(dst, tokens, blockSize)
}

// RequestKeys appends to dst the keys of r's whole blocks: those the
// engines' blocks of that request get (adapter, salt and multimodal
// inputs included). It allocates nothing when dst has room.
func (h *Hasher) RequestKeys(dst []uint64, r *Request, blockSize int) []uint64 {
	return h.h.RequestKeys(dst, (*index.Request)(r), blockSize)
}

// EaglePrompt is Prompt for workers keyed over EAGLE windows: the key of
// every block whose window of blockSize+1 tokens the prompt covers.
func (h *Hasher) EaglePrompt(dst []uint64, tokens []uint32, blockSize int) []uint64 {
	return h.h.EaglePrompt(dst, tokens, blockSize)
}

// EagleKeys is RequestKeys for workers keyed over EAGLE windows.
func (h *Hasher) EagleKeys(dst []uint64, r *Request, blockSize int) []uint64 {
	return h.h.EagleKeys(dst, (*index.Request)(r), blockSize)
}

// FindMatches hashes a base-model request's tokens into router blocks and
// returns, for every worker holding its first block (or predicted to),
// how many leading blocks it holds. Workers keyed over EAGLE windows are matched with the
// prompt's EAGLE keys, the others with its plain keys. Keys are hashed as
// the search needs them: a prompt whose workers all drop out early is not
// hashed to its end.
func (p *Pipeline) FindMatches(ctx context.Context, tokens []uint32) ([]Match, error) {
	return p.FindMatchesRequest(ctx, &Request{Tokens: tokens})
}

// FindMatchesRequest is FindMatches for a request on an adapter, with a
// cache salt, or with multimodal inputs: its keys are those the engines'
// blocks of that request get, and no other request's.
func (p *Pipeline) FindMatchesRequest(ctx context.Context, r *Request) ([]Match, error) {
	plain, eagle := p.read.kinds()
	q := lookup{req: (*index.Request)(r), blockSize: p.cfg.BlockSize, plain: plain, eagle: eagle}
	return nilIfEmpty(p.read.appendMatches(ctx, p.stopped, nil, &q))
}

// kinds reports whether the table has workers keyed plainly, and workers
// keyed over EAGLE windows, from what the last look found while neither the
// table nor a worker's mode has changed since: walking the table on every
// match cost 34 us with 16,000 workers, 0.7 us now
// (BenchmarkFindMatchesWorkers).
func (r *readPath) kinds() (plain, eagle bool) {
	table, epoch := r.workers.byID.Load(), r.eagleEpoch.Load() // before the walk: a change during it is seen next time
	if k := r.kindsSeen.Load(); k != nil && k.table == table && k.epoch == epoch {
		return k.plain, k.eagle
	}
	k := &kindsSeen{table: table, epoch: epoch}
	if table != nil {
		k.plain, k.eagle = kinds(*table)
	}
	r.kindsSeen.Store(k)
	return k.plain, k.eagle
}

// eagleChanged is told, by a worker's actor, that its mode changed.
func (r *readPath) eagleChanged() { r.eagleEpoch.Add(1) }

// kindsSeen is what readPath.kinds found in table, at a count of mode
// changes.
type kindsSeen struct {
	table        *[]*worker
	epoch        uint64
	plain, eagle bool
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
		if plain && eagle {
			break
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

// AppendMatchesKeys is FindMatches for a router that hashes requests
// itself (Hasher), appending to dst: with room in dst it allocates
// nothing. Workers keyed plainly are matched with keys (Prompt,
// RequestKeys), workers keyed over EAGLE windows with eagleKeys
// (EaglePrompt, EagleKeys); a nil slice leaves its kind of worker out, and
// Match.Eagle says which keys a worker's answer used. It reads the index
// on the calling goroutine and never waits for a worker or a shard; the
// README says what an answer reflects.
func (p *Pipeline) AppendMatchesKeys(ctx context.Context, dst []Match, keys, eagleKeys []uint64) ([]Match, error) {
	q := lookup{keys: keys, eagleKeys: eagleKeys, plain: keys != nil, eagle: eagleKeys != nil}
	return p.read.appendMatches(ctx, p.stopped, dst, &q)
}

// lookup is what a match is asked for: keys already hashed, or a request
// whose keys are hashed as the search needs them (req), for the workers
// keyed plainly, over EAGLE windows, or both.
type lookup struct {
	keys, eagleKeys []uint64
	req             *index.Request
	blockSize       int
	plain, eagle    bool
}

// find appends the scores of the lookup's keys of one kind.
func (q *lookup) find(ctx context.Context, r *readPath, shards *index.Shards, dst []index.Score, eagle bool) ([]index.Score, error) {
	if q.req == nil {
		if eagle {
			return shards.FindMatches(ctx, dst, q.eagleKeys)
		}
		return shards.FindMatches(ctx, dst, q.keys)
	}
	h := r.hashers.Get().(*index.Hasher)
	defer r.hashers.Put(h)
	return shards.FindMatchesRequest(ctx, dst, h, q.req, q.blockSize, eagle)
}

// appendMatches appends q's matches, each kind of worker asked for matched
// with its own keys; stopped is closed once the pipeline is shut down.
func (r *readPath) appendMatches(ctx context.Context, stopped <-chan struct{}, dst []Match, q *lookup) ([]Match, error) {
	shards := r.shards.Load()
	if shards == nil {
		select {
		case <-stopped: // shut down before Run
			return dst, ErrClosed
		default: // not running yet: no worker holds anything
			return dst, nil
		}
	}
	start := time.Now()
	var err error
	if q.plain {
		dst, err = r.appendKind(ctx, shards, dst, q, false)
	}
	if err == nil && q.eagle {
		dst, err = r.appendKind(ctx, shards, dst, q, true)
	}
	if err == nil {
		r.latency.observe(time.Since(start))
	}
	return dst, err
}

// readPath is what the read path needs, published on every change of the
// worker table, so that FindMatches and scrapes take no lock and never
// wait.
type readPath struct {
	shards  atomic.Pointer[index.Shards]
	workers workerTable
	scores  sync.Pool // *[]index.Score: the scratch of a match
	hashers sync.Pool // *index.Hasher: the scratch of hashing a request's keys
	weights Weights
	latency latency // FindMatches' durations, for metrics
	// kindsSeen caches kinds(workers); eagleEpoch counts the workers' mode
	// changes, which make it stale.
	kindsSeen  atomic.Pointer[kindsSeen]
	eagleEpoch atomic.Uint64
}

// appendKind appends q's matches for the workers of one kind.
func (r *readPath) appendKind(ctx context.Context, shards *index.Shards, dst []Match, q *lookup, eagle bool) ([]Match, error) {
	scratch := r.scores.Get().(*[]index.Score)
	defer r.scores.Put(scratch)
	scores, err := q.find(ctx, r, shards, (*scratch)[:0], eagle)
	*scratch = scores[:0]
	if errors.Is(err, index.ErrClosed) {
		return dst, ErrClosed
	}
	if err != nil {
		return dst, err
	}
	for _, sc := range scores {
		// A worker removed meanwhile is left out, and so is one of the other
		// kind, and one whose entries may be stale (a batch dropped, its
		// clear not yet queued).
		if w := r.workers.id(sc.Worker); w != nil && w.eagle() == eagle && !w.stale() {
			dst = append(dst, Match{Worker: w.name, Blocks: sc.Blocks, Predicted: max(sc.Blocks, sc.Predicted), Tiers: sc.Tiers,
				Score: sc.Weighted(index.Weights(r.weights)), Partial: w.partial(), Eagle: eagle})
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
	return p.read.shards.Load().Sync(ctx)
}

// LatencyBounds are the upper bounds of Stats.FindMatches' buckets: 1µs
// times powers of 4, up to about 262ms; a last bucket takes the rest.
var LatencyBounds = [...]time.Duration{
	1 << 0 * time.Microsecond, 1 << 2 * time.Microsecond, 1 << 4 * time.Microsecond, 1 << 6 * time.Microsecond,
	1 << 8 * time.Microsecond, 1 << 10 * time.Microsecond, 1 << 12 * time.Microsecond, 1 << 14 * time.Microsecond,
	1 << 16 * time.Microsecond, 1 << 18 * time.Microsecond,
}

// Latency counts FindMatches calls by duration.
type Latency struct {
	// Buckets[i] counts the calls that took at most LatencyBounds[i] and
	// more than the bound before; the last one, those past every bound.
	Buckets [len(LatencyBounds) + 1]uint64
	Sum     time.Duration // of every call counted
}

// latency is the live Latency, written by every FindMatches.
type latency struct {
	buckets [len(LatencyBounds) + 1]atomic.Uint64
	sum     atomic.Int64
}

func (l *latency) observe(d time.Duration) {
	i := 0
	for i < len(LatencyBounds) && d > LatencyBounds[i] {
		i++
	}
	l.buckets[i].Add(1)
	l.sum.Add(int64(d))
}

func (l *latency) load() Latency {
	var v Latency
	for i := range l.buckets {
		v.Buckets[i] = l.buckets[i].Load()
	}
	v.Sum = time.Duration(l.sum.Load())
	return v
}
