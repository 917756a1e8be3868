package wire

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/kvpipe/kvpipe/internal/ztest"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }

// record is one call to the handler.
type record struct {
	seq     uint64
	body    string
	reset   bool
	why     ResetReason
	resumed bool     // HandleResumed
	pos     position // the Subscriber's Position during HandleBatch
}

// position is what Subscriber.Position returns, comparable as one value.
type position struct {
	Seq, Fingerprint uint64
	Known            bool
}

// positionOf is s's Position; only s's Run goroutine may call it.
func positionOf(s *Subscriber) position {
	seq, fp, known := s.Position()
	return position{seq, fp, known}
}

// recorder is a Handler that hands every call to the test goroutine.
type recorder struct {
	calls chan record
	sub   *Subscriber // whose Position HandleBatch records, if set
}

func newRecorder() *recorder { return &recorder{calls: make(chan record, 100_000)} }

func (r *recorder) HandleBatch(seq uint64, payload []byte) {
	c := record{seq: seq, body: string(payload)}
	if r.sub != nil {
		c.pos = positionOf(r.sub)
	}
	r.calls <- c
}
func (r *recorder) HandleReset(why ResetReason) { r.calls <- record{reset: true, why: why} }
func (r *recorder) HandleResumed()              { r.calls <- record{resumed: true} }

func (r *recorder) next(t *testing.T) record {
	t.Helper()
	select {
	case c := <-r.calls:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("no handler call within 10s")
		return record{}
	}
}

// quiet reports whether the handler stays uncalled for d.
func (r *recorder) quiet(d time.Duration) (record, bool) {
	select {
	case c := <-r.calls:
		return c, false
	case <-time.After(d):
		return record{}, true
	}
}

var freeTCP = ztest.FreeTCP

func tempIPC(t *testing.T, name string) string {
	dir, err := os.MkdirTemp("", "kvpipe")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return "ipc://" + filepath.Join(dir, name)
}

// startSubscriber runs a Subscriber until the test ends and waits for it.
func startSubscriber(t *testing.T, cfg Config) (*Subscriber, *recorder) {
	t.Helper()
	if cfg.ReconnectMax == 0 {
		cfg.ReconnectMin, cfg.ReconnectMax = 20*time.Millisecond, 200*time.Millisecond
	}
	s, err := NewSubscriber(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, runSubscriber(t, s)
}

// runSubscriber runs s until the test ends and waits for it.
func runSubscriber(t *testing.T, s *Subscriber) *recorder {
	t.Helper()
	rec := newRecorder()
	rec.sub = s
	runHandler(t, s, rec)
	return rec
}

// runHandler runs s with h until the test ends and waits for it.
func runHandler(t *testing.T, s *Subscriber, h Handler) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, h) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != context.Canceled {
			t.Errorf("Run returned %v, want context.Canceled", err)
		}
	})
}

// syncUp publishes probe batches until the subscriber has one: PUB/SUB drops
// whatever is sent before the subscription arrives. It returns the last probe's seq.
func syncUp(t *testing.T, pub *wiretest.Publisher, rec *recorder) uint64 {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		pub.Publish([]byte("probe"))
		select {
		case c := <-rec.calls:
			if c.reset {
				continue
			}
			// Drain probes still in flight, then publish a marker to find the end.
			marker := pub.Publish([]byte("marker"))
			for {
				c = rec.next(t)
				if !c.reset && c.seq == marker {
					return marker
				}
			}
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Fatal("subscriber never received a probe")
	return 0
}

func body(i int) []byte { return fmt.Appendf(nil, "batch-%d", i) }

func seqBytes(seq uint64) []byte { return binary.BigEndian.AppendUint64(nil, seq) }

func newPublisher(t *testing.T, cfg wiretest.PublisherConfig) *wiretest.Publisher {
	t.Helper()
	p, err := wiretest.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// expectBatches reads n batches with consecutive seqs from first on, and no reset.
func expectBatches(t *testing.T, rec *recorder, first uint64, bodies ...string) {
	t.Helper()
	for i, want := range bodies {
		c := rec.next(t)
		if c.reset {
			t.Fatalf("batch %d: got a reset (%v), want seq %d", i, c.why, first+uint64(i))
		}
		if c.seq != first+uint64(i) || c.body != want {
			t.Fatalf("batch %d: got seq %d %q, want seq %d %q", i, c.seq, c.body, first+uint64(i), want)
		}
	}
}

// rawPUB is a bare zmq4 PUB bound to ep, for tests that write frames an
// engine would not; it closes when the test ends.
func rawPUB(t *testing.T, ep string) zmq4.Socket {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	raw := zmq4.NewPub(ctx)
	if err := raw.Listen(ep); err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		raw.Close()
		cancel()
	})
	return raw
}

// rawSync calls send until the subscriber has something (PUB drops what is
// sent before the subscription), then drains what is in flight.
func rawSync(t *testing.T, rec *recorder, send func()) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if time.Now().After(deadline) {
			t.Fatal("the subscriber never received anything")
		}
		send()
		if _, quiet := rec.quiet(20 * time.Millisecond); !quiet {
			break
		}
	}
	for len(rec.calls) > 0 {
		rec.next(t)
	}
}

// The engine snapshot's calls: no wire test gives a SnapshotEndpoint.
func (r *recorder) HandleEngineSnapshotBegin()        {}
func (r *recorder) HandleEngineSnapshot(chunk []byte) {}
func (r *recorder) HandleEngineSnapshotEnd(ok bool)   {}
func (r *recorder) HandleIdle() bool                  { return false }

// fakeRouter binds a bare zmq4 ROUTER to ep, an engine's replay socket as
// a test writes it: serve gets each request, on the ROUTER's goroutine,
// until the test ends, which closes the socket and waits for that goroutine.
func fakeRouter(t *testing.T, ep string, serve func(router zmq4.Socket, req zmq4.Msg)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	router := zmq4.NewRouter(ctx)
	if err := router.Listen(ep); err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			m, err := router.Recv()
			if err != nil {
				return
			}
			serve(router, m)
		}
	}()
	t.Cleanup(func() {
		cancel()
		router.Close()
		<-done
	})
}

// silentPeer is a TCP endpoint that takes connections and never speaks (a
// hung engine): the kernel accepts them, nobody reads or writes.
func silentPeer(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return "tcp://" + l.Addr().String()
}

// stallingRouter is a fakeRouter that answers every request with an empty
// buffer until stall is called, and from then on none: it hands them to
// asked instead (a hung engine's ROUTER, which takes requests and answers
// nothing).
func stallingRouter(t *testing.T, ep string) (stall func(), asked <-chan zmq4.Msg) {
	t.Helper()
	var stalled atomic.Bool
	reqs := make(chan zmq4.Msg, 64)
	fakeRouter(t, ep, func(router zmq4.Socket, m zmq4.Msg) {
		if !stalled.Load() {
			router.Send(zmq4.NewMsgFrom(m.Frames[0], nil, seqBytes(endMarker), nil))
			return
		}
		select {
		case reqs <- m:
		default: // the test has the first: enough
		}
	})
	return func() { stalled.Store(true) }, reqs
}
