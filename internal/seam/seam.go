// Package seam is the one place a relay meets a Pipeline: a Tap sees each
// engine worker's ops on their way to its shard, and the Republish it is
// bound to makes a worker hand it its whole state again. It is internal so
// that package kvpipe shows a router only what a router uses; the relay's
// other side, a Source feeding the index, is kvpipe.Source.
package seam

import (
	"context"

	"github.com/kvpipe/kvpipe/index"
)

// A Tap sees each engine worker's ops on their way to its shard, in the
// worker's goroutine: a relay publishes them to a stream. Its calls for one
// worker never overlap; ctx ends when the worker stops.
type Tap interface {
	// Bind is called once, by kvpipe.New, with the Republish of the
	// pipeline the Tap taps.
	Bind(republish Republish)
	// Ops gets one batch of ops the worker hands its shard (only valid
	// during the call) and returns the position it reached, which the
	// worker's saved state keeps (a relay's stream sequence). A removed
	// worker's last call has the one op index.OpRemoveWorker.
	Ops(ctx context.Context, worker string, ops []index.Op, o Origin) uint64
	// Flush returns once every batch given to Ops is stored, with the
	// position that covers them; a snapshot calls it in the worker's
	// goroutine once the worker's state is captured, and an error fails
	// the snapshot, or, when the snapshot has a deadline, records the
	// worker absent from it.
	Flush(ctx context.Context, worker string) (uint64, error)
}

// A Republish makes a worker hand its Tap its whole state again, from its
// own goroutine: a clear, then a store of every block it is indexed in, in
// parts of a shard batch's size. A relay whose stream holds a worker's
// messages out of order starts a true copy again from there, and the
// worker stays whole. It returns once the parts are tapped, or with ctx's
// error; kvpipe.ErrNoWorker for a worker the pipeline does not know.
type Republish func(ctx context.Context, worker string) error

// Origin says where a batch of ops given to a Tap came from.
type Origin struct {
	// Batch: the ops come from the engine batch Seq, whose payload has
	// Fingerprint; Part counts the batches of ops it made (0 first). Else
	// they come from a reset, a recovery, an engine's snapshot or a start
	// afresh. (What an imported snapshot puts back is not tapped: the
	// Tap had it when it was made.)
	Batch       bool
	Seq         uint64
	Fingerprint uint64
	Part        int
	Partial     bool // the worker's Partial once the ops are applied
	Eagle       bool // the worker keys its blocks over EAGLE windows (actor.Actor.Eagle)
	// Whole: the ops are a part of the worker's whole state, a clear first,
	// as Republish makes it.
	Whole bool
}
