package index

import (
	"math/bits"
	"sync/atomic"
)

// A shard's index is a flat open-addressing table per tier, chained key ->
// bitset of the shard's workers holding that block in that tier, with one
// writer (the shard goroutine) and any number of readers on their callers'
// goroutines. A lower tier's table is made on its first store: an index
// without offload has the device's alone, and reads it as it always did.
// Every tier's bitsets use the worker slots the device's tables map, so a
// reader combines a key's tiers word by word; all tiers' tables are of one
// width.
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
//     again in a later version (a later generation, below: without lower
//     tiers every rebuild is one), so readers of the old version keep
//     mapping the old worker's (stale) bits to the old worker, and the new
//     version was built after those bits were cleared.
//   - Versions are published with cur.Store after they are fully built. A
//     reader pins a version by incrementing its readers count and then
//     checking that it is still current (pin); the writer recycles a version
//     only after unpublishing it and seeing readers == 0. A reader that
//     incremented after that check fails the re-check (or, if the table has
//     been rebuilt and published again meanwhile, reads a complete current
//     version), so no reader reads a table while it is being rebuilt.
//   - A lower tier's index is published with an atomic pointer (lower) after
//     its first version is, and then lowerSet: a reader that sees either
//     pins a whole version.
//   - Slots and tiers: a reader maps every tier's bits with its pinned
//     device version's slots, so the versions it pins must agree on them.
//     Each version records the slot generation it was made in (gen). A
//     freed slot is handed out again only in a new generation, which starts
//     with a new version of every tier's table, built from the current
//     state (so without the old owner's bits), all built before any is
//     published; a table rebuilt on its own stays in its generation. A
//     reader pins the device's version, then each lower tier's, and retries
//     unless all are of one generation: in one generation a slot has one
//     owner at most, no version shows an earlier owner's bits, and the
//     width is one (only a new generation widens).
//   - Within a generation a worker may still take a free slot after the
//     device version a reader pinned was unpublished, and set bits in a
//     lower tier's version the reader pinned, which is still current; that
//     device version cannot map the slot. So a device version also has a
//     taken mask, a slot's bit stored after slots[s] and before any of the
//     worker's bits: the reader loads it after its pins and ignores
//     lower-tier bits of slots outside it (device bits need no mask: the
//     device version they are in maps them, as above).
//
// Removing a worker's last hold leaves the entry in place with an empty
// bitset (so probe chains stay intact); such entries are dropped when the
// writer rebuilds the table, which it does when used entries would pass 3/4
// of capacity or a worker needs a slot that only a new generation can give.

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
	slots   []atomic.Uint32 // device tables: bitset slot -> WorkerID, as of this version
	taken   []atomic.Uint64 // device tables: bit s set once slots[s] maps a worker in this version
	gen     uint64          // the writer's slot generation when this version was made
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

// emit appends a score of blocks for every worker in word w's set bits: a
// device-only table's, so every tier's count is the device's.
func (t *table) emit(dst []Score, set uint64, w, blocks int) []Score {
	for set != 0 {
		b := bits.TrailingZeros64(set)
		set &= set - 1
		dst = append(dst, Score{Worker: WorkerID(t.slots[w*64+b].Load()), Blocks: blocks,
			Tiers: [NumTiers]int{blocks, blocks, blocks, blocks}})
	}
	return dst
}

// matchTiers is match over the pinned versions ts of every tier (ts[0] the
// device's, a nil entry a tier without a table), all of one slot generation,
// so of one width.
func matchTiers(dst []Score, hashes []uint64, ts *[NumTiers]*table) []Score {
	words := ts[0].words
	for c := 0; c < words; c += chunk {
		dst = matchTiersChunk(dst, hashes, ts, c, min(chunk, words-c))
	}
	return dst
}

// matchTiersChunk walks the keys once, looking each up in every tier's
// table (lookahead at a time, as matchChunk does), and keeps per tier t the
// workers holding every key so far each in a tier <= t: a worker dropping
// out of tier t's set at key i scores Tiers[t] = i. Those sets only shrink,
// and tier NumTiers-1's holds the others, so the walk ends when it empties.
// The workers scored are those in that set at hashes[0]; their Scores are
// appended then, in slot order, and filled in as they drop out: a slot's
// Score is found by counting the scored slots below it.
func matchTiersChunk(dst []Score, hashes []uint64, ts *[NumTiers]*table, c, n int) []Score {
	d := ts[0]
	var (
		act   [NumTiers][chunk]uint64
		mask  [chunk]uint64 // the slots d maps: lower-tier bits of other slots are ignored
		first [chunk]uint64 // the workers scored
		rank  [chunk]int    // index in dst of word j's first scored worker
		ents  [NumTiers][lookahead]int
	)
	for t, tb := range ts {
		if tb == nil {
			for k := range ents[t] {
				ents[t][k] = -1
			}
		} else {
			ents[t][0] = tb.find(hashes[0])
		}
	}
	var any uint64
	for j := range n {
		// After the pins, before any bit: see the memory order above.
		mask[j] = d.taken[c+j].Load()
		var u uint64
		if e := ents[0][0]; e >= 0 {
			u = d.data[e+1+c+j].Load()
		}
		act[0][j] = u
		for t := 1; t < NumTiers; t++ {
			if e := ents[t][0]; e >= 0 {
				u |= ts[t].data[e+1+c+j].Load() & mask[j]
			}
			act[t][j] = u
		}
		first[j] = u
		any |= u
	}
	if any == 0 {
		return dst
	}
	base := len(dst)
	for j := range n {
		rank[j] = len(dst)
		for set := first[j]; set != 0; set &= set - 1 {
			b := bits.TrailingZeros64(set)
			dst = append(dst, Score{Worker: WorkerID(d.slots[(c+j)*64+b].Load())})
		}
	}
	scores := dst[base:]
	end := len(hashes)
walk:
	for i := 1; i < len(hashes); {
		g := min(lookahead, len(hashes)-i)
		for t, tb := range ts {
			if tb != nil {
				for k := range g {
					ents[t][k] = tb.find(hashes[i+k])
				}
			}
		}
		for k := 0; k < g; k, i = k+1, i+1 {
			any = 0
			for j := range n {
				var u uint64
				if e := ents[0][k]; e >= 0 {
					u = d.data[e+1+c+j].Load()
				}
				for t := range NumTiers {
					if t > 0 {
						if e := ents[t][k]; e >= 0 {
							u |= ts[t].data[e+1+c+j].Load() & mask[j]
						}
					}
					a := act[t][j]
					m := a & u
					if gone := a &^ m; gone != 0 {
						record(scores, gone, first[j], rank[j]-base, t, i)
					}
					act[t][j] = m
				}
				any |= act[NumTiers-1][j]
			}
			if any == 0 {
				end = -1 // every worker has dropped out of every tier
				break walk
			}
		}
	}
	if end >= 0 {
		for j := range n {
			for t := range NumTiers {
				record(scores, act[t][j], first[j], rank[j]-base, t, end)
			}
		}
	}
	for i := range scores {
		scores[i].Blocks = scores[i].Tiers[TierDevice]
	}
	return dst
}

// record sets Tiers[t] = blocks in the Score of every worker of gone, a
// subset of first, whose Scores start at scores[rank] in slot order.
func record(scores []Score, gone, first uint64, rank, t, blocks int) {
	for gone != 0 {
		b := bits.TrailingZeros64(gone)
		gone &= gone - 1
		scores[rank+bits.OnesCount64(first&(1<<b-1))].Tiers[t] = blocks
	}
}

// tierIx is one tier's index: the version readers pin, and the writer's
// bookkeeping of it.
type tierIx struct {
	cur   atomic.Pointer[table] // the version readers pin
	t     *table                // == cur.Load(), without the atomic
	spare *table                // the last version unpublished, reused once no reader holds it
	used  int                   // entries of t with a key (key 0's aside), held or emptied
	live  int                   // entries some worker holds, key 0's included
}

// pin returns the current version with its reader count held; the caller
// must unpin it. Lock-free: it retries only if a version was published
// between its two loads.
func (x *tierIx) pin() *table {
	for {
		t := x.cur.Load()
		t.readers.Add(1)
		if x.cur.Load() == t {
			return t
		}
		t.readers.Add(-1)
	}
}

func unpin(t *table) { t.readers.Add(-1) }

func (x *tierIx) publish(nt *table) {
	x.cur.Store(nt) // everything written to nt before happens before a reader's pin
	x.spare = x.t   // an older spare that take could not reuse goes to the GC, readers or not
	x.t = nt
}

// writer is a shard's index: the device tier's, each lower tier's once its
// first block is stored, and what only the shard goroutine touches. Its ops
// mean what Tree's do.
type writer struct {
	tierIx // the device tier
	// lower[t-1] is tier t's index, nil until its first store, so that an
	// index without offload pays one atomic load per lookup for tiers.
	lower    [NumTiers - 1]atomic.Pointer[tierIx]
	lowerSet atomic.Uint32 // bit t-1 set once lower[t-1] is published
	capacity int           // a lower tier's first table's entries
	gen      uint64        // the slot generation: see the memory order above

	holders  map[WorkerID]*holder
	owner    []WorkerID // slot -> worker, where taken
	taken    []bool
	free     []int // slots that t may hand out: no version since their last owner's shows its bits
	retiring []int // slots freed in this generation: free from the next one on

	unknownRemoves uint64
	made           int // tables allocated: the steady state reuses the spares
}

type holder struct {
	slot  int
	held  [NumTiers]map[uint64]int32 // per tier, hash -> how many engine blocks map to it; a lower tier's nil until used
	count [NumTiers]int              // per tier, the sum of held's counts
}

func newWriter(capacity int) *writer {
	w := &writer{holders: make(map[WorkerID]*holder), capacity: capacity}
	w.addSlots(1)
	w.t = w.take(&w.tierIx, capacity, 1)
	w.cur.Store(w.t)
	return w
}

// FindMatches is Tree.FindMatches on the current versions, safe from any
// goroutine concurrently with the writer.
func (w *writer) FindMatches(dst []Score, hashes []uint64) []Score {
	if len(hashes) == 0 {
		return dst
	}
	if w.lowerSet.Load() != 0 {
		var ts [NumTiers]*table
		w.pinTiers(&ts)
		dst = matchTiers(dst, hashes, &ts)
		for _, t := range ts {
			if t != nil {
				unpin(t)
			}
		}
		return dst
	}
	t := w.pin()
	dst = t.match(dst, hashes)
	unpin(t)
	return dst
}

// pinTiers pins the current version of every tier into ts (nil for a tier
// without a table), all of one slot generation. Lock-free: it retries only
// if a version was published between its loads, and a new generation's are
// published back to back.
func (w *writer) pinTiers(ts *[NumTiers]*table) {
	for {
		d := w.pin()
		ts[0] = d
		same := true
		for i := range w.lower {
			ts[i+1] = nil
			if x := w.lower[i].Load(); x != nil {
				t := x.pin()
				ts[i+1] = t
				same = same && t.gen == d.gen && t.words == d.words
			}
		}
		if same {
			return
		}
		for _, t := range ts {
			if t != nil {
				unpin(t)
			}
		}
	}
}

// Nodes is the number of blocks some worker holds on device.
func (w *writer) Nodes() int { return w.live }

// TierNodes is the number of blocks some worker holds in tier.
func (w *writer) TierNodes(tier Tier) int {
	if tier == TierDevice {
		return w.live
	}
	if tier < NumTiers {
		if x := w.lower[tier-1].Load(); x != nil {
			return x.live
		}
	}
	return 0
}

func (w *writer) Store(id WorkerID, k uint64)  { w.StoreTier(id, TierDevice, k) }
func (w *writer) Remove(id WorkerID, k uint64) { w.RemoveTier(id, TierDevice, k) }

func (w *writer) StoreTier(id WorkerID, tier Tier, k uint64) {
	if tier >= NumTiers {
		return
	}
	h := w.holder(id)
	held := h.held[tier]
	if held == nil {
		held = make(map[uint64]int32)
		h.held[tier] = held
	}
	n := held[k]
	held[k] = n + 1
	h.count[tier]++
	if n == 0 {
		w.set(w.ix(tier), k, h.slot)
	}
}

func (w *writer) RemoveTier(id WorkerID, tier Tier, k uint64) {
	if tier >= NumTiers {
		return
	}
	h := w.holders[id]
	if h == nil {
		w.unknownRemoves++
		return
	}
	held := h.held[tier]
	switch n := held[k]; {
	case n == 0:
		w.unknownRemoves++
	case n > 1:
		held[k] = n - 1
		h.count[tier]--
	default:
		delete(held, k)
		h.count[tier]--
		w.unset(w.ix(tier), k, h.slot)
	}
}

// heldIn is how many engine blocks of the worker's map to keys it holds in
// tier: its stores less its removes of blocks it held, since its last clear.
func (w *writer) heldIn(id WorkerID, tier Tier) int {
	if h := w.holders[id]; h != nil {
		return h.count[tier]
	}
	return 0
}

// ClearWorker clears the worker in every tier. It keeps the worker's slot
// and maps: an engine that cleared its cache fills it again.
func (w *writer) ClearWorker(id WorkerID) {
	for tier := range Tier(NumTiers) {
		w.ClearTier(id, tier)
	}
}

// ClearTier clears the worker's blocks in tier alone.
func (w *writer) ClearTier(id WorkerID, tier Tier) {
	h := w.holders[id]
	if h == nil || tier >= NumTiers || len(h.held[tier]) == 0 {
		return
	}
	x := w.ix(tier)
	for k := range h.held[tier] {
		w.unset(x, k, h.slot)
	}
	clear(h.held[tier])
	h.count[tier] = 0
}

// RemoveWorker clears the worker and frees its slot for a later generation.
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

// ix returns tier's index, creating a lower tier's on its first store.
func (w *writer) ix(tier Tier) *tierIx {
	if tier == TierDevice {
		return &w.tierIx
	}
	if x := w.lower[tier-1].Load(); x != nil {
		return x
	}
	x := &tierIx{}
	// Of the device's width and generation: pinTiers takes it with the
	// device's current version.
	x.t = w.take(x, w.capacity, w.t.words)
	x.cur.Store(x.t)
	w.lower[tier-1].Store(x) // after its first version: a reader that loads x pins a whole one
	w.lowerSet.Store(w.lowerSet.Load() | 1<<(tier-1))
	return x
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
		w.rebuildAll(words) // a new generation, where the retiring slots are free
	}
	s := w.free[len(w.free)-1]
	w.free = w.free[:len(w.free)-1]
	w.owner[s], w.taken[s] = id, true
	w.t.slots[s].Store(uint32(id)) // before any of its bits
	tw := &w.t.taken[s>>6]
	tw.Store(tw.Load() | 1<<(s&63)) // after the slot, before any bit
	h := &holder{slot: s}
	h.held[TierDevice] = make(map[uint64]int32)
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

func (w *writer) set(x *tierIx, k uint64, slot int) {
	t := x.t
	e, found := t.place(k)
	if !found && x.used+1 > (t.mask+1)/4*3 {
		w.grow(x)
		t = x.t
		e, found = t.place(k)
	}
	word := &t.data[e+1+slot>>6]
	if !found {
		word.Store(1 << (slot & 63))
		t.data[e].Store(k) // after the bits: see the memory order above
		x.used++
		x.live++
		return
	}
	if !t.held(e) {
		x.live++
	}
	word.Store(word.Load() | 1<<(slot&63))
}

func (w *writer) unset(x *tierIx, k uint64, slot int) {
	t := x.t
	e := t.find(k) // held, so present
	word := &t.data[e+1+slot>>6]
	word.Store(word.Load() &^ (1 << (slot & 63)))
	if !t.held(e) {
		x.live--
	}
}

// grow gives x's full table a new version. Without lower tiers that is a
// new generation too, freeing the retiring slots, as it always was; with
// them, only a new version of every tier can.
func (w *writer) grow(x *tierIx) {
	if w.lowerSet.Load() == 0 {
		w.rebuildAll(x.t.words)
		return
	}
	x.publish(w.build(x, x.t.words))
}

// rebuildAll publishes a new version of every tier's table, of words bitset
// words, in a new slot generation, and then frees the retiring slots. The
// versions are all built before any is published, so that readers see the
// generations disagree only between back-to-back stores.
func (w *writer) rebuildAll(words int) {
	w.gen++
	var nts [NumTiers]*table
	nts[0] = w.build(&w.tierIx, words)
	for i := range w.lower {
		if x := w.lower[i].Load(); x != nil {
			nts[i+1] = w.build(x, words)
		}
	}
	w.publish(nts[0])
	for i := range w.lower {
		if nts[i+1] != nil {
			w.lower[i].Load().publish(nts[i+1])
		}
	}
	w.free = append(w.free, w.retiring...)
	w.retiring = w.retiring[:0]
}

// build returns an unpublished version of x's table, of words bitset words,
// holding its held entries, at least half empty. x's used counts it.
func (w *writer) build(x *tierIx, words int) *table {
	old := x.t
	capacity := old.mask + 1
	for (x.live+1)*2 > capacity {
		capacity *= 2
	}
	nt := w.take(x, capacity, words)
	x.used = 0
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
		x.used++
	}
	oz, nz := (old.mask+1)*old.stride, (nt.mask+1)*nt.stride
	for j := 1; j <= old.words; j++ {
		nt.data[nz+j].Store(old.data[oz+j].Load())
	}
	if x == &w.tierIx {
		for s, ok := range w.taken {
			if ok {
				nt.slots[s].Store(uint32(w.owner[s]))
				tw := &nt.taken[s>>6]
				tw.Store(tw.Load() | 1<<(s&63))
			}
		}
	}
	return nt
}

// take returns an empty unpublished table of x, in the current generation:
// x's spare if no reader holds it and it is big enough, or a new one. It
// never waits for readers: one still reading a version unpublished a whole
// rebuild ago is rare, and then the writer allocates. Only the device's
// tables map slots: a reader maps every tier's bits with them.
func (w *writer) take(x *tierIx, capacity, words int) *table {
	need, nslots, ntaken := (capacity+1)*(1+words), 0, 0
	if x == &w.tierIx {
		nslots, ntaken = words*64, words
	}
	var t *table
	// The spare is unpublished: a reader that counts itself in from now on
	// fails pin's re-check and reads nothing, until it is published again.
	if r := x.spare; r != nil && r.readers.Load() == 0 && cap(r.data) >= need && cap(r.slots) >= nslots && cap(r.taken) >= ntaken {
		x.spare, t = nil, r
		t.data = t.data[:need]
		clear(t.data)
		t.slots = t.slots[:nslots]
		t.taken = t.taken[:ntaken]
		clear(t.taken)
	}
	if t == nil {
		t = &table{data: make([]atomic.Uint64, need), slots: make([]atomic.Uint32, nslots), taken: make([]atomic.Uint64, ntaken)}
		w.made++
	}
	t.shift = uint(64 - bits.TrailingZeros(uint(capacity)))
	t.mask, t.words, t.stride, t.gen = capacity-1, words, 1+words, w.gen
	return t
}
