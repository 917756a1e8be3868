package wire

import (
	"bytes"
	"context"

	"github.com/kvpipe/kvpipe/internal/zsock"
)

// result is how a replay or a batch's application ended for drain.
type result uint8

const (
	goOn    result = iota // done: go on
	dropped               // the held batches were the old incarnation's and are gone: start over on what is held now
	stopped               // ctx ended
)

// drain applies the live batches held, and every live batch a replay they
// set off held back; the engine's snapshot, when a reset asks for it, takes
// over from the batches still held. It returns false when ctx ended.
func (s *Subscriber) drain(ctx context.Context, sub *zsock.Receiver, h Handler) bool {
	for {
		for i := 0; i < len(s.live.frames); i++ { // a replay appends what it held back
			if s.needSnapshot {
				s.live.from(i)
				i = 0
				if !s.takeSnapshot(ctx, sub, h) {
					return false
				}
				if len(s.live.frames) == 0 {
					break
				}
			}
			switch s.apply(ctx, sub, h, s.live.frames[i]) {
			case stopped:
				return false
			case dropped:
				i = -1 // what is held now is the new incarnation's
			}
		}
		s.live.drop()
		if !s.needSnapshot {
			return true
		}
		// What the snapshot held back comes after its barrier: apply it now.
		if !s.takeSnapshot(ctx, sub, h) {
			return false
		}
		if len(s.live.frames) == 0 {
			return true
		}
	}
}

// apply applies one live batch, after a replay of what it shows missing.
func (s *Subscriber) apply(ctx context.Context, sub *zsock.Receiver, h Handler, f frame) result {
	if r := s.checkEpoch(ctx, sub, h, f); r != goOn {
		return r
	}
	outcome := s.seq.classify(f.seq)
	if outcome == seqFirst && f.seq > 0 && s.cfg.ReplayEndpoint != "" {
		// The stream starts past 0: the engine's buffer may hold what
		// the PUB sent before the subscription took hold.
		if s.catchUp(ctx, sub, h, forTail, f.seq) == stopped {
			return stopped
		}
		outcome = s.seq.classify(f.seq)
	}
	switch outcome {
	case seqFirst, seqInOrder:
		s.deliver(f, h)
		return goOn
	case seqDuplicate:
		if f.seq == s.seq.last {
			s.seq.learn(f.payload) // the barrier a snapshot anchored at
		}
		s.stats.Duplicates.Add(1)
		return goOn
	}
	return s.fillGap(ctx, sub, h, f, outcome)
}

// checkEpoch resets a worker whose live topic names another publisher
// incarnation, and replays the new one from its first batch.
func (s *Subscriber) checkEpoch(ctx context.Context, sub *zsock.Receiver, h Handler, f frame) result {
	if len(f.epoch) == 0 {
		return goOn
	}
	if len(s.epoch) > 0 && !bytes.Equal(f.epoch, s.epoch) {
		s.stats.Restarts.Add(1)
		s.warn.Warn("publisher restarted: new epoch", "endpoint", s.cfg.Endpoint, "epoch", string(f.epoch))
		s.reset(h, ResetRestart)
		// The new incarnation from its first batch, before this one.
		if s.cfg.ReplayEndpoint != "" {
			if r := s.catchUp(ctx, sub, h, forTail, probe); r != goOn {
				return r
			}
		}
	}
	s.epoch = append(s.epoch[:0], f.epoch...)
	return goOn
}

// fillGap settles a batch past the next one, or behind the last: the
// replay endpoint fills the gap, or shows another incarnation, or that
// the seq is garbage; without one, the gap is lost.
func (s *Subscriber) fillGap(ctx context.Context, sub *zsock.Receiver, h Handler, f frame, outcome seqOutcome) result {
	plausible := outcome == seqGap && f.seq-s.seq.last <= implausibleGap
	if outcome == seqGap {
		s.stats.Gaps.Add(1)
	}
	if s.cfg.ReplayEndpoint == "" {
		if plausible {
			s.lose(f.seq-s.seq.last-1, h, ResetGapLost)
		} else {
			s.stats.Restarts.Add(1)
			s.warn.Warn("publisher restarted: history unknown", "endpoint", s.cfg.Endpoint, "last", s.seq.last, "seq", f.seq)
			s.reset(h, ResetRestart)
		}
		s.deliver(f, h)
		return goOn
	}
	why, upto := forProof, uint64(probe)
	if plausible {
		why, upto = forGap, f.seq
	}
	if r := s.catchUp(ctx, sub, h, why, upto); r != goOn {
		return r // dropped: f was the old incarnation's, with the rest held
	}
	switch s.seq.classify(f.seq) {
	case seqFirst, seqInOrder:
		s.deliver(f, h)
	case seqDuplicate, seqRestart: // replayed, or behind a stream the engine vouches for
		s.stats.Duplicates.Add(1)
	case seqGap:
		s.stats.Malformed.Add(1)
		s.warn.Warn("seq contradicts the engine's replay buffer: skipped", "endpoint", s.cfg.Endpoint, "last", s.seq.last, "seq", f.seq)
	}
	return goOn
}

func (s *Subscriber) deliver(f frame, h Handler) {
	s.seq.apply(f.seq, f.payload)
	s.stats.Batches.Add(1)
	s.continuous = true
	h.HandleBatch(f.seq, f.payload)
}

// lose counts n batches gone for good and resets the worker's history.
func (s *Subscriber) lose(n uint64, h Handler, why ResetReason) {
	s.stats.Lost.Add(n)
	s.warn.Warn("batches lost: history unknown", "endpoint", s.cfg.Endpoint, "after", s.seq.last, "lost", n, "reason", why.String())
	s.reset(h, why)
}

func (s *Subscriber) reset(h Handler, why ResetReason) {
	s.seq.reset()
	s.notifyReset(h, why)
}

// notifyReset tells h; a reset within one incarnation asks for the engine's
// snapshot where it offers one.
func (s *Subscriber) notifyReset(h Handler, why ResetReason) {
	s.resumed = false
	h.HandleReset(why)
	switch {
	case !why.SameIncarnation():
		s.epoch = s.epoch[:0] // the next live batch names the new one
	case s.cfg.SnapshotEndpoint != "":
		s.needSnapshot = true
	}
}
