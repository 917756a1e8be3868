package index

import "github.com/kvpipe/kvpipe/internal/extrakeys"

// EAGLE windows (docs/FORMAT.md §10.5). An engine running EAGLE-family speculative decoding
// (SGLang's --speculative-algorithm EAGLE, EAGLE3, NEXTN, FROZEN_KV_MTP)
// keys its radix cache by bigrams, so its block i of size bs holds the
// bigrams of tokens [i·bs, (i+1)·bs], one token into the next block, and
// its events carry them (codec.Event.Bigram). dynamo's router (is_eagle)
// hashes such a block over that window of bs+1 tokens, stride bs, and
// chains the hashes as for any block; so does kvpipe, with the same seed,
// so that its keys are dynamo's. A block is keyed only once the token
// after it is known: a prompt of exactly m·bs tokens has m-1 EAGLE blocks,
// and any shorter tail is left out as for plain workers.

// EaglePrompt is Prompt for an engine with EAGLE windows: the key of every
// block whose window of blockSize+1 tokens the prompt covers.
func (h *Hasher) EaglePrompt(dst []uint64, tokens []uint32, blockSize int) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	var parent uint64
	for i := 0; i+blockSize < len(tokens); i += blockSize {
		parent = h.block(parent, i > 0, tokens[i:i+blockSize+1])
		dst = append(dst, parent)
	}
	return dst
}

// EagleKeys is RequestKeys for an engine with EAGLE windows: the keys its
// actor computes from that engine's bigram events for r. Only the hashed
// tokens differ: the namespace, the extra-key digest of each block (over
// the multimodal inputs overlapping the block itself, [i·bs, (i+1)·bs)) and
// the chain are RequestKeys'. It allocates nothing when dst has room.
func (h *Hasher) EagleKeys(dst []uint64, r *Request, blockSize int) []uint64 {
	ks := newKeyStream(dst, h, r, blockSize, true)
	ks.upTo(ks.n)
	return ks.keys
}

func sortedInputs(mm []MultiModal) bool {
	for i := 1; i < len(mm); i++ {
		if mm[i].Offset < mm[i-1].Offset {
			return false
		}
	}
	return true
}

// mmWalk digests the multimodal inputs of consecutive blocks as RequestKeys
// does: in one pass when they are sorted by offset.
type mmWalk struct {
	mm     []MultiModal
	sorted bool
	next   int // the first input that may still overlap a block, when sorted
}

// digest is the extra-key digest of the block [start, end); blocks must
// come in order.
func (w *mmWalk) digest(start, end int) uint64 {
	var d extrakeys.Digest
	if !w.sorted {
		digestUnsorted(&d, w.mm, start, end)
		return d.Sum()
	}
	for j := w.next; j < len(w.mm) && w.mm[j].Offset < end; j++ {
		if w.mm[j].Offset+w.mm[j].Length <= start {
			if j == w.next {
				w.next++
			}
			continue
		}
		d.MultiModal(w.mm[j].Hash, int64(w.mm[j].Offset-start))
	}
	return d.Sum()
}
