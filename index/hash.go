package index

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"

	"github.com/kvpipe/kvpipe/internal/extrakeys"
)

// Seed is the xxh3 seed of router block hashes, dynamo's, so that a block's
// token hash here equals dynamo's local block hash.
const Seed = 1337

// Hasher computes router block hashes. A block's token hash is xxh3-64 of
// its token ids as little-endian uint32, seeded (dynamo's
// compute_block_hash). Its key in the index is chained: a root's key is its
// token hash, any other block's is xxh3-64 of the parent's key and the token
// hash, both little-endian. Equal prefixes, and only they, get equal keys.
// A block that also depends on an adapter, a cache salt or a multimodal
// input gets its key from Key, which mixes those in (docs/FORMAT.md §10.1).
// A Hasher reuses its scratch: give each goroutine its own.
type Hasher struct {
	buf  []byte
	keys []uint64 // Shards.FindMatchesRequest's
}

// tokenHash is the seeded xxh3-64 of one block's tokens.
func (h *Hasher) tokenHash(tokens []uint32) uint64 {
	switch n := len(tokens); {
	case n == 16:
		return block16Hash((*[16]uint32)(tokens))
	case n > 4 && n <= 32:
		return tokensHash(tokens)
	}
	b := h.buf[:0]
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	h.buf = b
	return xxh3.HashSeed(b, Seed)
}

// chain returns the key of a block with token hash th under parent.
func chain(parent uint64, hasParent bool, th uint64) uint64 {
	if !hasParent {
		return th
	}
	return pairHash(parent, th)
}

// block returns the key of one block of tokens under parent (a root when hasParent is false).
func (h *Hasher) block(parent uint64, hasParent bool, tokens []uint32) uint64 {
	return chain(parent, hasParent, h.tokenHash(tokens))
}

// Prompt appends to dst the keys of every whole block of a request's
// tokens, as FindMatches takes them; a partial last block is left out. It
// is RequestKeys for a request on the base model, with no salt and no
// multimodal input.
func (h *Hasher) Prompt(dst []uint64, tokens []uint32, blockSize int) []uint64 {
	switch {
	case blockSize <= 0: // no block: without this, an endless loop
		return dst
	case blockSize == 16:
		return prompt16(dst, tokens)
	}
	var parent uint64
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		parent = h.block(parent, i > 0, tokens[i:i+blockSize])
		dst = append(dst, parent)
	}
	return dst
}

// prompt16 is Prompt of 16-token blocks. A block's token hash does not
// depend on the chain, so the CPU overlaps it with the previous block's
// Chain.
func prompt16(dst []uint64, tokens []uint32) []uint64 {
	var parent uint64
	for i := 0; i+16 <= len(tokens); i += 16 {
		th := block16Hash((*[16]uint32)(tokens[i : i+16]))
		if i == 0 {
			parent = th
		} else {
			parent = pairHash(parent, th)
		}
		dst = append(dst, parent)
	}
	return dst
}

// nsSeed keeps namespaces apart from token hashes and chained keys.
const nsSeed = 0x6b7670697065_6e73 // "kvpipens"

// Tags of Namespace's encoding.
const (
	nsLoraName = 'n'
	nsLoraID   = 'i'
	nsSalt     = 's'
)

// Namespace is the namespace of a request's or an event's blocks: 0 for the
// base model without a cache salt (whose keys are then exactly Prompt's),
// otherwise a seeded xxh3-64 of a tagged encoding: the adapter by name when
// lora is not empty, else by lora id when hasLoraID, then the salt when not
// empty. Strings are length-prefixed, so two different inputs never give
// the same encoding; a nonzero result is never 0. It allocates nothing
// while the name and salt together stay under about 200 bytes.
func Namespace(lora string, loraID int64, hasLoraID bool, salt string) uint64 {
	if lora == "" && !hasLoraID && salt == "" {
		return 0
	}
	var buf [224]byte
	b := buf[:0]
	switch {
	case lora != "":
		b = append(b, nsLoraName)
		b = binary.LittleEndian.AppendUint64(b, uint64(len(lora)))
		b = append(b, lora...)
	case hasLoraID:
		b = append(b, nsLoraID)
		b = binary.LittleEndian.AppendUint64(b, uint64(loraID))
	}
	if salt != "" {
		b = append(b, nsSalt)
		b = binary.LittleEndian.AppendUint64(b, uint64(len(salt)))
		b = append(b, salt...)
	}
	ns := xxh3.HashSeed(b, nsSeed)
	if ns == 0 {
		ns = 1
	}
	return ns
}

// Record tags of Key's two extended forms: 25 bytes, never a multiple of
// the 4 bytes of a token nor the 16 of Chain, so no extended key shares its
// hash input with a plain one.
const (
	keyRoot  = 'r'
	keyChild = 'c'
)

// Key is the router key of one block of tokens under parent (a root when
// hasParent is false). ns is the namespace of the block's request
// (Namespace), extra the digest of the block's extra keys (0 for none:
// codec.Event.BlockExtra, or what RequestKeys derives from a request).
//
// With ns and extra both 0 it is block's key, so keys of bare-token blocks
// stay the dynamo-compatible ones. A root with a nonzero ns or extra hashes
// both in with its token hash. A child ignores ns: it inherits the
// namespace from its parent's key through the chain, so only the root needs
// it; a nonzero extra is hashed in with the parent's key and the token
// hash.
func (h *Hasher) Key(parent uint64, hasParent bool, ns uint64, extra uint64, tokens []uint32) uint64 {
	th := h.tokenHash(tokens)
	if extra == 0 && (ns == 0 || hasParent) {
		return chain(parent, hasParent, th)
	}
	var b [25]byte
	if hasParent {
		b[0] = keyChild
		binary.LittleEndian.PutUint64(b[1:], parent)
		binary.LittleEndian.PutUint64(b[9:], th)
		binary.LittleEndian.PutUint64(b[17:], extra)
	} else {
		b[0] = keyRoot
		binary.LittleEndian.PutUint64(b[1:], ns)
		binary.LittleEndian.PutUint64(b[9:], extra)
		binary.LittleEndian.PutUint64(b[17:], th)
	}
	return xxh3.HashSeed(b[:], Seed)
}

// MultiModal is one multimodal input of a request as a router knows it:
// its content identifier (the mm hash vLLM computes from the processed
// item, or the uuid the client gave it; without any LoRA prefix) and the
// range of its placeholder tokens in the prompt, [Offset, Offset+Length).
type MultiModal struct {
	Hash   string
	Offset int
	Length int
}

// Request is what RequestKeys needs of a request: its prompt tokens, its
// adapter (by name, or by id when the engine publishes only lora_id), its
// cache salt, and its multimodal inputs, ordered by Offset as the engine
// orders them (any order is accepted; sorted is the fast path).
type Request struct {
	Tokens     []uint32
	Lora       string
	LoraID     int64
	HasLoraID  bool
	Salt       string
	MultiModal []MultiModal
}

// RequestKeys appends to dst the key of every whole block of r (a partial
// last block is left out): the keys an actor computes from the engine's
// BlockStored events for the same request, with Namespace and Key and the
// events' BlockExtra. A block's extra digest covers, in offset order, each
// multimodal input whose placeholder range overlaps the block, as the hash
// and the offset of its first placeholder relative to the block's first
// token; that is vLLM's per-block multimodal extra keys (since 0.19.1). The
// adapter and the salt are in the namespace, never in a block's digest.
// It allocates nothing when dst has room.
func (h *Hasher) RequestKeys(dst []uint64, r *Request, blockSize int) []uint64 {
	ks := newKeyStream(dst, h, r, blockSize, false)
	ks.upTo(ks.n)
	return ks.keys
}

// digestUnsorted adds the inputs overlapping [start, end) to d in the order
// of (Offset, position in mm), without sorting mm: the slow path of
// unordered inputs, quadratic in their number.
func digestUnsorted(d *extrakeys.Digest, mm []MultiModal, start, end int) {
	lastOff, lastIdx := 0, -1
	for {
		pick := -1
		for j := range mm {
			m := &mm[j]
			if m.Offset >= end || m.Offset+m.Length <= start {
				continue
			}
			if lastIdx >= 0 && (m.Offset < lastOff || m.Offset == lastOff && j <= lastIdx) {
				continue // already added
			}
			if pick < 0 || m.Offset < mm[pick].Offset {
				pick = j
			}
		}
		if pick < 0 {
			return
		}
		d.MultiModal(mm[pick].Hash, int64(mm[pick].Offset-start))
		lastOff, lastIdx = mm[pick].Offset, pick
	}
}
