package index

import (
	"context"
	"slices"
)

// Rounds of FindMatchesRequest: the keys of its first round, and how many
// times more each next round has. Most of the trace's prompts are matched
// for their first 32 keys (a shared system prompt) and no further, so the
// first round ends past that with the jump's second step. Doubling hashes
// at most twice the keys a match needs (4x hashed up to four times), and
// the searches it repeats cost about as much in all: each is a jump over
// a key in jumpStep, and the rounds' keys add up to twice the last's.
const (
	lazyFirst  = 2 * jumpStep
	lazyGrowth = 2
)

// FindMatchesRequest is FindMatches of r's keys (h.RequestKeys, or
// h.EagleKeys with eagle), hashed as the search needs them rather than
// all first: keys are chained, so a worker's score never depends on keys
// past where it dropped out. It searches a prefix of the keys, and a
// longer one (each lazyGrowth times the last) only while some worker's
// score, in some tier or predicted, reaches the prefix's end; a prompt
// whose workers drop out early costs a short hash. The answer is
// FindMatches' of all the keys, and reflects the shards as its last round
// read them. It allocates nothing once h and dst have room.
func (s *Shards) FindMatchesRequest(ctx context.Context, dst []Score, h *Hasher, r *Request, blockSize int, eagle bool) ([]Score, error) {
	ks := newKeyStream(h.keys[:0], h, r, blockSize, eagle)
	defer func() { h.keys = ks.keys[:0] }()
	start := len(dst)
	for want := lazyFirst; ; want *= lazyGrowth {
		keys := ks.upTo(want)
		var err error
		dst, err = s.FindMatches(ctx, dst[:start], keys)
		if err != nil || len(keys) == ks.n || !reachEnd(dst[start:], len(keys)) {
			return dst, err
		}
	}
}

// reachEnd reports whether some score reaches n keys, the end of the keys
// searched, in some tier or predicted: the keys after might be its too.
func reachEnd(scores []Score, n int) bool {
	for _, sc := range scores {
		if max(sc.Blocks, sc.Tiers[NumTiers-1], sc.Predicted) >= n {
			return true
		}
	}
	return false
}

// keyStream hashes a request's keys in order, as far as asked, appending
// them to keys after its first base: RequestKeys and EagleKeys hash them
// all at once, FindMatchesRequest as its search needs them.
type keyStream struct {
	h      *Hasher
	tokens []uint32
	size   int  // tokens a block hashes: the block size, one more over EAGLE windows
	step   int  // the block size
	plain  bool // 16-token blocks of the base model: prompt16's path
	ns     uint64
	mm     mmWalk
	n      int      // keys in all
	keys   []uint64 // keys[base:] hashed so far
	base   int
}

// newKeyStream returns the stream of r's keys, to be appended to dst.
func newKeyStream(dst []uint64, h *Hasher, r *Request, blockSize int, eagle bool) keyStream {
	ks := keyStream{h: h, tokens: r.Tokens, size: blockSize, step: blockSize, keys: dst, base: len(dst)}
	if blockSize <= 0 {
		return ks
	}
	ks.n = len(r.Tokens) / blockSize
	if eagle {
		// A block is keyed once the token after it is known.
		ks.size++
		ks.n = max(len(r.Tokens)-1, 0) / blockSize
	}
	ks.ns = Namespace(r.Lora, r.LoraID, r.HasLoraID, r.Salt)
	ks.mm = mmWalk{mm: r.MultiModal, sorted: sortedInputs(r.MultiModal)}
	ks.plain = blockSize == 16 && !eagle && ks.ns == 0 && len(r.MultiModal) == 0
	ks.keys = slices.Grow(ks.keys, ks.n)
	return ks
}

// upTo hashes the keys up to n (at most all of them) and returns those
// hashed.
func (ks *keyStream) upTo(n int) []uint64 {
	n = min(n, ks.n)
	i := len(ks.keys) - ks.base
	if i >= n {
		return ks.keys[ks.base:]
	}
	var parent uint64
	if i > 0 {
		parent = ks.keys[len(ks.keys)-1]
	}
	if ks.plain {
		for ; i < n; i++ {
			th := block16Hash((*[16]uint32)(ks.tokens[16*i : 16*i+16]))
			if i > 0 {
				th = pairHash(parent, th)
			}
			parent = th
			ks.keys = append(ks.keys, parent)
		}
		return ks.keys[ks.base:]
	}
	for ; i < n; i++ {
		start := i * ks.step
		extra := ks.mm.digest(start, start+ks.step)
		parent = ks.h.Key(parent, i > 0, ks.ns, extra, ks.tokens[start:start+ks.size])
		ks.keys = append(ks.keys, parent)
	}
	return ks.keys[ks.base:]
}
