package codec

import (
	"fmt"
	"math"

	"github.com/tinylib/msgp/msgp"
)

// SGLang's snapshot-v1 protocol (docs/FORMAT.md §6): the header that opens
// a snapshot reply and the chunks of KVSnapshotBlock records that follow it.
// (The epoch suffixes of the live topic are package wire's: they are in
// the topic frame, not in a payload.)

const (
	// snapshotVersion is the only header version this package knows.
	snapshotVersion = 1
	// snapshotChunkRecords is the most records SGLang puts in one chunk.
	snapshotChunkRecords = 4096
	// maxSnapshotChunkRecords is the most records DecodeSnapshotChunk
	// accepts in one chunk: 16 times what SGLang sends, room for a provider
	// that chunks more coarsely, and still a bound against a corrupt length.
	maxSnapshotChunkRecords = 1 << 16
)

// EngineSnapshotHeader is KVSnapshotHeader, the first reply of a snapshot:
// the state that follows is the engine's as of the live batch BarrierSeq
// (whose topic carries BarrierID), and live batches resume at ResumeSeq.
type EngineSnapshotHeader struct {
	Version     int
	Epoch       string
	ReplicaRank int
	ResumeSeq   uint64
	BarrierSeq  uint64
	BarrierID   string
	RecordCount int // records in all the chunks that follow
}

// EngineSnapshotBlock is one KVSnapshotBlock record: a chain of engine block
// hashes (one today) under Parent, or a root when HasParent is false.
type EngineSnapshotBlock struct {
	Parent    uint64
	HasParent bool
	Hashes    []uint64
}

// snapshotHeaderFields names the header's slots, in order.
var snapshotHeaderFields = [...]string{"version", "epoch", "replica_rank", "resume_seq", "barrier_seq", "barrier_id", "record_count"}

// DecodeEngineSnapshotHeader decodes the payload of a snapshot's "header" reply,
// the array [version, epoch, replica_rank, resume_seq, barrier_seq,
// barrier_id, record_count]. Slots past these seven (a newer version) are
// skipped; a version other than 1 is an error. Errors are *Error with
// Event -1.
func DecodeEngineSnapshotHeader(p []byte) (EngineSnapshotHeader, error) {
	var h EngineSnapshotHeader
	n, rest, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return EngineSnapshotHeader{}, fieldErr("snapshot header", err, p)
	}
	p = rest
	if n < uint32(len(snapshotHeaderFields)) {
		return EngineSnapshotHeader{}, &Error{Event: -1, Field: "snapshot header",
			Msg: fmt.Sprintf("array of %d elements, want at least %d (version, epoch, replica_rank, resume_seq, barrier_seq, barrier_id, record_count)",
				n, len(snapshotHeaderFields))}
	}
	for i := uint32(0); i < n; i++ {
		start := p
		switch i {
		case 0:
			var v int64
			if v, p, err = readInt(p); err == nil && v != snapshotVersion {
				return EngineSnapshotHeader{}, &Error{Event: -1, Field: "snapshot version",
					Msg: fmt.Sprintf("version %d, want %d: only snapshot-v1 is known", v, snapshotVersion)}
			}
			h.Version = int(v)
		case 1:
			h.Epoch, p, err = readStrOrBin(p)
		case 2:
			var v int64
			if v, p, err = readInt(p); err == nil && (v < 0 || v > math.MaxInt32) {
				err = fmt.Errorf("%d out of range", v)
			}
			h.ReplicaRank = int(v)
		case 3:
			h.ResumeSeq, p, err = readSeq(p)
		case 4:
			h.BarrierSeq, p, err = readSeq(p)
		case 5:
			h.BarrierID, p, err = readStrOrBin(p)
		case 6:
			var v int64
			if v, p, err = readInt(p); err == nil && (v < 0 || uint64(v) > math.MaxInt) {
				err = fmt.Errorf("%d out of range", v)
			}
			h.RecordCount = int(v)
		default: // a field from a newer version
			p, err = msgp.Skip(p)
		}
		if err != nil {
			name := "snapshot header"
			if int(i) < len(snapshotHeaderFields) {
				name = "snapshot " + snapshotHeaderFields[i]
			}
			return EngineSnapshotHeader{}, fieldErr(name, err, start)
		}
	}
	if len(p) != 0 {
		return EngineSnapshotHeader{}, &Error{Event: -1, Field: "snapshot header", Msg: fmt.Sprintf("%d trailing bytes after the header", len(p))}
	}
	return h, nil
}

// readStrOrBin reads a str or a bin as a string (it copies: the header is
// decoded once per snapshot).
func readStrOrBin(p []byte) (string, []byte, error) {
	switch msgp.NextType(p) {
	case msgp.StrType:
		s, rest, err := msgp.ReadStringZC(p)
		return string(s), rest, err
	case msgp.BinType:
		s, rest, err := msgp.ReadBytesZC(p)
		return string(s), rest, err
	}
	if len(p) == 0 {
		return "", p, msgp.ErrShortBytes
	}
	return "", p, detail("expected str or bin, got " + typeName(p))
}

// readSeq reads a publisher sequence number: a non-negative int of any width.
func readSeq(p []byte) (uint64, []byte, error) {
	v, neg, rest, err := readIntBits(p)
	if err != nil {
		return 0, p, err
	}
	if neg {
		return 0, p, fmt.Errorf("%d is negative", int64(v))
	}
	return v, rest, nil
}

// DecodeEngineSnapshotChunk decodes the payload of a snapshot's "chunk" reply, an
// array of at most MaxSnapshotChunkRecords records [parent_block_hash
// (int or nil), block_hashes (at most Limits.MaxBlocks)], into dst[:0],
// reusing dst's storage and each element's Hashes: in steady state it
// allocates nothing. Hashes are read as block hashes are in events: an int of
// any width and sign with its 64 bits kept, or a bin digest whose last 8
// bytes are the hash. Slots past the two of a record (a newer version) are
// skipped. The returned records are valid until the next decode into the
// same storage. On error it returns dst[:0] and an *Error whose Event is the
// failing record's index (-1 for the chunk itself).
func (d *Decoder) DecodeEngineSnapshotChunk(p []byte, dst []EngineSnapshotBlock) ([]EngineSnapshotBlock, error) {
	dst = dst[:0]
	n, p, err := readArrayHeader(p, maxSnapshotChunkRecords)
	if err != nil {
		return dst, fieldErr("snapshot chunk", err, p)
	}
	if cap(dst) < int(n) { // grow once, keeping the old elements' Hashes for reuse
		grown := make([]EngineSnapshotBlock, 0, n)
		dst = append(grown, dst[:cap(dst)]...)[:0]
	}
	for i := 0; i < int(n); i++ {
		if len(dst) < cap(dst) {
			dst = dst[:len(dst)+1]
		} else {
			dst = append(dst, EngineSnapshotBlock{})
		}
		blk := &dst[len(dst)-1]
		blk.Parent, blk.HasParent = 0, false
		blk.Hashes = blk.Hashes[:0]
		if p, err = d.decodeSnapshotBlock(p, blk); err != nil {
			if fe, ok := err.(*Error); ok {
				fe.Event = i
				return dst[:0], fe
			}
			return dst[:0], &Error{Event: i, Msg: describe(err, p)}
		}
	}
	if len(p) != 0 {
		return dst[:0], &Error{Event: -1, Field: "snapshot chunk", Msg: fmt.Sprintf("%d trailing bytes after the chunk", len(p))}
	}
	return dst, nil
}

func (d *Decoder) decodeSnapshotBlock(p []byte, blk *EngineSnapshotBlock) ([]byte, error) {
	if len(p) == 0 {
		return p, msgp.ErrShortBytes
	}
	if msgp.NextType(p) != msgp.ArrayType {
		return p, detail("expected array (parent_block_hash, block_hashes), got " + typeName(p))
	}
	n, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return p, err
	}
	if n < 2 {
		return p, &Error{Msg: fmt.Sprintf("record array of %d elements, want at least 2 (parent_block_hash, block_hashes)", n)}
	}
	start := p
	if msgp.IsNil(p) {
		p = p[1:]
	} else {
		if blk.Parent, p, err = readHash(p); err != nil {
			return p, fieldErr("snapshot parent_block_hash", err, start)
		}
		blk.HasParent = true
	}
	start = p
	if p, err = d.readSnapshotHashes(p, blk); err != nil {
		return p, fieldErr("snapshot block_hashes", err, start)
	}
	for i := uint32(2); i < n; i++ {
		if p, err = msgp.Skip(p); err != nil {
			return p, err
		}
	}
	return p, nil
}

func (d *Decoder) readSnapshotHashes(p []byte, blk *EngineSnapshotBlock) ([]byte, error) {
	n, p, err := readArrayHeader(p, d.limits().MaxBlocks)
	if err != nil {
		return p, err
	}
	if cap(blk.Hashes) < int(n) {
		blk.Hashes = make([]uint64, 0, n)
	}
	for i := 0; i < int(n); i++ {
		var h uint64
		if h, p, err = readHash(p); err != nil {
			return p, detail(fmt.Sprintf("[%d]: %s", i, describe(err, p)))
		}
		blk.Hashes = append(blk.Hashes, h)
	}
	return p, nil
}
