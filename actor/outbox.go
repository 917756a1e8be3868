package actor

import (
	"sync/atomic"

	"github.com/kvpipe/kvpipe/index"
)

// maxOps caps the ops of one index batch, so that a batch's memory is
// bounded (the bound Config.ShardQueue documents) and a huge event (a whole
// long prompt) is applied in parts rather than holding its shard at once.
const maxOps = 256

// outbox fills batches of ops and hands them to the worker's Sink, with
// the backpressure the config asks for.
type outbox struct {
	cfg   *Config
	stats *counters
	out   *index.Batch // being filled; nil until the first op
	spare *index.Batch // one the Sink did not take, filled next
	// resync: a dropped batch left the index behind; the next batch the
	// shard takes clears the worker first. Until then stale mirrors it for
	// the read path, which leaves the worker out of answers: the index may
	// hold blocks the dropped batch removed.
	resync bool
	stale  *atomic.Bool
	// dropped is told of a batch dropped: the mapping's next generation.
	dropped func()

	restoring bool // putting an imported snapshot's blocks back (Batch.IndexOnly)
}

// room flushes the batch being filled unless it has room for n more ops.
// Every change of the mapping asks for its ops' room before it reads the
// generation, and only room flushes: a flush that drops the batch starts a
// new generation, which must not fall between a block's ops and its
// mapping, or the index would keep keys the mapping says are out.
func (o *outbox) room(n int) {
	if o.out != nil && len(o.out.Ops)+n > maxOps {
		o.flush()
	}
}

// emit adds op to the batch being filled, and counts it.
func (o *outbox) emit(op index.Op) {
	kind, t := op.Kind, op.Tier
	if o.out == nil {
		o.out = o.take()
	}
	switch kind {
	case index.OpStore:
		o.stats.BlocksStored.Add(1)
		o.stats.TierBlocks[t].Add(1)
	case index.OpRemove:
		o.stats.BlocksRemoved.Add(1)
		o.stats.TierBlocks[t].Add(-1)
	case index.OpClearWorker:
		o.stats.zeroHeld()
	case index.OpClearTier:
		o.stats.TierBlocks[t].Store(0)
	}
	o.out.Ops = append(o.out.Ops, op)
}

// take returns a batch to fill: the one the Sink did not take, or one of
// the Sink's.
func (o *outbox) take() *index.Batch {
	if b := o.spare; b != nil {
		o.spare = nil
		return b
	}
	return o.cfg.Sink.Batch()
}

func (o *outbox) flush() {
	b := o.out
	if b == nil {
		return
	}
	o.out = nil
	if o.resync {
		// Entries were lost with a dropped batch: start the worker afresh.
		b.Ops = append(b.Ops, index.Op{})
		copy(b.Ops[1:], b.Ops)
		b.Ops[0] = index.Op{Kind: index.OpClearWorker}
	}
	b.IndexOnly = o.restoring
	if o.cfg.Sink.Send(b, !o.cfg.Drop) {
		o.sent()
		return
	}
	o.drop(b)
}

// sent: the shard took a batch, and with it any clear a drop owed.
func (o *outbox) sent() {
	if o.resync {
		o.resync = false
		o.stale.Store(false)
	}
}

// settle sends the clear a dropped batch owes, alone, if the shard has room
// now: with no batch after the drop it would otherwise wait for the
// engine's next one. It reports whether the clear is still owed.
func (o *outbox) settle() bool {
	if !o.resync || o.out != nil {
		return o.resync
	}
	b := o.take()
	b.Ops = append(b.Ops[:0], index.Op{Kind: index.OpClearWorker})
	b.IndexOnly = true // a Tap had the dropped ops: the clear is the index's alone
	if o.cfg.Sink.Send(b, false) {
		o.sent()
		return false
	}
	b.Ops = b.Ops[:0]
	o.spare = b
	return true
}

// drop discards b's ops: the index has lost them, so the worker is resynced
// (its entries cleared) with the next batch that gets through.
func (o *outbox) drop(b *index.Batch) {
	if !o.cfg.Sink.Stopping() { // stopping: not an overload
		o.stats.DroppedBatches.Add(1)
	}
	o.resync = true
	o.stale.Store(true)
	o.dropped()
	o.stats.zeroHeld()
	o.stats.Partial.Store(true)
	b.Ops = b.Ops[:0]
	o.spare = b
}
