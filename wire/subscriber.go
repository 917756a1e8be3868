package wire

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/internal/conf"
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
	// incarnation the Handler is rebuilt from it.
	SnapshotEndpoint string
	Topic            string // ZMQ prefix match; the engines' default is ""
	// Logger receives rate-limited warnings; nil discards them.
	Logger *slog.Logger
	Options
}

// Options tune a Subscriber; the zero value holds the defaults (kvpipe's
// defaulting rule: package kvpipe's doc). They are apart from Config so
// that one Options can serve every worker.
type Options struct {
	// IdleTimeout checks the engine after this long without a message,
	// since a peer that vanished without closing its TCP connection is
	// otherwise never noticed: with a replay endpoint and a history, a
	// replay that proves the last batch and finds nothing after it shows a
	// live, quiet engine, and the SUB is kept; otherwise (and without a
	// replay endpoint) the SUB is rebuilt. 0 means 30s; negative disables it.
	IdleTimeout time.Duration
	// ReconnectMin and ReconnectMax bound the jittered exponential backoff
	// between dial attempts (defaults 50ms and 5s).
	ReconnectMin, ReconnectMax time.Duration
	// ReplayTimeout bounds the wait for the first reply to a replay request
	// (default 2s); once replies flow, a pause of an eighth of it (at least
	// 50ms) means the rest was dropped, and the replay asks again from there.
	// It also bounds the wait for each reply of an engine snapshot, and,
	// ten times over and a second per 100,000 records its header announces,
	// the whole snapshot after its header (snapshotBudget).
	ReplayTimeout time.Duration
	// ReplayPatience is how long a failing replay is retried, with backoff,
	// before its gap counts as lost or a reconnect's history is reset
	// (default 10s): about the time an engine takes to turn over its replay
	// buffer. Negative: one attempt. A replay endpoint that answers
	// garbage, or (for a gap) does not complete its ZMTP handshake within
	// a second, gets no patience: its replay is given up at once
	// (ReplayAbandoned).
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

// setDefaults applies kvpipe's defaulting rule (package kvpipe's doc).
func (c *Options) setDefaults() error {
	if c.ReconnectMin < 0 || c.ReconnectMax < 0 || c.ReplayTimeout < 0 || c.MaxReplayBuffer < 0 || c.MaxMessage < 0 || c.HandshakeTimeout < 0 {
		return errors.New("ReconnectMin, ReconnectMax, ReplayTimeout, MaxReplayBuffer, MaxMessage and HandshakeTimeout must not be negative")
	}
	c.IdleTimeout = conf.Or(c.IdleTimeout, 30*time.Second)
	c.ReconnectMin, c.ReconnectMax = conf.Bounds(c.ReconnectMin, c.ReconnectMax, 50*time.Millisecond, 5*time.Second)
	c.ReplayTimeout = conf.Or(c.ReplayTimeout, 2*time.Second)
	c.ReplayPatience = conf.Or(c.ReplayPatience, 10*time.Second)
	c.TailCheck = conf.Or(c.TailCheck, time.Second)
	c.MaxReplayBuffer = conf.Or(c.MaxReplayBuffer, 10_000)
	return nil
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

// Handler receives one worker's stream, in the Subscriber's goroutine. It
// is one interface: a wrapper that embeds a Handler passes every call on.
type Handler interface {
	// HandleBatch gets every batch exactly once, in seq order. The payload
	// is only valid during the call.
	HandleBatch(seq uint64, payload []byte)
	// HandleReset says that batches were lost for good, or that the
	// publisher may be another process: the worker's state must be rebuilt
	// from the batches that follow.
	HandleReset(reason ResetReason)
	// HandleResumed says that the position the Subscriber was resumed at
	// (Resume) is proven: the engine is the incarnation that sent that
	// batch, and what followed it is replayed or on its way. Until then, or
	// until a reset says it is not, state restored with it is unproven.
	HandleResumed()
	// HandleEngineSnapshotBegin, HandleEngineSnapshot and
	// HandleEngineSnapshotEnd rebuild the worker from its engine's snapshot
	// (SGLang's snapshot-v1), which the Subscriber fetches after a reset
	// within one incarnation when it has a SnapshotEndpoint: Begin (drop the
	// worker's entries, keep what is known of its blocks), each chunk's
	// payload in order (a msgpack list of [parent_hash, [block_hashes]]
	// records), then End. With ok the worker is the engine's state as of
	// the snapshot's barrier, and the batches that follow come after it;
	// without, the snapshot broke off and its entries must go again.
	HandleEngineSnapshotBegin()
	HandleEngineSnapshot(chunk []byte)
	HandleEngineSnapshotEnd(ok bool)
	// HandleIdle is called when no live batch waits: a handler that held
	// work back (an actor whose shard had no room) hands it on now, and one
	// that keeps spare memory may give it back. It reports whether some
	// work is still held or memory still to give back; it is then called
	// again after a short wait, backing off to a second, while the
	// connection lasts, and before each reconnect attempt while it is down.
	HandleIdle() (held bool)
}

// Stats are what one Subscriber saw, as of one call of Stats.
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
	// ReplayAbandoned counts replays given up at once, without
	// ReplayPatience: the endpoint answered garbage, or did not complete
	// its ZMTP handshake after a gap.
	ReplayAbandoned  uint64
	HistoryMissing   uint64 // replays that found the engine no longer had a gap
	Lost             uint64 // batches the publisher sent that were never delivered
	LiveOverflow     uint64 // live batches dropped while a replay ran (replayed later)
	Snapshots        uint64 // engine snapshots applied after a reset
	SnapshotFailures uint64 // snapshots refused, broken off or unreachable
	Restarts         uint64 // another publisher incarnation detected
	Reconnects       uint64 // SUB sockets rebuilt after a failure or idle
	// ProtocolErrors counts connections closed because the peer broke ZMTP
	// or the message limit, by kind: ProtocolErrors[k] counts the kind
	// ProtocolErrorKinds[k] names.
	ProtocolErrors [numProtocolErrors]uint64
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
	s.ReplayAbandoned += o.ReplayAbandoned
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
	ReplayAbandoned                               atomic.Uint64
	LiveOverflow, Snapshots, SnapshotFailures     atomic.Uint64
	Restarts, Reconnects                          atomic.Uint64
	ProtocolErrors                                [numProtocolErrors]atomic.Uint64
	Connected                                     atomic.Bool
}

func (c *counters) load() Stats {
	st := Stats{
		Batches: c.Batches.Load(), Malformed: c.Malformed.Load(), Duplicates: c.Duplicates.Load(), Gaps: c.Gaps.Load(),
		Replays: c.Replays.Load(), Replayed: c.Replayed.Load(), TailChecks: c.TailChecks.Load(), ReplayFailures: c.ReplayFailures.Load(),
		ReplayUnreachable: c.ReplayUnreachable.Load(), ReplayAbandoned: c.ReplayAbandoned.Load(), HistoryMissing: c.HistoryMissing.Load(), Lost: c.Lost.Load(),
		LiveOverflow: c.LiveOverflow.Load(), Snapshots: c.Snapshots.Load(), SnapshotFailures: c.SnapshotFailures.Load(),
		Restarts: c.Restarts.Load(), Reconnects: c.Reconnects.Load(), Connected: c.Connected.Load(),
	}
	for i := range c.ProtocolErrors {
		st.ProtocolErrors[i] = c.ProtocolErrors[i].Load()
	}
	return st
}

// failures counts the replay requests that failed or could not be sent.
func (c *counters) failures() uint64 { return c.ReplayFailures.Load() + c.ReplayUnreachable.Load() }

// Subscriber receives one worker's batches: it is the transport, and Run is
// the worker's loop. Run it in the goroutine that owns the worker's state:
// the handler is called there.
type Subscriber struct {
	cfg   Config
	stats counters
	warn  *pace.Warner

	seq seqTracker
	// continuous: the last batch applied came while the current SUB
	// connection was up, so the engine cannot have restarted since.
	continuous bool
	replay     replayer  // the replay socket and its outages
	live       liveQueue // live batches held while a replay runs
	// epoch is the publisher lifecycle the live topic names (SGLang); a new
	// one is a restart, known without a round trip.
	epoch []byte
	// needSnapshot: a reset within one incarnation wants the engine's snapshot.
	needSnapshot bool
	// staleSub: a replay found the engine restarted while the SUB still
	// carried the old incarnation's stream: serve must reconnect.
	staleSub bool
	// calls are functions to run in Run's goroutine between batches
	// (Checkpoint).
	calls chan func()
	// resumed: placed by Resume, not yet proven nor reset.
	resumed bool
}

// NewSubscriber validates cfg and returns a Subscriber; Run starts it.
func NewSubscriber(cfg Config) (*Subscriber, error) {
	if err := validateEndpoint(cfg.Endpoint); err != nil {
		return nil, err
	}
	if cfg.ReplayEndpoint != "" {
		if err := validateEndpoint(cfg.ReplayEndpoint); err != nil {
			return nil, fmt.Errorf("replay %w", err)
		}
	}
	if cfg.SnapshotEndpoint != "" {
		if err := validateEndpoint(cfg.SnapshotEndpoint); err != nil {
			return nil, fmt.Errorf("snapshot %w", err)
		}
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	cfg.Logger = conf.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	s := &Subscriber{cfg: cfg, warn: pace.NewWarner(cfg.Logger, "kvpipe/wire: "), calls: make(chan func())}
	s.replay = replayer{cfg: &s.cfg, stats: &s.stats, warn: s.warn}
	s.live = liveQueue{max: cfg.MaxReplayBuffer, stats: &s.stats, warn: s.warn}
	return s, nil
}

// Resume places the stream after the batch seq whose payload has
// fingerprint fp, as restored from a snapshot; call it before Run. The
// first connection must then prove through the replay endpoint that the
// engine is the incarnation that sent that batch, and replays what came
// after it; else the handler gets a reset, as on any reconnect that cannot
// be proven.
func (s *Subscriber) Resume(seq, fp uint64) {
	s.seq = seqTracker{last: seq, fp: fp, fpKnown: true, dupFloor: seq, started: true}
	s.resumed = true
}

// Checkpoint runs f in Run's goroutine between two handler calls, where
// the handler's state and the stream's Position agree: while Run waits for
// a live batch, a dial, a backoff, a replay's reply (a replay under way is
// at its last batch applied) or an engine snapshot's header (once it has
// come, the handler is mid-snapshot until its end, or until the snapshot
// fails, its snapshotBudget after the header). It waits while Run is
// not running, and returns ctx's error if f has not run when ctx ends.
func (s *Subscriber) Checkpoint(ctx context.Context, f func()) error {
	done := make(chan struct{})
	call := func() { defer close(done); f() }
	select {
	case s.calls <- call:
	case <-ctx.Done():
		return ctx.Err()
	}
	<-done // it runs now; a handler call cannot be under way
	return nil
}

// Position is where the worker's stream stands, as a snapshot records it:
// the last batch applied, seq, and the fingerprint that proves it. known
// is false when there is no last batch or its fingerprint is not known
// (right after an engine snapshot, which places the stream at a seq whose
// batch it did not see). In a Handler's HandleBatch it is that batch's,
// which the Subscriber computed to track the stream: a handler that needs
// the fingerprint need not hash the payload again. Only a Handler's calls
// and Checkpoint's f (Run's goroutine) may call it.
func (s *Subscriber) Position() (seq, fingerprint uint64, known bool) {
	seq, ok := s.seq.latest()
	return seq, s.seq.fp, ok && s.seq.fpKnown
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
			call()
		}
	}
}

// guard is the ZMTP guard of every connection the Subscriber makes.
func (c *Config) guard(stats *counters) guard {
	return guard{limits: zmtp.Limits{MaxMessage: c.MaxMessage, HandshakeTimeout: c.HandshakeTimeout}, errors: &stats.ProtocolErrors}
}

// Stats returns the Subscriber's counters; any goroutine may call it.
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
	defer s.replay.close()
	backoff := pace.Backoff{Min: s.cfg.ReconnectMin, Max: s.cfg.ReconnectMax}
	for connectedBefore := false; ; {
		var sub *zsock.Receiver
		var err error
		// Checkpoint is served while it dials: a peer that accepts and never
		// speaks (a hung engine) holds a dial for HandshakeTimeout.
		s.serving(func() { sub, err = s.connect(ctx) })
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			s.warn.Warn("dial failed", "endpoint", s.cfg.Endpoint, "err", err)
			h.HandleIdle() // down for a while, perhaps: what it holds goes on, or back
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
		s.warn.Warn("subscription lost, reconnecting", "endpoint", s.cfg.Endpoint, "err", err)
		if s.stats.Batches.Load() != before {
			backoff.Reset() // it worked for a while; a peer that only breaks keeps backing off
		}
		h.HandleIdle()
		if !s.sleep(ctx, backoff.Next()) {
			return ctx.Err()
		}
	}
}

// serving runs f on a goroutine of its own and serves Checkpoint calls
// until f returns. f must touch nothing a Checkpoint reads: it is a dial.
func (s *Subscriber) serving(f func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	for {
		select {
		case <-done:
			return
		case call := <-s.calls:
			call()
		}
	}
}

func (s *Subscriber) connect(ctx context.Context) (*zsock.Receiver, error) {
	sock, err := dial(ctx, zmq4.Sub, s.cfg.Endpoint, s.cfg.guard(&s.stats))
	if err != nil {
		return nil, err
	}
	if err := sock.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		sock.Close()
		return nil, err
	}
	return zsock.Start(sock, liveDepth), nil
}
