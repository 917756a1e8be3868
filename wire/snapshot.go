package wire

import (
	"context"
	"errors"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/zsock"
)

// SnapshotHandler is a Handler that can rebuild its worker from an engine's
// snapshot (SGLang's snapshot-v1; vLLM and older SGLang have none). After a
// reset within one incarnation the Subscriber asks for one: HandleSnapshotBegin
// (drop the worker's entries, keep what is known of its blocks), then each
// chunk's payload in order (a msgpack list of [parent_hash, [block_hashes]]
// records), then HandleSnapshotEnd. With ok the worker is the engine's state
// as of the snapshot's barrier, and the batches that follow come after it;
// without, the snapshot broke off: its entries must be dropped again, which
// leaves the worker cleared, as right after the reset.
type SnapshotHandler interface {
	Handler
	HandleSnapshotBegin()
	HandleSnapshot(chunk []byte)
	HandleSnapshotEnd(ok bool)
}

var snapshotRequest = []byte("snapshot-v1")

// snapshot fetches the engine's snapshot into h, holding live batches
// meanwhile, and positions the stream at the snapshot's barrier. A failed
// snapshot is counted; the worker stays partial, cleared if the failure came
// after the header. It returns false only when ctx ended.
func (s *Subscriber) snapshot(ctx context.Context, sub *zsock.Receiver, h SnapshotHandler) bool {
	sock, err := dial(ctx, zmq4.Dealer, s.cfg.SnapshotEndpoint, s.guard())
	if err != nil {
		if ctx.Err() != nil {
			return false
		}
		s.snapshotFailed(h, false, "dial", err)
		return true
	}
	r := zsock.Start(sock, 64)
	defer r.Close()
	if err := sock.Send(zmq4.NewMsgFrom(nil, snapshotRequest)); err != nil {
		if ctx.Err() != nil {
			return false
		}
		s.snapshotFailed(h, false, "send", err)
		return true
	}
	timer := time.NewTimer(s.cfg.ReplayTimeout)
	defer timer.Stop()
	var live <-chan zmq4.Msg = sub.Msgs
	var header codec.SnapshotHeader
	begun, records := false, 0
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
		case m, ok := <-r.Msgs:
			if !ok {
				if ctx.Err() != nil {
					if begun {
						h.HandleSnapshotEnd(false)
					}
					return false
				}
				s.snapshotFailed(h, begun, "receive", r.Err())
				return true
			}
			// [empty, kind, payload]
			if len(m.Frames) != 3 || len(m.Frames[0]) != 0 {
				s.stats.Malformed.Add(1)
				continue // not progress: the timer keeps running
			}
			timer.Reset(s.cfg.ReplayTimeout)
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
				if header.BarrierSeq >= implausibleSeq {
					s.snapshotFailed(h, false, "header", errors.New("implausible barrier seq"))
					return true
				}
				begun = true
				h.HandleSnapshotBegin()
			case kind == "chunk" && begun:
				// The header's count bounds the chunks: a peer cannot stream
				// records forever, and one dropped on the way is noticed.
				n, err := codec.SnapshotRecords(payload)
				if records += n; err != nil || records > header.RecordCount {
					s.snapshotFailed(h, true, "chunk", errors.New("more records than the header announced, or a corrupt chunk"))
					return true
				}
				h.HandleSnapshot(payload)
			case kind == "end" && begun && records != header.RecordCount:
				s.snapshotFailed(h, true, "end", errors.New("fewer records than the header announced: a chunk was lost"))
				return true
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
	// Live batches older than the barrier may still be on their way: from
	// where the stream stood, they are duplicates, not a restart.
	floor := uint64(0)
	if _, ok := s.seq.Last(); ok {
		floor = s.seq.dupFloor
	}
	s.seq.anchor(barrier, floor)
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
