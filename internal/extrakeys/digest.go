// Package extrakeys holds the digest of one KV block's extra keys (the
// inputs besides its tokens that an engine folds into the block's hash:
// multimodal inputs, prompt embeddings, and whatever a newer engine adds).
//
// It is the one definition both sides of the router use: package codec
// digests what an engine's BlockStored event states, package index digests
// what a request states, and a block gets equal digests from both exactly
// when both describe the same content. It imports nothing of kvpipe, so
// that codec and index can both import it.
package extrakeys

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// seed keeps digests apart from every other xxh3 kvpipe computes.
const seed = 0x6b7670697065786b // "kvpipexk"

// Entry kinds: the first byte of every folded record.
const (
	kindMultiModal = 1
	kindRaw        = 2
)

// Digest folds one block's entries, in order, into 64 bits. The zero value
// holds no entry, and its Sum is 0 ("no extra keys"); once an entry is added
// Sum is never 0. Adding allocates nothing.
type Digest struct {
	sum uint64
	n   uint32
}

// fold mixes one record into d: its kind, a sub-tag, and two 64-bit words.
// Records are fixed-size, so no two sequences of records collide by
// construction, only by the 64-bit hash.
func (d *Digest) fold(kind, tag byte, a, b uint64) {
	var buf [26]byte
	buf[0], buf[1] = kind, tag
	binary.LittleEndian.PutUint64(buf[2:], d.sum)
	binary.LittleEndian.PutUint64(buf[10:], a)
	binary.LittleEndian.PutUint64(buf[18:], b)
	d.sum = xxh3.HashSeed(buf[:], seed)
	d.n++
}

// MultiModal adds a multimodal input that the block covers: its content
// identifier (vLLM's mm hash, without a LoRA prefix) and its first
// placeholder's position relative to the block's first token (negative when
// the input started in an earlier block).
func (d *Digest) MultiModal(hash string, blockOffset int64) {
	d.fold(kindMultiModal, 0, xxh3.HashString(hash), uint64(blockOffset))
}

// MultiModalBytes is MultiModal with the identifier as bytes (a decoder's
// zero-copy view): equal content gives an equal digest.
func (d *Digest) MultiModalBytes(hash []byte, blockOffset int64) {
	d.fold(kindMultiModal, 0, xxh3.Hash(hash), uint64(blockOffset))
}

// Raw adds one piece of an entry the digest knows no structure for: tag is
// the caller's type code for it, data its bytes (nil and empty are the
// same) and v a scalar (a value, a length or a count). Package codec feeds entries it
// cannot classify through Raw, piece by piece; see its documentation for
// the tags.
func (d *Digest) Raw(tag byte, data []byte, v uint64) {
	d.fold(kindRaw, tag, xxh3.Hash(data), v)
}

// Sum is the digest: 0 if nothing was added, otherwise never 0.
func (d *Digest) Sum() uint64 {
	if d.n == 0 {
		return 0
	}
	if d.sum == 0 {
		return 1
	}
	return d.sum
}
