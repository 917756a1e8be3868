package wire

import (
	"context"
	"errors"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/codec"
)

// SnapshotHandler is a Handler that can rebuild its worker from an engine's
// snapshot (SGLang's snapshot-v1; vLLM and older SGLang have none). After a
// reset within one incarnation the Subscriber asks for one: HandleSnapshotBegin
// (drop the worker's entries, keep what is known of its blocks), then each
// chunk's payload in order (a msgpack list of [parent_hash, [block_hashes]]
// records), then HandleSnapshotEnd. With ok the worker is the engine's state
// as of the snapshot's barrier, and the batches that follow come after it;
// without, the snapshot broke off and its entries must be dropped again.
type SnapshotHandler interface {
	Handler
	HandleSnapshotBegin()
	HandleSnapshot(chunk []byte)
	HandleSnapshotEnd(ok bool)
}

var snapshotRequest = []byte("snapshot-v1")

// snapshot fetches the engine's snapshot into h, holding live batches
// meanwhile, and positions the stream at the snapshot's barrier. A failed
// snapshot is counted and leaves the worker as it was (partial). It returns
// false only when ctx ended.
func (s *Subscriber) snapshot(ctx context.Context, sub *receiver, h SnapshotHandler) bool {
	sock, err := dial(ctx, zmq4.Dealer, s.cfg.SnapshotEndpoint, s.guard())
	if err != nil {
		if ctx.Err() != nil {
			return false
		}
		s.snapshotFailed(h, false, "dial", err)
		return true
	}
	r := startReceiver(sock, 64)
	defer r.close()
	if err := sock.Send(zmq4.NewMsgFrom(nil, snapshotRequest)); err != nil {
		s.snapshotFailed(h, false, "send", err)
		return true
	}
	timer := time.NewTimer(s.cfg.ReplayTimeout)
	defer timer.Stop()
	var live <-chan zmq4.Msg = sub.msgs
	var header codec.SnapshotHeader
	begun := false
	for {
		select {
		case <-ctx.Done():
			if begun {
				h.HandleSnapshotEnd(false)
			}
			return false
		case <-timer.C:
			s.snapshotFailed(h, begun, "wait", errors.New("timed out"))
			return true
		case m, ok := <-live:
			if !ok {
				live = nil
			} else {
				s.hold(m)
			}
		case m, ok := <-r.msgs:
			if !ok {
				s.snapshotFailed(h, begun, "receive", r.err)
				return true
			}
			timer.Reset(s.cfg.ReplayTimeout)
			// [empty, kind, payload]
			if len(m.Frames) != 3 || len(m.Frames[0]) != 0 {
				s.stats.Malformed.Add(1)
				continue
			}
			switch kind, payload := string(m.Frames[1]), m.Frames[2]; {
			case kind == "header" && !begun:
				if header, err = codec.DecodeSnapshotHeader(payload); err != nil {
					s.snapshotFailed(h, false, "header", err)
					return true
				}
				if len(s.epoch) > 0 && header.Epoch != string(s.epoch) {
					s.snapshotFailed(h, false, "header", errors.New("the snapshot is of another publisher incarnation"))
					return true
				}
				begun = true
				h.HandleSnapshotBegin()
			case kind == "chunk" && begun:
				h.HandleSnapshot(payload)
			case kind == "end" && begun:
				h.HandleSnapshotEnd(true)
				s.stats.Snapshots.Add(1)
				return s.resumeAfter(header.BarrierSeq)
			case kind == "error":
				s.snapshotFailed(h, begun, "engine", errors.New(string(payload)))
				return true
			default:
				s.snapshotFailed(h, begun, "reply", errors.New("unexpected "+kind+" reply"))
				return true
			}
		}
	}
}

// resumeAfter positions the stream after the barrier whose state the worker
// now holds: held live batches up to it are dropped, and the next ones
// continue from it (a gap to them is replayed as any other).
func (s *Subscriber) resumeAfter(barrier uint64) bool {
	s.seq.anchor(barrier)
	kept := s.queue[:0]
	for _, f := range s.queue {
		if f.seq == barrier {
			s.seq.Apply(f.seq, f.payload)
		} else if f.seq > barrier {
			kept = append(kept, f)
		}
	}
	clear(s.queue[len(kept):])
	s.queue = kept
	return true
}

func (s *Subscriber) snapshotFailed(h SnapshotHandler, begun bool, step string, err error) {
	if begun {
		h.HandleSnapshotEnd(false)
	}
	s.stats.SnapshotFailures.Add(1)
	s.logf("snapshot failed", "endpoint", s.cfg.SnapshotEndpoint, "step", step, "err", err)
}
