package kvpipe

import (
	"cmp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kvpipe/kvpipe/index"
)

// workerTable is the read path's copy of the worker table: FindMatches,
// Routed and scrapes read it with no lock, and p.mu's holder changes it.
// It keeps the workers in id order, ids being given in increasing order: a
// worker added is appended, in the array's room when it has some, which no
// earlier reader's view reaches; one removed is left out of a new array.
// Adding a worker so costs O(1) amortized, and removing one a copy of
// pointers. (Rebuilt whole, sorted and with two maps, on each change, a
// table took quadratic time to fill: a relay's follower catching up on
// 16,000 workers took 29 s.)
type workerTable struct {
	byID   atomic.Pointer[[]*worker]
	byName sync.Map // string -> *worker
}

// all is the table's workers in id order; the slice is not to be changed.
func (t *workerTable) all() []*worker {
	if ws := t.byID.Load(); ws != nil {
		return *ws
	}
	return nil
}

// id is the worker of id, nil if none.
func (t *workerTable) id(id index.WorkerID) *worker {
	ws := t.all()
	if i, ok := find(ws, id); ok {
		return ws[i]
	}
	return nil
}

// find is where id is, or would be, in ws (in id order).
func find(ws []*worker, id index.WorkerID) (int, bool) {
	return slices.BinarySearchFunc(ws, id, func(w *worker, id index.WorkerID) int { return cmp.Compare(w.id, id) })
}

// named is the worker of name, nil if none.
func (t *workerTable) named(name string) *worker {
	w, _ := t.byName.Load(name)
	ww, _ := w.(*worker)
	return ww
}

// add adds w, whose id is higher than any in t; p.mu is held.
func (t *workerTable) add(w *worker) {
	ws := append(t.all(), w)
	t.byID.Store(&ws)
	t.byName.Store(w.name, w)
}

// remove removes w; p.mu is held.
func (t *workerTable) remove(w *worker) {
	cur := t.all()
	i, ok := find(cur, w.id)
	if !ok {
		return
	}
	ws := make([]*worker, 0, len(cur)-1)
	ws = append(append(ws, cur[:i]...), cur[i+1:]...)
	t.byID.Store(&ws)
	t.byName.CompareAndDelete(w.name, w)
}

// byWorkerName orders workers by name, the order Stats and snapshots give.
func byWorkerName(a, b *worker) int { return strings.Compare(a.name, b.name) }
