package kvpipe

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe/index"
)

// Match is one worker's overlap with a request: its leading blocks cached.
type Match struct {
	Worker string
	Blocks int // leading blocks on device
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

// Hasher turns a request into router block keys, for FindMatchesKeys and
// AppendMatches, reusing what it allocated; its zero value is ready. One
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

// FindMatches hashes a base-model request's tokens into router blocks and
// returns, for every worker holding its first block, how many leading
// blocks it holds.
func (p *Pipeline) FindMatches(ctx context.Context, tokens []uint32) ([]Match, error) {
	var h index.Hasher
	return p.FindMatchesKeys(ctx, h.Prompt(nil, tokens, p.cfg.BlockSize))
}

// FindMatchesRequest is FindMatches for a request on an adapter, with a
// cache salt, or with multimodal inputs: its keys are those the engines'
// blocks of that request get, and no other request's.
func (p *Pipeline) FindMatchesRequest(ctx context.Context, r *Request) ([]Match, error) {
	var h index.Hasher
	return p.FindMatchesKeys(ctx, h.RequestKeys(nil, (*index.Request)(r), p.cfg.BlockSize))
}

// FindMatchesKeys is FindMatches for keys already hashed with a Hasher.
func (p *Pipeline) FindMatchesKeys(ctx context.Context, keys []uint64) ([]Match, error) {
	matches, err := p.AppendMatches(ctx, nil, keys)
	if len(matches) == 0 {
		matches = nil
	}
	return matches, err
}

// AppendMatches is FindMatchesKeys appending to dst: with room in dst it
// allocates nothing. It reads the index on the calling goroutine and never
// waits for a worker or a shard; the README says what an answer reflects.
func (p *Pipeline) AppendMatches(ctx context.Context, dst []Match, keys []uint64) ([]Match, error) {
	shards := p.shards.Load()
	if shards == nil {
		select {
		case <-p.stopped: // shut down before Run
			return dst, ErrClosed
		default: // not running yet: no worker holds anything
			return dst, nil
		}
	}
	start := time.Now()
	scratch := p.scores.Get().(*[]index.Score)
	defer p.scores.Put(scratch)
	scores, err := shards.FindMatches(ctx, (*scratch)[:0], keys)
	*scratch = scores[:0]
	if errors.Is(err, index.ErrClosed) {
		return dst, ErrClosed
	}
	if err != nil {
		return dst, err
	}
	p.latency.observe(time.Since(start))
	names := *p.names.Load()
	for _, sc := range scores {
		// A worker removed meanwhile is left out, and so is one whose
		// entries may be stale (a batch dropped, its clear not yet queued).
		if w, ok := names[sc.Worker]; ok && !w.stale() {
			dst = append(dst, Match{Worker: w.name, Blocks: sc.Blocks, Tiers: sc.Tiers, Score: sc.Weighted(p.cfg.TierWeights),
				Partial: w.partial()})
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
	return p.shards.Load().Sync(ctx)
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
