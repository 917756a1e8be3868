package engineenc

import (
	"github.com/kvpipe/kvpipe/codec"
	"github.com/tinylib/msgp/msgp"
)

// AppendEngineSnapshotHeader appends h as SGLang encodes a KVSnapshotHeader (a
// 7-element array, strings as str), whatever h.Version holds.
func AppendEngineSnapshotHeader(dst []byte, h *codec.EngineSnapshotHeader) []byte {
	dst = msgp.AppendArrayHeader(dst, 7) // version, epoch, replica_rank, resume_seq, barrier_seq, barrier_id, record_count
	dst = msgp.AppendInt(dst, h.Version)
	dst = msgp.AppendString(dst, h.Epoch)
	dst = msgp.AppendInt(dst, h.ReplicaRank)
	dst = msgp.AppendUint64(dst, h.ResumeSeq)
	dst = msgp.AppendUint64(dst, h.BarrierSeq)
	dst = msgp.AppendString(dst, h.BarrierID)
	return msgp.AppendInt(dst, h.RecordCount)
}

// AppendEngineSnapshotChunk appends blocks as SGLang encodes a
// list[KVSnapshotBlock]: hashes as signed int64, a missing parent as nil.
func AppendEngineSnapshotChunk(dst []byte, blocks []codec.EngineSnapshotBlock) []byte {
	dst = msgp.AppendArrayHeader(dst, uint32(len(blocks)))
	for i := range blocks {
		b := &blocks[i]
		dst = msgp.AppendArrayHeader(dst, 2)
		if b.HasParent {
			dst = msgp.AppendInt64(dst, int64(b.Parent))
		} else {
			dst = msgp.AppendNil(dst)
		}
		dst = msgp.AppendArrayHeader(dst, uint32(len(b.Hashes)))
		for _, h := range b.Hashes {
			dst = msgp.AppendInt64(dst, int64(h))
		}
	}
	return dst
}
