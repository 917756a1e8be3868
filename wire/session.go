package wire

import (
	"context"
	"errors"
	"time"

	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/internal/zsock"
)

var (
	errIdle  = errors.New("no message within the idle timeout")
	errStale = errors.New("the publisher restarted under the subscription")
)

// session is one SUB connection's life: the proof of continuity when it
// connects, its live batches, and the tail checks of its quiet spells.
type session struct {
	s    *Subscriber
	sub  *zsock.Receiver
	h    Handler
	idle *time.Timer // nil without an IdleTimeout
	// tail runs once per quiet spell, and only with a replay endpoint;
	// while that endpoint fails, it backs off.
	tail        *time.Timer
	tailing     bool
	tailBackoff pace.Backoff
	// owed retries what the handler held back (HandleIdle) while no batch
	// comes to carry it.
	owed        *time.Timer
	owedBackoff pace.Backoff
}

// serve handles one socket's messages until it fails, idles out or ctx
// ends, and closes it, also when the handler panics.
func (s *Subscriber) serve(ctx context.Context, sub *zsock.Receiver, h Handler) error {
	s.stats.Connected.Store(true)
	s.continuous = false
	defer func() {
		s.stats.Connected.Store(false)
		s.staleSub = false
		sub.Close()
		s.live.drop()
	}()
	c := &session{s: s, sub: sub, h: h}
	if err := c.prove(ctx); err != nil {
		return err
	}
	if s.cfg.IdleTimeout > 0 {
		c.idle = time.NewTimer(s.cfg.IdleTimeout)
		defer c.idle.Stop()
	}
	c.tailing = s.cfg.ReplayEndpoint != "" && s.cfg.TailCheck > 0
	c.tail = time.NewTimer(s.cfg.TailCheck)
	defer c.tail.Stop()
	if !c.tailing {
		c.tail.Stop()
	}
	c.tailBackoff = pace.Backoff{Min: s.cfg.TailCheck, Max: max(s.cfg.ReconnectMax, s.cfg.TailCheck)}
	c.owed = time.NewTimer(time.Hour)
	c.owed.Stop()
	defer c.owed.Stop()
	c.owedBackoff = pace.Backoff{Min: 10 * time.Millisecond, Max: time.Second}
	c.handIdle()
	return c.loop(ctx)
}

// prove settles a new connection, which may reach another incarnation of
// the engine: continuity is proven through the replay endpoint (which also
// replays what the engine sent meanwhile, or a new incarnation from its
// first batch), or, without one, the worker starts afresh.
func (c *session) prove(ctx context.Context) error {
	s := c.s
	if s.cfg.ReplayEndpoint == "" {
		if _, ok := s.seq.latest(); ok {
			s.reset(c.h, ResetUnproven)
		}
		return nil
	}
	why := forTail // no history: the engine's buffer is a head start, not owed
	if _, ok := s.seq.latest(); ok {
		why = forProof
	}
	ok := s.catchUp(ctx, c.sub, c.h, why, probe) != stopped
	if ok && s.resumed { // proven: a failed proof resets
		s.resumed = false
		c.h.HandleResumed()
	}
	return c.settled(ctx, ok && s.drain(ctx, c.sub, c.h))
}

func (c *session) loop(ctx context.Context) error {
	var idle <-chan time.Time
	if c.idle != nil {
		idle = c.idle.C
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case call := <-c.s.calls:
			call()
		case <-idle:
			if err := c.idleCheck(ctx); err != nil {
				return err
			}
		case <-c.tail.C:
			if err := c.tailCheck(ctx); err != nil {
				return err
			}
			c.handIdle()
		case <-c.owed.C:
			c.handIdle()
		case m, ok := <-c.sub.Msgs:
			if !ok {
				return c.sub.Err()
			}
			if c.idle != nil {
				c.idle.Reset(c.s.cfg.IdleTimeout)
			}
			if c.tailing {
				c.tail.Reset(c.s.cfg.TailCheck)
			}
			if f, ok := c.s.live.parse(m); ok {
				c.s.live.frames = append(c.s.live.frames, f)
				if err := c.settled(ctx, c.s.drain(ctx, c.sub, c.h)); err != nil {
					return err
				}
			}
			if len(c.sub.Msgs) == 0 {
				c.owedBackoff.Reset() // a new quiet spell: its first retry comes soon
				c.handIdle()
			}
		}
	}
}

// handIdle lets the handler hand on what it held back, now that no batch
// waits, and asks again later while it still holds some.
func (c *session) handIdle() {
	if !c.h.HandleIdle() {
		c.owedBackoff.Reset()
		return
	}
	c.owed.Reset(c.owedBackoff.Next())
}

// idleCheck tells a quiet engine from a dead or hung one, or a SUB that
// no longer carries its stream, after IdleTimeout without a message: it
// asks the replay endpoint for anything after the last batch. An answer
// that proves the last batch and holds nothing after it means the engine
// is alive, the same process, and has published nothing: the SUB is kept.
// Anything else (no answer, a restart, batches the SUB never carried)
// rebuilds the SUB, as does idling without a replay endpoint or history.
func (c *session) idleCheck(ctx context.Context) error {
	s := c.s
	if _, ok := s.seq.latest(); !ok || s.cfg.ReplayEndpoint == "" {
		return errIdle
	}
	s.stats.TailChecks.Add(1)
	replayed, failures, restarts := s.stats.Replayed.Load(), s.stats.failures(), s.stats.Restarts.Load()
	if err := c.settled(ctx, s.catchUp(ctx, c.sub, c.h, forTail, probe) != stopped && s.drain(ctx, c.sub, c.h)); err != nil {
		return err
	}
	if s.stats.Replayed.Load() != replayed || s.stats.failures() != failures || s.stats.Restarts.Load() != restarts || c.sub.Dead() {
		return errIdle
	}
	c.idle.Reset(s.cfg.IdleTimeout)
	return nil
}

// tailCheck asks the engine for anything after the last batch, after a
// quiet spell.
func (c *session) tailCheck(ctx context.Context) error {
	s := c.s
	if _, ok := s.seq.latest(); !ok {
		return nil
	}
	s.stats.TailChecks.Add(1)
	before := s.stats.Replayed.Load()
	failures := s.stats.failures()
	if err := c.settled(ctx, s.catchUp(ctx, c.sub, c.h, forTail, probe) != stopped && s.drain(ctx, c.sub, c.h)); err != nil {
		return err
	}
	switch {
	case s.stats.failures() != failures:
		c.tail.Reset(c.tailBackoff.Next())
	case s.stats.Replayed.Load() != before:
		c.tailBackoff.Reset()
		c.tail.Reset(s.cfg.TailCheck) // more may be there: look again
	default:
		c.tailBackoff.Reset()
	}
	return nil
}

// settled turns how catchUp and drain ended into serve's answer: ctx's
// error when it ended, errStale when the SUB must be rebuilt, nil to go on.
func (c *session) settled(ctx context.Context, ok bool) error {
	switch {
	case !ok:
		return ctx.Err()
	case c.s.staleSub:
		return errStale
	}
	return nil
}
