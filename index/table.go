package index

import (
	"math/bits"
	"sync/atomic"
)

// A shard's index is a flat open-addressing table, chained key -> bitset of
// the shard's workers holding that block, with one writer (the shard
// goroutine) and any number of readers on their callers' goroutines.
//
// Memory order relied on (Go's sync/atomic is sequentially consistent, and
// everything named below is an atomic load or store):
//   - A new entry's bitset is stored before its key, and a key, once stored,
//     never changes within a version: a probe chain only grows, so a reader
//     either finds the key or stops at an empty entry that was empty when it
//     looked (the store had not happened yet).
//   - A worker's slot -> WorkerID is stored before any of its bits, so a
//     reader that saw a bit maps it to the worker that set it. Within a
//     version a slot is taken at most once; a freed slot is only handed out
//     again in a later version, so readers of the old version keep mapping
//     the old worker's (stale) bits to the old worker, and the new version
//     was built after those bits were cleared.
//   - Versions are published with cur.Store after they are fully built. A
//     reader pins a version by incrementing its readers count and then
//     checking that it is still current (pin); the writer recycles a version
//     only after unpublishing it and seeing readers == 0. A reader that
//     incremented after that check fails the re-check (or, if the table has
//     been rebuilt and published again meanwhile, reads a complete current
//     version), so no reader reads a table while it is being rebuilt.
//
// Removing a worker's last hold leaves the entry in place with an empty
// bitset (so probe chains stay intact); such entries are dropped when the
// writer rebuilds the table, which it does when used entries would pass 3/4
// of capacity or a worker needs a slot that only a new version can give.

const (
	minCap = 1 << 10 // entries of a new shard's table
	chunk  = 8       // bitset words a reader scores at once, on its stack (512 workers)
	// lookahead is how many keys a reader looks up, at most, before
	// scoring them.
	lookahead = 32
)

// table is one version of a shard's index.
type table struct {
	readers atomic.Int32    // readers that pinned this version
	data    []atomic.Uint64 // cap+1 entries of stride words: key, then bitset; entry cap is key 0's
	slots   []atomic.Uint32 // bitset slot -> WorkerID, as of this version
	shift   uint            // 64 - log2(cap)
	mask    int             // cap - 1
	words   int             // bitset words per entry
	stride  int             // 1 + words
}

func (t *table) home(k uint64) int { return int((k * 0x9e3779b97f4a7c15) >> t.shift) }

// find returns the offset of k's entry in data, or -1. Key 0 marks an empty
// entry, so key 0 itself has the extra entry at the end.
func (t *table) find(k uint64) int {
	if k == 0 {
		return (t.mask + 1) * t.stride
	}
	for i := t.home(k); ; i = (i + 1) & t.mask {
		e := i * t.stride
		switch t.data[e].Load() {
		case k:
			return e
		case 0:
			return -1
		}
	}
}

// place returns the offset of k's entry, or of the empty entry that would
// take it (found false). The writer's alone.
func (t *table) place(k uint64) (e int, found bool) {
	if k == 0 {
		return (t.mask + 1) * t.stride, true
	}
	for i := t.home(k); ; i = (i + 1) & t.mask {
		e := i * t.stride
		switch t.data[e].Load() {
		case k:
			return e, true
		case 0:
			return e, false
		}
	}
}

// held reports whether any worker holds the entry at e.
func (t *table) held(e int) bool {
	for j := 1; j <= t.words; j++ {
		if t.data[e+j].Load() != 0 {
			return true
		}
	}
	return false
}

// match appends the score of every worker of this version holding at least
// hashes[0]. Each key's bitset is loaded once per chunk of words.
func (t *table) match(dst []Score, hashes []uint64) []Score {
	for c := 0; c < t.words; c += chunk {
		dst = t.matchChunk(dst, hashes, c, min(chunk, t.words-c))
	}
	return dst
}

func (t *table) matchChunk(dst []Score, hashes []uint64, c, n int) []Score {
	var active [chunk]uint64 // the workers holding every key so far
	e := t.find(hashes[0])
	if e < 0 {
		return dst
	}
	var any uint64
	for j := range n {
		active[j] = t.data[e+1+c+j].Load()
		any |= active[j]
	}
	if any == 0 {
		return dst
	}
	// Keys are looked up a group at a time before their bitsets are read:
	// the lookups are independent, so the CPU overlaps their cache misses,
	// which are most of a long prompt's cost (a static table's p99 lookup,
	// 3,500 keys on the trace, took a third less time than one key at a
	// time). Up to lookahead-1 lookups past the end of a match are wasted.
	var ents [lookahead]int
	for i := 1; i < len(hashes); {
		g := min(lookahead, len(hashes)-i)
		for k := range g {
			ents[k] = t.find(hashes[i+k])
		}
		for k := 0; k < g; k, i = k+1, i+1 {
			e := ents[k]
			any = 0
			for j := range n {
				var m uint64
				if e >= 0 {
					m = active[j] & t.data[e+1+c+j].Load()
				}
				if gone := active[j] &^ m; gone != 0 {
					dst = t.emit(dst, gone, c+j, i)
				}
				active[j] = m
				any |= m
			}
			if any == 0 {
				return dst
			}
		}
	}
	for j := range n {
		dst = t.emit(dst, active[j], c+j, len(hashes))
	}
	return dst
}

// emit appends a score of blocks for every worker in word w's set bits.
func (t *table) emit(dst []Score, set uint64, w, blocks int) []Score {
	for set != 0 {
		b := bits.TrailingZeros64(set)
		set &= set - 1
		dst = append(dst, Score{Worker: WorkerID(t.slots[w*64+b].Load()), Blocks: blocks})
	}
	return dst
}

// writer is a shard's index: the published table and what only the shard
// goroutine touches. Its ops mean what Tree's do.
type writer struct {
	cur   atomic.Pointer[table] // the version readers pin
	t     *table                // == cur.Load(), without the atomic
	spare *table                // the last version unpublished, reused once no reader holds it
	used  int                   // entries of t with a key (key 0's aside), held or emptied
	live  int                   // entries some worker holds, key 0's included

	holders  map[WorkerID]*holder
	owner    []WorkerID // slot -> worker, where taken
	taken    []bool
	free     []int // slots that t may hand out: no version since their last owner's shows its bits
	retiring []int // slots freed in t: free from the next version on

	unknownRemoves uint64
	made           int // tables allocated: the steady state reuses the spare
}

type holder struct {
	slot int
	held map[uint64]int32 // hash -> how many engine blocks map to it
}

func newWriter(capacity int) *writer {
	w := &writer{holders: make(map[WorkerID]*holder)}
	w.addSlots(1)
	w.t = w.take(capacity, 1)
	w.cur.Store(w.t)
	return w
}

// pin returns the current version with its reader count held; the caller
// must unpin it. Lock-free: it retries only if a version was published
// between its two loads.
func (w *writer) pin() *table {
	for {
		t := w.cur.Load()
		t.readers.Add(1)
		if w.cur.Load() == t {
			return t
		}
		t.readers.Add(-1)
	}
}

func unpin(t *table) { t.readers.Add(-1) }

// FindMatches is Tree.FindMatches on the current version, safe from any
// goroutine concurrently with the writer.
func (w *writer) FindMatches(dst []Score, hashes []uint64) []Score {
	if len(hashes) == 0 {
		return dst
	}
	t := w.pin()
	dst = t.match(dst, hashes)
	unpin(t)
	return dst
}

// Nodes is the number of blocks some worker holds.
func (w *writer) Nodes() int { return w.live }

func (w *writer) Store(id WorkerID, k uint64) {
	h := w.holder(id)
	n := h.held[k]
	h.held[k] = n + 1
	if n == 0 {
		w.set(k, h.slot)
	}
}

func (w *writer) Remove(id WorkerID, k uint64) {
	h := w.holders[id]
	if h == nil {
		w.unknownRemoves++
		return
	}
	switch n := h.held[k]; {
	case n == 0:
		w.unknownRemoves++
	case n > 1:
		h.held[k] = n - 1
	default:
		delete(h.held, k)
		w.unset(k, h.slot)
	}
}

// ClearWorker keeps the worker's slot and map: an engine that cleared its
// cache fills it again.
func (w *writer) ClearWorker(id WorkerID) {
	if h := w.holders[id]; h != nil {
		for k := range h.held {
			w.unset(k, h.slot)
		}
		clear(h.held)
	}
}

// RemoveWorker clears the worker and frees its slot for a later version.
func (w *writer) RemoveWorker(id WorkerID) {
	h := w.holders[id]
	if h == nil {
		return
	}
	w.ClearWorker(id)
	delete(w.holders, id)
	w.taken[h.slot] = false
	w.retiring = append(w.retiring, h.slot)
}

// holder returns id's state, giving it a slot on its first store.
func (w *writer) holder(id WorkerID) *holder {
	if h := w.holders[id]; h != nil {
		return h
	}
	if len(w.free) == 0 {
		words := w.t.words
		if len(w.retiring) == 0 {
			words++
			w.addSlots(words)
		}
		w.rebuild(words) // a new version, where the retiring slots are free
	}
	s := w.free[len(w.free)-1]
	w.free = w.free[:len(w.free)-1]
	w.owner[s], w.taken[s] = id, true
	w.t.slots[s].Store(uint32(id)) // before any of its bits
	h := &holder{slot: s, held: make(map[uint64]int32)}
	w.holders[id] = h
	return h
}

// addSlots extends the slot bookkeeping to words bitset words.
func (w *writer) addSlots(words int) {
	lo, hi := len(w.owner), words*64
	w.owner = append(w.owner, make([]WorkerID, hi-lo)...)
	w.taken = append(w.taken, make([]bool, hi-lo)...)
	for s := hi - 1; s >= lo; s-- { // the lowest slot is handed out first
		w.free = append(w.free, s)
	}
}

func (w *writer) set(k uint64, slot int) {
	t := w.t
	e, found := t.place(k)
	if !found && w.used+1 > (t.mask+1)/4*3 {
		w.rebuild(t.words)
		t = w.t
		e, found = t.place(k)
	}
	word := &t.data[e+1+slot>>6]
	if !found {
		word.Store(1 << (slot & 63))
		t.data[e].Store(k) // after the bits: see the memory order above
		w.used++
		w.live++
		return
	}
	if !t.held(e) {
		w.live++
	}
	word.Store(word.Load() | 1<<(slot&63))
}

func (w *writer) unset(k uint64, slot int) {
	t := w.t
	e := t.find(k) // held, so present
	word := &t.data[e+1+slot>>6]
	word.Store(word.Load() &^ (1 << (slot & 63)))
	if !t.held(e) {
		w.live--
	}
}

// rebuild publishes a new version of words bitset words holding t's held
// entries, at least half empty, and retires t.
func (w *writer) rebuild(words int) {
	old := w.t
	capacity := old.mask + 1
	for (w.live+1)*2 > capacity {
		capacity *= 2
	}
	nt := w.take(capacity, words)
	w.used = 0
	for i := 0; i <= old.mask; i++ {
		e := i * old.stride
		k := old.data[e].Load()
		if k == 0 || !old.held(e) {
			continue
		}
		ne, _ := nt.place(k)
		for j := 1; j <= old.words; j++ {
			nt.data[ne+j].Store(old.data[e+j].Load())
		}
		nt.data[ne].Store(k)
		w.used++
	}
	oz, nz := (old.mask+1)*old.stride, (nt.mask+1)*nt.stride
	for j := 1; j <= old.words; j++ {
		nt.data[nz+j].Store(old.data[oz+j].Load())
	}
	for s, ok := range w.taken {
		if ok {
			nt.slots[s].Store(uint32(w.owner[s]))
		}
	}
	w.cur.Store(nt) // publish: everything above happens before a reader's pin
	w.t = nt
	w.free = append(w.free, w.retiring...)
	w.retiring = w.retiring[:0]
	w.spare = old // an older spare that take could not reuse goes to the GC, readers or not
}

// take returns an empty unpublished table: the spare if no reader holds it
// and it is big enough, or a new one. It never waits for readers: one
// still reading a version unpublished a whole rebuild ago is rare, and then
// the writer allocates.
func (w *writer) take(capacity, words int) *table {
	need, nslots := (capacity+1)*(1+words), words*64
	var t *table
	// The spare is unpublished: a reader that counts itself in from now on
	// fails pin's re-check and reads nothing, until it is published again.
	if r := w.spare; r != nil && r.readers.Load() == 0 && cap(r.data) >= need && cap(r.slots) >= nslots {
		w.spare, t = nil, r
		t.data = t.data[:need]
		clear(t.data)
		t.slots = t.slots[:nslots]
	}
	if t == nil {
		t = &table{data: make([]atomic.Uint64, need), slots: make([]atomic.Uint32, nslots)}
		w.made++
	}
	t.shift = uint(64 - bits.TrailingZeros(uint(capacity)))
	t.mask, t.words, t.stride = capacity-1, words, 1+words
	return t
}
