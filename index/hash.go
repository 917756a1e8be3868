package index

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// Seed is the xxh3 seed of router block hashes, dynamo's, so that a block's
// token hash here equals dynamo's local block hash.
const Seed = 1337

// Hasher computes router block hashes. A block's token hash is xxh3-64 of
// its token ids as little-endian uint32, seeded (dynamo's
// compute_block_hash). Its key in the index is chained: a root's key is its
// token hash, any other block's is xxh3-64 of the parent's key and the token
// hash, both little-endian. Equal prefixes, and only they, get equal keys.
// A Hasher reuses a scratch buffer: give each goroutine its own.
type Hasher struct{ buf []byte }

// TokenHash is the seeded xxh3-64 of one block's tokens.
func (h *Hasher) TokenHash(tokens []uint32) uint64 {
	b := h.buf[:0]
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	h.buf = b
	return xxh3.HashSeed(b, Seed)
}

// Chain returns the key of a block with token hash th under parent.
func Chain(parent uint64, hasParent bool, th uint64) uint64 {
	if !hasParent {
		return th
	}
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], parent)
	binary.LittleEndian.PutUint64(b[8:], th)
	return xxh3.HashSeed(b[:], Seed)
}

// Block returns the key of one block of tokens under parent (a root when hasParent is false).
func (h *Hasher) Block(parent uint64, hasParent bool, tokens []uint32) uint64 {
	return Chain(parent, hasParent, h.TokenHash(tokens))
}

// Prompt appends to dst the keys of every whole block of a request's
// tokens, as FindMatches takes them; a partial last block is left out.
func (h *Hasher) Prompt(dst []uint64, tokens []uint32, blockSize int) []uint64 {
	var parent uint64
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		parent = h.Block(parent, i > 0, tokens[i:i+blockSize])
		dst = append(dst, parent)
	}
	return dst
}
