package predict

import "sync/atomic"

// Counts are one worker's prediction counters: written by its shard, read
// by scrapes.
type Counts struct {
	Live      atomic.Int64  // predictions held now
	Confirmed atomic.Uint64 // ended by a store of their block: it is held now
	Ended     atomic.Uint64 // ended by a remove, a clear, a resync or the worker's removal
	Expired   atomic.Uint64 // ended by their TTL
	Dropped   atomic.Uint64 // evicted by the cap
}

// Batch is what a router predicts of one worker (index.Shards.Predict); the
// Set keeps none of it but Counts.
type Batch struct {
	Keys  []uint64 // a prompt's keys, each chained from the one before
	Until int64    // unix nanoseconds: the keys end then
	// Max caps the worker's predictions: past it the least recently
	// predicted end (an LRU, as an engine's cache evicts).
	Max    int
	Counts *Counts // the worker's, kept by the shard
}

// entry is one key's slot. A key, once stored in a table, never changes
// there (an ended prediction keeps its key with until 0), so probe chains
// stay whole for readers; until is stored before the key.
type entry struct {
	key   atomic.Uint64
	until atomic.Int64 // 0: not predicted
}

// table is one version of a Set's open-addressing table (linear probing).
type table struct {
	ents  []entry
	mask  int
	shift uint
}

func newTable(size int) *table {
	n, shift := 16, uint(60)
	for n < size {
		n, shift = n*2, shift-1
	}
	return &table{ents: make([]entry, n), mask: n - 1, shift: shift}
}

func (t *table) home(k uint64) int { return int((k * 0x9e3779b97f4a7c15) >> t.shift) }

// place returns k's entry, or the empty one that would take it. Key 0
// marks an empty entry, so it is never predicted.
func (t *table) place(k uint64) (e *entry, found bool) {
	for i := t.home(k); ; i = (i + 1) & t.mask {
		switch t.ents[i].key.Load() {
		case k:
			return &t.ents[i], true
		case 0:
			return &t.ents[i], false
		}
	}
}

// has reports whether k is predicted in this version.
func (t *table) has(k uint64) bool {
	if k == 0 {
		return false
	}
	e, ok := t.place(k)
	return ok && e.until.Load() != 0
}

// item is a prediction in expiry order: stale once its key was predicted
// again (a later until) or ended.
type item struct {
	key   uint64
	until int64
}

// Set is one worker's predicted keys. Add, End, Clear and Expire are its
// writer's (one at a time); Run may be called from any goroutine at any
// time, without a lock.
type Set struct {
	cur   atomic.Pointer[table]
	t     *table
	used  int // entries with a key, predicted or ended
	live  int
	order []item // by until (kept non-decreasing): the expiry and LRU order
	head  int    // order[:head] are done
	last  int64  // the latest until
	c     *Counts
}

// NewSet returns an empty Set counting in c.
func NewSet(c *Counts) *Set {
	s := &Set{c: c}
	s.publish(newTable(16))
	return s
}

func (s *Set) publish(t *table) {
	s.t = t
	s.cur.Store(t) // after t is built: a reader sees it whole
}

// Len is how many keys are predicted.
func (s *Set) Len() int { return s.live }

// Run returns how many keys, from keys[from] on, are predicted in a row. A
// reader sees each key as of one instant, later keys at later instants.
func (s *Set) Run(keys []uint64, from int) int {
	t := s.cur.Load()
	n := 0
	for _, k := range keys[from:] {
		if !t.has(k) {
			break
		}
		n++
	}
	return n
}

// Add predicts b's keys until b.Until, last key first: past the cap, a
// prompt's leading keys are the last to go, as an engine's LRU evicts its
// leaves first.
func (s *Set) Add(b *Batch) {
	until := max(b.Until, s.last, 1) // non-decreasing, so order stays sorted
	s.last = until
	for i := len(b.Keys) - 1; i >= 0; i-- {
		if k := b.Keys[i]; k != 0 {
			s.put(k, until)
		}
	}
	for s.live > max(b.Max, 1) && s.evictOldest() {
		s.c.Dropped.Add(1)
	}
	s.compact()
	s.c.Live.Store(int64(s.live))
}

// put predicts k until until.
func (s *Set) put(k uint64, until int64) {
	if (s.used+1)*4 > len(s.t.ents)*3 {
		s.rebuild()
	}
	e, found := s.t.place(k)
	if !found || e.until.Load() == 0 {
		s.live++
	}
	e.until.Store(until)
	if !found {
		e.key.Store(k)
		s.used++
	}
	s.order = append(s.order, item{k, until})
}

// End ends k's prediction, reporting whether it was predicted.
func (s *Set) End(k uint64) bool {
	if k == 0 || s.live == 0 {
		return false
	}
	e, ok := s.t.place(k)
	if !ok || e.until.Load() == 0 {
		return false
	}
	e.until.Store(0)
	s.live--
	s.c.Live.Store(int64(s.live))
	return true
}

// Clear ends every prediction and reports how many there were.
func (s *Set) Clear() int {
	n := s.live
	s.publish(newTable(16)) // readers of the old version see it as of before
	s.used, s.live, s.head, s.last = 0, 0, 0, 0
	s.order = s.order[:0]
	s.c.Live.Store(0)
	return n
}

// Expire ends the predictions whose until is at or before now, and
// reports how many.
func (s *Set) Expire(now int64) int {
	n := 0
	for s.head < len(s.order) && s.order[s.head].until <= now {
		if s.endCurrent(s.order[s.head]) {
			n++
		}
		s.head++
	}
	s.compact()
	s.c.Live.Store(int64(s.live))
	return n
}

// evictOldest ends the least recently predicted key; false when none.
func (s *Set) evictOldest() bool {
	for s.head < len(s.order) {
		it := s.order[s.head]
		s.head++
		if s.endCurrent(it) {
			return true
		}
	}
	return false
}

// endCurrent ends it's key unless it was predicted again since or ended.
func (s *Set) endCurrent(it item) bool {
	e, ok := s.t.place(it.key)
	if !ok || e.until.Load() != it.until {
		return false
	}
	e.until.Store(0)
	s.live--
	return true
}

// compact bounds order: the items done go, and when stale ones (keys
// predicted again) outnumber the live, only the current stay.
func (s *Set) compact() {
	if s.head > 0 && s.head*2 >= len(s.order) {
		s.order = append(s.order[:0], s.order[s.head:]...)
		s.head = 0
	}
	if len(s.order)-s.head <= 2*s.live+64 {
		return
	}
	kept := s.order[:0]
	for _, it := range s.order[s.head:] {
		if e, ok := s.t.place(it.key); ok && e.until.Load() == it.until {
			kept = append(kept, it)
		}
	}
	s.order, s.head = kept, 0
}

// rebuild publishes a new version holding the live keys only, sized for
// twice them, so that ended entries do not fill the table.
func (s *Set) rebuild() {
	nt := newTable(max(4*s.live, 16))
	for i := range s.t.ents {
		e := &s.t.ents[i]
		if k, u := e.key.Load(), e.until.Load(); k != 0 && u != 0 {
			ne, _ := nt.place(k)
			ne.until.Store(u)
			ne.key.Store(k)
		}
	}
	s.used = s.live
	s.publish(nt)
}

// Counts returns the counters the Set keeps.
func (s *Set) Counts() *Counts { return s.c }
