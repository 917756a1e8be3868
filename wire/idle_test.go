package wire

import (
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/wiretest"
)

// holding is a recorder whose handler always holds work back: every
// HandleIdle reports some still held, and its time is sent on idles.
type holding struct {
	*recorder
	idles chan time.Time
}

func (h holding) HandleIdle() bool {
	select {
	case h.idles <- time.Now():
	default:
	}
	return true
}

// Each quiet spell's first retry of held work comes after the shortest
// wait, however long the retries of the spells before it backed off: a
// handler that holds work on every idle (an actor with spare batches to
// give back) must not push a clear owed after a later batch out to the
// longest wait.
func TestHeldWorkRetriedSoonInEachQuietSpell(t *testing.T) {
	ep := freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	defer pub.Close()
	s, err := NewSubscriber(Config{Endpoint: ep, Options: Options{TailCheck: -1, ReconnectMin: 20 * time.Millisecond, ReconnectMax: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	h := holding{recorder: newRecorder(), idles: make(chan time.Time, 1)}
	runHandler(t, s, h)
	syncUp(t, pub, h.recorder)
	for i := range 12 { // enough spells for the backoff to reach its top (1 s) if never reset
		pub.Publish(body(i))
		for got := h.next(t); got.body != string(body(i)); got = h.next(t) {
		}
		drain(h.idles)
		<-h.idles // the idle right after the batch
		after := time.Now()
		select {
		case <-h.idles: // the first retry
			if wait := time.Since(after); wait > 500*time.Millisecond {
				t.Fatalf("spell %d: the first retry came after %v", i, wait)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("spell %d: no retry of the held work", i)
		}
		time.Sleep(30 * time.Millisecond) // a few retries, backing off
	}
}

// drain empties c.
func drain(c chan time.Time) {
	for {
		select {
		case <-c:
		default:
			return
		}
	}
}

// While its engine is gone, the handler is still asked before each
// reconnect attempt to hand on held work and give back spare memory: an
// actor's batches left from a flood go back to the heap, and an owed
// clear reaches the shard, also while the engine stays away.
func TestHandlerIdledWhileDisconnected(t *testing.T) {
	ep := freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
	s, err := NewSubscriber(Config{Endpoint: ep, Options: Options{TailCheck: -1, ReconnectMin: 20 * time.Millisecond, ReconnectMax: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	h := holding{recorder: newRecorder(), idles: make(chan time.Time, 1)}
	runHandler(t, s, h)
	syncUp(t, pub, h.recorder)
	pub.Close()
	for deadline := time.Now().Add(10 * time.Second); s.Stats().Connected; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("still connected 10 s after the engine closed")
		}
	}
	drain(h.idles)
	for i := range 3 {
		select {
		case <-h.idles:
		case <-time.After(5 * time.Second):
			t.Fatalf("idle %d: none while disconnected (%+v)", i, s.Stats())
		}
	}
	if s.Stats().Connected {
		t.Error("connected again with no engine")
	}
}
