package wire

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/internal/pace"
)

// Config configures the Subscriber of one worker.
type Config struct {
	Endpoint       string // the engine's PUB, e.g. tcp://10.0.0.5:5557
	ReplayEndpoint string // the engine's ROUTER replay socket; "" when it has none
	Topic          string // ZMQ prefix match; the engines' default is ""

	// IdleTimeout rebuilds the SUB socket after this long without a message,
	// since a peer that vanished without closing its TCP connection is
	// otherwise never noticed. 0 means 30s; negative disables it.
	IdleTimeout time.Duration
	// ReconnectMin and ReconnectMax bound the jittered exponential backoff
	// between dial attempts (defaults 50ms and 5s).
	ReconnectMin, ReconnectMax time.Duration
	// ReplayTimeout bounds the wait for each replay reply (default 2s).
	ReplayTimeout time.Duration
	// TailCheck asks the replay endpoint for anything after the last batch
	// once the stream has been quiet this long (default 1s; negative
	// disables it). A PUB that drops the last batches of a burst shows no
	// gap until the next burst; this recovers them without waiting.
	TailCheck time.Duration
	// MaxReplayBuffer bounds the live batches held while a replay runs
	// (default 10,000, vLLM's replay buffer). Past it, live batches are
	// dropped and counted (LiveOverflow); the next batch then shows a gap,
	// which is replayed again.
	MaxReplayBuffer int
	// Logger receives rate-limited warnings; nil discards them.
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	if c.IdleTimeout == 0 {
		c.IdleTimeout = 30 * time.Second
	}
	if c.ReconnectMin <= 0 {
		c.ReconnectMin = 50 * time.Millisecond
	}
	if c.ReconnectMax < c.ReconnectMin {
		c.ReconnectMax = max(5*time.Second, c.ReconnectMin)
	}
	if c.ReplayTimeout <= 0 {
		c.ReplayTimeout = 2 * time.Second
	}
	if c.TailCheck == 0 {
		c.TailCheck = time.Second
	}
	if c.MaxReplayBuffer <= 0 {
		c.MaxReplayBuffer = 10_000
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// ResetReason says why a worker's history can no longer be trusted.
type ResetReason uint8

const (
	ResetRestart        ResetReason = iota // seq went backwards
	ResetHistoryMissing                    // the replay buffer no longer had the lost batches
	ResetGapLost                           // a gap with no replay endpoint, or a replay that failed
)

func (r ResetReason) String() string {
	return [...]string{"restart", "history_missing", "gap_lost"}[r]
}

// Handler receives one worker's stream, in the Subscriber's goroutine.
type Handler interface {
	// HandleBatch gets every batch exactly once, in seq order. The payload
	// is only valid during the call.
	HandleBatch(seq uint64, payload []byte)
	// HandleReset says that batches were lost for good: the worker's state
	// must be rebuilt from the batches that follow.
	HandleReset(reason ResetReason)
}

// Stats counts what one Subscriber saw. Any goroutine may read it.
type Stats struct {
	Batches        atomic.Uint64 // delivered to the handler, live or replayed
	Malformed      atomic.Uint64 // wrong frame count or seq width: skipped
	Duplicates     atomic.Uint64 // seq already applied: dropped
	Gaps           atomic.Uint64 // seq > last+1 seen
	Replays        atomic.Uint64 // replay requests sent
	Replayed       atomic.Uint64 // batches recovered through replay
	TailChecks     atomic.Uint64 // replays asked after a quiet spell, gap or not
	ReplayFailures atomic.Uint64 // replays that timed out or could not connect
	HistoryMissing atomic.Uint64 // replays that started later than asked
	Lost           atomic.Uint64 // batches known to be gone for good
	LiveOverflow   atomic.Uint64 // live batches dropped while a replay ran
	Restarts       atomic.Uint64 // seq went backwards
	Reconnects     atomic.Uint64 // SUB sockets rebuilt after a failure or idle
	Connected      atomic.Bool
}

// Subscriber receives one worker's batches. Run it in the goroutine that owns
// the worker's state: the handler is called there.
type Subscriber struct {
	cfg   Config
	stats Stats
	warn  pace.Limiter

	seq    SeqTracker
	dealer *receiver // replay socket, dialled on the first gap
	queue  []frame   // live batches held while a replay runs
}

type frame struct {
	seq     uint64
	payload []byte
}

// NewSubscriber validates cfg and returns a Subscriber; Run starts it.
func NewSubscriber(cfg Config) (*Subscriber, error) {
	if err := ValidateEndpoint(cfg.Endpoint); err != nil {
		return nil, err
	}
	if cfg.ReplayEndpoint != "" {
		if err := ValidateEndpoint(cfg.ReplayEndpoint); err != nil {
			return nil, fmt.Errorf("replay %w", err)
		}
	}
	cfg.setDefaults()
	return &Subscriber{cfg: cfg, warn: pace.Limiter{Every: time.Second}}, nil
}

// Stats returns the Subscriber's counters.
func (s *Subscriber) Stats() *Stats { return &s.stats }

// liveDepth is how many received messages may wait for the handler; past it
// the socket stops reading and the loss surfaces upstream as a seq gap.
const liveDepth = 1024

// Run subscribes and feeds h until ctx is done, rebuilding the socket with
// backoff whenever it fails. It returns ctx's error.
func (s *Subscriber) Run(ctx context.Context, h Handler) error {
	defer s.closeDealer()
	backoff := pace.Backoff{Min: s.cfg.ReconnectMin, Max: s.cfg.ReconnectMax}
	for connectedBefore := false; ; {
		sub, err := s.connect(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			s.logf("dial failed", "endpoint", s.cfg.Endpoint, "err", err)
			if !pace.Sleep(ctx, backoff.Next()) {
				return ctx.Err()
			}
			continue
		}
		if connectedBefore {
			s.stats.Reconnects.Add(1)
		}
		connectedBefore = true
		backoff.Reset()
		err = s.serve(ctx, sub, h)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		// What follows may come from a restarted publisher: the seq tracker
		// tells a restart (seq back) from a gap (seq ahead).
		s.logf("subscription lost, reconnecting", "endpoint", s.cfg.Endpoint, "err", err)
	}
}

func (s *Subscriber) connect(ctx context.Context) (*receiver, error) {
	sock, err := dial(ctx, zmq4.Sub, s.cfg.Endpoint)
	if err != nil {
		return nil, err
	}
	if err := sock.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		sock.Close()
		return nil, err
	}
	return startReceiver(sock, liveDepth), nil
}

var errIdle = errors.New("no message within the idle timeout")

// serve handles one socket's messages until it fails, idles out or ctx
// ends, and closes it, also when the handler panics.
func (s *Subscriber) serve(ctx context.Context, sub *receiver, h Handler) error {
	s.stats.Connected.Store(true)
	defer func() {
		s.stats.Connected.Store(false)
		sub.close()
	}()
	var idle <-chan time.Time
	var timer *time.Timer
	if s.cfg.IdleTimeout > 0 {
		timer = time.NewTimer(s.cfg.IdleTimeout)
		defer timer.Stop()
		idle = timer.C
	}
	// The tail check runs once per quiet spell, and only with a replay endpoint.
	tail := time.NewTimer(s.cfg.TailCheck)
	defer tail.Stop()
	if s.cfg.ReplayEndpoint == "" || s.cfg.TailCheck < 0 {
		tail.Stop()
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-idle:
			return errIdle
		case <-tail.C:
			if last, ok := s.seq.Last(); ok {
				s.stats.TailChecks.Add(1)
				s.queue = s.queue[:0]
				ended, n := s.replay(ctx, last+1, probe, sub, h)
				s.drain(ctx, sub, h)
				if !ended || n > 0 {
					tail.Reset(s.cfg.TailCheck) // more may be there: look again
				}
			}
		case m, ok := <-sub.msgs:
			if !ok {
				return sub.err
			}
			if timer != nil {
				timer.Reset(s.cfg.IdleTimeout)
			}
			if s.cfg.ReplayEndpoint != "" && s.cfg.TailCheck > 0 {
				tail.Reset(s.cfg.TailCheck)
			}
			if f, ok := s.parseLive(m); ok {
				s.queue = append(s.queue[:0], f)
				s.drain(ctx, sub, h)
			}
		}
	}
}

// probe, as a replay's upto, marks a tail check: no gap is known, so an
// answer with nothing in it means nothing was lost.
const probe = 1<<64 - 1

// parseLive checks the [topic, seq, payload] shape.
func (s *Subscriber) parseLive(m zmq4.Msg) (frame, bool) {
	if len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
		s.stats.Malformed.Add(1)
		s.logf("malformed message skipped", "frames", len(m.Frames), "seq_bytes", seqWidth(m))
		return frame{}, false
	}
	return frame{seq: binary.BigEndian.Uint64(m.Frames[1]), payload: m.Frames[2]}, true
}

func seqWidth(m zmq4.Msg) int {
	if len(m.Frames) < 2 {
		return 0
	}
	return len(m.Frames[1])
}

// maxReplaysPerBatch bounds the replays one live batch can set off (a replay
// holds live batches back, and one of them may show a gap of its own).
const maxReplaysPerBatch = 4

// drain applies the live batches in s.queue, and every live batch a replay
// they set off held back.
func (s *Subscriber) drain(ctx context.Context, sub *receiver, h Handler) {
	replays := 0
	for i := 0; i < len(s.queue); i++ { // a replay appends what it held back
		f := s.queue[i]
		switch s.seq.Classify(f.seq) {
		case Duplicate:
			s.stats.Duplicates.Add(1)
			continue
		case Restart:
			s.stats.Restarts.Add(1)
			s.logf("publisher restarted: history unknown", "endpoint", s.cfg.Endpoint, "last", s.seq.last, "seq", f.seq)
			s.seq.Reset()
			h.HandleReset(ResetRestart)
		case Gap:
			s.stats.Gaps.Add(1)
			if s.cfg.ReplayEndpoint != "" && replays < maxReplaysPerBatch {
				replays++
				s.replay(ctx, s.seq.last+1, f.seq, sub, h)
				switch s.seq.Classify(f.seq) {
				case Duplicate: // the replay delivered it
					s.stats.Duplicates.Add(1)
					continue
				case First, InOrder:
					s.deliver(f, h)
					continue
				}
			}
			last := s.seq.last
			s.stats.Lost.Add(f.seq - last - 1)
			s.logf("batches lost: history unknown", "endpoint", s.cfg.Endpoint, "from", last+1, "to", f.seq-1)
			s.seq.Reset()
			h.HandleReset(ResetGapLost)
		}
		s.deliver(f, h)
	}
	clear(s.queue) // drop payload references
	s.queue = s.queue[:0]
}

func (s *Subscriber) deliver(f frame, h Handler) {
	s.seq.Apply(f.seq)
	s.stats.Batches.Add(1)
	h.HandleBatch(f.seq, f.payload)
}

// maxReplayRequests is a safety bound on the requests of one replay; it
// goes on only while the requests deliver something.
const maxReplayRequests = 1024

// replay asks the replay socket for every batch from start on (the gap ends
// before upto, or upto is probe) and delivers them in order, holding live
// batches back in s.queue meanwhile. A ROUTER drops replies past its
// high-water mark as silently as a PUB drops batches: a reply that skips a
// seq makes it ask again from the hole on the same socket (the rest of the
// earlier answer is then ignored; every request ends with its own marker),
// and a wait that times out after some progress asks again on a fresh one.
// It reports whether the engine said it had nothing more, and how many
// batches it delivered.
func (s *Subscriber) replay(ctx context.Context, start, upto uint64, sub *receiver, h Handler) (ended bool, delivered int) {
	if s.dealer != nil && s.dealer.dead() {
		s.closeDealer() // the engine's ROUTER went away since the last replay
	}
	outstanding := 0 // requests whose end marker has not come yet
	var asked uint64 // start of the latest request
	ask := func(from uint64) bool {
		if s.dealer == nil {
			sock, err := dial(ctx, zmq4.Dealer, s.cfg.ReplayEndpoint)
			if err != nil {
				s.replayFailed("dial", err)
				return false
			}
			s.dealer = startReceiver(sock, liveDepth)
		}
		var req [8]byte
		binary.BigEndian.PutUint64(req[:], from)
		if err := s.dealer.sock.Send(zmq4.NewMsgFrom(nil, req[:])); err != nil {
			s.replayFailed("send", err)
			return false
		}
		s.stats.Replays.Add(1)
		outstanding++
		asked = from
		return true
	}
	if !ask(start) {
		return false, 0
	}
	timer := time.NewTimer(s.cfg.ReplayTimeout)
	defer timer.Stop()
	first := true // before the first reply to the first request
	progressed := false
	live := sub.msgs
	for requests := 1; ; {
		select {
		case <-ctx.Done():
			return true, delivered
		case <-timer.C:
			// Replies, or an end marker, were lost on the way.
			s.closeDealer() // a late reply must not answer the next request
			last, ok := s.seq.Last()
			if !progressed || !ok || requests >= maxReplayRequests || (upto != probe && last+1 >= upto) {
				s.replayFailed("wait", errors.New("timed out"))
				return false, delivered
			}
			progressed, outstanding = false, 0
			if !ask(last + 1) {
				return false, delivered
			}
			requests++
			timer.Reset(s.cfg.ReplayTimeout)
		case m, ok := <-live:
			if !ok {
				live = nil // the SUB failed; finish the replay, serve then reconnects
				continue
			}
			if f, ok := s.parseLive(m); ok {
				if len(s.queue) < s.cfg.MaxReplayBuffer {
					s.queue = append(s.queue, f)
				} else {
					s.stats.LiveOverflow.Add(1)
				}
			}
		case m, ok := <-s.dealer.msgs:
			if !ok {
				s.replayFailed("receive", s.dealer.err)
				return false, delivered
			}
			timer.Reset(s.cfg.ReplayTimeout)
			// [empty, seq, payload] or [empty, topic, seq, payload]: the
			// last two frames are always seq and payload.
			n := len(m.Frames)
			if n < 3 || n > 4 || len(m.Frames[0]) != 0 || len(m.Frames[n-2]) != 8 {
				s.stats.Malformed.Add(1)
				continue
			}
			seq := binary.BigEndian.Uint64(m.Frames[n-2])
			if seq == 1<<64-1 { // -1: the end marker of one request
				if outstanding--; outstanding > 0 {
					continue
				}
				if first && upto != probe {
					s.historyMissing(start, upto, h)
				}
				return true, delivered
			}
			if first {
				if seq < start {
					continue // a late reply to an earlier replay
				}
				first = false
				if seq > start {
					s.historyMissing(start, min(seq, upto), h)
				}
			}
			last, ok := s.seq.Last()
			switch {
			case ok && seq <= last:
				s.stats.Duplicates.Add(1)
				continue
			case ok && seq > last+1:
				// A reply went missing: ask again from the hole, once.
				if asked != last+1 {
					if requests >= maxReplayRequests || !ask(last+1) {
						s.replayFailed("wait", errors.New("too many holes"))
						return false, delivered
					}
					requests++
				}
				continue
			}
			s.seq.applyReplayed(seq, start)
			s.stats.Replayed.Add(1)
			s.stats.Batches.Add(1)
			delivered++
			progressed = true
			h.HandleBatch(seq, m.Frames[n-1])
		}
	}
}

// historyMissing handles a replay that could not go back to start: the
// batches from start to before resume are gone.
func (s *Subscriber) historyMissing(start, resume uint64, h Handler) {
	s.stats.HistoryMissing.Add(1)
	s.stats.Lost.Add(resume - start)
	s.logf("replay buffer no longer holds the gap: history unknown", "endpoint", s.cfg.ReplayEndpoint, "from", start, "resume", resume)
	s.seq.Reset()
	h.HandleReset(ResetHistoryMissing)
}

func (s *Subscriber) replayFailed(step string, err error) {
	s.stats.ReplayFailures.Add(1)
	s.logf("replay failed", "endpoint", s.cfg.ReplayEndpoint, "step", step, "err", err)
	s.closeDealer() // a late reply must not answer the next request
}

func (s *Subscriber) closeDealer() {
	if s.dealer != nil {
		s.dealer.close()
		s.dealer = nil
	}
}

func (s *Subscriber) logf(msg string, args ...any) {
	if n, ok := s.warn.Allow(time.Now()); ok {
		if n > 0 {
			args = append(args, "suppressed", n)
		}
		s.cfg.Logger.Warn("kvpipe/wire: "+msg, args...)
	}
}
