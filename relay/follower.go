package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/nats-io/nats.go/jetstream"
)

// Follower is a kvpipe.Source that feeds a router's Pipeline from a
// relay's stream instead of the engines: it starts from the newest
// snapshot in the bucket, if the stream still holds every message after
// it, and then applies the stream's messages in order with one ordered
// consumer. Its Run is the Source's: Pipeline runs it, and runs it again
// (after a backoff) when it returns an error, e.g. when the stream lost
// messages it had not read yet; each Run starts from the snapshot again.
//
// What it guarantees: each worker's entries are the relay's, as of the
// last message applied, and a worker whose history the follower could not
// see whole (no usable snapshot and a trimmed stream, a bad message) is
// Partial until a clear of the worker makes it whole again. It never
// keeps a key because it missed a message: a gap in the stream starts it
// over, and a bad message clears its worker.
type Follower struct {
	js    jetstream.JetStream
	set   opstream.Settings // NewFollower's, defaulted
	log   *slog.Logger
	stats followerCounters
	busy  atomic.Bool

	mu     sync.Mutex // guards reason
	reason string

	// Owned by Run (its calls never overlap).
	// fed: the workers given ops, across runs (the next run clears those it
	// does not rebuild), each with the EAGLE mode it was last given.
	fed      map[string]bool
	snap     snapshot.Snapshot
	buf      []byte
	ops      []index.Op
	warn     *pace.Warner
	lastSeen uint64 // the stream sequence of the last message handled in this run
	lastGap  gap    // where the last run that ended on a gap found it
}

// gap is where a run found the stream skip: the sequence it expected and
// the one delivered.
type gap struct{ next, got uint64 }

// FollowerStats are a follower's counters.
type FollowerStats struct {
	Applied    uint64 // messages applied
	Skipped    uint64 // messages the snapshot already held
	Duplicates uint64 // messages at or before the last one handled (a consumer resumed): dropped
	// BadMessages could not be decoded (their worker was cleared, and is
	// Partial until a clear in the stream); Gaps are runs ended because the
	// stream no longer held the next message; Holes are gaps found again by
	// the run after (the stream lacks those messages for good: a deleted
	// message, a purged subject), gone past with every worker cleared;
	// StreamsRemade runs ended because the stream was deleted and made
	// again under them.
	BadMessages, Gaps, Holes, StreamsRemade uint64
	// SnapshotsLoaded and SnapshotsRefused count the snapshots each run
	// found; RefusedReason says why the last refused one was.
	SnapshotsLoaded, SnapshotsRefused uint64
	RefusedReason                     string
	Runs                              uint64
	LastApplied                       uint64 // stream sequence of the last message handled
	Lag                               uint64 // messages in the stream after it
}

type followerCounters struct {
	applied, skipped, duplicates, bad, gaps, holes, remade atomic.Uint64
	loaded, refused, runs                                  atomic.Uint64
	lastApplied, lag                                       atomic.Uint64
}

// Stats returns the follower's counters; any goroutine may call it.
func (f *Follower) Stats() FollowerStats {
	c := &f.stats
	f.mu.Lock()
	reason := f.reason
	f.mu.Unlock()
	return FollowerStats{Applied: c.applied.Load(), Skipped: c.skipped.Load(), Duplicates: c.duplicates.Load(),
		BadMessages: c.bad.Load(), Gaps: c.gaps.Load(), Holes: c.holes.Load(), StreamsRemade: c.remade.Load(), SnapshotsLoaded: c.loaded.Load(), SnapshotsRefused: c.refused.Load(),
		RefusedReason: reason, Runs: c.runs.Load(), LastApplied: c.lastApplied.Load(), Lag: c.lag.Load()}
}

// NewFollower returns a follower of the relay whose settings s are (the
// relay's own); a nil logger discards what it logs.
func NewFollower(js jetstream.JetStream, s Settings, logger *slog.Logger) (*Follower, error) {
	set, err := opstream.Settings(s).WithDefaults()
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Follower{js: js, set: set, log: logger, fed: map[string]bool{}, warn: pace.NewWarner(logger, "kvpipe/relay: ")}, nil
}

var _ kvpipe.Source = (*Follower)(nil)

// followed is what a run knows of one worker.
type followed struct {
	name    string
	covered uint64 // its messages up to this sequence are in the snapshot
	whole   bool   // its entries are the relay's: seen from a snapshot, a clear or its start
}

// errGap ends a run whose stream skipped messages it had not read.
var errGap = errors.New("relay: the stream no longer holds messages the follower has not read")

// errRemade ends a run whose stream was deleted and made again under it.
var errRemade = errors.New("relay: the stream was deleted and made again under the follower")

// streamCheck is how often a run asks whether its stream is still the one
// it started on. One made again numbers its messages from 1 again, and the
// consumer, resuming after the last it delivered, would skip those as if
// nothing had happened: the index would keep what the old stream built.
const streamCheck = 2 * time.Second

// Run feeds f's pipeline until ctx ends (nil) or the stream fails it.
func (f *Follower) Run(ctx context.Context, feed *kvpipe.Feed) error {
	if f.busy.Swap(true) {
		return errors.New("relay: Follower.Run called again while running")
	}
	defer f.busy.Store(false)
	f.stats.runs.Add(1)
	err := f.run(ctx, feed)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// following is where one run of a Follower starts in the stream.
type following struct {
	workers      map[string]*followed
	fromSnapshot bool
	base         uint64 // with a snapshot: every worker's messages up to base are in it
	// defaultWhole: a worker the stream names first holds its whole
	// history (the stream starts at its first message).
	defaultWhole bool
	next         uint64    // the sequence expected next
	created      time.Time // the stream's, as the run began
}

func (f *Follower) run(ctx context.Context, feed *kvpipe.Feed) error {
	s := f.set
	stream, err := f.js.Stream(ctx, s.Stream)
	if err != nil {
		return fmt.Errorf("relay: stream %s: %w", s.Stream, err)
	}
	fl, err := f.start(ctx, feed, stream)
	if err != nil {
		return err
	}
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{s.Prefix + ".>"}}
	if fl.fromSnapshot {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, fl.next
	}
	cons, err := f.js.OrderedConsumer(ctx, s.Stream, cfg)
	if err != nil {
		return fmt.Errorf("relay: consumer: %w", err)
	}
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("relay: consumer: %w", err)
	}
	defer it.Stop()
	f.lastSeen = fl.next - 1
	f.stats.lastApplied.Store(f.lastSeen) // what the snapshot covers counts as applied
	return f.consume(ctx, feed, stream, it, fl)
}

// start loads the snapshot, checks it against the stream and applies it,
// or clears what an earlier run fed when there is none to use.
func (f *Follower) start(ctx context.Context, feed *kvpipe.Feed, stream jetstream.Stream) (*following, error) {
	// The snapshot first, the stream's state after: a snapshot written in
	// between then is checked against a stream that has what it covers.
	snap, meta, err := f.load(ctx, feed.BlockSize())
	if err != nil {
		return nil, err
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("relay: stream %s: %w", f.set.Stream, err)
	}
	st := info.State
	fl := &following{workers: map[string]*followed{}, defaultWhole: st.FirstSeq <= 1, next: max(st.FirstSeq, 1), created: info.Created}
	if snap != nil {
		var reason string
		if fl.base, reason = check(snap, meta, info); reason != "" {
			f.refuse(reason)
			snap = nil
			// A stream made again, or one that lost what followed the
			// snapshot, does not hold the workers' whole history.
			fl.defaultWhole = false
		}
	}
	if snap != nil {
		f.stats.loaded.Add(1)
		fl.fromSnapshot, fl.next = true, fl.base+1
		return fl, f.applySnapshot(ctx, feed, snap, fl.base, fl.workers)
	}
	// Nothing of an earlier run may stay: the stream rebuilds what it
	// can, from its first message.
	if err := f.clearFed(ctx, feed); err != nil {
		return nil, err
	}
	if !fl.defaultWhole {
		f.log.Warn("kvpipe/relay: following the stream without a snapshot from a point after its start: workers are partial until their engines clear",
			"first_seq", st.FirstSeq)
	}
	return fl, nil
}

// consume applies the stream's messages from fl.next on, until ctx ends,
// the stream fails, or it is made again (checked every streamCheck).
func (f *Follower) consume(ctx context.Context, feed *kvpipe.Feed, stream jetstream.Stream, it jetstream.MessagesContext, fl *following) error {
	s := f.set
	first := true            // no message handled yet
	var wait context.Context // ends at the next check
	stopWait := context.CancelFunc(func() {})
	defer func() { stopWait() }()
	renew := func() {
		stopWait()
		wait, stopWait = context.WithTimeout(ctx, streamCheck)
	}
	renew()
	for {
		msg, err := it.Next(jetstream.NextContext(wait))
		if wait.Err() != nil && ctx.Err() == nil {
			if err := f.sameStream(ctx, stream, fl.created); err != nil {
				return err
			}
			renew()
			if err != nil {
				continue // the wait ended, not a message
			}
		}
		if err != nil {
			return fmt.Errorf("relay: consuming %s: %w", s.Stream, err)
		}
		md, err := msg.Metadata()
		if err != nil {
			return fmt.Errorf("relay: consuming %s: %w", s.Stream, err)
		}
		seq := md.Sequence.Stream
		f.stats.lag.Store(md.NumPending)
		if seq <= f.lastSeen {
			f.stats.duplicates.Add(1)
			continue
		}
		if seq != fl.next {
			if err := f.skipped(ctx, feed, fl, seq, first); err != nil {
				return err
			}
		}
		first = false
		fl.next, f.lastSeen = seq+1, seq
		if err := f.handle(ctx, feed, fl.workers, msg, seq, fl.base, fl.defaultWhole); err != nil {
			return err
		}
		f.stats.lastApplied.Store(seq)
	}
}

// skipped handles a message at seq past fl.next: the stream trimmed before
// the first message of a run without a snapshot (its workers are then not
// whole), a gap (errGap: the next run may find the messages, from the
// snapshot), or the gap the run before ended on (passHole).
func (f *Follower) skipped(ctx context.Context, feed *kvpipe.Feed, fl *following, seq uint64, first bool) error {
	switch g := (gap{fl.next, seq}); {
	case first && !fl.fromSnapshot:
		// Trimmed between reading the stream's state and the consumer's
		// start: the history is not whole after all.
		fl.defaultWhole = false
		for _, w := range fl.workers {
			w.whole = false
		}
	case g != f.lastGap:
		f.stats.gaps.Add(1)
		f.lastGap = g
		return fmt.Errorf("%w: next was %d, the stream delivered %d", errGap, fl.next, seq)
	default:
		return f.passHole(ctx, feed, fl, g)
	}
	return nil
}

// passHole goes on past messages the stream lacks for good (the run
// before found the same gap): their subjects are unknown, so every worker
// may have lost ops, removes among them. Each is cleared, partial until a
// clear of its own in the stream, and so is any worker first seen after.
func (f *Follower) passHole(ctx context.Context, feed *kvpipe.Feed, fl *following, g gap) error {
	f.stats.holes.Add(1)
	f.log.Warn("kvpipe/relay: the stream lacks messages for good: every worker cleared, partial until the relay clears it",
		"from", g.next, "to", g.got-1)
	for _, w := range fl.workers {
		w.whole = false
	}
	fl.defaultWhole = false
	return f.clearFed(ctx, feed)
}

// clearFed clears every worker the follower has fed, but one whose name
// the router's own engine worker has taken since (not the follower's).
func (f *Follower) clearFed(ctx context.Context, feed *kvpipe.Feed) error {
	for name, eagle := range f.fed {
		if err := feed.Apply(ctx, name, kvpipe.FedState{Partial: true, Eagle: eagle}, []index.Op{{Kind: index.OpClearWorker}}); err != nil && !errors.Is(err, kvpipe.ErrNameTaken) {
			return err
		}
	}
	return nil
}

// sameStream returns errRemade, counted, if the stream is not the one made
// at created. One it cannot ask about (the server restarting, the stream
// not made again yet) is asked about at the next check: the consumer rides
// out NATS trouble on its own, and a run ended for it would apply the
// stream again.
func (f *Follower) sameStream(ctx context.Context, stream jetstream.Stream, created time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, streamCheck)
	defer cancel()
	info, err := stream.Info(ctx)
	if err != nil {
		return nil
	}
	if !info.Created.Equal(created) {
		f.stats.remade.Add(1)
		return fmt.Errorf("%w: made at %v, now at %v", errRemade, created, info.Created)
	}
	return nil
}

// handle applies the message at seq, unless the snapshot covers it.
func (f *Follower) handle(ctx context.Context, feed *kvpipe.Feed, workers map[string]*followed, msg jetstream.Msg,
	seq, base uint64, defaultWhole bool) error {
	s := f.set
	w := workers[msg.Subject()]
	if w == nil {
		name, err := opstream.WorkerOfSubject(s.Prefix, msg.Subject())
		if err != nil {
			f.badMessage(seq, msg.Subject(), err)
			return nil // no worker of ours: nothing to clear
		}
		w = &followed{name: name, covered: base, whole: defaultWhole}
		workers[msg.Subject()] = w
	}
	if seq <= w.covered {
		f.stats.skipped.Add(1)
		return nil
	}
	ops, h, err := opstream.DecodeMessage(msg.Data(), f.ops)
	f.ops = ops[:0]
	if err != nil {
		// Its ops are lost, removes perhaps among them: the worker's
		// entries go, and it is partial until a clear makes it whole.
		f.badMessage(seq, msg.Subject(), err)
		w.whole = false
		eagle := f.fed[w.name]
		if err := feed.Apply(ctx, w.name, kvpipe.FedState{Partial: true, Eagle: eagle}, []index.Op{{Kind: index.OpClearWorker}}); errors.Is(err, kvpipe.ErrNameTaken) {
			return nil // not ours to clear
		} else if err != nil {
			return err
		}
		f.fed[w.name] = eagle
		return nil
	}
	removed := -1 // the last OpRemoveWorker's index
	for i, op := range ops {
		switch op.Kind {
		case index.OpClearWorker:
			w.whole = true // from here on its entries are the relay's
		case index.OpRemoveWorker:
			// Gone on the relay; added again, it starts from nothing
			// there and here alike.
			removed, w.covered, w.whole = i, 0, true
		}
	}
	if err := feed.Apply(ctx, w.name, kvpipe.FedState{Partial: h.Partial || !w.whole, Eagle: h.Eagle}, ops); errors.Is(err, kvpipe.ErrNameTaken) {
		// The router's own engine worker has the name: its ops are not
		// the relay's to change, and the stream goes on past them.
		f.badMessage(seq, msg.Subject(), err)
		return nil
	} else if err != nil {
		return err
	}
	f.stats.applied.Add(1)
	if removed >= 0 && removed == len(ops)-1 {
		delete(f.fed, w.name)
	} else { // fed, or removed and made again by the ops after (Feed.Apply)
		f.fed[w.name] = h.Eagle
	}
	return nil
}

// load reads and decodes the newest snapshot; nil without a usable one.
// An error is NATS trouble, for the run to be tried again.
func (f *Follower) load(ctx context.Context, blockSize int) (*snapshot.Snapshot, opstream.SnapshotMeta, error) {
	s := f.set
	obs, err := f.js.ObjectStore(ctx, s.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, opstream.SnapshotMeta{}, nil
	}
	if err != nil {
		return nil, opstream.SnapshotMeta{}, fmt.Errorf("relay: bucket %s: %w", s.Bucket, err)
	}
	var meta opstream.SnapshotMeta
	f.buf, meta, err = opstream.LoadSnapshot(ctx, obs, s.Object, f.buf[:0])
	switch {
	case errors.Is(err, snapshot.ErrNotFound):
		return nil, meta, nil
	case errors.Is(err, snapshot.ErrCorrupt):
		f.refuse(err.Error())
		return nil, meta, nil
	case err != nil:
		return nil, meta, err
	}
	if err := snapshot.Decode(f.buf, &f.snap); err != nil {
		f.refuse(fmt.Sprintf("snapshot unusable (%d bytes): %v", len(f.buf), err))
		return nil, meta, nil
	}
	if f.snap.BlockSize != blockSize {
		f.refuse(fmt.Sprintf("snapshot of block size %d, the router's is %d", f.snap.BlockSize, blockSize))
		return nil, meta, nil
	}
	if f.snap.KeySeed != index.Seed {
		f.refuse(fmt.Sprintf("snapshot of keys hashed with key seed %d, this kvpipe's is %d", f.snap.KeySeed, index.Seed))
		return nil, meta, nil
	}
	return &f.snap, meta, nil
}

// check says why snap cannot be used with the stream as info describes it
// ("" when it can), and the sequence up to which it covers every worker.
func check(snap *snapshot.Snapshot, meta opstream.SnapshotMeta, info *jetstream.StreamInfo) (base uint64, reason string) {
	st := info.State
	base = meta.StreamLast
	if !meta.Known {
		base = 0
		first := true
		for i := range snap.Workers {
			if w := &snap.Workers[i]; !w.Absent && (first || w.StreamSeq < base) {
				base, first = w.StreamSeq, false
			}
		}
	}
	for i := range snap.Workers {
		if w := &snap.Workers[i]; w.StreamSeq > st.LastSeq {
			return 0, fmt.Sprintf("worker %q covers stream seq %d, past the stream's last %d: the stream was deleted or purged under the snapshot",
				w.Name, w.StreamSeq, st.LastSeq)
		}
	}
	if base > st.LastSeq {
		return 0, fmt.Sprintf("snapshot covers stream seq %d, past the stream's last %d: the stream was deleted or purged under the snapshot",
			base, st.LastSeq)
	}
	if meta.Known && !meta.StreamCreated.Equal(info.Created) {
		return 0, fmt.Sprintf("snapshot of the stream created %s, this one was created %s: the stream was made again",
			meta.StreamCreated.Format(time.RFC3339Nano), info.Created.Format(time.RFC3339Nano))
	}
	if base+1 < st.FirstSeq {
		return 0, fmt.Sprintf("the stream no longer holds seq %d to %d after the snapshot (its first is %d): older than its retention",
			base+1, st.FirstSeq-1, st.FirstSeq)
	}
	return base, ""
}

// applySnapshot rebuilds every worker of snap, removes the workers of an
// earlier run that snap does not have, and fills workers with what the run
// knows of each.
func (f *Follower) applySnapshot(ctx context.Context, feed *kvpipe.Feed, snap *snapshot.Snapshot, base uint64, workers map[string]*followed) error {
	in := map[string]bool{}
	for i := range snap.Workers {
		in[string(snap.Workers[i].Name)] = true
	}
	for name := range f.fed {
		if !in[name] {
			if err := feed.Apply(ctx, name, kvpipe.FedState{Partial: true}, []index.Op{{Kind: index.OpRemoveWorker}}); err != nil {
				return err
			}
			delete(f.fed, name)
		}
	}
	for i := range snap.Workers {
		w := &snap.Workers[i]
		name := string(w.Name)
		f.ops = w.AppendOps(append(f.ops[:0], index.Op{Kind: index.OpClearWorker}))
		// In parts of at most a shard batch; partial until the last.
		for ops := f.ops; len(ops) > 0; {
			n := min(len(ops), 256)
			err := feed.Apply(ctx, name, kvpipe.FedState{Partial: w.Partial || n < len(ops), Eagle: w.Eagle}, ops[:n])
			if errors.Is(err, kvpipe.ErrNameTaken) {
				f.warn.Warn("snapshot worker skipped", "worker", name, "err", err)
				break // its messages are skipped as well (handle)
			}
			if err != nil {
				return err
			}
			ops = ops[n:]
			f.fed[name] = w.Eagle
		}
		// An absent worker's entries up to base are not in the snapshot:
		// partial until the relay clears it (starting it afresh).
		workers[f.set.Subject(name)] = &followed{name: name, covered: max(w.StreamSeq, base), whole: !w.Absent}
	}
	f.log.Info("kvpipe/relay: started from the snapshot", "workers", len(snap.Workers), "blocks", snap.Blocks(), "stream_seq", base)
	return nil
}

func (f *Follower) refuse(reason string) {
	f.stats.refused.Add(1)
	f.mu.Lock()
	f.reason = reason
	f.mu.Unlock()
	f.log.Error("kvpipe/relay: snapshot refused; following the stream from its first message", "reason", reason)
}

func (f *Follower) badMessage(seq uint64, subject string, err error) {
	f.stats.bad.Add(1)
	f.warn.Warn("bad message skipped", "seq", seq, "subject", subject, "err", err)
}
