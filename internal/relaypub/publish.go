package relaypub

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A worker's messages are published in a window: the worker's goroutine
// (the publisher) sends each one as soon as it is made, and the worker's
// settler goroutine takes their acknowledgements in the order they were
// made. The stream must hold each worker's messages in that order; the
// settler checks it on every acknowledgement (each one's stream sequence
// is past the one before) and resets the worker in the stream when it does
// not hold. Two things keep it holding when publishes fail:
//   - once one fails, the settler sends every message from there on itself,
//     one at a time, until none is left unsettled (retrying);
//   - a connection that buffers while it reconnects could send older
//     messages after newer retries, so on one the window is one message
//     (see Config.MaxInFlight).

// pubState is one worker's publishing state. The publisher owns the fields
// in the first group: the worker's goroutine, then the one that removes
// it. The settler owns last's writes; mu guards the next group.
type pubState struct {
	subject, token string

	lineage lineage
	fresh   bool     // started from nothing, nothing published yet
	expect  []stored // restored: what the stream holds of it after its snapshot, to make again
	id      []byte

	queue chan entry    // to the settler, in the order made
	slots chan struct{} // one per unsettled entry: the window
	// leaving takes the worker's removal, its last message, outside the
	// window: it is handed over even when the window is full, and the
	// settler sends it after every entry made before it.
	leaving chan entry
	removed atomic.Bool   // the removal is made: nothing more of this incarnation
	free    chan []byte   // message buffers the settler is done with
	exit    chan struct{} // closed when the settler returns

	last atomic.Uint64 // the stream sequence of its last settled message
	// quiet: parted from the stream, it publishes nothing until its whole
	// state comes (Origin.Whole). gen counts the partings: the settler drops
	// what was sent before the last one.
	quiet atomic.Bool
	gen   atomic.Uint64

	mu        sync.Mutex
	retrying  bool // a publish failed: the settler sends each message itself
	unsettled int  // entries made and not settled yet
}

// entry is one message of a worker on its way to the settler, or a flush.
type entry struct {
	id      string
	msg     []byte
	fut     jetstream.PubAckFuture // nil: not sent yet, the settler sends it
	removal bool                   // the worker's last message
	gen     uint64                 // the worker's partings when it was made
	// replayed: the stream holds the message at seq already (a restored
	// worker making its replay's messages again).
	replayed bool
	seq      uint64
	// settled, when set, hears the worker's last sequence once this entry
	// is settled, or an error.
	settled chan<- settledAt
}

type settledAt struct {
	seq uint64
	err error
}

// stored is one message the stream holds.
type stored struct {
	id  string
	seq uint64
}

// errParted: the worker is being reset in the stream, so no position of it
// can be trusted until it is.
var errParted = errors.New("relay: the worker parted from the stream and is being reset")

// state returns worker's publishing state, made (with its settler) on
// first use. A worker added again after its removal waits until the
// stream holds that removal, which every router would otherwise apply
// after the new incarnation's first messages; false when ctx ends first.
func (ru *run) state(ctx context.Context, worker string) (*pubState, bool) {
	for {
		ru.mu.Lock()
		ps := ru.pubs[worker]
		if ps == nil {
			tok := opstream.Token(worker)
			lin, again := ru.gone[worker]
			if !again {
				lin = freshLineage(tok)
			}
			delete(ru.gone, worker)
			n := ru.r.window
			ps = &pubState{token: tok, subject: ru.r.set.Prefix + "." + tok, lineage: lin, fresh: true,
				queue: make(chan entry, n), slots: make(chan struct{}, n), leaving: make(chan entry, 1),
				free: make(chan []byte, n), exit: make(chan struct{})}
			ru.pubs[worker] = ps
			ru.settlers.Go(func() { ru.settle(worker, ps) })
		}
		ru.mu.Unlock()
		if !ps.removed.Load() {
			return ps, true
		}
		select {
		case <-ps.exit:
		case <-ctx.Done():
			return nil, false
		}
		ru.mu.Lock()
		if ru.pubs[worker] == ps { // its settler stopped before the removal settled
			ru.forget(worker, ps)
		}
		ru.mu.Unlock()
	}
}

// forget drops a removed worker's state, keeping its lineage for the
// worker added again; ru.mu is held.
func (ru *run) forget(worker string, ps *pubState) {
	delete(ru.pubs, worker)
	ru.gone[worker] = ps.lineage
}

// publish is the pipeline's Publish: it makes ops into one message, sends
// it, and returns the stream sequence of the worker's last message settled
// (flush tells a snapshot the one covering this message). It waits only
// while the worker's window is full, and, for a removal, until the stream
// has it.
func (ru *run) Ops(ctx context.Context, worker string, ops []index.Op, o seam.Origin) uint64 {
	r := ru.r
	ps, ok := ru.state(ctx, worker)
	if !ok {
		r.stats.abandoned.Add(1)
		return 0
	}
	removal := len(ops) == 1 && ops[0].Kind == index.OpRemoveWorker
	var msg []byte
	select {
	case msg = <-ps.free:
	default:
	}
	msg, err := opstream.AppendMessage(msg[:0], opstream.Header{Partial: o.Partial, Eagle: o.Eagle}, ops)
	if err != nil {
		r.stats.encodeErrors.Add(1)
		r.log.Error("kvpipe/relay: batch not published", "worker", worker, "err", err)
		return ps.last.Load()
	}
	ps.identify(r, o, ops, msg)
	e := entry{id: string(ps.id), msg: msg, removal: removal}
	switch {
	case removal:
		return ru.remove(ctx, ps, &e)
	case ps.quiet.Load() && (!o.Whole || ops[0].Kind != index.OpClearWorker):
		return ps.last.Load()
	case ps.quiet.Load():
		// Its whole state, a clear first: the stream follows the worker
		// again from here.
		ps.quiet.Store(false)
		ps.expect = nil
	case len(ps.expect) > 0:
		// A replay after a restart: the stream has this message if the
		// relay before made the same one, whether or not the server still
		// remembers its id.
		x := ps.expect[0]
		if x.id != e.id {
			ru.part(worker, ps, "its replay differs from what the stream holds")
			return ps.last.Load()
		}
		ps.expect = ps.expect[1:]
		r.stats.replayed.Add(1)
		e = entry{replayed: true, seq: x.seq}
	}
	if !ru.enqueue(ctx, ps, &e) {
		r.stats.abandoned.Add(1)
	}
	return ps.last.Load()
}

// identify makes the id of the worker's next message, msg of ops. A fresh
// worker's first message clears what an earlier relay left of it (the
// pipeline starts a tapped worker afresh): the same in every relay, so it
// gets an id every relay gives it, and a second relay following the engine
// from its start shares the first one's ids from there on.
func (ps *pubState) identify(r *Relay, o seam.Origin, ops []index.Op, msg []byte) {
	start := ps.fresh && !o.Batch && len(ops) == 1 && ops[0].Kind == index.OpClearWorker
	ps.fresh = false
	switch {
	case o.Batch:
		ps.id, ps.lineage = appendBatchID(ps.id[:0], ps.token, o.Seq, o.Fingerprint, o.Part, ps.lineage, msg)
	case start:
		ps.id, ps.lineage = appendStartID(ps.id[:0], ps.token, ps.lineage, msg)
	default:
		ps.id, ps.lineage = appendOtherID(ps.id[:0], ps.token, r.nonce, r.other.Add(1), ps.lineage, msg)
	}
}

// remove hands the worker's removal to its settler and waits, while ctx
// lasts, until the stream has it. Should ctx end first, the settler goes
// on sending it; the state stays until then, so that the worker added
// again waits for it (state).
func (ru *run) remove(ctx context.Context, ps *pubState, e *entry) uint64 {
	ps.expect = nil // it goes, whatever it had to make again
	ps.removed.Store(true)
	if ru.settleCtx.Err() != nil {
		ru.r.stats.abandoned.Add(1)
		return ps.last.Load()
	}
	settled := make(chan settledAt, 1)
	e.settled = settled
	ps.leaving <- *e // never blocks: a worker is removed once
	select {
	case <-settled:
	case <-ctx.Done():
	case <-ps.exit:
	}
	return ps.last.Load()
}

// enqueue takes a slot of the window for e, sends e's message unless the
// settler is retrying (then the settler sends it, in its turn), and hands
// e to the settler. It is false when ctx ends or the settler stopped first.
func (ru *run) enqueue(ctx context.Context, ps *pubState, e *entry) bool {
	if ru.settleCtx.Err() != nil { // stopped: nothing more goes out
		return false
	}
	select {
	case ps.slots <- struct{}{}:
	case <-ctx.Done():
		return false
	case <-ps.exit:
		return false
	}
	e.gen = ps.gen.Load()
	ps.mu.Lock()
	if ru.settleCtx.Err() != nil {
		ps.mu.Unlock()
		<-ps.slots
		return false
	}
	ps.unsettled++
	if e.msg != nil && !ps.retrying {
		m := &nats.Msg{Subject: ps.subject, Data: e.msg, Header: nats.Header{jetstream.MsgIDHeader: []string{e.id}}}
		// An error leaves fut nil: the settler sends it. e.msg is reused
		// once settled: nats.go copies Data when it sends, and keeps the
		// message only for its own retries and callbacks, which pub has
		// none of (no handlers, WithRetryAttempts(0)).
		e.fut, _ = ru.r.pub.PublishMsgAsync(m, jetstream.WithRetryAttempts(0))
	}
	ps.mu.Unlock()
	ps.queue <- *e // never blocks: it holds a slot
	return true
}

// flush is the pipeline's Flush: it waits until every message the worker
// made is settled and returns the stream sequence of the last.
func (ru *run) Flush(ctx context.Context, worker string) (uint64, error) {
	ps, ok := ru.state(ctx, worker)
	if !ok {
		return 0, context.Cause(ctx)
	}
	return ru.flushState(ctx, ps)
}

func (ru *run) flushState(ctx context.Context, ps *pubState) (uint64, error) {
	settled := make(chan settledAt, 1)
	if !ru.enqueue(ctx, ps, &entry{settled: settled}) {
		return 0, errors.Join(context.Cause(ctx), errors.New("relay: flush: the worker's publishing stopped"))
	}
	select {
	case s := <-settled:
		return s.seq, s.err
	case <-ctx.Done():
		return 0, context.Cause(ctx)
	case <-ps.exit:
		return 0, errors.New("relay: flush: the worker's publishing stopped")
	}
}

// settle is worker's settler: it takes each entry's acknowledgement in
// order, sends again what failed, and checks that the stream holds the
// worker's messages in order. It returns after the worker's removal, or
// when the run's settling ends.
func (ru *run) settle(worker string, ps *pubState) {
	defer close(ps.exit)
	var removal *entry // taken, and sent once the queue is empty
	for {
		var e entry
		switch {
		case len(ps.queue) > 0:
			e = <-ps.queue
		case removal != nil:
			e = *removal
		default:
			select {
			case e = <-ps.queue:
			case x := <-ps.leaving:
				// Whatever was made before it is in the queue by now.
				removal = &x
				continue
			case <-ru.settleCtx.Done():
				return
			}
		}
		err := ru.settleOne(worker, ps, &e)
		if e.removal {
			ru.mu.Lock()
			ru.forget(worker, ps)
			ru.mu.Unlock()
			e.settled <- settledAt{seq: ps.last.Load(), err: err}
			return
		}
		ps.mu.Lock()
		if ps.unsettled--; ps.unsettled == 0 {
			ps.retrying = false // nothing older is left to overtake
		}
		ps.mu.Unlock()
		<-ps.slots
		if e.settled != nil {
			e.settled <- settledAt{seq: ps.last.Load(), err: err}
		}
	}
}

// settleOne settles the entry e: a replayed message's place, a flush, or
// a message sent, whose acknowledgement it waits for.
func (ru *run) settleOne(worker string, ps *pubState, e *entry) error {
	r := ru.r
	switch {
	case e.replayed:
		ps.last.Store(e.seq)
		return nil
	case e.msg == nil: // a flush
		if ps.quiet.Load() {
			return errParted
		}
		return nil
	case e.gen != ps.gen.Load() && !e.removal:
		// Sent before the worker parted: its whole state follows,
		// and nothing before it matters.
		return nil
	}
	var err error
	ack := ru.ack(worker, ps, e)
	switch {
	case ack == nil:
		r.stats.abandoned.Add(1)
		err = context.Cause(ru.settleCtx)
	case ack.Sequence <= ps.last.Load() && !e.removal:
		// Stored before the worker's last message, or taken for
		// a copy of one that was: its messages are no longer in
		// order in the stream.
		ru.part(worker, ps, "the stream holds its messages out of order")
		err = errParted
	default:
		r.stats.published.Add(1)
		if ack.Duplicate {
			r.stats.duplicates.Add(1)
		}
		ps.last.Store(ack.Sequence)
	}
	select {
	case ps.free <- e.msg:
	default:
	}
	return err
}

// ack waits for e's acknowledgement; when its publish failed, or was never
// sent, it sends e itself, again and again after a backoff, until the stream
// acknowledges it. Nil when the run's settling ends first.
func (ru *run) ack(worker string, ps *pubState, e *entry) *jetstream.PubAck {
	r := ru.r
	ctx := ru.settleCtx
	if e.fut != nil {
		select {
		case a := <-e.fut.Ok():
			return a
		case err := <-e.fut.Err():
			r.warn.Warn("publish failed; sending it again", "worker", worker, "err", err)
		case <-ctx.Done():
			return nil
		}
	}
	ps.mu.Lock()
	ps.retrying = true
	ps.mu.Unlock()
	backoff := pace.Backoff{Min: r.cfg.RetryMin, Max: r.cfg.RetryMax}
	for attempt := 0; ; attempt++ {
		if attempt > 0 || e.fut != nil {
			r.stats.retries.Add(1)
		}
		actx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
		ack, err := r.pub.Publish(actx, ps.subject, e.msg, jetstream.WithMsgID(e.id), jetstream.WithRetryAttempts(0))
		cancel()
		if err == nil {
			return ack
		}
		if ctx.Err() != nil {
			return nil
		}
		r.warn.Warn("publish failed; trying again", "worker", worker, "err", err)
		if !pace.Sleep(ctx, backoff.Next()) {
			return nil
		}
	}
}

// part handles a worker whose ops no longer follow what the stream holds
// of it: applied after those, they would count blocks twice or miss
// removes. The worker publishes nothing more until it is reset in the
// stream: it publishes its whole state (seam.Republish: a clear, then
// every block it holds), which every router applies afresh. Should that
// fail, it is removed (every router drops its entries) and added again,
// to start from its engine.
func (ru *run) part(worker string, ps *pubState, why string) {
	if ps.quiet.Swap(true) || ru.settleCtx.Err() != nil {
		return // being reset, or the relay is stopping: its next start resets it
	}
	ps.gen.Add(1)
	r := ru.r
	r.stats.resets.Add(1)
	r.log.Error("kvpipe/relay: worker parted from the stream; publishing its whole state again", "worker", worker, "why", why)
	ru.resetting.Go(func() {
		// The worker may be in the middle of a long replay, which
		// Republish waits for, up to RepublishTimeout or the worker's stop.
		ctx, cancel := context.WithTimeout(context.Background(), r.cfg.RepublishTimeout)
		defer cancel()
		err := ru.republish(ctx, worker)
		if err == nil {
			r.stats.republished.Add(1)
		}
		if err == nil || errors.Is(err, kvpipe.ErrNoWorker) || errors.Is(err, kvpipe.ErrClosed) || ru.settleCtx.Err() != nil {
			return // done, removed meanwhile, or the relay is stopping
		}
		r.log.Error("kvpipe/relay: worker's state not published again; removing and adding it", "worker", worker, "err", err)
		ctx, cancel = context.WithTimeout(context.Background(), r.cfg.ShutdownTimeout)
		defer cancel()
		r.mu.Lock()
		wc, ok := r.workers[worker]
		r.mu.Unlock()
		if !ok || ru.p.RemoveWorker(ctx, worker) != nil {
			return
		}
		if err := ru.p.AddWorker(worker, wc); err != nil {
			r.log.Error("kvpipe/relay: worker not added again", "worker", worker, "err", err)
		}
	})
}
