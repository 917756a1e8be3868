package index

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// Seed is the xxh3 seed of router block hashes (dynamo's, so the two agree on
// a block's token hash).
const Seed = 1337

// Hasher computes router block hashes: xxh3-64 of a block's token ids as
// little-endian uint32, seeded, with the parent's hash in front so that equal
// prefixes, and only they, give equal keys. A root block has no parent bytes.
// It reuses a scratch buffer, so give each goroutine its own.
type Hasher struct{ buf []byte }

// Block returns the router hash of one block of tokens under parent (root: hasParent false).
func (h *Hasher) Block(parent uint64, hasParent bool, tokens []uint32) uint64 {
	b := h.buf[:0]
	if hasParent {
		b = binary.LittleEndian.AppendUint64(b, parent)
	}
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	h.buf = b
	return xxh3.HashSeed(b, Seed)
}

// Prompt appends to dst the router hashes of every whole block of a
// request's tokens, as FindMatches takes them.
func (h *Hasher) Prompt(dst []uint64, tokens []uint32, blockSize int) []uint64 {
	var parent uint64
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		parent = h.Block(parent, i > 0, tokens[i:i+blockSize])
		dst = append(dst, parent)
	}
	return dst
}
