package wire

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/zsock"
	"github.com/tinylib/msgp/msgp"
)

var snapshotRequest = []byte("snapshot-v1")

// snapshotTalk is the logic of one engine snapshot conversation (SGLang's
// snapshot-v1), without sockets: what each [kind, payload] reply means. A
// header, the chunks it announces, then an end; an error reply, anything
// out of order, or a count that does not match breaks it off.
type snapshotTalk struct {
	epoch   []byte // the live stream's publisher incarnation; nil when unknown
	header  codec.EngineSnapshotHeader
	begun   bool // the header was taken: the handler is rebuilding
	records int
}

// snapshotStep is what one reply asks of the Subscriber.
type snapshotStep uint8

const (
	snapBegin snapshotStep = iota // the header: HandleEngineSnapshotBegin
	snapChunk                     // a chunk: HandleEngineSnapshot(payload)
	snapEnd                       // complete: HandleEngineSnapshotEnd(true), then resume after the barrier
	snapFail                      // broken off: the error says why
)

func (t *snapshotTalk) reply(kind string, payload []byte) (snapshotStep, error) {
	switch {
	case kind == "header" && !t.begun:
		header, err := codec.DecodeEngineSnapshotHeader(payload)
		switch {
		case err != nil:
			return snapFail, err
		case len(t.epoch) > 0 && header.Epoch != string(t.epoch):
			return snapFail, errors.New("the snapshot is of another publisher incarnation")
		case header.BarrierSeq >= implausibleSeq:
			return snapFail, errors.New("implausible barrier seq")
		}
		t.header, t.begun = header, true
		return snapBegin, nil
	case kind == "chunk" && t.begun:
		// The header's count bounds the chunks: a peer cannot stream
		// records forever, and one dropped on the way is noticed.
		// The array header alone says how many records a chunk holds;
		// decoding them is the handler's.
		n, _, err := msgp.ReadArrayHeaderBytes(payload)
		if t.records += int(n); err != nil || t.records > t.header.RecordCount {
			return snapFail, errors.New("more records than the header announced, or a corrupt chunk")
		}
		return snapChunk, nil
	case kind == "end" && t.begun && t.records != t.header.RecordCount:
		return snapFail, errors.New("fewer records than the header announced: a chunk was lost")
	case kind == "end" && t.begun:
		return snapEnd, nil
	case kind == "error":
		return snapFail, errors.New(string(payload))
	}
	return snapFail, errors.New("unexpected " + kind + " reply")
}

// snapshotCall is one engine snapshot on its own socket: snapshotTalk
// decides what each reply means, snapshotCall carries it out.
type snapshotCall struct {
	s    *Subscriber
	h    Handler
	talk snapshotTalk
}

// takeSnapshot fetches the engine's snapshot into h, holding live
// batches meanwhile (and serving Checkpoint until its header), and
// positions the stream at the snapshot's barrier. A failed snapshot is
// counted; the worker stays partial, cleared if the failure came after the
// header. It returns false only when ctx ended.
func (s *Subscriber) takeSnapshot(ctx context.Context, sub *zsock.Receiver, h Handler) bool {
	s.needSnapshot = false
	c := &snapshotCall{s: s, h: h, talk: snapshotTalk{epoch: s.epoch}}
	var sock zmq4.Socket
	var err error
	s.serving(func() { sock, err = dial(ctx, zmq4.Dealer, s.cfg.SnapshotEndpoint, s.cfg.guard(&s.stats)) })
	if err == nil {
		r := zsock.Start(sock, 64)
		defer r.Close()
		if err = sock.Send(zmq4.NewMsgFrom(nil, snapshotRequest)); err == nil {
			return c.replies(ctx, sub, r)
		}
	}
	if ctx.Err() != nil {
		return false
	}
	c.failed("request", err)
	return true
}

// An engine snapshot may take, from its header to its end, snapshotRounds
// ReplayTimeouts and a second for every snapshotRecordsPerSecond records
// its header announces (counted up to snapshotBudgetRecords, four times
// the blocks an actor holds at most). A real engine sends it in one burst
// (its sends time out after 500 ms), and kvpipe applies millions of blocks
// a second; one that trickles replies, each within ReplayTimeout, would
// otherwise hold Checkpoint (a save, a dump, the save on SIGTERM) for as
// long as it likes.
const (
	snapshotRounds           = 10
	snapshotRecordsPerSecond = 100_000
	snapshotBudgetRecords    = 1 << 24
)

// snapshotBudget is how long a snapshot of records may take after its
// header, at replayTimeout.
func snapshotBudget(replayTimeout time.Duration, records int) time.Duration {
	records = min(max(records, 0), snapshotBudgetRecords)
	budget := time.Duration(records) * time.Second / snapshotRecordsPerSecond // at most 168 s
	if replayTimeout >= (math.MaxInt64-budget)/snapshotRounds {
		return math.MaxInt64
	}
	return budget + snapshotRounds*replayTimeout
}

// replies takes the snapshot's replies from r until it ends.
func (c *snapshotCall) replies(ctx context.Context, sub, r *zsock.Receiver) bool {
	s, h, t := c.s, c.h, &c.talk
	timer := time.NewTimer(s.cfg.ReplayTimeout)
	defer timer.Stop()
	whole := time.NewTimer(time.Hour) // from the header on
	whole.Stop()
	defer whole.Stop()
	var wholeC <-chan time.Time
	var live <-chan zmq4.Msg = sub.Msgs
	for {
		var m zmq4.Msg
		var ok bool
		select {
		case call := <-c.checkpoints():
			call()
			continue
		case <-ctx.Done():
		case <-timer.C:
			c.failed("wait", errors.New("timed out"))
			return true
		case <-wholeC:
			c.failed("wait", fmt.Errorf("not ended %v after its header", snapshotBudget(s.cfg.ReplayTimeout, t.header.RecordCount)))
			return true
		case m, ok := <-live:
			if !ok {
				live = nil
			} else {
				s.live.hold(m)
			}
			continue
		case m, ok = <-r.Msgs:
		}
		if !ok { // ctx ended, or the socket failed
			if ctx.Err() != nil {
				if t.begun {
					h.HandleEngineSnapshotEnd(false)
				}
				return false
			}
			c.failed("receive", r.Err())
			return true
		}
		if len(m.Frames) != 3 || len(m.Frames[0]) != 0 { // [empty, kind, payload]
			s.stats.Malformed.Add(1)
			continue // not progress: the timer keeps running
		}
		timer.Reset(s.cfg.ReplayTimeout)
		switch c.apply(string(m.Frames[1]), m.Frames[2]) {
		case snapBegin:
			whole.Reset(snapshotBudget(s.cfg.ReplayTimeout, t.header.RecordCount))
			wholeC = whole.C
		case snapEnd, snapFail:
			return true
		}
	}
}

// apply carries out one reply of the snapshot, and says what it was.
func (c *snapshotCall) apply(kind string, payload []byte) snapshotStep {
	s, h, t := c.s, c.h, &c.talk
	st, err := t.reply(kind, payload)
	switch st {
	case snapBegin:
		h.HandleEngineSnapshotBegin()
	case snapChunk:
		h.HandleEngineSnapshot(payload)
	case snapEnd:
		h.HandleEngineSnapshotEnd(true)
		s.stats.Snapshots.Add(1)
		s.live.resumeAfter(&s.seq, t.header.BarrierSeq)
	case snapFail:
		c.failed(kind, err)
	}
	return st
}

// resumeAfter positions the stream after the barrier whose state the worker
// now holds: held live batches up to it are dropped, and the next ones
// continue from it (a gap to them is replayed as any other).
func (q *liveQueue) resumeAfter(seq *seqTracker, barrier uint64) {
	// Live batches older than the barrier may still be on their way: from
	// where the stream stood, they are duplicates, not a restart.
	floor := uint64(0)
	if _, ok := seq.latest(); ok {
		floor = seq.dupFloor
	}
	seq.anchor(barrier, floor)
	kept := q.frames[:0]
	for _, f := range q.frames {
		if f.seq == barrier {
			seq.apply(f.seq, f.payload)
		} else if f.seq > barrier {
			kept = append(kept, f)
		}
	}
	clear(q.frames[len(kept):])
	q.frames = kept
}

// checkpoints is where Checkpoint calls come while the snapshot is read:
// until its header; once begun, the handler is mid-snapshot.
func (c *snapshotCall) checkpoints() <-chan func() {
	if c.talk.begun {
		return nil
	}
	return c.s.calls
}

func (c *snapshotCall) failed(step string, err error) {
	if c.talk.begun {
		c.h.HandleEngineSnapshotEnd(false)
	}
	c.s.stats.SnapshotFailures.Add(1)
	c.s.warn.Warn("snapshot failed", "endpoint", c.s.cfg.SnapshotEndpoint, "step", step, "err", err)
}
