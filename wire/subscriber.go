package wire

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/internal/zmtp"
	"github.com/kvpipe/kvpipe/internal/zsock"
)

// Config configures the Subscriber of one worker.
type Config struct {
	Endpoint       string // the engine's PUB, e.g. tcp://10.0.0.5:5557
	ReplayEndpoint string // the engine's ROUTER replay socket; "" when it has none
	// SnapshotEndpoint is the engine's snapshot ROUTER (SGLang's
	// snapshot_endpoint); "" when it has none. After a reset within one
	// incarnation a SnapshotHandler is rebuilt from it.
	SnapshotEndpoint string
	Topic            string // ZMQ prefix match; the engines' default is ""
	// Logger receives rate-limited warnings; nil discards them.
	Logger *slog.Logger
	Options
}

// Options tune a Subscriber; the zero value holds the defaults. They are
// apart from Config so that one Options can serve every worker.
type Options struct {
	// IdleTimeout rebuilds the SUB socket after this long without a message,
	// since a peer that vanished without closing its TCP connection is
	// otherwise never noticed. 0 means 30s; negative disables it.
	IdleTimeout time.Duration
	// ReconnectMin and ReconnectMax bound the jittered exponential backoff
	// between dial attempts (defaults 50ms and 5s).
	ReconnectMin, ReconnectMax time.Duration
	// ReplayTimeout bounds the wait for the first reply to a replay request
	// (default 2s); once replies flow, a pause of an eighth of it (at least
	// 50ms) means the rest was dropped, and the replay asks again from there.
	ReplayTimeout time.Duration
	// ReplayPatience is how long a failing replay is retried, with backoff,
	// before its gap counts as lost or a reconnect's history is reset
	// (default 10s): about the time an engine takes to turn over its replay
	// buffer. Negative: one attempt.
	ReplayPatience time.Duration
	// TailCheck asks the replay endpoint for anything after the last batch
	// once the stream has been quiet this long (default 1s; negative
	// disables it). A PUB that drops the last batches of a burst shows no
	// gap until the next burst; this recovers them without waiting.
	TailCheck time.Duration
	// MaxReplayBuffer bounds the live batches held while a replay runs
	// (default 10,000, vLLM's replay buffer). Past it, live batches are
	// dropped and counted (LiveOverflow); they then show as a gap, replayed
	// in turn while the engine's buffer still holds them.
	MaxReplayBuffer int
	// MaxMessage bounds one message from the engine, checked before zmq4
	// allocates it (default 64 MiB, far above the largest real batch); a
	// peer that sends more, or breaks ZMTP, loses its connection and is
	// counted in ProtocolErrors.
	MaxMessage int64
	// HandshakeTimeout bounds the ZMTP handshake of each connection
	// (default 5s): a port that accepts and never speaks costs no more.
	HandshakeTimeout time.Duration
}

func (c *Options) setDefaults() {
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
	if c.ReplayPatience == 0 {
		c.ReplayPatience = 10 * time.Second
	}
	if c.TailCheck == 0 {
		c.TailCheck = time.Second
	}
	if c.MaxReplayBuffer <= 0 {
		c.MaxReplayBuffer = 10_000
	}
}

// ResetReason says why a worker's history can no longer be trusted.
type ResetReason uint8

const (
	ResetRestart        ResetReason = iota // another publisher incarnation: its hashes may differ
	ResetHistoryMissing                    // the replay buffer no longer had the lost batches
	ResetGapLost                           // a gap with no replay endpoint, or one unreachable past ReplayPatience
	ResetUnproven                          // a reconnect whose continuity could not be proven
)

func (r ResetReason) String() string {
	return [...]string{"restart", "history_missing", "gap_lost", "unproven"}[r]
}

// SameIncarnation reports whether the publisher that follows the reset is
// known to be the one before it, so that its block hashes keep their meaning.
func (r ResetReason) SameIncarnation() bool {
	return r == ResetHistoryMissing || r == ResetGapLost
}

// Handler receives one worker's stream, in the Subscriber's goroutine.
type Handler interface {
	// HandleBatch gets every batch exactly once, in seq order. The payload
	// is only valid during the call.
	HandleBatch(seq uint64, payload []byte)
	// HandleReset says that batches were lost for good, or that the
	// publisher may be another process: the worker's state must be rebuilt
	// from the batches that follow.
	HandleReset(reason ResetReason)
}

// A ResumeHandler is told when the position a Subscriber was resumed at
// (Resume) is proven: the engine is the incarnation that sent that batch,
// and what followed it is replayed or on its way. Until then, or until a
// reset says it is not, state restored with the position is unproven.
type ResumeHandler interface {
	Handler
	HandleResumed()
}

// Stats is a snapshot of what one Subscriber saw.
type Stats struct {
	Batches           uint64 // delivered to the handler, live or replayed
	Malformed         uint64 // wrong frame count or seq width, or a seq the engine's buffer contradicts: skipped
	Duplicates        uint64 // seq already applied: dropped
	Gaps              uint64 // seq > last+1 seen live
	Replays           uint64 // replay requests sent
	Replayed          uint64 // batches recovered through replay
	TailChecks        uint64 // replays asked after a quiet spell, gap or not
	ReplayFailures    uint64 // requests that timed out or broke after connecting
	ReplayUnreachable uint64 // replay dials that failed
	HistoryMissing    uint64 // replays that found the engine no longer had a gap
	Lost              uint64 // batches the publisher sent that were never delivered
	LiveOverflow      uint64 // live batches dropped while a replay ran (replayed later)
	Snapshots         uint64 // engine snapshots applied after a reset
	SnapshotFailures  uint64 // snapshots refused, broken off or unreachable
	Restarts          uint64 // another publisher incarnation detected
	Reconnects        uint64 // SUB sockets rebuilt after a failure or idle
	// ProtocolErrors counts connections closed because the peer broke ZMTP
	// or the message limit, by kind (ProtocolErrorKinds).
	ProtocolErrors [NumProtocolErrors]uint64
	Connected      bool // a SUB connection is up (Add leaves it alone)
}

// Add adds o's counts to s, as when summing workers.
func (s *Stats) Add(o Stats) {
	s.Batches += o.Batches
	s.Malformed += o.Malformed
	s.Duplicates += o.Duplicates
	s.Gaps += o.Gaps
	s.Replays += o.Replays
	s.Replayed += o.Replayed
	s.TailChecks += o.TailChecks
	s.ReplayFailures += o.ReplayFailures
	s.ReplayUnreachable += o.ReplayUnreachable
	s.HistoryMissing += o.HistoryMissing
	s.Lost += o.Lost
	s.LiveOverflow += o.LiveOverflow
	s.Snapshots += o.Snapshots
	s.SnapshotFailures += o.SnapshotFailures
	s.Restarts += o.Restarts
	s.Reconnects += o.Reconnects
	for i := range s.ProtocolErrors {
		s.ProtocolErrors[i] += o.ProtocolErrors[i]
	}
}

// counters are the live Stats: written by the Subscriber's goroutines,
// read by Stats from any goroutine.
type counters struct {
	Batches, Malformed, Duplicates, Gaps          atomic.Uint64
	Replays, Replayed, TailChecks, ReplayFailures atomic.Uint64
	ReplayUnreachable, HistoryMissing, Lost       atomic.Uint64
	LiveOverflow, Snapshots, SnapshotFailures     atomic.Uint64
	Restarts, Reconnects                          atomic.Uint64
	ProtocolErrors                                [NumProtocolErrors]atomic.Uint64
	Connected                                     atomic.Bool
}

func (c *counters) load() Stats {
	st := Stats{
		Batches: c.Batches.Load(), Malformed: c.Malformed.Load(), Duplicates: c.Duplicates.Load(), Gaps: c.Gaps.Load(),
		Replays: c.Replays.Load(), Replayed: c.Replayed.Load(), TailChecks: c.TailChecks.Load(), ReplayFailures: c.ReplayFailures.Load(),
		ReplayUnreachable: c.ReplayUnreachable.Load(), HistoryMissing: c.HistoryMissing.Load(), Lost: c.Lost.Load(),
		LiveOverflow: c.LiveOverflow.Load(), Snapshots: c.Snapshots.Load(), SnapshotFailures: c.SnapshotFailures.Load(),
		Restarts: c.Restarts.Load(), Reconnects: c.Reconnects.Load(), Connected: c.Connected.Load(),
	}
	for i := range c.ProtocolErrors {
		st.ProtocolErrors[i] = c.ProtocolErrors[i].Load()
	}
	return st
}

// Subscriber receives one worker's batches. Run it in the goroutine that owns
// the worker's state: the handler is called there.
type Subscriber struct {
	cfg   Config
	stats counters
	warn  pace.Limiter

	seq SeqTracker
	// continuous: the last batch applied came while the current SUB
	// connection was up, so the engine cannot have restarted since.
	continuous bool
	dealer     *zsock.Receiver // replay socket, dialled on the first replay
	queue      []frame         // live batches held while a replay runs
	// replayDown: the replay endpoint is unreachable; warned once per outage.
	// patienceSpent: a replay already waited ReplayPatience for it.
	replayDown, patienceSpent bool
	// epoch is the publisher lifecycle the live topic names (SGLang); a new
	// one is a restart, known without a round trip.
	epoch []byte
	// needSnapshot: a reset within one incarnation wants the engine's snapshot.
	needSnapshot bool
	// staleSub: a replay found the engine restarted while the SUB still
	// carried the old incarnation's stream: serve must reconnect.
	staleSub bool
	// dropped counts the times the held live batches were thrown away.
	dropped uint64
	// calls are functions to run in Run's goroutine between batches
	// (Checkpoint).
	calls chan func(Position)
	// resumed: placed by Resume, not yet proven nor reset.
	resumed bool
}

// Position is where a worker's stream stands: the last batch applied and
// the fingerprint that proves it, as a snapshot records it.
type Position struct {
	Seq, Fingerprint uint64
	// Known: there is a last batch, and its fingerprint is known (not
	// right after an engine snapshot, which places the stream at a seq
	// whose batch it did not see).
	Known bool
}

type frame struct {
	seq     uint64
	payload []byte
	epoch   []byte // from the topic frame; nil when the engine sends none
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
	if cfg.SnapshotEndpoint != "" {
		if err := ValidateEndpoint(cfg.SnapshotEndpoint); err != nil {
			return nil, fmt.Errorf("snapshot %w", err)
		}
	}
	cfg.setDefaults()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Subscriber{cfg: cfg, warn: pace.Limiter{Every: time.Second}, calls: make(chan func(Position))}, nil
}

// Resume places the stream after the batch seq whose payload has
// fingerprint fp, as restored from a snapshot; call it before Run. The
// first connection must then prove through the replay endpoint that the
// engine is the incarnation that sent that batch, and replays what came
// after it; else the handler gets a reset, as on any reconnect that cannot
// be proven.
func (s *Subscriber) Resume(seq, fp uint64) {
	s.seq = SeqTracker{last: seq, fp: fp, fpKnown: true, dupFloor: seq, started: true}
	s.resumed = true
}

// Checkpoint runs f in Run's goroutine between two handler calls, with the
// stream's position, so that f sees the handler's state and the position
// agree. It waits while Run is not running or is in the middle of a replay,
// and returns ctx's error if f has not run when ctx ends.
func (s *Subscriber) Checkpoint(ctx context.Context, f func(Position)) error {
	done := make(chan struct{})
	call := func(pos Position) { defer close(done); f(pos) }
	select {
	case s.calls <- call:
	case <-ctx.Done():
		return ctx.Err()
	}
	<-done // it runs now; a handler call cannot be under way
	return nil
}

func (s *Subscriber) position() Position {
	seq, ok := s.seq.Last()
	return Position{Seq: seq, Fingerprint: s.seq.fp, Known: ok && s.seq.fpKnown}
}

// sleep is pace.Sleep that serves Checkpoint calls meanwhile.
func (s *Subscriber) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		case call := <-s.calls:
			call(s.position())
		}
	}
}

func (s *Subscriber) guard() guard {
	return guard{limits: zmtp.Limits{MaxMessage: s.cfg.MaxMessage, HandshakeTimeout: s.cfg.HandshakeTimeout}, errors: &s.stats.ProtocolErrors}
}

// Stats returns a snapshot of the Subscriber's counters; any goroutine may call it.
func (s *Subscriber) Stats() Stats { return s.stats.load() }

// liveDepth is how many received messages may wait for the handler; past it
// the socket stops reading and the loss surfaces upstream as a seq gap.
const liveDepth = 1024

// implausibleGap: a live seq this far past the last is garbage or another
// incarnation, never that many lost batches. No engine reaches
// implausibleSeq either (a million batches a second for 290,000 years).
const (
	implausibleGap = 1 << 32
	implausibleSeq = 1 << 63
)

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
			if !s.sleep(ctx, backoff.Next()) {
				return ctx.Err()
			}
			continue
		}
		if connectedBefore {
			s.stats.Reconnects.Add(1)
		}
		connectedBefore = true
		before := s.stats.Batches.Load()
		err = s.serve(ctx, sub, h)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		s.logf("subscription lost, reconnecting", "endpoint", s.cfg.Endpoint, "err", err)
		if s.stats.Batches.Load() != before {
			backoff.Reset() // it worked for a while; a peer that only breaks keeps backing off
		}
		if !s.sleep(ctx, backoff.Next()) {
			return ctx.Err()
		}
	}
}

func (s *Subscriber) connect(ctx context.Context) (*zsock.Receiver, error) {
	sock, err := dial(ctx, zmq4.Sub, s.cfg.Endpoint, s.guard())
	if err != nil {
		return nil, err
	}
	if err := sock.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		sock.Close()
		return nil, err
	}
	return zsock.Start(sock, liveDepth), nil
}

var (
	errIdle  = errors.New("no message within the idle timeout")
	errStale = errors.New("the publisher restarted under the subscription")
)

// serve handles one socket's messages until it fails, idles out or ctx
// ends, and closes it, also when the handler panics.
func (s *Subscriber) serve(ctx context.Context, sub *zsock.Receiver, h Handler) error {
	s.stats.Connected.Store(true)
	s.continuous = false
	defer func() {
		s.stats.Connected.Store(false)
		s.staleSub = false
		sub.Close()
		s.dropQueue()
	}()
	// A new connection may reach another incarnation of the engine: prove
	// continuity through the replay endpoint (which also replays what the
	// engine sent meanwhile, or a new incarnation from its first batch), or,
	// without one, start afresh.
	if s.cfg.ReplayEndpoint != "" {
		why := forTail // no history: the engine's buffer is a head start, not owed
		if _, ok := s.seq.Last(); ok {
			why = forProof
		}
		ok := s.catchUp(ctx, sub, h, why, probe)
		if ok && s.resumed { // proven: a failed proof resets
			s.resumed = false
			if r, ok := h.(ResumeHandler); ok {
				r.HandleResumed()
			}
		}
		if err := s.settled(ctx, ok && s.drain(ctx, sub, h)); err != nil {
			return err
		}
	} else if _, ok := s.seq.Last(); ok {
		s.reset(h, ResetUnproven)
	}
	var idle <-chan time.Time
	var timer *time.Timer
	if s.cfg.IdleTimeout > 0 {
		timer = time.NewTimer(s.cfg.IdleTimeout)
		defer timer.Stop()
		idle = timer.C
	}
	// The tail check runs once per quiet spell, and only with a replay
	// endpoint; while that endpoint fails, it backs off.
	tailing := s.cfg.ReplayEndpoint != "" && s.cfg.TailCheck > 0
	tail := time.NewTimer(s.cfg.TailCheck)
	defer tail.Stop()
	if !tailing {
		tail.Stop()
	}
	tailBackoff := pace.Backoff{Min: s.cfg.TailCheck, Max: max(s.cfg.ReconnectMax, s.cfg.TailCheck)}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case call := <-s.calls:
			call(s.position())
		case <-idle:
			return errIdle
		case <-tail.C:
			if _, ok := s.seq.Last(); !ok {
				continue
			}
			s.stats.TailChecks.Add(1)
			before := s.stats.Replayed.Load()
			failures := s.failures()
			if err := s.settled(ctx, s.catchUp(ctx, sub, h, forTail, probe) && s.drain(ctx, sub, h)); err != nil {
				return err
			}
			switch {
			case s.failures() != failures:
				tail.Reset(tailBackoff.Next())
			case s.stats.Replayed.Load() != before:
				tailBackoff.Reset()
				tail.Reset(s.cfg.TailCheck) // more may be there: look again
			default:
				tailBackoff.Reset()
			}
		case m, ok := <-sub.Msgs:
			if !ok {
				return sub.Err()
			}
			if timer != nil {
				timer.Reset(s.cfg.IdleTimeout)
			}
			if tailing {
				tail.Reset(s.cfg.TailCheck)
			}
			if f, ok := s.parseLive(m); ok {
				s.queue = append(s.queue, f)
				if err := s.settled(ctx, s.drain(ctx, sub, h)); err != nil {
					return err
				}
			}
		}
	}
}

// settled turns how catchUp and drain ended into serve's answer: ctx's
// error when it ended, errStale when the SUB must be rebuilt, nil to go on.
func (s *Subscriber) settled(ctx context.Context, ok bool) error {
	switch {
	case !ok:
		return ctx.Err()
	case s.staleSub:
		return errStale
	}
	return nil
}

func (s *Subscriber) failures() uint64 {
	return s.stats.ReplayFailures.Load() + s.stats.ReplayUnreachable.Load()
}

// parseLive checks the [topic, seq, payload] shape.
func (s *Subscriber) parseLive(m zmq4.Msg) (frame, bool) {
	if len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
		s.stats.Malformed.Add(1)
		s.logf("malformed message skipped", "frames", len(m.Frames), "seq_bytes", seqWidth(m))
		return frame{}, false
	}
	_, epoch, _ := codec.SplitTopic(m.Frames[0])
	return frame{seq: binary.BigEndian.Uint64(m.Frames[1]), payload: m.Frames[2], epoch: epoch}, true
}

func seqWidth(m zmq4.Msg) int {
	if len(m.Frames) < 2 {
		return 0
	}
	return len(m.Frames[1])
}

// drain applies the live batches in s.queue, and every live batch a replay
// they set off held back. It returns false when ctx ended.
func (s *Subscriber) drain(ctx context.Context, sub *zsock.Receiver, h Handler) bool {
	for i := 0; i < len(s.queue); i++ { // a replay appends what it held back
		if s.needSnapshot { // the snapshot takes over from the batches still held
			n := copy(s.queue, s.queue[i:])
			clear(s.queue[n:])
			s.queue, i = s.queue[:n], 0
			if !s.takeSnapshot(ctx, sub, h) {
				return false
			}
			if len(s.queue) == 0 {
				break
			}
		}
		f := s.queue[i]
		if len(f.epoch) > 0 {
			if len(s.epoch) > 0 && !bytes.Equal(f.epoch, s.epoch) {
				s.stats.Restarts.Add(1)
				s.logf("publisher restarted: new epoch", "endpoint", s.cfg.Endpoint, "epoch", string(f.epoch))
				s.reset(h, ResetRestart)
				// The new incarnation from its first batch, before this one.
				dropped := s.dropped
				if s.cfg.ReplayEndpoint != "" && !s.catchUp(ctx, sub, h, forTail, probe) {
					return false
				}
				if s.dropped != dropped {
					i = -1
					continue
				}
			}
			s.epoch = append(s.epoch[:0], f.epoch...)
		}
		outcome := s.seq.Classify(f.seq)
		if outcome == First && f.seq > 0 && s.cfg.ReplayEndpoint != "" {
			// The stream starts past 0: the engine's buffer may hold what
			// the PUB sent before the subscription took hold.
			if !s.catchUp(ctx, sub, h, forTail, f.seq) {
				return false
			}
			outcome = s.seq.Classify(f.seq)
		}
		switch outcome {
		case First, InOrder:
			s.deliver(f, h)
			continue
		case Duplicate:
			if f.seq == s.seq.last {
				s.seq.learn(f.payload) // the barrier a snapshot anchored at
			}
			s.stats.Duplicates.Add(1)
			continue
		}
		plausible := outcome == Gap && f.seq-s.seq.last <= implausibleGap
		if outcome == Gap {
			s.stats.Gaps.Add(1)
		}
		if s.cfg.ReplayEndpoint == "" {
			if plausible {
				s.lose(f.seq-s.seq.last-1, h, ResetGapLost)
			} else {
				s.stats.Restarts.Add(1)
				s.logf("publisher restarted: history unknown", "endpoint", s.cfg.Endpoint, "last", s.seq.last, "seq", f.seq)
				s.reset(h, ResetRestart)
			}
			s.deliver(f, h)
			continue
		}
		// The replay endpoint decides: it fills the gap, or shows another
		// incarnation, or that the seq is garbage.
		why, upto := forProof, uint64(probe)
		if plausible {
			why, upto = forGap, f.seq
		}
		dropped := s.dropped
		if !s.catchUp(ctx, sub, h, why, upto) {
			return false
		}
		if s.dropped != dropped { // f was the old incarnation's, with the rest held
			i = -1
			continue
		}
		switch s.seq.Classify(f.seq) {
		case First, InOrder:
			s.deliver(f, h)
		case Duplicate, Restart: // replayed, or behind a stream the engine vouches for
			s.stats.Duplicates.Add(1)
		case Gap:
			s.stats.Malformed.Add(1)
			s.logf("seq contradicts the engine's replay buffer: skipped", "endpoint", s.cfg.Endpoint, "last", s.seq.last, "seq", f.seq)
		}
	}
	clear(s.queue) // drop payload references
	s.queue = s.queue[:0]
	if s.needSnapshot {
		// What the snapshot held back comes after its barrier: apply it now.
		return s.takeSnapshot(ctx, sub, h) && (len(s.queue) == 0 || s.drain(ctx, sub, h))
	}
	return true
}

// takeSnapshot rebuilds the worker from the engine's snapshot when both
// sides can; it returns false only when ctx ended.
func (s *Subscriber) takeSnapshot(ctx context.Context, sub *zsock.Receiver, h Handler) bool {
	s.needSnapshot = false
	if sh, ok := h.(SnapshotHandler); ok {
		return s.snapshot(ctx, sub, sh)
	}
	return true
}

func (s *Subscriber) deliver(f frame, h Handler) {
	s.seq.Apply(f.seq, f.payload)
	s.stats.Batches.Add(1)
	s.continuous = true
	h.HandleBatch(f.seq, f.payload)
}

// lose counts n batches gone for good and resets the worker's history.
func (s *Subscriber) lose(n uint64, h Handler, why ResetReason) {
	s.stats.Lost.Add(n)
	s.logf("batches lost: history unknown", "endpoint", s.cfg.Endpoint, "after", s.seq.last, "lost", n, "reason", why.String())
	s.reset(h, why)
}

func (s *Subscriber) reset(h Handler, why ResetReason) {
	s.seq.Reset()
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

// purpose says why a replay runs, which decides what its failure costs.
type purpose uint8

const (
	forTail  purpose = iota // a quiet spell: nothing known missing, one attempt
	forGap                  // a live gap: retried, then lost
	forProof                // a reconnect or an implausible seq: retried, then unproven
)

// catchUp runs one replay to its end: it proves that the engine is the
// incarnation the history came from, then delivers everything the engine
// holds past the last applied batch (upto is the live seq that showed a gap,
// or probe), holding live batches back in s.queue meanwhile. Every request
// after the first goes out on a new connection, so no late reply to an
// earlier one can crowd it. It returns false only when ctx ended:
// cancellation costs nothing.
func (s *Subscriber) catchUp(ctx context.Context, sub *zsock.Receiver, h Handler, why purpose, upto uint64) bool {
	if s.dealer != nil && s.dealer.Dead() {
		s.closeDealer() // the engine's ROUTER went away since the last replay
	}
	var r replayState
	r.begin(&s.seq, upto, s.continuous)
	stall := max(s.cfg.ReplayTimeout/8, 50*time.Millisecond)
	timer := time.NewTimer(s.cfg.ReplayTimeout)
	defer timer.Stop()
	retry := pace.Backoff{Min: s.cfg.ReconnectMin, Max: s.cfg.ReconnectMax}
	var failingSince time.Time
	var live <-chan zmq4.Msg = sub.Msgs
	for askNow, recheck := true, false; ; {
		if askNow {
			askNow = false
			if !s.request(ctx, r.ask(recheck)) {
				if !s.retry(ctx, &live, &retry, &failingSince, why) {
					return ctx.Err() == nil && s.giveUp(h, why, &r)
				}
				askNow, recheck = true, false
				continue
			}
			timer.Reset(s.cfg.ReplayTimeout)
		}
		var st step
		select {
		case <-ctx.Done():
			return false
		case <-timer.C:
			if st = r.timeout(); st.v == vFail {
				s.replayFailed("wait", errors.New("timed out"))
			}
		case m, ok := <-live:
			if !ok {
				live = nil // the SUB failed; finish the replay, serve then reconnects
			} else {
				s.hold(m)
			}
			continue
		case m, ok := <-s.dealer.Msgs:
			if !ok {
				if ctx.Err() != nil {
					return false // the socket closed because ctx ended
				}
				if st = r.timeout(); st.v == vFail {
					s.replayFailed("receive", s.dealer.Err())
				}
				break
			}
			moves := r.moves
			// Only a proof or a delivery keeps the replay alive: a peer that
			// streams junk or duplicates runs into the stall timeout.
			seq, payload, ok := parseReply(m)
			if !ok {
				s.stats.Malformed.Add(1)
				continue
			}
			if seq == endMarker {
				if st = r.end(); st.v == vMissing {
					s.missing(st, r.upto-st.lost, r.upto, h)
					st.v = vDone
				}
			} else {
				st = r.reply(seq, payload)
			}
			if r.moves != moves {
				timer.Reset(stall)
			}
			switch st.v {
			case vMissing:
				s.missing(st, seq-st.lost, seq, h)
				fallthrough
			case vDeliver:
				s.stats.Replayed.Add(1)
				s.stats.Batches.Add(1)
				failingSince = time.Time{}
				h.HandleBatch(seq, payload)
				continue
			case vDup:
				s.stats.Duplicates.Add(1)
				continue
			case vSkip:
				continue
			}
		}
		switch st.v {
		case vAsk: // replies were dropped: ask from the hole
			s.closeDealer()
			askNow, recheck = true, true
		case vRestart:
			s.closeDealer()
			if s.continuous || live == nil || sub.Dead() {
				// The SUB carried the old incarnation: what it holds and
				// brings is the dead engine's. Serve reconnects after this.
				s.dropQueue()
				s.staleSub, live = live != nil, nil
			}
			s.stats.Restarts.Add(1)
			s.logf("publisher restarted: replaying the new one from its start", "endpoint", s.cfg.ReplayEndpoint, "last", s.seq.last)
			s.notifyReset(h, ResetRestart)
			r.restarted()
			askNow, recheck = true, false
		case vDone:
			s.continuous = live != nil // what the replay delivered is vouched for by the live connection
			s.patienceSpent = false
			if s.replayDown {
				s.replayDown = false
				s.cfg.Logger.Info("kvpipe/wire: replay endpoint reachable again", "endpoint", s.cfg.ReplayEndpoint)
			}
			return true
		case vFail:
			s.closeDealer()
			if !s.retry(ctx, &live, &retry, &failingSince, why) {
				return ctx.Err() == nil && s.giveUp(h, why, &r)
			}
			askNow, recheck = true, false
		}
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

// request sends a replay request for every batch from start on, dialling
// the replay socket first if needed. It reports whether the request went out.
func (s *Subscriber) request(ctx context.Context, start uint64) bool {
	if s.dealer == nil {
		sock, err := dial(ctx, zmq4.Dealer, s.cfg.ReplayEndpoint, s.guard())
		if err != nil {
			if ctx.Err() == nil {
				s.stats.ReplayUnreachable.Add(1)
				if !s.replayDown {
					s.replayDown = true
					s.cfg.Logger.Warn("kvpipe/wire: replay endpoint unreachable; backing off", "endpoint", s.cfg.ReplayEndpoint, "err", err)
				}
			}
			return false
		}
		s.dealer = zsock.Start(sock, liveDepth)
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], start)
	if err := s.dealer.Sock.Send(zmq4.NewMsgFrom(nil, req[:])); err != nil {
		if ctx.Err() == nil {
			s.replayFailed("send", err)
		}
		s.closeDealer()
		return false
	}
	s.stats.Replays.Add(1)
	return true
}

// retry waits out the backoff before a failed replay is sent again, holding
// live batches meanwhile. It reports false when the replay should give up:
// ctx ended, or the failures have lasted past the purpose's patience.
func (s *Subscriber) retry(ctx context.Context, live *<-chan zmq4.Msg, b *pace.Backoff, since *time.Time, why purpose) bool {
	now := time.Now()
	if since.IsZero() {
		*since = now
	}
	// A tail check makes one attempt, and so does any replay once this
	// outage has had its patience: a dead endpoint must not hold up every gap.
	if why == forTail || s.patienceSpent || s.cfg.ReplayPatience < 0 {
		return false
	}
	if now.Sub(*since) >= s.cfg.ReplayPatience {
		s.patienceSpent = true
		return false
	}
	wait := time.NewTimer(b.Next())
	defer wait.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-wait.C:
			return true
		case m, ok := <-*live:
			if !ok {
				*live = nil
				continue
			}
			s.hold(m)
		}
	}
}

// giveUp settles a replay that could not be made: a known gap is lost, an
// unproven history is reset, a tail check just ends. It returns true.
func (s *Subscriber) giveUp(h Handler, why purpose, r *replayState) bool {
	_, started := s.seq.Last()
	switch {
	case r.unfilled() > 0:
		s.lose(r.unfilled(), h, ResetGapLost)
	case why == forProof && started && !r.proven:
		s.logf("continuity not proven: history unknown", "endpoint", s.cfg.ReplayEndpoint)
		s.reset(h, ResetUnproven)
	}
	return true
}

// missing settles batches from..to-1 that the engine no longer holds.
func (s *Subscriber) missing(st step, from, to uint64, h Handler) {
	if st.lost == 0 && !st.reset {
		return // no history to miss: a router that joined late
	}
	s.stats.HistoryMissing.Add(1)
	s.stats.Lost.Add(st.lost)
	s.logf("replay buffer no longer holds the gap: history unknown", "endpoint", s.cfg.ReplayEndpoint, "from", from, "to", to, "lost", st.lost)
	if st.reset {
		s.notifyReset(h, ResetHistoryMissing)
	}
}

// dropQueue throws the held live batches away.
func (s *Subscriber) dropQueue() {
	clear(s.queue) // drop payload references
	s.queue = s.queue[:0]
	s.dropped++
}

// hold keeps a live message that arrived during a replay for drain.
func (s *Subscriber) hold(m zmq4.Msg) {
	f, ok := s.parseLive(m)
	if !ok {
		return
	}
	if len(s.queue) >= s.cfg.MaxReplayBuffer {
		s.stats.LiveOverflow.Add(1)
		return
	}
	s.queue = append(s.queue, f)
}

func (s *Subscriber) replayFailed(step string, err error) {
	s.stats.ReplayFailures.Add(1)
	s.logf("replay failed", "endpoint", s.cfg.ReplayEndpoint, "step", step, "err", err)
	s.closeDealer() // a late reply must not answer the next request
}

func (s *Subscriber) closeDealer() {
	if s.dealer != nil {
		s.dealer.Close()
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
