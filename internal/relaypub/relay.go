package relaypub

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/conf"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/kvpipe/kvpipe/relay"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Config configures a Relay.
type Config struct {
	Settings relay.Settings // its followers' too
	// Pipeline configures the engine side as for a router; the relay sets
	// its Tap, and Tap and Source must be unset. Its Backpressure
	// must be Block: a dropped batch would resync the worker, and two
	// relays would then part ways (see the message ids).
	Pipeline kvpipe.Config
	// SnapshotEvery is how often the relay writes its snapshot (default
	// 15s); it writes one more when Run's context ends.
	SnapshotEvery time.Duration
	// PublishTimeout bounds one publish attempt (default 2s); a publish is
	// tried again, with a backoff from RetryMin to RetryMax (defaults 50ms
	// and 2s), until it is acknowledged or the relay stops.
	PublishTimeout     time.Duration
	RetryMin, RetryMax time.Duration
	// MaxInFlight bounds each worker's messages sent and not acknowledged
	// yet (default 128); a worker waits while it has that many. On a
	// connection that buffers while it reconnects (nats.ReconnectBufSize
	// not -1) it is 1: such a buffer sends what it holds after the relay's
	// own retries, and the stream would hold a worker's messages out of
	// order. Connect with nats.ReconnectBufSize(-1) to keep many in flight.
	MaxInFlight int
	// ShutdownTimeout bounds the last snapshot and the pipeline's drain
	// once Run's context ends (default 10s). A worker that cannot give its
	// part of that snapshot within half of it (in a long replay, say) is
	// recorded absent, and the standby starts it afresh.
	ShutdownTimeout time.Duration
	// RepublishTimeout bounds the wait of a worker parted from the stream
	// for its turn to publish its whole state: it may be in the middle of a
	// long replay (default 1m). Past it the worker is removed and added.
	RepublishTimeout time.Duration
	// ReadIdle is how long the server keeps the consumer that reads a
	// restored worker's messages after the snapshot once it goes quiet
	// (default 5s).
	ReadIdle time.Duration
	Logger   *slog.Logger // default Pipeline.Logger, else none
	// Lease, when set, makes this relay one of several for the same
	// engines: it writes only while it holds the lease, and a standby
	// (another relay with a Lease on the same key) takes over from the
	// last snapshot when it stops or goes silent. It renews the lease while
	// it drains, and stops draining (sends nothing more) if it loses it.
	Lease *Lease
}

// ErrStreamChanged: the stream was deleted (and made again) under a running
// relay. Run handles it itself, by starting its pipeline again from the
// last snapshot; it is exported for logs.
var ErrStreamChanged = errors.New("relay: the stream was deleted or made again under the relay")

// Relay subscribes to engines through a kvpipe.Pipeline and publishes
// each worker's normalised index ops to the stream, one message per batch
// of ops, up to MaxInFlight of them unacknowledged; every SnapshotEvery
// it writes the pipeline's snapshot, with the stream sequence each worker
// reached, to the object store. New starts nothing; Run owns every
// goroutine until it returns. A Relay runs once.
type Relay struct {
	js     jetstream.JetStream
	pub    jetstream.JetStream // js's connection, for the workers' publishes: its own acknowledgement timeout
	window int                 // MaxInFlight, as the connection allows
	cfg    Config
	set    opstream.Settings // cfg.Settings, defaulted
	log    *slog.Logger
	nonce  uint64 // this relay process's, in the ids of ops made of no engine batch
	other  atomic.Uint64
	stats  counters

	// switching is held while one pipeline gives way to the next (the
	// stream changed), and by AddWorker and RemoveWorker, which wait for it.
	switching sync.Mutex

	mu      sync.Mutex
	workers map[string]kvpipe.WorkerConfig
	cur     *run // the pipeline running, or to run next
	ran     bool

	warn *pace.Warner
}

// Stats are a relay's counters.
type Stats struct {
	Published  uint64 // messages the stream acknowledged, duplicates included
	Duplicates uint64 // of those, acknowledged as copies of a message stored before
	Retries    uint64 // publish attempts that failed and were tried again
	// Abandoned: publishes given up because their worker stopped (its
	// batch is replayed by the next relay from the last snapshot).
	Abandoned      uint64
	EncodeErrors   uint64 // batches with an op no message can carry (a bug): not published
	Snapshots      uint64 // snapshots written
	SnapshotErrors uint64 // snapshots that could not be taken or written
	SnapshotBytes  uint64 // size of the last one written
	// SnapshotAbsent counts the workers snapshots were written without:
	// their state could not be taken in time (in a replay, say), and a
	// relay started from the snapshot starts them afresh.
	SnapshotAbsent uint64
	// Restored is how many workers started from the snapshot loaded at the
	// last start; SnapshotIgnored counts snapshots loaded but not used
	// (corrupt, another block size, refused by the pipeline).
	Restored        uint64
	SnapshotIgnored uint64
	StreamChanges   uint64 // times the stream was found deleted or made again
	// Replayed counts a restored worker's messages the stream already held
	// (made again by its replay: not sent). Resets counts workers reset in
	// the stream because their ops parted from what it holds of them;
	// Republished, those reset by publishing their whole state (the others
	// were removed and added again).
	Replayed, Resets, Republished uint64
	// Terms counts the times the relay started writing (with a Lease, each
	// holding of it); LeaseLost, the terms that ended with the lease lost.
	Terms, LeaseLost uint64
}

type counters struct {
	published, duplicates, retries, abandoned, encodeErrors  atomic.Uint64
	snapshots, snapshotErrors, snapshotBytes, snapshotAbsent atomic.Uint64
	restored, snapshotIgnored, streamChanges, replayed       atomic.Uint64
	resets, republished, terms, leaseLost                    atomic.Uint64
}

// Stats returns the relay's counters; any goroutine may call it.
func (r *Relay) Stats() Stats {
	c := &r.stats
	return Stats{Published: c.published.Load(), Duplicates: c.duplicates.Load(), Retries: c.retries.Load(),
		Abandoned: c.abandoned.Load(), EncodeErrors: c.encodeErrors.Load(), Snapshots: c.snapshots.Load(),
		SnapshotErrors: c.snapshotErrors.Load(), SnapshotBytes: c.snapshotBytes.Load(), SnapshotAbsent: c.snapshotAbsent.Load(), Restored: c.restored.Load(),
		SnapshotIgnored: c.snapshotIgnored.Load(), StreamChanges: c.streamChanges.Load(),
		Replayed: c.replayed.Load(), Resets: c.resets.Load(), Republished: c.republished.Load(),
		Terms: c.terms.Load(), LeaseLost: c.leaseLost.Load()}
}

// New validates cfg and returns a relay publishing through js. It starts
// nothing.
func New(js jetstream.JetStream, cfg Config) (*Relay, error) {
	set, err := opstream.Settings(cfg.Settings).WithDefaults()
	if err != nil {
		return nil, err
	}
	switch {
	case cfg.Pipeline.Tap != nil || cfg.Pipeline.Source != nil:
		return nil, errors.New("relay: Pipeline.Tap and Pipeline.Source must be unset: the relay sets Tap")
	case cfg.Pipeline.Backpressure != kvpipe.Block:
		return nil, errors.New("relay: Pipeline.Backpressure must be Block")
	case cfg.SnapshotEvery < 0 || cfg.PublishTimeout < 0 || cfg.ShutdownTimeout < 0 || cfg.RetryMin < 0 || cfg.RetryMax < 0 ||
		cfg.RepublishTimeout < 0 || cfg.ReadIdle < 0:
		return nil, errors.New("relay: durations must not be negative")
	case cfg.MaxInFlight < 0:
		return nil, errors.New("relay: MaxInFlight must not be negative")
	case js.Conn() == nil:
		return nil, errors.New("relay: the JetStream context has no connection")
	}
	cfg.defaults()
	window := cfg.MaxInFlight
	if window > 1 && js.Conn().Opts.ReconnectBufSize != -1 {
		window = 1
		cfg.Logger.Warn("kvpipe/relay: the NATS connection buffers while it reconnects: one message in flight per worker; connect with nats.ReconnectBufSize(-1) for MaxInFlight",
			"max_in_flight", cfg.MaxInFlight)
	}
	// Async publishes time out, or a lost acknowledgement would hold its
	// worker's window; the relay bounds each worker's, not the total.
	pub, err := jetstream.New(js.Conn(), jetstream.WithPublishAsyncTimeout(cfg.PublishTimeout),
		jetstream.WithPublishAsyncMaxPending(1<<30))
	if err != nil {
		return nil, err
	}
	r := &Relay{js: js, pub: pub, window: window, cfg: cfg, set: set, log: cfg.Logger, nonce: rand.Uint64(),
		workers: map[string]kvpipe.WorkerConfig{}, warn: pace.NewWarner(cfg.Logger, "kvpipe/relay: ")}
	// The first pipeline is made now so that AddWorker checks each
	// worker's config at once, as a Pipeline's does.
	if r.cur, err = r.newRun(); err != nil {
		return nil, err
	}
	return r, nil
}

// defaults applies kvpipe's defaulting rule (package kvpipe's doc).
func (cfg *Config) defaults() {
	cfg.MaxInFlight = conf.Or(cfg.MaxInFlight, 128)
	cfg.SnapshotEvery = conf.Or(cfg.SnapshotEvery, 15*time.Second)
	cfg.PublishTimeout = conf.Or(cfg.PublishTimeout, 2*time.Second)
	cfg.RetryMin, cfg.RetryMax = conf.Bounds(cfg.RetryMin, cfg.RetryMax, 50*time.Millisecond, 2*time.Second)
	cfg.ShutdownTimeout = conf.Or(cfg.ShutdownTimeout, 10*time.Second)
	cfg.RepublishTimeout = conf.Or(cfg.RepublishTimeout, time.Minute)
	cfg.ReadIdle = conf.Or(cfg.ReadIdle, 5*time.Second)
	cfg.Logger = conf.Or(conf.Or(cfg.Logger, cfg.Pipeline.Logger), slog.New(slog.DiscardHandler))
	cfg.Pipeline.Logger = conf.Or(cfg.Pipeline.Logger, cfg.Logger)
}

// run is one pipeline of the relay and what its publishes share. Run makes
// another when the stream is made again under it.
type run struct {
	r         *Relay
	p         *kvpipe.Pipeline
	republish seam.Republish // p's, bound by kvpipe.New
	// Set by Run before the pipeline runs, read-only after.
	stream  jetstream.Stream
	obs     jetstream.ObjectStore // the snapshot's bucket
	created time.Time             // the stream's creation time: its incarnation
	stop    context.CancelFunc
	done    chan error // the pipeline's Run result
	// resetting: workers being reset (part); done before the pipeline stops.
	resetting sync.WaitGroup
	// The workers' settlers (publish.go) run until settleCtx ends.
	settlers     sync.WaitGroup
	settleCtx    context.Context
	stopSettling context.CancelFunc

	mu   sync.Mutex
	pubs map[string]*pubState
	// gone holds the lineage of each worker removed in this run, past its
	// removal: added again, it goes on from there, or its new messages
	// would be taken for copies of its first ones and dropped.
	gone map[string]lineage
}

func (r *Relay) newRun() (*run, error) {
	ru := &run{r: r, pubs: map[string]*pubState{}, gone: map[string]lineage{}}
	ru.settleCtx, ru.stopSettling = context.WithCancel(context.Background())
	pc := r.cfg.Pipeline
	pc.Tap = runTap{ru}
	p, err := kvpipe.New(pc)
	if err != nil {
		return nil, err
	}
	ru.p = p
	return ru, nil
}

// runTap is the run's side of the seam: the run's Ops and Flush, and Bind,
// which keeps the pipeline's Republish.
type runTap struct{ *run }

func (t runTap) Bind(republish seam.Republish) { t.republish = republish }

// AddWorker subscribes to one engine, as Pipeline.AddWorker does; the
// relay keeps its config across its pipelines.
func (r *Relay) AddWorker(name string, wc kvpipe.WorkerConfig) error {
	r.switching.Lock()
	defer r.switching.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cur == nil {
		return kvpipe.ErrClosed
	}
	if err := r.cur.p.AddWorker(name, wc); err != nil {
		return err
	}
	r.workers[name] = wc
	return nil
}

// RemoveWorker stops a worker, as Pipeline.RemoveWorker does; its last
// message, one OpRemoveWorker, removes it from every follower. That
// message is sent until the stream has it, even past the pipeline's wait
// for it, and a worker added again under the name waits for it.
func (r *Relay) RemoveWorker(ctx context.Context, name string) error {
	r.switching.Lock()
	defer r.switching.Unlock()
	r.mu.Lock()
	if _, ok := r.workers[name]; !ok {
		r.mu.Unlock()
		return fmt.Errorf("%w: %q", kvpipe.ErrNoWorker, name)
	}
	delete(r.workers, name)
	ru := r.cur
	r.mu.Unlock()
	if ru == nil {
		return nil
	}
	return ru.p.RemoveWorker(ctx, name)
}

// Pipeline is the pipeline the relay runs now (another one after the stream
// was made again under it): its FindMatches answers as a router's would.
func (r *Relay) Pipeline() *kvpipe.Pipeline {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cur == nil {
		return nil
	}
	return r.cur.p
}

// Run ensures the stream and the bucket, starts the workers from the
// snapshot in the bucket (if one is usable), runs the pipeline publishing
// every batch of ops, and writes a snapshot every SnapshotEvery. When ctx
// ends it writes a last snapshot, stops the pipeline and returns ctx's
// cause, once every goroutine it started has stopped. It waits for NATS
// while it cannot reach it. With a Lease it does all that only while it
// holds the lease, and waits (subscribed to no engine) while another relay
// does.
func (r *Relay) Run(ctx context.Context) error {
	r.mu.Lock()
	if r.ran {
		r.mu.Unlock()
		return kvpipe.ErrRunning
	}
	r.ran = true
	ru := r.cur
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.cur = nil
		r.mu.Unlock()
	}()
	if r.cfg.Lease == nil {
		return r.lead(ctx, ru)
	}
	err := r.cfg.Lease.Run(ctx, func(held context.Context) error {
		err := r.lead(held, ru)
		// The next term's pipeline, current at once: AddWorker and
		// RemoveWorker between terms go to it.
		next, nerr := r.nextRun()
		ru = next
		switch {
		case nerr != nil:
			return nerr
		case errors.Is(context.Cause(held), ErrLeaseLost):
			r.stats.leaseLost.Add(1)
			return nil // wait to hold the lease again
		}
		return err
	})
	if ru != nil { // made for a term that never came
		ru.p.Shutdown(context.WithoutCancel(ctx))
		ru.endSettling(context.WithoutCancel(ctx))
	}
	return err
}

// lead runs the relay's pipelines from ru on until ctx ends.
func (r *Relay) lead(ctx context.Context, ru *run) error {
	r.stats.terms.Add(1)
	for {
		err := ru.run(ctx)
		if !errors.Is(err, ErrStreamChanged) {
			return err
		}
		r.stats.streamChanges.Add(1)
		r.log.Error("kvpipe/relay: the stream was deleted or made again under the relay: starting again from the last snapshot")
		// What the old pipeline still sends belongs to the old stream. It
		// stops before the next one is made; AddWorker and RemoveWorker
		// wait for the switch, so that neither meets a pipeline that is
		// stopping.
		r.switching.Lock()
		ru.stopSettling()
		ru.finish(afterHeld(ctx))
		next, err := r.nextRun()
		r.switching.Unlock()
		if err != nil {
			return err
		}
		if ctx.Err() != nil {
			next.p.Shutdown(ctx) // never ran
			next.endSettling(ctx)
			return context.Cause(ctx)
		}
		ru = next
	}
}

// nextRun makes the relay's next pipeline with its workers and makes it
// current.
func (r *Relay) nextRun() (*run, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	next, err := r.newRun()
	if err != nil {
		return nil, err
	}
	for name, wc := range r.workers {
		if err := next.p.AddWorker(name, wc); err != nil {
			return nil, err
		}
	}
	r.cur = next
	return next, nil
}

// run runs ru's pipeline until ctx ends, when it writes the last snapshot
// and stops the pipeline, or until the stream changes under it, when it
// returns ErrStreamChanged and leaves the pipeline to finish.
func (ru *run) run(ctx context.Context) error {
	r := ru.r
	backoff := pace.Backoff{Min: r.cfg.RetryMin, Max: r.cfg.RetryMax}
	for {
		err := ru.setUp(ctx)
		if err == nil {
			break
		}
		r.log.Warn("kvpipe/relay: cannot set up the stream and bucket; trying again", "err", err)
		if !pace.Sleep(ctx, backoff.Next()) {
			ru.p.Shutdown(context.Background()) // never ran: nothing to wait for
			ru.endSettling(ctx)
			return context.Cause(ctx)
		}
	}
	// The pipeline stops when the relay says, after its last snapshot.
	pctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	ru.stop, ru.done = stop, make(chan error, 1)
	go func() { ru.done <- ru.p.Run(pctx) }()
	err := ru.loop(ctx)
	switch {
	case errors.Is(err, ErrStreamChanged):
		return err
	case errors.Is(err, errPipelineStopped):
		stop()
		err := <-ru.done
		ru.resetting.Wait()
		sctx, cancel := context.WithTimeout(afterHeld(ctx), r.cfg.ShutdownTimeout)
		defer cancel()
		ru.endSettling(sctx)
		return err
	}
	sctx, cancel := context.WithTimeout(afterHeld(ctx), r.cfg.ShutdownTimeout)
	defer cancel()
	if errors.Is(context.Cause(ctx), ErrLeaseLost) {
		// Another relay may hold the lease soon: send nothing more, and
		// leave the snapshot to it.
		ru.stopSettling()
		r.log.Warn("kvpipe/relay: lease lost: stopping without a last snapshot")
	} else if serr := ru.snapshot(sctx); serr != nil {
		r.log.Warn("kvpipe/relay: last snapshot not written", "err", serr)
	}
	ru.finish(sctx)
	return context.Cause(ctx)
}

// finish stops ru's pipeline and waits for it: within ctx it drains, past
// it its workers' publishes give up.
func (ru *run) finish(ctx context.Context) {
	sctx, cancel := context.WithTimeout(ctx, ru.r.cfg.ShutdownTimeout)
	defer cancel()
	if err := ru.p.Shutdown(sctx); err != nil {
		ru.stop()
	}
	<-ru.done
	ru.stop()
	ru.resetting.Wait() // after the workers, before the settlers stop
	ru.endSettling(sctx)
}

// endSettling lets the workers' last messages be acknowledged, while ctx
// lasts, then stops their settlers and waits for them.
func (ru *run) endSettling(ctx context.Context) {
	ru.mu.Lock()
	list := make([]*pubState, 0, len(ru.pubs))
	for _, ps := range ru.pubs {
		list = append(list, ps)
	}
	ru.mu.Unlock()
	for _, ps := range list {
		ru.flushState(ctx, ps)
	}
	ru.stopSettling()
	ru.settlers.Wait()
	ru.resetting.Wait() // a settler may have started one; none can now
}

var errPipelineStopped = errors.New("relay: pipeline stopped")

// loop writes the snapshots until ctx ends (nil), the stream changes, or
// the pipeline stops by itself.
func (ru *run) loop(ctx context.Context) error {
	t := time.NewTicker(ru.r.cfg.SnapshotEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-ru.done:
			ru.done <- err
			return errPipelineStopped
		case <-t.C:
			if err := ru.snapshot(ctx); errors.Is(err, ErrStreamChanged) {
				return err
			} else if err != nil && ctx.Err() == nil {
				ru.r.log.Warn("kvpipe/relay: snapshot not written", "err", err)
			}
		}
	}
}

// setUp ensures the stream and the bucket and starts the workers from the
// bucket's snapshot, if usable.
func (ru *run) setUp(ctx context.Context) error {
	r := ru.r
	stream, obs, err := opstream.Ensure(ctx, r.js, r.set)
	if err != nil {
		return err
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return fmt.Errorf("relay: stream info: %w", err)
	}
	ru.stream, ru.obs, ru.created = stream, obs, info.Created
	data, meta, err := opstream.LoadSnapshot(ctx, obs, r.set.Object, nil)
	switch {
	case errors.Is(err, snapshot.ErrNotFound):
		r.log.Info("kvpipe/relay: no snapshot yet: workers start from their engines")
		return nil
	case err != nil && !errors.Is(err, snapshot.ErrCorrupt):
		return err // NATS trouble: try again rather than resync every worker
	}
	var s snapshot.Snapshot
	if err == nil {
		err = snapshot.Decode(data, &s)
	}
	if err != nil {
		r.stats.snapshotIgnored.Add(1)
		r.log.Error("kvpipe/relay: snapshot unusable, workers resync from their engines", "err", err)
		return nil
	}
	if s.BlockSize != r.cfg.Pipeline.BlockSize {
		r.stats.snapshotIgnored.Add(1)
		r.log.Error("kvpipe/relay: snapshot of another block size, workers resync from their engines",
			"snapshot", s.BlockSize, "configured", r.cfg.Pipeline.BlockSize)
		return nil
	}
	// Sequences of another incarnation of the stream mean nothing in this
	// one: the workers go on from the snapshot's state, but as having
	// published nothing here.
	sameStream := meta.Known && meta.StreamCreated.Equal(info.Created)
	for i := range s.Workers {
		if !meta.Known && s.Workers[i].StreamSeq > info.State.LastSeq {
			sameStream = false
		}
	}
	if err := restorePipeline(ru.p, &s, data, sameStream); err != nil {
		r.stats.snapshotIgnored.Add(1)
		r.log.Error("kvpipe/relay: snapshot refused by the pipeline, workers resync from their engines", "err", err)
		return nil
	}
	r.stats.restored.Store(uint64(len(s.Workers) - absent(&s)))
	if err := ru.placeRestored(ctx, s.Workers, sameStream); err != nil {
		return err
	}
	r.log.Info("kvpipe/relay: workers start from the snapshot", "workers", len(s.Workers), "same_stream", sameStream)
	return nil
}

// absent is the number of workers s records absent.
func absent(s *snapshot.Snapshot) int {
	n := 0
	for i := range s.Workers {
		if s.Workers[i].Absent {
			n++
		}
	}
	return n
}

// restorePipeline restores p from s, decoded from data; unless sameStream,
// with the workers' stream sequences cleared (see setUp).
func restorePipeline(p *kvpipe.Pipeline, s *snapshot.Snapshot, data []byte, sameStream bool) error {
	if !sameStream {
		for i := range s.Workers {
			s.Workers[i].StreamSeq = 0
		}
		var err error
		if data, err = snapshot.Append(data[:0], s); err != nil {
			return err
		}
	}
	var restored kvpipe.Snapshot
	if err := restored.UnmarshalBinary(data); err != nil {
		return err
	}
	return p.Restore(&restored)
}

// placeRestored places each restored worker's publishing where its
// snapshot left it: its last message's sequence and lineage, and, in the
// same stream, what the stream holds after it, which its replay makes again.
func (ru *run) placeRestored(ctx context.Context, workers []snapshot.Worker, sameStream bool) error {
	for i := range workers {
		w := &workers[i]
		ps, ok := ru.state(ctx, string(w.Name))
		if !ok {
			return context.Cause(ctx)
		}
		ps.fresh = false
		if w.Absent {
			// Its state was not taken: the pipeline starts it afresh. Not
			// fresh here, so that its clear gets an id of its own, never
			// dropped as a copy of the one that started it before.
			continue
		}
		ps.last.Store(w.StreamSeq)
		ps.lineage = ru.lineageAt(ctx, ps, w.StreamSeq)
		if sameStream && w.StreamSeq != 0 {
			// (At 0 the worker publishes its whole state first: nothing
			// the stream holds of it is made again.)
			var err error
			if ps.expect, err = ru.after(ctx, ps.subject, w.StreamSeq); err != nil {
				return err
			}
		}
	}
	return nil
}

// lineageAt reads the lineage of a restored worker from its message at seq,
// the last it published before the snapshot, so that its replay makes the
// ids the stream holds (and a second relay in step with this one the same
// ones). Without that message (0, trimmed, another worker's) the worker
// starts a lineage of its own; a replay with messages after seq in the
// stream then parts from them and the worker is reset.
func (ru *run) lineageAt(ctx context.Context, ps *pubState, seq uint64) lineage {
	if seq == 0 {
		return rand.Uint64()
	}
	m, err := ru.stream.GetMsg(ctx, seq)
	if err != nil || m.Subject != ps.subject {
		return rand.Uint64()
	}
	l, ok := lineageOf(m.Header.Get(jetstream.MsgIDHeader))
	if !ok {
		return rand.Uint64()
	}
	return l
}

// after lists the messages of subject after seq, oldest first: their ids
// only, read through one consumer (a takeover may have thousands to read).
func (ru *run) after(ctx context.Context, subject string, seq uint64) ([]stored, error) {
	last, err := ru.stream.GetLastMsgForSubject(ctx, subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("relay: reading %s after %d: %w", subject, seq, err)
	}
	if last.Sequence <= seq {
		return nil, nil
	}
	cons, err := ru.stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject},
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: seq + 1, HeadersOnly: true,
		InactiveThreshold: ru.r.cfg.ReadIdle})
	if err != nil {
		return nil, fmt.Errorf("relay: reading %s after %d: %w", subject, seq, err)
	}
	var out []stored
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		batch, err := cons.Fetch(1024, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return nil, fmt.Errorf("relay: reading %s after %d: %w", subject, seq, err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				return nil, fmt.Errorf("relay: reading %s after %d: %w", subject, seq, err)
			}
			out = append(out, stored{id: m.Headers().Get(jetstream.MsgIDHeader), seq: md.Sequence.Stream})
			if md.Sequence.Stream >= last.Sequence || md.NumPending == 0 {
				return out, nil
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			return nil, fmt.Errorf("relay: reading %s after %d: %w", subject, seq, err)
		}
		if n == 0 {
			// Short, the replay would send again what the stream holds.
			return nil, fmt.Errorf("relay: reading %s after %d: no message within a second, %d read, more pending", subject, seq, len(out))
		}
	}
}

// snapshot takes the pipeline's snapshot and writes it with the stream's
// incarnation and last sequence as they were before the capture.
func (ru *run) snapshot(ctx context.Context) error {
	r := ru.r
	info, err := ru.stream.Info(ctx)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		// Not made again here: this run's pipeline, finishing, would send
		// its last ops into the new stream, and the next run's replay from
		// the snapshot sends them again (a router counted their stores
		// twice). The next run makes it (setUp).
		return ErrStreamChanged
	}
	if err != nil {
		r.stats.snapshotErrors.Add(1)
		return fmt.Errorf("relay: stream info: %w", err)
	}
	if !info.Created.Equal(ru.created) {
		return ErrStreamChanged
	}
	var s kvpipe.Snapshot
	if err := ru.p.Snapshot(ctx, &s); err != nil {
		r.stats.snapshotErrors.Add(1)
		return fmt.Errorf("relay: taking the snapshot: %w", err)
	}
	data, err := s.AppendBinary(nil)
	if err != nil {
		r.stats.snapshotErrors.Add(1)
		return fmt.Errorf("relay: encoding the snapshot: %w", err)
	}
	meta := opstream.SnapshotMeta{Known: true, StreamCreated: info.Created, StreamLast: info.State.LastSeq}
	if err := opstream.SaveSnapshot(ctx, ru.obs, r.set.Object, data, meta); err != nil {
		r.stats.snapshotErrors.Add(1)
		return err
	}
	r.stats.snapshots.Add(1)
	r.stats.snapshotBytes.Store(uint64(len(data)))
	r.stats.snapshotAbsent.Add(uint64(len(s.Absent())))
	return nil
}
