package index

import (
	"testing"
	"time"
)

// flood has s fill its whole queue, and a shard that then applies every
// batch hand them back, as Shards does.
func flood(t *testing.T, s *Sender, queue chan *Batch) {
	t.Helper()
	for range cap(queue) {
		if !s.Send(s.Batch(), false) {
			t.Fatal("a queue with room refused a batch")
		}
	}
	for range cap(queue) {
		b := <-queue
		b.free <- b
	}
}

// A flood's batches go back to the heap once they have stayed free a
// whole window, all but keepBatches; none sooner.
func TestSenderTrimsAFloodsBatches(t *testing.T) {
	queue := make(chan *Batch, 64)
	s := NewSender(1, queue, nil)
	flood(t, s, queue)
	if s.made != 64 {
		t.Fatalf("made %d batches for a queue of 64", s.made)
	}
	t0 := time.Unix(1000, 0)
	steps := []struct {
		at       time.Duration
		more     bool
		wantMade int
	}{
		{0, true, 64},                    // the window opens
		{trimWindow / 2, true, 64},       // not a whole window yet
		{trimWindow, false, keepBatches}, // stayed free throughout: given back
		{3 * trimWindow, false, keepBatches},
	}
	for _, st := range steps {
		if more := s.Trim(t0.Add(st.at)); more != st.more || s.made != st.wantMade {
			t.Fatalf("at %v: more %v with %d batches, want %v with %d", st.at, more, s.made, st.more, st.wantMade)
		}
	}
	if n := len(s.free); n != keepBatches {
		t.Fatalf("%d free batches kept, want %d", n, keepBatches)
	}
}

// A worker whose stream uses k batches at a time keeps k, however often it
// idles between them: the steady state makes no batch again.
func TestSenderTrimKeepsWhatAStreamUsesAllocatingNothing(t *testing.T) {
	queue := make(chan *Batch, 64)
	s := NewSender(1, queue, nil)
	flood(t, s, queue)
	const inUse = 20
	now := time.Unix(1000, 0)
	for round := range 40 {
		var out []*Batch
		for range inUse {
			out = append(out, s.Batch())
		}
		for _, b := range out {
			s.Send(b, false)
		}
		for range inUse {
			b := <-queue
			b.free <- b
		}
		s.Trim(now)
		now = now.Add(trimWindow / 4)
		if round > 8 && s.made != inUse {
			t.Fatalf("round %d: %d batches, want the %d in use", round, s.made, inUse)
		}
	}
	allocs := testing.AllocsPerRun(100, func() {
		for range inUse {
			s.Send(s.Batch(), false)
		}
		for range inUse {
			b := <-queue
			b.free <- b
		}
		s.Trim(now)
		now = now.Add(trimWindow / 4)
	})
	if raceEnabled { // the race detector allocates on its own
		allocs = 0
	}
	if allocs != 0 || s.made != inUse {
		t.Fatalf("steady state: %v allocations a round, %d batches; want none and %d", allocs, s.made, inUse)
	}
}

// Batches given back are not the Sender's to hand out any more, and a
// Sender that trimmed makes new ones as a flood needs them.
func TestSenderRefillsAfterATrim(t *testing.T) {
	queue := make(chan *Batch, 64)
	s := NewSender(1, queue, nil)
	flood(t, s, queue)
	t0 := time.Unix(1000, 0)
	s.Trim(t0)
	s.Trim(t0.Add(trimWindow))
	flood(t, s, queue)
	if s.made != 64 || len(s.free) != 64 {
		t.Fatalf("after a second flood: %d made, %d free; want 64 and 64", s.made, len(s.free))
	}
}

// Batches lost between Batch and Send (a panic in the worker's goroutine)
// are not waited for: after a whole idle window with what is free within
// keepBatches, Trim stops asking to be called again.
func TestSenderTrimForgetsLostBatches(t *testing.T) {
	queue := make(chan *Batch, 64)
	s := NewSender(1, queue, nil)
	flood(t, s, queue)
	for range keepBatches + 5 { // taken and never sent nor handed back
		s.Batch()
	}
	t0 := time.Unix(1000, 0)
	more := true
	for i := 0; more && i < 5; i++ {
		more = s.Trim(t0.Add(time.Duration(i) * trimWindow))
	}
	if more {
		t.Fatalf("Trim still asks to be called again with %d made and %d free", s.made, len(s.free))
	}
	if n := len(s.free); n != keepBatches {
		t.Fatalf("%d free batches kept, want %d", n, keepBatches)
	}
}
