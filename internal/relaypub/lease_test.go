package relaypub

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/natstest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

const leaseBucket = "test-leases"

// leaseSpan is one holding as its lead saw it: from lead's call to its
// return (end zero while it runs).
type leaseSpan struct {
	who        string
	start, end time.Time
}

// leaseRec records the holdings of every Lease on one key, and any moment
// two of them held it.
type leaseRec struct {
	mu       sync.Mutex
	now      []string // holding now
	spans    []leaseSpan
	overlaps []string
}

// lead returns a lead function for who that records its holding around
// body; a nil body holds until the held context ends.
func (r *leaseRec) lead(who string, body func(held context.Context) error) func(context.Context) error {
	return func(held context.Context) error {
		r.mu.Lock()
		if len(r.now) > 0 {
			r.overlaps = append(r.overlaps, fmt.Sprintf("%s took the lease while %v held it", who, r.now))
		}
		r.now = append(r.now, who)
		i := len(r.spans)
		r.spans = append(r.spans, leaseSpan{who: who, start: time.Now()})
		r.mu.Unlock()
		defer func() {
			r.mu.Lock()
			r.spans[i].end = time.Now()
			r.now = slices.DeleteFunc(r.now, func(s string) bool { return s == who })
			r.mu.Unlock()
		}()
		if body == nil {
			<-held.Done()
			return context.Cause(held)
		}
		return body(held)
	}
}

// holder is who holds the lease now ("" for nobody).
func (r *leaseRec) holder() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.now) == 0 {
		return ""
	}
	return r.now[0]
}

func (r *leaseRec) all() []leaseSpan {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.spans)
}

// last is the last holding of who (ok false if none).
func (r *leaseRec) last(who string) (leaseSpan, bool) {
	spans := r.all()
	for i := len(spans) - 1; i >= 0; i-- {
		if spans[i].who == who {
			return spans[i], true
		}
	}
	return leaseSpan{}, false
}

// check fails t if two holdings ever overlapped: as seen at their start,
// and on the recorded monotonic intervals.
func (r *leaseRec) check(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, o := range r.overlaps {
		t.Error(o)
	}
	for i := 1; i < len(r.spans); i++ {
		prev, cur := r.spans[i-1], r.spans[i]
		if prev.end.IsZero() || cur.start.Before(prev.end) {
			t.Errorf("holding %d (%s) started %v before holding %d (%s) ended", i, cur.who,
				prev.end.Sub(cur.start), i-1, prev.who)
		}
	}
}

// waitFor polls cond every 2ms for up to d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
	}
}

// leaseConn is a connection of its own, to be closed under a lease.
func leaseConn(t *testing.T, srv *natstest.Server) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc := srv.Connect(t, nats.ReconnectWait(10*time.Millisecond))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

func newTestLease(t *testing.T, js jetstream.JetStream, who string, ttl time.Duration) *Lease {
	t.Helper()
	l, err := NewLease(js, LeaseConfig{Bucket: leaseBucket, Holder: who, TTL: ttl, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// leaseRun is a Lease's Run in a goroutine.
type leaseRun struct {
	*Lease
	cancel context.CancelFunc
	done   chan error
}

// runLease runs l with lead until stop or the test's end.
func runLease(t *testing.T, l *Lease, lead func(context.Context) error) *leaseRun {
	ctx, cancel := context.WithCancel(context.Background())
	r := &leaseRun{Lease: l, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- l.Run(ctx, lead) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop ends the run and returns Run's error.
func (r *leaseRun) stop(t *testing.T) error {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		r.done <- err // for a second stop
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("Lease.Run did not return within 10s of its context's end")
		return nil
	}
}

// TestLeaseOneHolderAtATime: three leases on one key, each run again and
// again for random spells, their leads holding a random while or until the
// lease ends: never do two hold at once.
func TestLeaseOneHolderAtATime(t *testing.T) {
	srv := natstest.Start(t)
	const ttl = 600 * time.Millisecond
	var rec leaseRec
	var wg sync.WaitGroup
	start := time.Now()
	for _, who := range []string{"a", "b", "c"} {
		_, js := leaseConn(t, srv)
		l := newTestLease(t, js, who, ttl)
		rng := rand.New(rand.NewPCG(uint64(who[0]), 1))
		wg.Go(func() {
			for time.Since(start) < 3*time.Second {
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(100+rng.IntN(500))*time.Millisecond)
				hold := time.Duration(rng.IntN(100)) * time.Millisecond
				untilLost := rng.IntN(3) == 0
				err := l.Run(ctx, rec.lead(who, func(held context.Context) error {
					if untilLost {
						<-held.Done()
						return context.Cause(held)
					}
					select {
					case <-held.Done():
						return held.Err()
					case <-time.After(hold):
						return nil
					}
				}))
				cancel()
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("%s: Run returned %v, want its context's deadline", who, err)
					return
				}
			}
			if st := l.Stats(); st.Holding || st.Released+st.Lost < st.Acquired {
				t.Errorf("%s: stats %+v after Run returned, want not holding, every holding released or lost", who, st)
			}
		})
	}
	wg.Wait()
	rec.check(t)
	spans := rec.all()
	holders := map[string]bool{}
	for _, s := range spans {
		holders[s.who] = true
	}
	if len(spans) < 10 || len(holders) < 2 {
		t.Errorf("%d holdings by %d leases, want at least 10 by 2 or more", len(spans), len(holders))
	}
	t.Logf("%d holdings by %d leases", len(spans), len(holders))
}

// TestLeaseGracefulHandOver: a holder whose lead returns, or whose Run's
// context ends, deletes the key and the standby, watching it, holds the
// lease within milliseconds, far under the TTL/4 of its poll.
func TestLeaseGracefulHandOver(t *testing.T) {
	srv := natstest.Start(t)
	const ttl = 2 * time.Second
	const quick = 150 * time.Millisecond
	var rec leaseRec
	runs := map[string]*leaseRun{}
	steps := map[string]chan struct{}{}
	for _, who := range []string{"a", "b"} {
		_, js := leaseConn(t, srv)
		step := make(chan struct{})
		steps[who] = step
		runs[who] = runLease(t, newTestLease(t, js, who, ttl), rec.lead(who, func(held context.Context) error {
			select {
			case <-held.Done():
				return context.Cause(held)
			case <-step:
				return nil
			}
		}))
		if who == "a" {
			waitFor(t, 5*time.Second, "a to hold", func() bool { return rec.holder() == "a" })
		}
	}
	time.Sleep(100 * time.Millisecond) // b watches the key
	for i := range 4 {
		from := rec.holder()
		to := map[string]string{"a": "b", "b": "a"}[from]
		steps[from] <- struct{}{}
		waitFor(t, ttl, to+" to hold", func() bool { return rec.holder() == to })
		prev, _ := rec.last(from)
		cur, _ := rec.last(to)
		if gap := cur.start.Sub(prev.end); gap > quick {
			t.Errorf("hand-over %d, %s to %s, took %v, want under %v", i, from, to, gap, quick)
		} else {
			t.Logf("hand-over %d, %s to %s: %v", i, from, to, gap)
		}
		time.Sleep(ttl/4 + 100*time.Millisecond) // the one that gave up is a standby again
	}
	from := rec.holder()
	to := map[string]string{"a": "b", "b": "a"}[from]
	if err := runs[from].stop(t); !errors.Is(err, context.Canceled) {
		t.Errorf("Run of %s returned %v, want context.Canceled", from, err)
	}
	waitFor(t, ttl, to+" to hold", func() bool { return rec.holder() == to })
	prev, _ := rec.last(from)
	cur, _ := rec.last(to)
	if gap := cur.start.Sub(prev.end); gap > quick {
		t.Errorf("hand-over on %s's end took %v, want under %v", from, gap, quick)
	}
	if st := runs[from].Stats(); st.Holding || st.Lost != 0 || st.Released != st.Acquired {
		t.Errorf("%s's stats %+v, want every holding released, none lost", from, st)
	}
	rec.check(t)
}

// TestLeaseCrashedHolder: a holder cut from NATS ends its held context
// within TTL/2 of its last renew, and the standby holds the lease only
// after that, once the key expired, within about TTL + TTL/4.
func TestLeaseCrashedHolder(t *testing.T) {
	srv := natstest.Start(t)
	const ttl = time.Second
	var rec leaseRec
	_, js := leaseConn(t, srv)
	ncA, jsA := leaseConn(t, srv)
	_, jsB := leaseConn(t, srv)
	var causeA error
	a := runLease(t, newTestLease(t, jsA, "a", ttl), rec.lead("a", func(held context.Context) error {
		<-held.Done()
		causeA = context.Cause(held)
		return causeA
	}))
	waitFor(t, 5*time.Second, "a to hold", func() bool { return rec.holder() == "a" })
	runLease(t, newTestLease(t, jsB, "b", ttl), rec.lead("b", nil))
	time.Sleep(ttl / 2) // b watches; a renewed

	crash := time.Now()
	ncA.Close()
	time.Sleep(20 * time.Millisecond) // what a flushed on closing is stored
	kv, err := js.KeyValue(context.Background(), leaseBucket)
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(context.Background(), DefaultLeaseKey)
	if err != nil {
		t.Fatalf("the lease key after a's crash: %v", err)
	}
	renewed := e.Created() // the server's time of a's last renew: the key expires TTL after it
	if string(e.Value()) != "a" {
		t.Fatalf("the key holds %q, want a", e.Value())
	}

	waitFor(t, 3*ttl, "b to hold", func() bool { return rec.holder() == "b" })
	spanA, _ := rec.last("a")
	spanB, _ := rec.last("b")
	t.Logf("after the crash: a stopped in %v (%v after its last renew), b took over in %v",
		spanA.end.Sub(crash), spanA.end.Sub(renewed), spanB.start.Sub(crash))
	if spanA.end.IsZero() || spanA.end.Sub(renewed) > ttl/2+100*time.Millisecond {
		t.Errorf("a held the lease %v after its last renew, want at most TTL/2 (%v)", spanA.end.Sub(renewed), ttl/2)
	}
	if !spanB.start.After(spanA.end) {
		t.Errorf("b took the lease %v before a stopped", spanA.end.Sub(spanB.start))
	}
	if spanB.start.Sub(renewed) < ttl {
		t.Errorf("b took the lease %v after a's last renew, before it expired (TTL %v)", spanB.start.Sub(renewed), ttl)
	}
	// The server checks ages every 250ms at most; b polls every TTL/4.
	if d := spanB.start.Sub(crash); d > ttl+ttl/4+300*time.Millisecond {
		t.Errorf("b took the lease %v after the crash, want about TTL + TTL/4 (%v)", d, ttl+ttl/4)
	}
	if !errors.Is(causeA, ErrLeaseLost) || !strings.Contains(causeA.Error(), "no renew") {
		t.Errorf("a's held context ended with %v, want ErrLeaseLost for want of renewals", causeA)
	}
	if st := a.Stats(); st.Lost != 1 || st.Holding || st.RenewErrors == 0 {
		t.Errorf("a's stats %+v, want 1 lost, renew errors, not holding", st)
	}
	if err := a.stop(t); !errors.Is(err, context.Canceled) {
		t.Errorf("a's Run returned %v, want context.Canceled", err)
	}
	rec.check(t)
}

// TestLeaseNATSRestart: a restart of NATS briefer than the holder's slack
// leaves it holding; a stop longer than TTL makes it stop before anyone
// else holds the lease, and one holds it when NATS is back.
func TestLeaseNATSRestart(t *testing.T) {
	t.Run("brief", func(t *testing.T) {
		srv := natstest.Start(t)
		// Renews go out every TTL/6 and the holder stops TTL/2 after the
		// last that succeeded. NATS stops just after a renew and is back
		// after the next one's first attempt timed out (TTL/10), 150ms
		// before TTL/2: the holder must try again in time, and keep the
		// lease.
		const ttl = 3 * time.Second
		var rec leaseRec
		_, js := leaseConn(t, srv)
		_, jsA := leaseConn(t, srv)
		_, jsB := leaseConn(t, srv)
		a := runLease(t, newTestLease(t, jsA, "a", ttl), rec.lead("a", nil))
		waitFor(t, 5*time.Second, "a to hold", func() bool { return rec.holder() == "a" })
		b := runLease(t, newTestLease(t, jsB, "b", ttl), rec.lead("b", nil))
		kv, err := js.KeyValue(context.Background(), leaseBucket)
		if err != nil {
			t.Fatal(err)
		}
		w, err := kv.Watch(context.Background(), DefaultLeaseKey, jetstream.UpdatesOnly())
		if err != nil {
			t.Fatal(err)
		}
		select {
		case <-w.Updates():
		case <-time.After(ttl):
			t.Fatal("no renew seen")
		}
		w.Stop()
		renewed := time.Now()
		srv.Stop()
		time.Sleep(time.Until(renewed.Add(ttl/2 - 150*time.Millisecond)))
		srv.StartAgain()
		t.Logf("NATS was down for %v after a renew", time.Since(renewed))
		time.Sleep(ttl)
		if spans := rec.all(); len(spans) != 1 || !spans[0].end.IsZero() {
			t.Errorf("holdings %+v, want a's first, still held", spans)
		}
		if st := a.Stats(); st.Acquired != 1 || st.Lost != 0 || !st.Holding || st.RenewErrors == 0 {
			t.Errorf("a's stats %+v, want its first holding, renew errors, nothing lost", st)
		}
		if st := b.Stats(); st.Acquired != 0 {
			t.Errorf("b's stats %+v, want nothing acquired", st)
		}
		rec.check(t)
	})
	t.Run("long", func(t *testing.T) {
		srv := natstest.Start(t)
		const ttl = time.Second
		var rec leaseRec
		_, jsA := leaseConn(t, srv)
		_, jsB := leaseConn(t, srv)
		runLease(t, newTestLease(t, jsA, "a", ttl), rec.lead("a", nil))
		waitFor(t, 5*time.Second, "a to hold", func() bool { return rec.holder() == "a" })
		runLease(t, newTestLease(t, jsB, "b", ttl), rec.lead("b", nil))
		time.Sleep(ttl / 2)
		stopped := time.Now()
		srv.Stop()
		waitFor(t, ttl, "a to stop", func() bool { return rec.holder() == "" })
		spanA, _ := rec.last("a")
		if d := spanA.end.Sub(stopped); d > ttl/2+100*time.Millisecond {
			t.Errorf("a held the lease %v into the outage, want at most TTL/2 (%v)", d, ttl/2)
		}
		time.Sleep(time.Until(stopped.Add(ttl + 300*time.Millisecond)))
		restarted := time.Now()
		srv.StartAgain()
		waitFor(t, 3*ttl, "a holder after the restart", func() bool { return rec.holder() != "" })
		spans := rec.all()
		if len(spans) != 2 || !spans[0].end.Before(restarted) {
			t.Errorf("holdings %+v, want a's ended before the restart and one more", spans)
		}
		time.Sleep(ttl) // renewals go on: still exactly one
		if spans := rec.all(); len(spans) != 2 || !spans[1].end.IsZero() {
			t.Errorf("holdings %+v, want the one after the restart to last", spans)
		}
		t.Logf("a stopped %v into the outage; %s held the lease %v after the restart",
			spanA.end.Sub(stopped), spans[1].who, spans[1].start.Sub(restarted))
		rec.check(t)
	})
}

// TestLeaseBucketWithAnotherTTL: Run refuses a bucket whose max age is not
// the lease's TTL, at once and without holding.
func TestLeaseBucketWithAnotherTTL(t *testing.T) {
	srv := natstest.Start(t)
	_, js := leaseConn(t, srv)
	ctx := context.Background()
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: leaseBucket, TTL: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	l := newTestLease(t, js, "a", time.Second)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	called := false
	err := l.Run(ctx, func(context.Context) error { called = true; return nil })
	if err == nil || ctx.Err() != nil || called || !strings.Contains(err.Error(), "TTL") {
		t.Fatalf("Run on a bucket of another TTL: %v (lead called: %v), want an error about the TTL at once", err, called)
	}
	t.Log(err)
}

// TestLeaseLeadError: Run returns lead's error after deleting the key, and
// the standby holds the lease at once.
func TestLeaseLeadError(t *testing.T) {
	srv := natstest.Start(t)
	const ttl = 2 * time.Second
	var rec leaseRec
	_, jsA := leaseConn(t, srv)
	_, jsB := leaseConn(t, srv)
	boom := errors.New("boom")
	fail := make(chan struct{})
	a := runLease(t, newTestLease(t, jsA, "a", ttl), rec.lead("a", func(held context.Context) error {
		select {
		case <-held.Done():
			return context.Cause(held)
		case <-fail:
			return fmt.Errorf("lead: %w", boom)
		}
	}))
	waitFor(t, 5*time.Second, "a to hold", func() bool { return rec.holder() == "a" })
	runLease(t, newTestLease(t, jsB, "b", ttl), rec.lead("b", nil))
	time.Sleep(100 * time.Millisecond) // b watches the key
	close(fail)
	select {
	case err := <-a.done:
		a.done <- err
		if !errors.Is(err, boom) {
			t.Errorf("Run returned %v, want lead's error", err)
		}
	case <-time.After(ttl):
		t.Fatal("Run did not return lead's error")
	}
	if st := a.Stats(); st.Released != 1 || st.Holding {
		t.Errorf("a's stats %+v, want released, not holding", st)
	}
	waitFor(t, ttl, "b to hold", func() bool { return rec.holder() == "b" })
	spanA, _ := rec.last("a")
	spanB, _ := rec.last("b")
	if gap := spanB.start.Sub(spanA.end); gap > 150*time.Millisecond {
		t.Errorf("b took over %v after a's lead failed, want at once", gap)
	}
	rec.check(t)
}

// TestLeaseTakenKeyIsLostAtOnce: a key written by another under the holder
// ends the holding at its next renew, not TTL/2 later, and it is not
// deleted.
func TestLeaseTakenKeyIsLostAtOnce(t *testing.T) {
	srv := natstest.Start(t)
	const ttl = 1500 * time.Millisecond
	var rec leaseRec
	_, js := leaseConn(t, srv)
	var cause error
	a := runLease(t, newTestLease(t, js, "a", ttl), rec.lead("a", func(held context.Context) error {
		<-held.Done()
		cause = context.Cause(held)
		return nil
	}))
	waitFor(t, 5*time.Second, "a to hold", func() bool { return rec.holder() == "a" })
	kv, err := js.KeyValue(context.Background(), leaseBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.PutString(context.Background(), DefaultLeaseKey, "intruder"); err != nil {
		t.Fatal(err)
	}
	put := time.Now()
	waitFor(t, ttl, "a to stop", func() bool { return rec.holder() == "" })
	span, _ := rec.last("a")
	if d := span.end.Sub(put); d > ttl/3+100*time.Millisecond {
		t.Errorf("a stopped %v after its key was taken, want within a renew (%v)", d, ttl/3)
	}
	if !errors.Is(cause, ErrLeaseLost) || !strings.Contains(cause.Error(), "taken") {
		t.Errorf("a's held context ended with %v, want ErrLeaseLost for a taken key", cause)
	}
	e, err := kv.Get(context.Background(), DefaultLeaseKey)
	if err != nil || string(e.Value()) != "intruder" {
		t.Errorf("the key after a lost it: %v, %v; want the intruder's", e, err)
	}
	if st := a.Stats(); st.Lost != 1 || st.Released != 0 {
		t.Errorf("a's stats %+v, want 1 lost, none released", st)
	}
	rec.check(t)
}

// TestLeaseDrainEndsWhenLost: after Run's context ends, lead drains on
// afterHeld(held), which lasts while the renewals go on (past TTL) and ends
// as soon as the lease is lost, so a drain cannot write while a standby
// holds the lease.
func TestLeaseDrainEndsWhenLost(t *testing.T) {
	srv := natstest.Start(t)
	const ttl = 1500 * time.Millisecond
	var rec leaseRec
	_, js := leaseConn(t, srv)
	draining, drained := make(chan struct{}), make(chan error, 1)
	a := runLease(t, newTestLease(t, js, "a", ttl), rec.lead("a", func(held context.Context) error {
		<-held.Done()
		drain := afterHeld(held)
		close(draining)
		<-drain.Done()
		drained <- context.Cause(drain)
		return nil
	}))
	waitFor(t, 5*time.Second, "a to hold", func() bool { return rec.holder() == "a" })
	a.cancel()
	<-draining
	select {
	case err := <-drained:
		t.Fatalf("the drain ended %v, while the lease was held: %v", ttl, err)
	case <-time.After(ttl):
	}
	kv, err := js.KeyValue(context.Background(), leaseBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.PutString(context.Background(), DefaultLeaseKey, "intruder"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-drained:
		if !errors.Is(err, ErrLeaseLost) {
			t.Errorf("the drain ended with %v, want ErrLeaseLost", err)
		}
	case <-time.After(ttl):
		t.Fatalf("the drain went on %v after the key was taken", ttl)
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	if afterHeld(ended).Err() != nil {
		t.Error("without a lease, afterHeld of an ended context ended too")
	}
	rec.check(t)
}

func TestNewLeaseErrors(t *testing.T) {
	srv := natstest.Start(t)
	_, js := leaseConn(t, srv)
	for _, c := range []struct {
		name string
		js   jetstream.JetStream
		cfg  LeaseConfig
	}{
		{"no JetStream", nil, LeaseConfig{}},
		{"bucket", js, LeaseConfig{Bucket: "a.b"}},
		{"key", js, LeaseConfig{Key: "a b"}},
		{"key dot", js, LeaseConfig{Key: "a."}},
		{"TTL", js, LeaseConfig{TTL: 10 * time.Millisecond}},
	} {
		if _, err := NewLease(c.js, c.cfg); err == nil {
			t.Errorf("%s: NewLease took %+v", c.name, c.cfg)
		}
	}
	l, err := NewLease(js, LeaseConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if l.cfg.Bucket != DefaultLeaseBucket || l.cfg.Key != DefaultLeaseKey || l.cfg.TTL != DefaultLeaseTTL || l.cfg.Holder == "" {
		t.Errorf("defaults: %+v", l.cfg)
	}
}
