package predict

import (
	"sync"
	"testing"
)

func keys(from, n int) []uint64 {
	ks := make([]uint64, n)
	for i := range ks {
		ks[i] = uint64(from + i)
	}
	return ks
}

func TestSetRunExpireAndEnd(t *testing.T) {
	var c Counts
	s := NewSet(&c)
	s.Add(&Batch{Keys: keys(1, 10), Until: 100, Max: 1000})
	s.Add(&Batch{Keys: keys(5, 10), Until: 200, Max: 1000}) // 5..9 predicted again, until 200
	if got := s.Run(keys(1, 20), 0); got != 14 {
		t.Fatalf("Run = %d, want 14 (keys 1..14)", got)
	}
	if got := s.Run(keys(1, 20), 3); got != 11 {
		t.Fatalf("Run from 3 = %d, want 11", got)
	}
	if !s.End(7) || s.End(7) || s.End(99) {
		t.Fatal("End reports a key predicted once, and only then")
	}
	if got := s.Run(keys(1, 20), 0); got != 6 {
		t.Fatalf("Run after End(7) = %d, want 6", got)
	}
	if n := s.Expire(99); n != 0 {
		t.Fatalf("Expire(99) ended %d before their time", n)
	}
	if n := s.Expire(100); n != 4 { // 1..4; 5..9 were predicted again
		t.Fatalf("Expire(100) ended %d, want 4", n)
	}
	if got, live := s.Run(keys(5, 10), 0), c.Live.Load(); got != 2 || live != 9 {
		t.Fatalf("after expiry Run = %d, live %d; want 2 (5, 6), 9", got, live)
	}
	if n := s.Expire(200); n != 9 || s.Len() != 0 {
		t.Fatalf("Expire(200) ended %d, %d left; want 9, 0", n, s.Len())
	}
}

// Past the cap the least recently predicted go, and a prompt's leading
// keys are its most recent.
func TestSetCapIsAnLRU(t *testing.T) {
	var c Counts
	s := NewSet(&c)
	s.Add(&Batch{Keys: keys(100, 5), Until: 10, Max: 8})
	s.Add(&Batch{Keys: keys(200, 5), Until: 20, Max: 8})
	if s.Len() != 8 || c.Dropped.Load() != 2 {
		t.Fatalf("len %d, dropped %d; want 8, 2", s.Len(), c.Dropped.Load())
	}
	// The first prompt lost its last two keys, its leading ones stay.
	if got := s.Run(keys(100, 5), 0); got != 3 {
		t.Fatalf("first prompt runs %d, want 3", got)
	}
	s.Add(&Batch{Keys: keys(100, 3), Until: 30, Max: 8}) // used again: the second prompt is older now
	s.Add(&Batch{Keys: keys(300, 2), Until: 40, Max: 8})
	if got := s.Run(keys(100, 5), 0); got != 3 {
		t.Fatalf("first prompt runs %d after its reuse, want 3", got)
	}
	if got := s.Run(keys(200, 5), 0); got != 3 {
		t.Fatalf("second prompt runs %d, want 3 (its leaves evicted)", got)
	}
	if n := s.Clear(); n != 8 || s.Run(keys(100, 3), 0) != 0 || c.Live.Load() != 0 {
		t.Fatalf("Clear ended %d, want 8, and nothing left", n)
	}
}

// Many keys predicted again and again keep the table and the order
// bounded, and readers running beside the writer see whole versions.
func TestSetBoundedUnderChurn(t *testing.T) {
	var c Counts
	s := NewSet(&c)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if n := s.Run(keys(1, 64), 0); n > 64 {
				t.Errorf("Run = %d", n)
			}
		}
	})
	for i := range 2000 {
		s.Add(&Batch{Keys: keys(1+i%200, 64), Until: int64(i + 1), Max: 500})
		if i%7 == 0 {
			s.End(uint64(i % 263))
		}
		s.Expire(int64(i - 50))
	}
	close(stop)
	wg.Wait()
	if s.Len() > 500 || len(s.order)-s.head > 2*s.Len()+64 || len(s.t.ents) > 8*max(s.Len(), 16) {
		t.Fatalf("live %d, order %d, table %d: not bounded", s.Len(), len(s.order)-s.head, len(s.t.ents))
	}
	if got := s.Run(keys(1+1999%200, 64), 0); got != 64 {
		t.Fatalf("the last prompt runs %d, want 64", got)
	}
}
