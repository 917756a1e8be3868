package wire

import (
	"context"
	"encoding/binary"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/internal/wiretest"
)

func TestInOrderOverTCPAndIPC(t *testing.T) {
	for _, transport := range []string{"tcp", "ipc"} {
		t.Run(transport, func(t *testing.T) {
			ep := freeTCP(t)
			if transport == "ipc" {
				ep = tempIPC(t, "pub")
			}
			pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
			defer pub.Close()
			s, rec := startSubscriber(t, Config{Endpoint: ep})
			last := syncUp(t, pub, rec)
			var want []string
			for i := range 500 {
				pub.Publish(body(i))
				want = append(want, string(body(i)))
			}
			expectBatches(t, rec, last+1, want...)
			if st := s.Stats(); st.Gaps != 0 || st.Lost != 0 || st.Malformed != 0 {
				t.Errorf("gaps=%d lost=%d malformed=%d, want 0", st.Gaps, st.Lost, st.Malformed)
			}
		})
	}
}

// Two engines' streams on one endpoint: the subscriber gets its topic's,
// in order, and none of the other's (which, with their own seqs, would also
// show as gaps and restarts).
func TestTopicFilter(t *testing.T) {
	ep := freeTCP(t)
	raw := rawPUB(t, ep)
	s, rec := startSubscriber(t, Config{Endpoint: ep, Topic: "kv@worker-a"})
	var seqA, seqB uint64
	send := func(topic string, seq *uint64, body string) {
		raw.Send(zmq4.NewMsgFrom([]byte(topic), seqBytes(*seq), []byte(body)))
		*seq++
	}
	rawSync(t, rec, func() { send("kv@worker-a", &seqA, "ours") })
	first := seqA
	var want []string
	for range 30 {
		send("kv@worker-b", &seqB, "not ours")
		send("kv@worker-a", &seqA, "ours")
		want = append(want, "ours")
	}
	expectBatches(t, rec, first, want...)
	if c, ok := rec.quiet(100 * time.Millisecond); !ok {
		t.Errorf("received %+v after the last of our batches", c)
	}
	if st := s.Stats(); st.Gaps != 0 || st.Restarts != 0 {
		t.Errorf("gaps %d restarts %d: the other topic's seqs got through", st.Gaps, st.Restarts)
	}
}

func TestGapRecoveredThroughReplay(t *testing.T) {
	for _, withTopic := range []bool{false, true} {
		name := map[bool]string{false: "reply [empty seq payload]", true: "reply [empty topic seq payload]"}[withTopic]
		t.Run(name, func(t *testing.T) {
			ep, replay := freeTCP(t), freeTCP(t)
			pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay, Topic: "kv", ReplyWithTopic: withTopic})
			defer pub.Close()
			s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: replay, Topic: "kv"})
			last := syncUp(t, pub, rec)
			var want []string
			for i := range 40 {
				if i%10 >= 3 && i%10 <= 5 { // three batches dropped in every ten
					pub.Drop(body(i))
				} else {
					pub.Publish(body(i))
				}
				want = append(want, string(body(i)))
			}
			expectBatches(t, rec, last+1, want...)
			st := s.Stats()
			if st.Lost != 0 || st.Gaps == 0 || st.Replayed < 12 {
				t.Errorf("lost=%d gaps=%d replayed=%d; want 0 lost, gaps, at least 12 replayed",
					st.Lost, st.Gaps, st.Replayed)
			}
			if c, ok := rec.quiet(100 * time.Millisecond); !ok {
				t.Errorf("unexpected call after the stream: %+v", c)
			}
		})
	}
}

// A handler reads the batch's fingerprint from the Subscriber's Position
// instead of hashing the payload again: live and replayed, it must be the
// batch's own.
func TestPositionDuringHandleBatchIsTheBatchs(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	defer pub.Close()
	_, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: replay})
	last := syncUp(t, pub, rec)
	for i := range 20 {
		if i%5 == 2 { // replayed
			pub.Drop(body(i))
		} else {
			pub.Publish(body(i))
		}
	}
	for i := range 20 {
		c := rec.next(t)
		want := position{Seq: last + 1 + uint64(i), Fingerprint: fingerprint(body(i)), Known: true}
		if c.seq != want.Seq || c.pos != want {
			t.Fatalf("batch %d: seq %d, Position %+v; want seq %d, Position %+v", i, c.seq, c.pos, want.Seq, want)
		}
	}
}

func TestGapWithoutReplayIsCountedAndResets(t *testing.T) {
	ep := freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	s, rec := startSubscriber(t, Config{Endpoint: ep})
	last := syncUp(t, pub, rec)
	pub.Drop(body(0))
	pub.Drop(body(1))
	pub.Publish(body(2))
	if c := rec.next(t); !c.reset || c.why != ResetGapLost {
		t.Fatalf("got %+v, want a gap_lost reset", c)
	}
	expectBatches(t, rec, last+3, string(body(2)))
	if got := s.Stats().Lost; got != 2 {
		t.Errorf("lost = %d, want 2", got)
	}
}

func TestReplayThatNoLongerHasTheGap(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay, BufferSteps: 4})
	defer pub.Close()
	s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: replay})
	last := syncUp(t, pub, rec)
	dups := s.Stats().Duplicates // probes both replayed at connect and received live
	// The buffer keeps only the last 4 of these.
	for i := range 10 {
		pub.Drop(body(i))
	}
	pub.Publish(body(10))
	if c := rec.next(t); !c.reset || c.why != ResetHistoryMissing {
		t.Fatalf("got %+v, want a history_missing reset", c)
	}
	// When the request comes the buffer holds the last 4 batches, bodies 7..10
	// (seqs last+8..last+11): 7 batches are gone, and the live 10 is a duplicate.
	expectBatches(t, rec, last+8, string(body(7)), string(body(8)), string(body(9)), string(body(10)))
	// The live body 10 is judged after the replay delivered it.
	for deadline := time.Now().Add(5 * time.Second); s.Stats().Duplicates == dups && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if st := s.Stats(); st.HistoryMissing != 1 || st.Lost != 7 || st.Duplicates-dups != 1 {
		t.Errorf("history_missing=%d lost=%d duplicates=%d, want 1, 7, 1", st.HistoryMissing, st.Lost, st.Duplicates-dups)
	}
}

func TestFailedPublishIsAGapReplayCannotFill(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	defer pub.Close()
	s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: replay})
	last := syncUp(t, pub, rec)
	pub.SkipSeq()
	pub.Publish(body(1))
	if c := rec.next(t); !c.reset || c.why != ResetHistoryMissing {
		t.Fatalf("got %+v, want a history_missing reset", c)
	}
	expectBatches(t, rec, last+2, string(body(1)))
	if got := s.Stats().Lost; got != 1 {
		t.Errorf("lost = %d, want 1", got)
	}
}

func TestReplayEndpointDownCountsTheLoss(t *testing.T) {
	ep := freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: freeTCP(t), Options: Options{ReplayTimeout: 200 * time.Millisecond, ReplayPatience: 300 * time.Millisecond, TailCheck: -1}})
	last := syncUp(t, pub, rec)
	before := s.Stats().ReplayUnreachable
	pub.Drop(body(0))
	pub.Publish(body(1))
	if c := rec.next(t); !c.reset || c.why != ResetGapLost {
		t.Fatalf("got %+v, want a gap_lost reset", c)
	}
	expectBatches(t, rec, last+2, string(body(1)))
	// Retried with backoff for the patience (20ms..200ms steps: several
	// dials), then lost; unreachable is not a failed replay.
	if st := s.Stats(); st.ReplayUnreachable-before < 2 || st.ReplayFailures != 0 || st.Lost != 1 {
		t.Errorf("replay_unreachable=%d replay_failures=%d lost=%d, want >= 2, 0, 1",
			st.ReplayUnreachable-before, st.ReplayFailures, st.Lost)
	}
}

func TestPublisherRestart(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: replay})
	syncUp(t, pub, rec)
	for i := range 20 {
		pub.Publish(body(i))
	}
	for range 20 {
		rec.next(t)
	}
	pub.Close()
	time.Sleep(100 * time.Millisecond) // the engine is down for a while
	pub = newPublisher(t, wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	defer pub.Close()
	// The restarted engine starts at 0 again. Until the SUB has reconnected
	// its batches are lost, as with a real engine, so wait for a reset.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if time.Now().After(deadline) {
			t.Fatal("no restart seen")
		}
		pub.Publish([]byte("after restart"))
		c, quiet := rec.quiet(20 * time.Millisecond)
		if !quiet && c.reset {
			if c.why != ResetRestart {
				t.Fatalf("reset %v, want restart", c.why)
			}
			break
		}
	}
	if c := rec.next(t); c.reset || c.body != "after restart" {
		t.Fatalf("after the reset got %+v", c)
	}
	st := s.Stats()
	if st.Restarts != 1 || st.Reconnects < 1 {
		t.Errorf("restarts=%d reconnects=%d, want 1 and at least 1", st.Restarts, st.Reconnects)
	}
}

// A raw PUB sends messages of the wrong shape between good ones: each bad one
// is counted and skipped, the good ones all arrive.
func TestMalformedMessagesAreSkipped(t *testing.T) {
	ep := freeTCP(t)
	raw := rawPUB(t, ep)
	s, rec := startSubscriber(t, Config{Endpoint: ep})
	seq := uint64(0)
	good := func() {
		raw.Send(zmq4.NewMsgFrom([]byte(""), seqBytes(seq), body(int(seq))))
		seq++
	}
	rawSync(t, rec, good)
	start := seq
	bad := []zmq4.Msg{
		zmq4.NewMsgFrom([]byte(""), seqBytes(99)),                               // 2 frames
		zmq4.NewMsgFrom([]byte(""), seqBytes(99), []byte("p"), []byte("extra")), // 4 frames
		zmq4.NewMsgFrom([]byte(""), []byte{0, 0, 0, 1}, []byte("p")),            // 4-byte seq
		zmq4.NewMsgFrom([]byte(""), []byte{}, []byte("p")),                      // empty seq
	}
	for _, m := range bad {
		raw.Send(m)
		good()
	}
	var want []string
	for i := start; i < seq; i++ {
		want = append(want, string(body(int(i))))
	}
	expectBatches(t, rec, start, want...)
	if got := s.Stats().Malformed; got != uint64(len(bad)) {
		t.Errorf("malformed = %d, want %d", got, len(bad))
	}
}

func TestSubscriberDialsBeforeThePublisherBinds(t *testing.T) {
	ep := freeTCP(t)
	s, rec := startSubscriber(t, Config{Endpoint: ep})
	time.Sleep(150 * time.Millisecond) // several failed dials
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	syncUp(t, pub, rec)
	if !s.Stats().Connected {
		t.Error("not connected after receiving")
	}
}

func TestIdleWatchdogRebuildsTheSocket(t *testing.T) {
	ep := freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	s, rec := startSubscriber(t, Config{Endpoint: ep, Options: Options{IdleTimeout: 100 * time.Millisecond}})
	syncUp(t, pub, rec)
	// Nothing is published: only the watchdog can make a reconnect.
	for deadline := time.Now().Add(5 * time.Second); s.Stats().Reconnects == 0; {
		if time.Now().After(deadline) {
			t.Fatal("no reconnect within 5s of an idle spell with a 100ms idle timeout")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// Without a replay endpoint nothing proves the engine is the same one.
	if c := rec.next(t); !c.reset || c.why != ResetUnproven {
		t.Errorf("after the idle reconnect: %+v, want an unproven reset", c)
	}
	syncUp(t, pub, rec) // and it still receives
}

func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, `endpoint "": scheme "" is not tcp or ipc`},
		{Config{Endpoint: "http://x:1"}, `scheme "http" is not tcp or ipc`},
		{Config{Endpoint: "tcp://host"}, "want tcp://host:port"},
		{Config{Endpoint: "ipc://"}, "want ipc://path"},
		{Config{Endpoint: "tcp://h:1", ReplayEndpoint: "udp://h:2"}, `replay endpoint "udp://h:2"`},
	} {
		_, err := NewSubscriber(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewSubscriber(%+v) = %v, want an error containing %q", tc.cfg, err, tc.want)
		}
	}
}

// A PUB that drops the last batches of a burst shows no gap until the next
// burst; the tail check finds them in the replay buffer after a quiet spell.
func TestTailCheckRecoversAQuietTail(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	defer pub.Close()
	s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: replay, Options: Options{TailCheck: 100 * time.Millisecond}})
	last := syncUp(t, pub, rec)
	replayed := s.Stats().Replayed // the engine's buffer at connect, replayed first
	pub.Publish(body(0))
	pub.Drop(body(1))
	pub.Drop(body(2))
	expectBatches(t, rec, last+1, string(body(0)), string(body(1)), string(body(2)))
	if st := s.Stats(); st.TailChecks == 0 || st.Replayed-replayed != 2 || st.Lost != 0 {
		t.Errorf("tail checks %d, replayed %d, lost %d; want >= 1, 2, 0", st.TailChecks, st.Replayed-replayed, st.Lost)
	}
	// A quiet spell with nothing lost changes nothing.
	if c, quiet := rec.quiet(350 * time.Millisecond); !quiet {
		t.Errorf("a tail check with nothing new made a call: %+v", c)
	}
	if n := s.Stats().HistoryMissing; n != 0 {
		t.Errorf("history missing = %d, want 0", n)
	}
}

// A ROUTER past its high-water mark drops replies silently: a hole inside
// a replay must not be applied over; the subscriber asks again from the hole.
func TestReplayWithAHoleAsksAgain(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	// What the engine keeps for replay, by seq; empty until the test knows
	// what the subscriber has applied.
	var stored atomic.Pointer[[][]byte]
	stored.Store(&[][]byte{})
	requests := make(chan uint64, 16)
	round := 0
	fakeRouter(t, replay, func(router zmq4.Socket, m zmq4.Msg) {
		start, buf := binary.BigEndian.Uint64(m.Frames[2]), *stored.Load()
		if len(buf) > 0 {
			requests <- start
			for seq := start; seq < uint64(len(buf)); seq++ {
				if round == 0 && seq == start+2 {
					continue // dropped on the way
				}
				router.Send(zmq4.NewMsgFrom(m.Frames[0], nil, seqBytes(seq), buf[seq]))
			}
			round++
		}
		router.Send(zmq4.NewMsgFrom(m.Frames[0], nil, seqBytes(endMarker), nil))
	})

	s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: replay, Options: Options{TailCheck: -1}})
	last := syncUp(t, pub, rec)
	var buf [][]byte
	for range last {
		buf = append(buf, []byte("probe")) // never replayed: before the gap
	}
	buf = append(buf, []byte("marker")) // the last batch applied: the proof
	var want []string
	for i := range 5 {
		buf = append(buf, body(i))
		want = append(want, string(body(i)))
	}
	stored.Store(&buf)
	for i := range 4 {
		pub.Drop(body(i))
	}
	pub.Publish(body(4))
	expectBatches(t, rec, last+1, want...)
	// The first request proves the marker, gets body 0, misses body 1; the
	// second asks again from body 0, the last applied.
	if got := []uint64{<-requests, <-requests}; got[0] != last || got[1] != last+1 {
		t.Errorf("replay requests from %v, want %d then %d (the hole)", got, last, last+1)
	}
	if st := s.Stats(); st.Lost != 0 || st.ReplayFailures != 0 || st.Restarts != 0 {
		t.Errorf("lost %d, replay failures %d, restarts %d; want 0", st.Lost, st.ReplayFailures, st.Restarts)
	}
}

// Shutting down while a replay waits for its answer is not a loss: no
// reset, no lost batch, no failure counted.
func TestCancelDuringAReplayIsNotALoss(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	stall, requests := stallingRouter(t, replay)
	s, err := NewSubscriber(Config{Endpoint: ep, ReplayEndpoint: replay, Options: Options{TailCheck: -1, ReplayTimeout: time.Minute, ReconnectMin: 20 * time.Millisecond, ReconnectMax: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(runCtx, rec) }()
	syncUp(t, pub, rec)
	stall()
	pub.Drop(body(0))
	pub.Publish(body(1))
	select {
	case <-requests: // the gap's replay is waiting for its answer
	case <-time.After(10 * time.Second):
		t.Fatal("no replay request for the gap")
	}
	cancel()
	if err := <-done; err != context.Canceled {
		t.Fatalf("Run returned %v", err)
	}
	for len(rec.calls) > 0 {
		if c := <-rec.calls; c.reset {
			t.Errorf("a reset (%v) on shutdown", c.why)
		}
	}
	if st := s.Stats(); st.Lost != 0 || st.ReplayFailures != 0 || st.ReplayUnreachable != 0 {
		t.Errorf("lost %d, replay failures %d, unreachable %d; want 0", st.Lost, st.ReplayFailures, st.ReplayUnreachable)
	}
}

// SGLang names its publisher lifecycle in the topic: a new epoch on the same
// connection is a restart, without a round trip.
func TestNewEpochIsARestart(t *testing.T) {
	ep := freeTCP(t)
	raw := rawPUB(t, ep)
	s, rec := startSubscriber(t, Config{Endpoint: ep, Topic: "kv"})
	send := func(epoch string, seq uint64) {
		raw.Send(zmq4.NewMsgFrom([]byte("kv\x00sgl-kv-epoch="+epoch), seqBytes(seq), body(int(seq))))
	}
	var seq uint64
	rawSync(t, rec, func() { send("aaaa", seq); seq++ })
	send("aaaa", seq)
	expectBatches(t, rec, seq, string(body(int(seq))))
	send("bbbb", seq+1) // in order, but from another lifecycle
	if c := rec.next(t); !c.reset || c.why != ResetRestart {
		t.Fatalf("got %+v, want a restart reset", c)
	}
	expectBatches(t, rec, seq+1, string(body(int(seq+1))))
	send("bbbb", seq+2)
	expectBatches(t, rec, seq+2, string(body(int(seq+2))))
	if got := s.Stats().Restarts; got != 1 {
		t.Errorf("restarts %d, want 1", got)
	}
}

// A live seq 2^40 past the last is garbage or another incarnation, never
// 2^40 lost batches.
func TestImplausibleSeqJumpIsNotALoss(t *testing.T) {
	ep := freeTCP(t)
	raw := rawPUB(t, ep)
	s, rec := startSubscriber(t, Config{Endpoint: ep})
	var seq uint64
	rawSync(t, rec, func() { raw.Send(zmq4.NewMsgFrom(nil, seqBytes(seq), body(int(seq)))); seq++ })
	jump := seq + 1<<40
	raw.Send(zmq4.NewMsgFrom(nil, seqBytes(jump), body(1)))
	if c := rec.next(t); !c.reset || c.why != ResetRestart {
		t.Fatalf("got %+v, want a restart reset", c)
	}
	expectBatches(t, rec, jump, string(body(1)))
	if st := s.Stats(); st.Lost != 0 || st.Restarts != 1 {
		t.Errorf("lost %d, restarts %d; want 0 and 1", st.Lost, st.Restarts)
	}
}
