package kvpipe

import (
	"context"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/kvpipe/kvpipe/wire"
)

// republishPart bounds the ops of one part Republish hands the Tap: a
// shard batch's size, as the actor's own batches.
const republishPart = 256

// tapped is a worker's side of its Tap, in the worker's goroutine: where
// the ops being made come from, and the position the Tap last returned
// (or the restored snapshot's), which the worker's saved state keeps.
type tapped struct {
	tap       seam.Tap // nil without one
	ctx       context.Context
	name      string
	a         *actor.Actor
	origin    seam.Origin
	streamSeq uint64
}

// tapSink hands the Tap each batch of the actor's ops before the shard
// has it, but for those for the index only (an imported snapshot's blocks,
// the clear a dropped batch owes): the Tap had them.
type tapSink struct {
	actor.Sink
	t *tapped
}

func (s tapSink) Send(b *index.Batch, wait bool) bool {
	if !b.IndexOnly {
		s.t.ops(b.Ops)
	}
	return s.Sink.Send(b, wait)
}

// ops hands the Tap one batch of the actor's ops.
func (t *tapped) ops(ops []index.Op) {
	o := t.origin
	o.Partial, o.Eagle = t.a.Partial(), t.a.Eagle()
	t.streamSeq = t.tap.Ops(t.ctx, t.name, ops, o)
	t.origin.Part++
}

// republish hands the Tap the worker's whole state, and nothing to the
// shard, which has it: a clear, then a store of every block in each tier
// it is indexed in, in parts, partial until the last. scratch is reused.
func (t *tapped) republish(scratch *snapshot.Worker) {
	t.a.Export(scratch)
	ops := make([]index.Op, 1, 1+scratch.OpCount()) // rare: not worth a buffer kept
	ops[0] = index.Op{Kind: index.OpClearWorker}
	for ops := scratch.AppendOps(ops); len(ops) > 0; {
		n := min(len(ops), republishPart)
		// The actor's Partial, not the export's: a restored state not yet
		// proven is exported as the snapshot says, but kept out of answers.
		o := seam.Origin{Whole: true, Partial: t.a.Partial() || n < len(ops), Eagle: scratch.Eagle}
		t.streamSeq = t.tap.Ops(t.ctx, t.name, ops[:n], o)
		ops = ops[n:]
	}
}

// tappedHandler marks the ops an engine batch makes with its origin. The
// batch's fingerprint is the one the subscriber computed (pos), so that a
// payload is hashed once.
type tappedHandler struct {
	wire.Handler
	t   *tapped
	pos func() (seq, fingerprint uint64, known bool) // the subscriber's Position
}

func (h tappedHandler) HandleBatch(seq uint64, payload []byte) {
	_, fp, _ := h.pos()
	h.t.origin = seam.Origin{Batch: true, Seq: seq, Fingerprint: fp}
	defer func() { h.t.origin = seam.Origin{} }() // what follows is of no engine batch, until the next one
	h.Handler.HandleBatch(seq, payload)
}
