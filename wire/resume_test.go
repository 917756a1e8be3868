package wire

import (
	"context"
	"errors"
	"io"
	"math"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/wiretest"
)

// A subscriber resumed from a snapshot's seq and fingerprint proves
// continuity at its first connection and gets only what came after; a
// fingerprint the engine's batch does not have is another incarnation,
// replayed from its first batch after a restart reset; without a replay
// endpoint nothing can be proven, and the worker is reset.
func TestResumeFromASnapshot(t *testing.T) {
	cases := []struct {
		name      string
		replay    bool
		fp        func() uint64
		wantReset *ResetReason
		from      int // the first batch delivered
	}{
		{"proven", true, func() uint64 { return fingerprint(body(4)) }, nil, 5},
		{"another incarnation", true, func() uint64 { return fingerprint([]byte("not batch 4")) }, ptr(ResetRestart), 0},
		{"no replay endpoint", false, func() uint64 { return fingerprint(body(4)) }, ptr(ResetUnproven), -1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ep, replay := freeTCP(t), ""
			if c.replay {
				replay = freeTCP(t)
			}
			pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
			defer pub.Close()
			for i := range 10 { // sent before anyone listens: only the replay buffer has them
				pub.Publish(body(i))
			}
			pub.Flush() // the publisher is asynchronous: the replay buffer holds batch 4 from here
			s, err := NewSubscriber(Config{Endpoint: ep, ReplayEndpoint: replay,
				Options: Options{ReconnectMin: 20 * time.Millisecond, ReconnectMax: 200 * time.Millisecond}})
			if err != nil {
				t.Fatal(err)
			}
			s.Resume(4, c.fp())
			rec := runSubscriber(t, s)
			if c.wantReset != nil {
				if got := rec.next(t); !got.reset || got.why != *c.wantReset {
					t.Fatalf("first call %+v, want a %v reset", got, *c.wantReset)
				}
			}
			var want []string
			for i := max(c.from, 0); i < 10; i++ {
				want = append(want, string(body(i)))
			}
			if c.wantReset == nil { // proven: the handler is told once the replay is through
				expectBatches(t, rec, uint64(c.from), want...)
				if got := rec.next(t); !got.resumed {
					t.Fatalf("after the replay %+v, want HandleResumed", got)
				}
				want = nil
			}
			if c.from < 0 { // nothing replayed: the next live batch goes on
				last := syncUp(t, pub, rec)
				if last < 10 {
					t.Fatalf("live batches from %d", last)
				}
				return
			}
			expectBatches(t, rec, uint64(c.from), want...)
			if got, ok := rec.quiet(100 * time.Millisecond); !ok {
				t.Errorf("unexpected call %+v", got)
			}
			var pos position
			if err := s.Checkpoint(context.Background(), func() { pos = positionOf(s) }); err != nil {
				t.Fatal(err)
			}
			if want := (position{Seq: 9, Fingerprint: fingerprint(body(9)), Known: true}); pos != want {
				t.Errorf("position %+v, want %+v", pos, want)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

// Checkpoint runs in Run's goroutine, so it waits for Run, and gives up
// with its context.
func TestCheckpointWaitsForRun(t *testing.T) {
	s, err := NewSubscriber(Config{Endpoint: freeTCP(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	ran := false
	if err := s.Checkpoint(ctx, func() { ran = true }); err != context.DeadlineExceeded || ran {
		t.Fatalf("Checkpoint without Run: err %v, ran %v; want the deadline and no call", err, ran)
	}
	// Run with no publisher there: it is dialling, and still answers.
	runSubscriber(t, s)
	var pos position
	if err := s.Checkpoint(context.Background(), func() { pos = positionOf(s) }); err != nil {
		t.Fatal(err)
	}
	if pos.Known {
		t.Errorf("position %+v before any batch, want none known", pos)
	}
}

// A dial to a peer that accepts and never speaks lasts HandshakeTimeout:
// a Checkpoint meanwhile is answered at once, not after it (a snapshot
// of every worker would wait for the hung one).
func TestCheckpointAnsweredWhileAHandshakeHangs(t *testing.T) {
	s, err := NewSubscriber(Config{Endpoint: silentPeer(t), Options: Options{HandshakeTimeout: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	runSubscriber(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Checkpoint(ctx, func() {}); err != nil {
		t.Fatalf("Checkpoint during a handshake that hangs: %v", err)
	}
}

// A replay whose endpoint takes the request and never answers (a hung
// engine) waits ReplayTimeout for a reply, and then retries for
// ReplayPatience; a Checkpoint meanwhile is answered at once, at the last
// batch applied (a snapshot or a save on SIGTERM must not wait for it).
func TestCheckpointAnsweredWhileAReplayWaits(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	stall, asked := stallingRouter(t, replay)
	s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: replay, Options: Options{TailCheck: -1, ReplayTimeout: time.Hour}})
	last := syncUp(t, pub, rec)
	stall()
	pub.Drop(body(0))
	pub.Publish(body(1)) // a gap: the replay asks, and waits
	select {
	case <-asked:
	case <-time.After(10 * time.Second):
		t.Fatal("the gap was never asked for")
	}
	wait, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	var pos position
	if err := s.Checkpoint(wait, func() { pos = positionOf(s) }); err != nil {
		t.Fatalf("Checkpoint during a replay that waits: %v", err)
	}
	if pos.Seq != last || !pos.Known {
		t.Errorf("position %+v during the replay, want seq %d (the last applied), known", pos, last)
	}
}

// A replay's dial to an endpoint that accepts and never speaks lasts
// replayHandshake (1 s); a Checkpoint meanwhile is answered at once, while
// the connection the dial waits on is still open. (The catch-up of a new
// session dials first, before any batch.)
func TestCheckpointAnsweredWhileAReplayDialHangs(t *testing.T) {
	ep := freeTCP(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	s, _ := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: "tcp://" + l.Addr().String(), Options: Options{TailCheck: -1}})
	var conn net.Conn
	select {
	case conn = <-accepted:
		defer conn.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("the replay never dialled")
	}
	wait, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	if err := s.Checkpoint(wait, func() {}); err != nil {
		t.Fatalf("Checkpoint during the replay's dial: %v", err)
	}
	// The dial still waits: its connection is open (what it sent read, no
	// end of it).
	conn.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	if _, err = io.Copy(io.Discard, conn); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("the dial ended before the Checkpoint was answered: %v", err)
	}
}

// A reset within one incarnation fetches the engine's snapshot; an
// endpoint that hangs before the snapshot's header (its dial's handshake,
// or a ROUTER that takes the request and answers nothing) waits
// HandshakeTimeout or ReplayTimeout, and a Checkpoint meanwhile is
// answered at once.
func TestCheckpointAnsweredWhileAnEngineSnapshotWaits(t *testing.T) {
	for _, c := range []struct {
		name string
		peer func(t *testing.T) string // the snapshot endpoint
	}{
		{"handshake hangs", silentPeer},
		{"no header", func(t *testing.T) string {
			ep := freeTCP(t)
			fakeRouter(t, ep, func(zmq4.Socket, zmq4.Msg) {})
			return ep
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ep, snap := freeTCP(t), c.peer(t)
			pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
			defer pub.Close()
			s, rec := startSubscriber(t, Config{Endpoint: ep, SnapshotEndpoint: snap,
				Options: Options{TailCheck: -1, HandshakeTimeout: time.Hour, ReplayTimeout: time.Hour}})
			syncUp(t, pub, rec)
			pub.Drop(body(0))
			pub.Publish(body(1)) // a gap lost, so a reset, so the engine's snapshot
			if got := rec.next(t); !got.reset || got.why != ResetGapLost {
				t.Fatalf("got %+v, want a gap_lost reset", got)
			}
			wait, stop := context.WithTimeout(context.Background(), 10*time.Second)
			defer stop()
			ran := false
			if err := s.Checkpoint(wait, func() { ran = true }); err != nil || !ran {
				t.Fatalf("Checkpoint while the engine's snapshot waits: %v (ran %v)", err, ran)
			}
		})
	}
}

// An engine snapshot whose replies trickle in, each within ReplayTimeout,
// fails once its budget (snapshotBudget) is spent: a Checkpoint meanwhile
// waits for that, not for the snapshot's end, and the stream goes on.
func TestTricklingEngineSnapshotFails(t *testing.T) {
	const replayTimeout = 100 * time.Millisecond
	ep, snap := freeTCP(t), freeTCP(t)
	header := engineenc.AppendEngineSnapshotHeader(nil, &codec.EngineSnapshotHeader{Version: 1, BarrierSeq: 1, RecordCount: 1_000})
	chunk := engineenc.AppendEngineSnapshotChunk(nil, []codec.EngineSnapshotBlock{{Hashes: []uint64{1}}})
	stop := make(chan struct{})
	var trickled sync.WaitGroup
	t.Cleanup(func() { close(stop); trickled.Wait() })
	fakeRouter(t, snap, func(router zmq4.Socket, req zmq4.Msg) {
		id := req.Frames[0]
		reply := func(kind string, payload []byte) error {
			return router.Send(zmq4.NewMsgFrom(id, nil, []byte(kind), payload))
		}
		trickled.Go(func() {
			if reply("header", header) != nil {
				return
			}
			for {
				select {
				case <-stop:
					return
				case <-time.After(replayTimeout / 4):
				}
				if reply("chunk", chunk) != nil {
					return
				}
			}
		})
	})
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	s, err := NewSubscriber(Config{Endpoint: ep, SnapshotEndpoint: snap,
		Options: Options{TailCheck: -1, ReplayTimeout: replayTimeout, ReconnectMin: 20 * time.Millisecond, ReconnectMax: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	rec := snapshotting{recorder: newRecorder(), begun: make(chan struct{}, 1)}
	runHandler(t, s, rec)
	syncUp(t, pub, rec.recorder)
	pub.Drop(body(0))
	pub.Publish(body(1)) // a gap lost, so a reset, so the engine's snapshot
	if got := rec.next(t); !got.reset || got.why != ResetGapLost {
		t.Fatalf("got %+v, want a gap_lost reset", got)
	}
	<-rec.begun // the header taken: Checkpoint now waits for the snapshot's end
	// The trickle never ends: without the bound, the Checkpoint would wait
	// for this context.
	wait, cancel := context.WithTimeout(context.Background(), 20*snapshotRounds*replayTimeout)
	defer cancel()
	if err := s.Checkpoint(wait, func() {}); err != nil {
		t.Fatalf("Checkpoint during a trickling snapshot: %v", err)
	}
	if st := s.Stats(); st.SnapshotFailures != 1 || st.Snapshots != 0 {
		t.Errorf("snapshots %d, failures %d; want 0 and 1", st.Snapshots, st.SnapshotFailures)
	}
	pub.Publish(body(2))
	for {
		if got := rec.next(t); got.body == string(body(2)) {
			break
		}
	}
}

// snapshotting is a recorder that says when an engine snapshot begins.
type snapshotting struct {
	*recorder
	begun chan struct{}
}

func (r snapshotting) HandleEngineSnapshotBegin() {
	select {
	case r.begun <- struct{}{}:
	default:
	}
}

func TestSnapshotBudget(t *testing.T) {
	for _, c := range []struct {
		name    string
		timeout time.Duration
		records int
		want    time.Duration
	}{
		{"no records", 2 * time.Second, 0, 20 * time.Second},
		{"a negative count", 2 * time.Second, -5, 20 * time.Second},
		{"4 Mi records", 2 * time.Second, 1 << 22, 20*time.Second + 41943040*time.Microsecond},
		{"more than any engine", 2 * time.Second, 1 << 40, 20*time.Second + 167772160*time.Microsecond},
		{"a timeout past reckoning", math.MaxInt64 / 4, 100, math.MaxInt64},
	} {
		if got := snapshotBudget(c.timeout, c.records); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}
