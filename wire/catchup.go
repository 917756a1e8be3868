package wire

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/internal/conf"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/internal/zmtp"
	"github.com/kvpipe/kvpipe/internal/zsock"
)

// purpose says why a replay runs, which decides what its failure costs.
type purpose uint8

const (
	forTail  purpose = iota // a quiet spell: nothing known missing, one attempt
	forGap                  // a live gap: retried, then lost
	forProof                // a reconnect or an implausible seq: retried, then unproven
)

// replayCall is one replay on the Subscriber's replay socket: replayState
// decides what each reply means, replayCall sends the requests, waits, and
// carries out the verdicts.
type replayCall struct {
	s            *Subscriber
	sub          *zsock.Receiver
	h            Handler
	why          purpose
	r            replayState
	timer        *time.Timer // the first reply's timeout, then the stall's
	stall        time.Duration
	retry        pace.Backoff
	failingSince time.Time
	live         <-chan zmq4.Msg // the SUB's messages, held meanwhile; nil once it failed
	askNow       bool
	recheck      bool // the next request re-asks a hole
	dropped      bool // the held live batches were dropped (another incarnation)
	heard        bool // a well-formed reply came to the current request
	// abandoned: the endpoint proved useless (garbage for an answer): the
	// replay gives up at once, without ReplayPatience.
	abandoned bool
}

// action is what replayCall.wait leaves its caller to do.
type action uint8

const (
	waitMore  action = iota // nothing to settle: wait again
	settleNow               // settle the step
	stopNow                 // ctx ended
)

// catchUp runs one replay to its end: it proves that the engine is the
// incarnation the history came from, then delivers everything the engine
// holds past the last applied batch (upto is the live seq that showed a gap,
// or probe), holding live batches back meanwhile. Every request after the
// first goes out on a new connection, so no late reply to an earlier one
// can crowd it. Cancellation costs nothing.
func (s *Subscriber) catchUp(ctx context.Context, sub *zsock.Receiver, h Handler, why purpose, upto uint64) result {
	if s.replay.dealer != nil && s.replay.dealer.Dead() {
		s.replay.close() // the engine's ROUTER went away since the last replay
	}
	c := &replayCall{s: s, sub: sub, h: h, why: why, live: sub.Msgs, askNow: true,
		stall: max(s.cfg.ReplayTimeout/8, 50*time.Millisecond), timer: time.NewTimer(s.cfg.ReplayTimeout),
		retry: pace.Backoff{Min: s.cfg.ReconnectMin, Max: s.cfg.ReconnectMax}}
	defer c.timer.Stop()
	c.r.begin(&s.seq, upto, s.continuous)
	for {
		if c.askNow && !c.send(ctx) {
			if s.replay.hung && c.why != forProof {
				// Not even a handshake within replayHandshake: a hung
				// process or not an engine, no slow answer to wait for,
				// and live batches wait behind the gap. A reconnect's
				// proof keeps its patience: its link was just in trouble,
				// and giving up costs the worker its whole history.
				c.abandoned = true
			}
			if c.abandoned || !c.backOff(ctx) {
				return c.giveUp(ctx)
			}
			continue
		}
		st, act := c.wait(ctx)
		switch act {
		case stopNow:
			return stopped
		case waitMore:
			continue
		}
		if res, done := c.settle(ctx, st); done {
			return res
		}
	}
}

// send sends the request replayState asks for; false when it did not go out.
func (c *replayCall) send(ctx context.Context) bool {
	c.askNow = false
	if !c.s.replay.request(ctx, c.r.ask(c.recheck), c.s.serving) {
		c.askNow, c.recheck = true, false
		return false
	}
	c.timer.Reset(c.s.cfg.ReplayTimeout)
	c.heard = false
	return true
}

// wait waits for the next reply, the timeout, or a live message to hold,
// and runs the Checkpoint calls that come meanwhile.
func (c *replayCall) wait(ctx context.Context) (step, action) {
	s := c.s
	select {
	case <-ctx.Done():
		return step{}, stopNow
	case <-c.timer.C:
		st := c.r.timeout()
		if st.v == vFail {
			s.replay.failed("wait", errors.New("timed out"))
		}
		return st, settleNow
	case m, ok := <-c.live:
		if !ok {
			c.live = nil // the SUB failed; finish the replay, serve then reconnects
		} else {
			s.live.hold(m)
		}
		return step{}, waitMore
	case m, ok := <-s.replay.dealer.Msgs:
		if !ok {
			if ctx.Err() != nil {
				return step{}, stopNow // the socket closed because ctx ended
			}
			st := c.r.timeout()
			if st.v == vFail {
				s.replay.failed("receive", s.replay.dealer.Err())
			}
			return st, settleNow
		}
		return c.reply(m)
	case call := <-s.calls:
		call() // between two handler calls: see Checkpoint
		return step{}, waitMore
	}
}

// reply takes one reply: only a proof or a delivery keeps the replay
// alive, so a peer that streams junk or duplicates runs into the stall
// timeout.
func (c *replayCall) reply(m zmq4.Msg) (step, action) {
	s := c.s
	moves := c.r.moves
	seq, payload, ok := parseReply(m)
	if !ok {
		s.stats.Malformed.Add(1)
		if c.heard {
			return step{}, waitMore // a junk reply among good ones: the stall timeout judges
		}
		// Its first answer is garbage: no engine's ROUTER, and waiting
		// for a better one would hold the live stream back for nothing.
		c.abandoned = true
		s.replay.failed("reply", errors.New("malformed reply"))
		return step{v: vFail}, settleNow
	}
	c.heard = true
	var st step
	if seq == endMarker {
		if st = c.r.end(); st.v == vMissing {
			c.missing(st, c.r.upto-st.lost, c.r.upto)
			st.v = vDone
		}
	} else {
		st = c.r.reply(seq, payload)
	}
	if c.r.moves != moves {
		c.timer.Reset(c.stall)
	}
	switch st.v {
	case vMissing:
		c.missing(st, seq-st.lost, seq)
		fallthrough
	case vDeliver:
		s.stats.Replayed.Add(1)
		s.stats.Batches.Add(1)
		c.failingSince = time.Time{}
		c.h.HandleBatch(seq, payload)
		return st, waitMore
	case vDup:
		s.stats.Duplicates.Add(1)
		return st, waitMore
	case vSkip:
		return st, waitMore
	}
	return st, settleNow
}

// settle carries out a verdict; done when the replay is over.
func (c *replayCall) settle(ctx context.Context, st step) (res result, done bool) {
	s := c.s
	switch st.v {
	case vAsk: // replies were dropped: ask from the hole
		s.replay.close()
		c.askNow, c.recheck = true, true
	case vRestart:
		s.replay.close()
		if s.continuous || c.live == nil || c.sub.Dead() {
			// The SUB carried the old incarnation: what it holds and
			// brings is the dead engine's. Serve reconnects after this.
			s.live.drop()
			c.dropped = true
			s.staleSub, c.live = c.live != nil, nil
		}
		s.stats.Restarts.Add(1)
		s.warn.Warn("publisher restarted: replaying the new one from its start", "endpoint", s.cfg.ReplayEndpoint, "last", s.seq.last)
		s.notifyReset(c.h, ResetRestart)
		c.r.restarted()
		c.askNow, c.recheck = true, false
	case vDone:
		s.continuous = c.live != nil // what the replay delivered is vouched for by the live connection
		s.replay.up()
		return c.result(), true
	case vFail:
		s.replay.close()
		if c.abandoned || !c.backOff(ctx) {
			return c.giveUp(ctx), true
		}
		c.askNow, c.recheck = true, false
	}
	return goOn, false
}

func (c *replayCall) result() result {
	if c.dropped {
		return dropped
	}
	return goOn
}

// backOff waits out the backoff before a failed replay is sent again,
// holding live batches and running Checkpoint calls meanwhile. It reports
// false when the replay should give up: ctx ended, or the failures have
// lasted past the purpose's patience.
func (c *replayCall) backOff(ctx context.Context) bool {
	s := c.s
	now := time.Now()
	if c.failingSince.IsZero() {
		c.failingSince = now
	}
	// A tail check makes one attempt, and so does any replay once this
	// outage has had its patience: a dead endpoint must not hold up every gap.
	if c.why == forTail || s.replay.patienceSpent || s.cfg.ReplayPatience < 0 {
		return false
	}
	if now.Sub(c.failingSince) >= s.cfg.ReplayPatience {
		s.replay.patienceSpent = true
		return false
	}
	wait := time.NewTimer(c.retry.Next())
	defer wait.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-wait.C:
			return true
		case m, ok := <-c.live:
			if !ok {
				c.live = nil
				continue
			}
			s.live.hold(m)
		case call := <-s.calls:
			call()
		}
	}
}

// giveUp settles a replay that could not be made: a known gap is lost, an
// unproven history is reset, a tail check just ends.
func (c *replayCall) giveUp(ctx context.Context) result {
	if ctx.Err() != nil {
		return stopped
	}
	s := c.s
	if c.abandoned {
		s.stats.ReplayAbandoned.Add(1)
		s.warn.Warn("replay endpoint useless: going on unproven", "endpoint", s.cfg.ReplayEndpoint)
	}
	_, started := s.seq.latest()
	switch {
	case c.r.unfilled() > 0:
		s.lose(c.r.unfilled(), c.h, ResetGapLost)
	case c.why == forProof && started && !c.r.proven:
		s.warn.Warn("continuity not proven: history unknown", "endpoint", s.cfg.ReplayEndpoint)
		s.reset(c.h, ResetUnproven)
	}
	return c.result()
}

// missing settles batches from..to-1 that the engine no longer holds.
func (c *replayCall) missing(st step, from, to uint64) {
	s := c.s
	if st.lost == 0 && !st.reset {
		return // no history to miss: a router that joined late
	}
	s.stats.HistoryMissing.Add(1)
	s.stats.Lost.Add(st.lost)
	s.warn.Warn("replay buffer no longer holds the gap: history unknown", "endpoint", s.cfg.ReplayEndpoint, "from", from, "to", to, "lost", st.lost)
	if st.reset {
		s.notifyReset(c.h, ResetHistoryMissing)
	}
}

// endMarker is seq -1 as the engines send it: the end of one answer.
const endMarker = 1<<64 - 1

// parseReply checks a replay reply: [empty, seq, payload] (SGLang, vLLM
// before 0.26) or [empty, topic, seq, payload]; the last two frames are
// always seq and payload.
func parseReply(m zmq4.Msg) (seq uint64, payload []byte, ok bool) {
	n := len(m.Frames)
	if n < 3 || n > 4 || len(m.Frames[0]) != 0 || len(m.Frames[n-2]) != 8 {
		return 0, nil, false
	}
	return binary.BigEndian.Uint64(m.Frames[n-2]), m.Frames[n-1], true
}

// replayer is the replay socket, dialled on the first replay, and what
// its outages have cost.
type replayer struct {
	cfg    *Config
	stats  *counters
	warn   *pace.Warner
	dealer *zsock.Receiver
	// down: the endpoint is unreachable; warned once per outage.
	// patienceSpent: a replay already waited ReplayPatience for it.
	// hung: the last dial connected and timed out in its handshake.
	down, patienceSpent, hung bool
}

// replayHandshake bounds a replay dial's ZMTP handshake (HandshakeTimeout
// if shorter). An engine's ROUTER completes it in milliseconds; a replay
// holds live batches back meanwhile, so an endpoint that has not answered
// in a second is given up rather than waited on.
const replayHandshake = time.Second

// timedOut reports whether a dial failed by running out of time (a TCP
// connect or a ZMTP handshake), rather than being refused or broken.
func timedOut(err error) bool {
	var v *zmtp.Violation
	if errors.As(err, &v) {
		return v.Kind == zmtp.KindHandshakeTimeout
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// request sends a replay request for every batch from start on, dialling
// the replay socket first if needed, through serving (Subscriber.serving:
// a dial takes up to replayHandshake, and Checkpoint is answered
// meanwhile). It reports whether the request went out.
func (p *replayer) request(ctx context.Context, start uint64, serving func(func())) bool {
	if p.dealer == nil {
		g := p.cfg.guard(p.stats)
		g.limits.HandshakeTimeout = min(conf.Or(g.limits.HandshakeTimeout, zmtp.DefaultHandshakeTimeout), replayHandshake)
		var sock zmq4.Socket
		var err error
		serving(func() { sock, err = dial(ctx, zmq4.Dealer, p.cfg.ReplayEndpoint, g) })
		p.hung = err != nil && timedOut(err)
		if err != nil {
			if ctx.Err() == nil {
				p.stats.ReplayUnreachable.Add(1)
				if !p.down {
					p.down = true
					p.cfg.Logger.Warn("kvpipe/wire: replay endpoint unreachable; backing off", "endpoint", p.cfg.ReplayEndpoint, "err", err)
				}
			}
			return false
		}
		p.dealer = zsock.Start(sock, liveDepth)
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], start)
	if err := p.dealer.Sock.Send(zmq4.NewMsgFrom(nil, req[:])); err != nil {
		if ctx.Err() == nil {
			p.failed("send", err)
		}
		p.close()
		return false
	}
	p.stats.Replays.Add(1)
	return true
}

// up notes a replay that completed: the endpoint works again.
func (p *replayer) up() {
	p.patienceSpent = false
	if p.down {
		p.down = false
		p.cfg.Logger.Info("kvpipe/wire: replay endpoint reachable again", "endpoint", p.cfg.ReplayEndpoint)
	}
}

func (p *replayer) failed(step string, err error) {
	p.stats.ReplayFailures.Add(1)
	p.warn.Warn("replay failed", "endpoint", p.cfg.ReplayEndpoint, "step", step, "err", err)
	p.close() // a late reply must not answer the next request
}

func (p *replayer) close() {
	if p.dealer != nil {
		p.dealer.Close()
		p.dealer = nil
	}
}
