package relaypub

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"regexp"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/nats-io/nats.go/jetstream"
)

// Defaults of LeaseConfig.
const (
	DefaultLeaseBucket = "kvpipe-leases"
	DefaultLeaseKey    = "relay"
	DefaultLeaseTTL    = 10 * time.Second
)

// minLeaseTTL is the shortest max age the server takes for a stream.
const minLeaseTTL = 100 * time.Millisecond

// ErrLeaseLost is the cause of a held context ended because the lease was
// lost: its key was taken or removed, or no renew succeeded for TTL/2.
var ErrLeaseLost = errors.New("relay: lease lost")

// errStepDown is the cause of a held context ended because lead returned.
var errStepDown = errors.New("relay: lease given up")

// leaseKeyRe is what a KV key may be: dot-separated tokens of these.
var leaseKeyRe = regexp.MustCompile(`^[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*$`)

// LeaseConfig configures a Lease.
type LeaseConfig struct {
	Bucket string // KV bucket (default DefaultLeaseBucket), [A-Za-z0-9_-]+
	// Key is the lease's key (default DefaultLeaseKey): one key per set of
	// engines a relay serves.
	Key string
	// Holder names who holds the lease; it is the key's value. It must be
	// unique to this Lease: a key holding it is taken as this Lease's own.
	// The default is host-pid-random.
	Holder string
	// TTL (default DefaultLeaseTTL, at least 100ms): a holder that cannot
	// renew for TTL loses the lease to a standby. It is the bucket's max age,
	// so every Lease on a bucket must use the same.
	TTL    time.Duration
	Logger *slog.Logger // default none
}

// Lease decides which of several relays for the same engines writes: the
// one holding a key of a JetStream KV bucket. Run takes the key with a
// create (which fails while it exists), renews it every TTL/6 with a
// compare-and-set on its revision, and deletes it when lead returns, so
// that a standby (watching the key) takes over at once. A key not renewed
// for TTL expires (it is the bucket's max age) and a standby takes it.
//
// No overlap: a holder ends its held context once no renew has succeeded
// for TTL/2, measured on its monotonic clock from when the last successful
// renew was sent. The server received that renew later and expires the key
// TTL after that, so the held context ends at least TTL/2 before any
// standby can hold the lease. The lease is renewed until lead returns,
// also after Run's ctx ended (lead drains while it holds the lease). It
// assumes that the holder's and the server's clocks run at alike rates
// (and the server's is not stepped forward); that lead stops writing within
// TTL/2 of its context ending for a lost lease (a Relay stops sending at
// once); and that nobody else writes or deletes the key or its bucket.
//
// The bucket is file-stored so that a key and its age outlive a server
// restart: in memory, a restarted server would forget the lease and let a
// standby take it while the holder still writes.
type Lease struct {
	js    jetstream.JetStream
	cfg   LeaseConfig
	value []byte
	log   *slog.Logger
	stats leaseCounters

	running atomic.Bool

	warn *pace.Warner
}

// LeaseStats are a Lease's counters.
type LeaseStats struct {
	Acquired uint64 // times the lease was taken
	// Lost counts holdings ended because the key was taken or removed, or
	// no renew succeeded for TTL/2.
	Lost uint64
	// Released counts holdings given back by deleting the key, for a
	// standby to take at once.
	Released    uint64
	RenewErrors uint64 // renew attempts that failed and were tried again
	Holding     bool   // held now: from taking the lease until it is lost or lead returns
}

type leaseCounters struct {
	acquired, lost, released, renewErrors atomic.Uint64
	holding                               atomic.Bool
}

// Stats returns the lease's counters; any goroutine may call it.
func (l *Lease) Stats() LeaseStats {
	c := &l.stats
	return LeaseStats{Acquired: c.acquired.Load(), Lost: c.lost.Load(), Released: c.released.Load(),
		RenewErrors: c.renewErrors.Load(), Holding: c.holding.Load()}
}

// NewLease validates cfg and returns a lease on js. It starts nothing and
// does not reach the server: Run does.
func NewLease(js jetstream.JetStream, cfg LeaseConfig) (*Lease, error) {
	if js == nil {
		return nil, errors.New("relay: NewLease needs a JetStream")
	}
	if cfg.Bucket == "" {
		cfg.Bucket = DefaultLeaseBucket
	}
	if cfg.Key == "" {
		cfg.Key = DefaultLeaseKey
	}
	if cfg.Holder == "" {
		cfg.Holder = defaultHolder()
	}
	if cfg.TTL == 0 {
		cfg.TTL = DefaultLeaseTTL
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	switch {
	case !opstream.BucketName.MatchString(cfg.Bucket):
		return nil, fmt.Errorf("relay: lease bucket name %q must match %s", cfg.Bucket, opstream.BucketName)
	case !leaseKeyRe.MatchString(cfg.Key):
		return nil, fmt.Errorf("relay: lease key %q must match %s", cfg.Key, leaseKeyRe)
	case cfg.TTL < minLeaseTTL:
		return nil, fmt.Errorf("relay: lease TTL %v is under %v, the shortest max age the server takes", cfg.TTL, minLeaseTTL)
	}
	return &Lease{js: js, cfg: cfg, value: []byte(cfg.Holder), log: cfg.Logger,
		warn: pace.NewWarner(cfg.Logger, "kvpipe/relay: ")}, nil
}

// defaultHolder is host-pid-random: unique to the Lease even within a
// process.
func defaultHolder() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return fmt.Sprintf("%s-%d-%08x", host, os.Getpid(), rand.Uint32())
}

// Run waits until it holds the lease, then calls lead with a context that
// ends when the lease is lost (its cause wraps ErrLeaseLost) or ctx ends.
// When lead returns it releases the lease (deletes the key if still its
// own, so a standby takes over at once) and, unless ctx ended, waits to
// hold it again and calls lead again; after giving the lease up it lets
// standbys try first, for TTL/4. It returns ctx's cause when ctx ends, or
// lead's error when lead returns one that is not its context's ending
// (after releasing). It waits for NATS while it cannot reach it, but
// returns at once a bucket that cannot be the lease's (another TTL). Every
// goroutine it starts has stopped when it returns; a Lease runs once at a
// time.
func (l *Lease) Run(ctx context.Context, lead func(held context.Context) error) error {
	if lead == nil {
		return errors.New("relay: Lease.Run needs a lead function")
	}
	if !l.running.CompareAndSwap(false, true) {
		return errors.New("relay: Lease.Run called while the lease runs")
	}
	defer l.running.Store(false)
	kv, err := l.open(ctx)
	if err != nil {
		return err
	}
	for again := false; ; again = true {
		sent, rev, ok := l.acquire(ctx, kv, again)
		if !ok {
			return context.Cause(ctx)
		}
		if err := l.hold(ctx, kv, sent, rev, lead); err != nil {
			return err
		}
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
	}
}

// errBucket marks an error of open that trying again does not mend.
type errBucket struct{ error }

func (e errBucket) Unwrap() error { return e.error }

// open opens the bucket, or creates it, and checks its TTL; it tries again
// on errors of the server or the network until ctx ends.
func (l *Lease) open(ctx context.Context) (jetstream.KeyValue, error) {
	b := pace.Backoff{Min: 50 * time.Millisecond, Max: 2 * time.Second}
	for {
		kv, err := l.openOnce(ctx)
		var eb errBucket
		switch {
		case err == nil:
			return kv, nil
		case errors.As(err, &eb):
			return nil, eb.error
		case ctx.Err() != nil:
			return nil, context.Cause(ctx)
		}
		l.warn.Warn("cannot open the lease bucket; trying again", "bucket", l.cfg.Bucket, "err", err)
		if !pace.Sleep(ctx, b.Next()) {
			return nil, context.Cause(ctx)
		}
	}
}

func (l *Lease) openOnce(ctx context.Context) (jetstream.KeyValue, error) {
	ctx, cancel := context.WithTimeout(ctx, max(l.cfg.TTL, 2*time.Second))
	defer cancel()
	kv, err := l.js.KeyValue(ctx, l.cfg.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = l.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket:      l.cfg.Bucket,
			Description: "kvpipe relay leases: one key per set of engines, held by the relay that writes",
			History:     1,
			TTL:         l.cfg.TTL,
			Storage:     jetstream.FileStorage,
		})
		if errors.Is(err, jetstream.ErrBucketExists) { // made by another, maybe otherwise: check it
			kv, err = l.js.KeyValue(ctx, l.cfg.Bucket)
		}
	}
	if errors.Is(err, jetstream.ErrBadBucket) || errors.Is(err, jetstream.ErrJetStreamNotEnabled) ||
		errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) {
		return nil, errBucket{fmt.Errorf("relay: lease bucket %s: %w", l.cfg.Bucket, err)}
	}
	if err != nil {
		return nil, err
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, err
	}
	if st.TTL() != l.cfg.TTL {
		return nil, errBucket{fmt.Errorf("relay: lease bucket %s keeps keys for %v, not the lease's TTL %v: "+
			"every lease on a bucket needs its TTL (use %v, another bucket, or delete this one)",
			l.cfg.Bucket, st.TTL(), l.cfg.TTL, st.TTL())}
	}
	if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok && bs.StreamInfo().Config.Storage == jetstream.MemoryStorage {
		l.log.Warn("kvpipe/relay: the lease bucket is in memory: a server restart forgets the lease", "bucket", l.cfg.Bucket)
	}
	return kv, nil
}

// acquire takes the lease: it creates the key, and while another holds it
// waits for the key's deletion (watched) or TTL/4 (polled: a key removed by
// max age makes no watch event) and tries again. After a release (again)
// it first waits TTL/4, for standbys to take the lease. It returns when
// the key was sent and its revision, or false when ctx ended.
func (l *Lease) acquire(ctx context.Context, kv jetstream.KeyValue, again bool) (time.Time, uint64, bool) {
	if again && !pace.Sleep(ctx, l.cfg.TTL/4) {
		return time.Time{}, 0, false
	}
	var w jetstream.KeyWatcher
	var updates <-chan jetstream.KeyValueEntry
	defer func() {
		if w != nil {
			w.Stop()
		}
	}()
	b := pace.Backoff{Min: l.cfg.TTL / 50, Max: l.cfg.TTL / 4}
	for {
		sent := time.Now()
		rev, err := l.tryCreate(ctx, kv)
		wait := l.cfg.TTL / 4
		switch {
		case err == nil:
			return sent, rev, true
		case ctx.Err() != nil:
			return time.Time{}, 0, false
		case errors.Is(err, jetstream.ErrKeyExists):
			b.Reset()
			if w == nil {
				if w, err = kv.Watch(ctx, l.cfg.Key); err != nil {
					w = nil
					l.log.Debug("kvpipe/relay: cannot watch the lease key; polling it", "key", l.cfg.Key, "err", err)
				} else {
					updates = w.Updates()
				}
			}
		default:
			l.warn.Warn("cannot take the lease; trying again", "key", l.cfg.Key, "err", err)
			wait = b.Next()
		}
		if !l.waitForKey(ctx, wait, &w, &updates) {
			return time.Time{}, 0, false
		}
	}
}

// waitForKey waits d, or less if the watcher reports the key deleted or
// purged; it reports false if ctx ended. A watcher whose updates end is
// stopped, to be made again.
func (l *Lease) waitForKey(ctx context.Context, d time.Duration, w *jetstream.KeyWatcher, updates *<-chan jetstream.KeyValueEntry) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		case e, ok := <-*updates:
			switch {
			case !ok:
				(*w).Stop()
				*w, *updates = nil, nil
			case e != nil && e.Operation() != jetstream.KeyValuePut:
				return true
			}
		}
	}
}

// tryCreate creates the key with the holder's value, or takes it back if
// it already holds that value (a create or renew of ours that we gave up on
// landed, or we lost the lease by silence and could not delete the key):
// nobody else can hold the lease while the key exists.
func (l *Lease) tryCreate(ctx context.Context, kv jetstream.KeyValue) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.TTL/4)
	defer cancel()
	rev, err := kv.Create(ctx, l.cfg.Key, l.value)
	if !errors.Is(err, jetstream.ErrKeyExists) {
		return rev, err
	}
	if r, ok := l.ours(ctx, kv); ok {
		if rev, uerr := kv.Update(ctx, l.cfg.Key, l.value, r); uerr == nil {
			return rev, nil
		}
	}
	return 0, err
}

// ours returns the key's revision if it holds this Lease's value.
func (l *Lease) ours(ctx context.Context, kv jetstream.KeyValue) (uint64, bool) {
	e, err := kv.Get(ctx, l.cfg.Key)
	if err != nil || e.Operation() != jetstream.KeyValuePut || string(e.Value()) != l.cfg.Holder {
		return 0, false
	}
	return e.Revision(), true
}

// holding is the state of one holding of the lease.
type holding struct {
	cancel  context.CancelCauseFunc
	holding *atomic.Bool // the Lease's Stats.Holding

	mu       sync.Mutex
	rev      uint64    // the key's last revision of ours
	deadline time.Time // the last successful renew's sending + TTL/2
	cause    error     // why the holding ended; nil while it lasts
	taken    bool      // the key is another's (or gone): do not delete it
}

// end ends the holding for cause; it reports false if it had ended.
func (h *holding) end(cause error, taken bool) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cause != nil {
		return false
	}
	h.cause, h.taken = cause, taken
	h.holding.Store(false)
	h.cancel(cause)
	return true
}

// lose ends h as lost, for cause.
func (l *Lease) lose(h *holding, cause error, taken bool) {
	if h.end(cause, taken) {
		l.log.Warn("kvpipe/relay: lease lost", "key", l.cfg.Key, "holder", l.cfg.Holder, "why", cause)
	}
}

// hold runs lead while the lease is held, renewing it, then releases it.
// It returns lead's error unless that is its context's ending.
func (l *Lease) hold(ctx context.Context, kv jetstream.KeyValue, sent time.Time, rev uint64, lead func(context.Context) error) error {
	// keep lasts while the lease is held: renewals go on after ctx ends,
	// while lead drains, so that the lease cannot pass to a standby before
	// lead has stopped writing. held, lead's, ends with keep or ctx.
	keep, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(errStepDown)
	held, cancelHeld := context.WithCancelCause(context.WithValue(keep, keepKey{}, keep))
	defer cancelHeld(errStepDown)
	defer context.AfterFunc(ctx, func() { cancelHeld(context.Cause(ctx)) })()
	h := &holding{cancel: cancel, holding: &l.stats.holding, rev: rev, deadline: sent.Add(l.cfg.TTL / 2)}
	l.stats.acquired.Add(1)
	l.stats.holding.Store(true)
	l.log.Info("kvpipe/relay: holding the lease", "key", l.cfg.Key, "holder", l.cfg.Holder, "revision", rev)

	var err error
	var endedFirst bool
	func() {
		var wg sync.WaitGroup
		defer func() { // also if lead panics: the key then expires
			h.end(errStepDown, false)
			wg.Wait()
		}()
		wg.Go(func() { l.renew(keep, kv, h, sent) })
		wg.Go(func() { l.watchdog(keep, h) })
		err = lead(held)
		endedFirst = held.Err() != nil
	}()

	if h.cause != errStepDown {
		l.stats.lost.Add(1)
	}
	if !h.taken {
		l.release(ctx, kv, h.rev)
	}
	if err != nil && endedFirst && (errors.Is(err, context.Cause(held)) || errors.Is(err, held.Err()) ||
		errors.Is(err, ErrLeaseLost)) {
		err = nil
	}
	return err
}

// keepKey is the key under which a held context carries its holding's
// keep context, which outlives it while the lease is held.
type keepKey struct{}

// afterHeld is the context for a drain after ctx ended: with a lease, it
// lasts while the lease is held (renewals go on while lead drains) and ends
// when it is lost, so that lead stops writing before a standby can hold
// it; without one, it does not end.
func afterHeld(ctx context.Context) context.Context {
	if keep, ok := ctx.Value(keepKey{}).(context.Context); ok {
		return keep
	}
	return context.WithoutCancel(ctx)
}

// renew renews the key every TTL/6 until held ends, sooner after a failed
// attempt; it ends the holding when the key turns out another's. Three
// attempts fit in the TTL/2 a holder may go unrenewed: one slow renew (a
// loaded machine, a GC pause, a server election) must not cost the lease.
func (l *Lease) renew(held context.Context, kv jetstream.KeyValue, h *holding, sent time.Time) {
	// An attempt waits TTL/10 at most: a renew lost with a dying server
	// must leave time, before TTL/2, to try again on the next.
	every, timeout := l.cfg.TTL/6, l.cfg.TTL/10
	next := sent.Add(every)
	b := pace.Backoff{Min: l.cfg.TTL / 100, Max: l.cfg.TTL / 20}
	for {
		if !pace.Sleep(held, time.Until(next)) {
			return
		}
		h.mu.Lock()
		rev := h.rev
		h.mu.Unlock()
		sent := time.Now()
		ctx, cancel := context.WithTimeout(held, timeout)
		nrev, err := kv.Update(ctx, l.cfg.Key, l.value, rev)
		switch {
		case err == nil:
			h.mu.Lock()
			h.rev = nrev // even if the holding ended: it is the revision to delete
			if d := sent.Add(l.cfg.TTL / 2); d.After(h.deadline) {
				h.deadline = d
			}
			h.mu.Unlock()
			next = sent.Add(every)
			b.Reset()
		case held.Err() != nil:
		case errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyNotFound):
			// A renew we gave up on may have landed: then the key still
			// holds our value, at a later revision, and is still ours.
			if r, ok := l.ours(ctx, kv); ok && r != rev {
				h.mu.Lock()
				h.rev = r
				h.mu.Unlock()
				next = time.Now()
				break
			}
			l.lose(h, fmt.Errorf("%w: key %s was taken or removed (%v)", ErrLeaseLost, l.cfg.Key, err), true)
		default:
			l.stats.renewErrors.Add(1)
			l.warn.Warn("lease not renewed; trying again", "key", l.cfg.Key, "err", err)
			next = time.Now().Add(b.Next())
		}
		cancel()
	}
}

// watchdog ends the holding once its deadline passes unrenewed: TTL/2
// after the last successful renew was sent, at least TTL/2 before the
// server can expire the key.
func (l *Lease) watchdog(held context.Context, h *holding) {
	h.mu.Lock()
	d := time.Until(h.deadline)
	h.mu.Unlock()
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-held.Done():
			return
		case <-t.C:
		}
		h.mu.Lock()
		d := time.Until(h.deadline)
		h.mu.Unlock()
		if d > 0 {
			t.Reset(d)
			continue
		}
		l.lose(h, fmt.Errorf("%w: no renew succeeded for %v", ErrLeaseLost, l.cfg.TTL/2), false)
		return
	}
}

// release deletes the key if it is still this Lease's, for a standby to
// take the lease at once; if it cannot, the key expires.
func (l *Lease) release(ctx context.Context, kv jetstream.KeyValue, rev uint64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.TTL/4)
	defer cancel()
	err := kv.Delete(ctx, l.cfg.Key, jetstream.LastRevision(rev))
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		r, ok := l.ours(ctx, kv)
		if !ok {
			l.log.Debug("kvpipe/relay: lease key no longer ours; nothing to release", "key", l.cfg.Key)
			return
		}
		err = kv.Delete(ctx, l.cfg.Key, jetstream.LastRevision(r))
	}
	if err != nil {
		l.log.Warn("kvpipe/relay: lease not released: a standby takes it when it expires",
			"key", l.cfg.Key, "ttl", l.cfg.TTL, "err", err)
		return
	}
	l.stats.released.Add(1)
	l.log.Info("kvpipe/relay: lease released", "key", l.cfg.Key, "holder", l.cfg.Holder)
}
