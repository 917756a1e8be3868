package kvpipe

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/index"
)

// The table answers by id and by name for the workers added and not
// removed, in id order, while readers read it (run with -race: a reader's
// view is never written under it).
func TestWorkerTable(t *testing.T) {
	var tab workerTable
	var live []*worker
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				// The race detector checks that nothing writes what a
				// view reads.
				view := tab.all()
				for i := 1; i < len(view); i++ {
					if view[i-1].id >= view[i].id {
						t.Errorf("not in id order: %d then %d", view[i-1].id, view[i].id)
						return
					}
				}
			}
		})
	}
	for id := range index.WorkerID(600) {
		w := &worker{id: id, name: fmt.Sprintf("w%d", id%150)} // names reused once removed
		if old := tab.named(w.name); old != nil {
			tab.remove(old)
			live = slices.DeleteFunc(live, func(x *worker) bool { return x == old })
		}
		tab.add(w)
		live = append(live, w)
		if id%7 == 0 { // and some removed in the middle
			gone := live[len(live)/2]
			tab.remove(gone)
			live = slices.Delete(live, len(live)/2, len(live)/2+1)
			if tab.id(gone.id) != nil || tab.named(gone.name) != nil {
				t.Fatalf("worker %d found after its removal", gone.id)
			}
		}
	}
	close(stop)
	wg.Wait()
	if !slices.Equal(tab.all(), live) {
		t.Fatalf("table holds %d workers, want %d", len(tab.all()), len(live))
	}
	for _, w := range live {
		if tab.id(w.id) != w || tab.named(w.name) != w {
			t.Errorf("worker %d (%s) not found", w.id, w.name)
		}
	}
	tab.remove(&worker{id: 10000, name: "w1"}) // not in the table: nothing removed
	if tab.named("w1") == nil {
		t.Error("removing an unknown worker removed the one of its name")
	}
}

// BenchmarkAddWorker adds a worker to a pipeline that holds n already: its cost must not grow with n, or a follower catching
// up on n workers takes n times n.
func BenchmarkAddWorker(b *testing.B) {
	for _, n := range []int{100, 1000, 16000} {
		b.Run(fmt.Sprintf("workers=%d", n), func(b *testing.B) {
			p, err := New(Config{BlockSize: 16})
			if err != nil {
				b.Fatal(err)
			}
			for i := range n {
				if err := p.AddWorker(fmt.Sprintf("w%d", i), WorkerConfig{}); err != nil {
					b.Fatal(err)
				}
			}
			names := make([]string, b.N)
			for i := range names {
				names[i] = fmt.Sprintf("x%d", i)
			}
			b.ResetTimer()
			for i := range b.N {
				if err := p.AddWorker(names[i], WorkerConfig{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkFindMatchesWorkers: a match on a pipeline of n workers that hold
// nothing, so that what it costs beyond the lookup is what grows with the
// table (which kinds of keys to hash: plain, EAGLE).
func BenchmarkFindMatchesWorkers(b *testing.B) {
	for _, n := range []int{100, 16000} {
		b.Run(fmt.Sprintf("workers=%d", n), func(b *testing.B) {
			p := startPipeline(b, Config{})
			for i := range n {
				if err := p.AddWorker(fmt.Sprintf("w%d", i), WorkerConfig{}); err != nil {
					b.Fatal(err)
				}
			}
			for p.read.shards.Load() == nil { // Run has not started yet
				time.Sleep(time.Millisecond)
			}
			r := &Request{Tokens: make([]uint32, 1024)}
			ctx := context.Background()
			for b.Loop() {
				if _, err := p.FindMatchesRequest(ctx, r); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
