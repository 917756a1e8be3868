package index

import (
	"sync/atomic"
)

// writer is a shard's index: the device tier's, each lower tier's once its
// first block is stored, and what only the shard goroutine touches. Its ops
// mean what the reference tree's do (tree_test.go).
//
// Closed workers. A worker is closed while every device block it holds is a
// root or has its parent (by the ops' links) on device too: along a prompt
// whose keys chain as the links say, it then holds the keys up to its score
// and none after, which lets a reader jump (table.jump). The writer keeps
// each worker's orphan count (chains) and the device version's closed mask
// (setClosed): a change that can leave a worker with orphans opens it
// first, and only then changes its bits; the worker is closed again once it
// has none. opened counts the openings: a reader that saw it unchanged from
// before it loaded the closed masks to after its last read knows that no
// worker it jumped over was opened meanwhile.
//
// With lower tiers, the same holds of each level l, a tier with a table:
// the blocks a worker holds in any tier <= l (its Tiers[l] is the run of a
// prompt's keys in them), whose orphans the worker's chains of that level
// count, and whose closed mask is that tier's table's. A block offloaded
// from the device to the host (a move or a copy) leaves the union as
// closed as it was, so such workers are read by jumping too
// (tierWalk.jump).
type writer struct {
	tierIx // the device tier
	// lower[t-1] is tier t's index, nil until its first store, so that an
	// index without offload pays one atomic load per lookup for tiers.
	lower    [NumTiers - 1]atomic.Pointer[tierIx]
	lowerSet atomic.Uint32 // bit t-1 set once lower[t-1] is published
	opened   atomic.Uint64
	capacity int    // a lower tier's first table's entries
	gen      uint64 // the slot generation: see the memory order in table.go

	// Lookups read the fields above (tierIx's cur on), the writer alone
	// those below, some on every op.
	_        lineGap
	holders  map[WorkerID]*holder
	owner    []WorkerID // slot -> worker, where taken
	taken    []bool
	free     []int // slots that t may hand out: no version since their last owner's shows its bits
	retiring []int // slots freed in this generation: free from the next one on

	unknownRemoves uint64
	made           int // tables allocated: a small index's steady state reuses the spares
}

type holder struct {
	slot int
	dev  chains // the device blocks: level 0
	// up[l-1] is level l's chains, the blocks held in any tier <= l, kept
	// while tier l has a table.
	up     [NumTiers - 1]chains
	held   [NumTiers]map[uint64]int32 // lower tiers: hash -> how many engine blocks map to it; nil until used
	count  [NumTiers]int              // per tier, the engine blocks held (the sum of the references)
	closed [NumTiers]bool             // per level, as its table's closed mask says
}

// level returns the chains of level l, nil for a tier without a table:
// lowerSet is the writer's.
func (h *holder) level(l Tier, lowerSet uint32) *chains {
	switch {
	case l == TierDevice:
		return &h.dev
	case lowerSet&(1<<(l-1)) != 0:
		return &h.up[l-1]
	}
	return nil
}

func newWriter(capacity int) *writer {
	w := &writer{holders: make(map[WorkerID]*holder), capacity: capacity}
	w.addSlots(1)
	w.t = w.tierIx.take(capacity, 1, true, w.gen, &w.made)
	w.cur.Store(w.t)
	return w
}

// findMatches is Tree.findMatches on the current versions, safe from any
// goroutine concurrently with the writer.
func (w *writer) findMatches(dst []Score, hashes []uint64) []Score {
	if len(hashes) == 0 {
		return dst
	}
	if w.lowerSet.Load() != 0 {
		var ts [NumTiers]*table
		w.pinTiers(&ts)
		dst = matchTiers(dst, hashes, &ts, &w.opened)
		for _, t := range ts {
			if t != nil {
				unpin(t)
			}
		}
		return dst
	}
	t := w.pin()
	dst = t.match(dst, hashes, &w.opened)
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

// tierNodes is the number of blocks some worker holds in tier.
func (w *writer) tierNodes(tier Tier) int {
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

// apply applies one op of worker id.
func (w *writer) apply(id WorkerID, op Op) {
	switch op.Kind {
	case OpStore:
		w.store(id, op)
	case OpRemove:
		w.remove(id, op.Tier, op.Hash)
	case OpClearWorker:
		w.clearWorker(id)
	case OpClearTier:
		w.clearTier(id, op.Tier)
	case OpRemoveWorker:
		w.removeWorker(id)
	}
}

func (w *writer) store(id WorkerID, op Op) {
	tier := op.Tier
	if tier >= NumTiers {
		return
	}
	h := w.holder(id)
	x := w.ix(tier) // first: a new tier's level starts as the one below
	h.count[tier]++
	k := op.Hash
	var first bool
	orphans := h.dev.orphans
	if tier == TierDevice {
		first = h.dev.store(k, op.Link, op.Parent)
	} else {
		held := h.held[tier]
		if held == nil {
			held = make(map[uint64]int32)
			h.held[tier] = held
		}
		n := held[k]
		held[k] = n + 1
		first = n == 0
	}
	if set := w.lowerSet.Load(); set != 0 {
		for l := max(tier, TierHost); l < NumTiers; l++ { // the levels above the device
			if c := h.level(l, set); c != nil {
				c.store(k, op.Link, op.Parent)
			}
		}
	} else if !first {
		// The device alone, and k held there already: no bit changes, but
		// a store that knows k's link where the first did not may close it.
		if h.dev.orphans < orphans {
			w.mark(h, tier, true)
		}
		return
	}
	w.mark(h, tier, false) // before the bit
	if first {
		w.set(x, k, h.slot)
	}
	w.mark(h, tier, true)
}

// mark opens (to false) the worker at each level from tier up whose
// chains, just changed, count orphans, before the change of bits they
// prepare; or closes (to true) those that count none, after it.
func (w *writer) mark(h *holder, tier Tier, to bool) {
	set := w.lowerSet.Load()
	for l := tier; l < NumTiers; l++ {
		if c := h.level(l, set); c != nil {
			w.setClosed(h, l, to, (c.orphans == 0) == to)
		}
		if set == 0 {
			return // the device alone
		}
	}
}

func (w *writer) remove(id WorkerID, tier Tier, k uint64) {
	if tier >= NumTiers {
		return
	}
	h := w.holders[id]
	if h == nil {
		w.unknownRemoves++
		return
	}
	var last bool
	if tier == TierDevice {
		var known bool
		if known, last = h.dev.remove(k); !known {
			w.unknownRemoves++
			return
		}
	} else {
		held := h.held[tier]
		n := held[k]
		switch {
		case n == 0:
			w.unknownRemoves++
			return
		case n > 1:
			held[k] = n - 1
		default:
			delete(held, k)
			last = true
		}
	}
	h.count[tier]--
	if set := w.lowerSet.Load(); set != 0 {
		for l := max(tier, TierHost); l < NumTiers; l++ { // the levels above the device
			if c := h.level(l, set); c != nil {
				c.remove(k)
			}
		}
	}
	if !last {
		return // still held in tier: so in every level above it
	}
	w.mark(h, tier, false) // before the bit
	w.unset(w.ix(tier), k, h.slot)
	w.mark(h, tier, true)
}

// setClosed closes (to true) or opens the worker at level l, if cond and
// it is not so already. Opening clears its bit before counting in opened,
// and both come before the change of bits that needed them: a reader that
// loads opened, then the mask, and sees a bit changed after, sees opened
// moved.
func (w *writer) setClosed(h *holder, l Tier, to, cond bool) {
	if !cond || h.closed[l] == to {
		return
	}
	h.closed[l] = to
	cw := &w.ix(l).t.closed[h.slot>>6]
	if to {
		cw.Store(cw.Load() | 1<<(h.slot&63))
		return
	}
	cw.Store(cw.Load() &^ (1 << (h.slot & 63)))
	w.opened.Add(1)
}

// prefetchAhead is how many ops ahead of the one applied a shard loads the
// entries the op will need.
const prefetchAhead = 4

// prefetch loads the home entries an op's key will need, its tier's table
// and the worker's chains of each level it changes (the lower tiers' held
// maps aside), so that their cache misses overlap the ops applied before
// it: ingest is mostly those misses.
func prefetch(w *writer, h *holder, op *Op) {
	if op.Kind > OpRemove || op.Hash == 0 || op.Tier >= NumTiers {
		return
	}
	if op.Tier == TierDevice {
		w.t.touch(op.Hash)
		h.dev.touch(op.Hash)
	}
	if w.lowerSet.Load() == 0 {
		return
	}
	for l := max(op.Tier, TierHost); l < NumTiers; l++ {
		if x := w.lower[l-1].Load(); x != nil {
			if l == op.Tier {
				x.t.touch(op.Hash)
			}
			h.up[l-1].touch(op.Hash)
		}
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

// clearWorker clears the worker in every tier. It keeps the worker's slot
// and maps: an engine that cleared its cache fills it again.
func (w *writer) clearWorker(id WorkerID) {
	for tier := range Tier(NumTiers) {
		w.clearTier(id, tier)
	}
}

// clearTier clears the worker's blocks in tier alone.
func (w *writer) clearTier(id WorkerID, tier Tier) {
	h := w.holders[id]
	if h == nil || tier >= NumTiers || h.count[tier] == 0 && (tier != TierDevice || h.dev.n == 0) {
		return
	}
	h.count[tier] = 0
	set := w.lowerSet.Load()
	// Its blocks go in no particular order: every level they are in is
	// open meanwhile.
	for l := tier; l < NumTiers; l++ {
		if h.level(l, set) != nil {
			w.setClosed(h, l, false, true)
		}
	}
	defer w.mark(h, tier, true)
	x := w.ix(tier)
	drop := func(k uint64, refs uint32) {
		w.unset(x, k, h.slot)
		for l := max(tier, TierHost); l < NumTiers; l++ { // the levels above the device
			if c := h.level(l, set); c != nil {
				for range refs {
					c.remove(k)
				}
			}
		}
	}
	if tier == TierDevice {
		h.dev.each(drop)
		h.dev.reset()
	} else {
		for k, n := range h.held[tier] {
			drop(k, uint32(n))
		}
		clear(h.held[tier])
	}
}

// removeWorker clears the worker and frees its slot for a later generation.
func (w *writer) removeWorker(id WorkerID) {
	h := w.holders[id]
	if h == nil {
		return
	}
	w.clearWorker(id)
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
	x := &tierIx{tier: tier}
	// Of the device's width and generation: pinTiers takes it with the
	// device's current version.
	x.t = x.take(w.capacity, w.t.words, false, w.gen, &w.made)
	// Its level starts as the one below it (no block is in tier yet), closed
	// where that one is.
	below := tier - 1
	for below > TierDevice && w.lower[below-1].Load() == nil {
		below--
	}
	for _, h := range w.holders {
		c := h.level(below, w.lowerSet.Load())
		h.up[tier-1] = c.clone()
		h.closed[tier] = h.closed[below]
		if h.closed[tier] {
			setBit(x.t.closed, h.slot)
		}
	}
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
	for l := range Tier(NumTiers) {
		if h.level(l, w.lowerSet.Load()) != nil {
			w.setClosed(h, l, true, true) // nothing held: closed
		}
	}
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
	if !found && (x.used+1)*growDen > t.size*growNum {
		w.grow(x)
		t = x.t
		e, found = t.place(k)
	}
	word := &t.data[e+1+slot>>6]
	if !found {
		word.Store(1 << (slot & 63))
		t.data[e].Store(k) // after the bits: see the memory order in table.go
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

// A table is rebuilt when more than growNum/growDen of its entries have a
// key (held or emptied), to buildDen/buildNum entries per held one.
const (
	growNum, growDen   = 4, 5
	buildNum, buildDen = 3, 5
	minTable           = 16
)

// build returns an unpublished version of x's table, of words bitset words,
// holding its held entries, at a load of buildNum/buildDen. x's used counts
// it. It marks the workers closed at its level; a device version maps the
// taken slots too.
func (w *writer) build(x *tierIx, words int) *table {
	old := x.t
	capacity := max(minTable, (x.live+1)*buildDen/buildNum)
	nt := x.take(capacity, words, x == &w.tierIx, w.gen, &w.made)
	x.used = copyHeld(nt, old)
	for s, ok := range w.taken {
		if !ok {
			continue
		}
		if x == &w.tierIx {
			nt.slots[s].Store(uint32(w.owner[s]))
			setBit(nt.taken, s)
		}
		if w.holders[w.owner[s]].closed[x.tier] {
			setBit(nt.closed, s)
		}
	}
	return nt
}

func setBit(ws []atomic.Uint64, s int) {
	w := &ws[s>>6]
	w.Store(w.Load() | 1<<(s&63))
}

// copyHeld copies old's held entries, and key 0's, into the empty nt of at
// least as many words, and returns how many it copied (key 0's aside).
func copyHeld(nt, old *table) (used int) {
	for i := range old.size {
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
		used++
	}
	oz, nz := old.size*old.stride, nt.size*nt.stride
	for j := 1; j <= old.words; j++ {
		nt.data[nz+j].Store(old.data[oz+j].Load())
	}
	return used
}

// take returns an empty unpublished table of generation gen: the spare if
// no reader holds it and it is big enough, or a new one, counted in made.
// It never waits for readers: one still reading a version unpublished a
// whole rebuild ago is rare, and then the writer allocates. Only the device's tables (device) map slots:
// a reader maps every tier's bits with them.
func (x *tierIx) take(capacity, words int, device bool, gen uint64, made *int) *table {
	need, nslots, nwords := (capacity+1)*(1+words), 0, 0
	if device {
		nslots, nwords = words*64, words
	}
	ncl := words // every tier's table has its level's closed mask
	// The spare is unpublished: a reader that counts itself in from now on
	// fails pin's re-check and reads nothing, until it is published again.
	var t *table
	if r := x.spare; r != nil && r.readers.Load() == 0 && cap(r.data) >= need && cap(r.slots) >= nslots && cap(r.taken) >= nwords && cap(r.closed) >= ncl {
		x.spare, t = nil, r
		t.data = t.data[:need]
		clear(t.data)
		t.slots = t.slots[:nslots]
		t.taken = t.taken[:nwords]
		clear(t.taken)
		t.closed = t.closed[:ncl]
		clear(t.closed)
	}
	if t == nil {
		t = &table{data: make([]atomic.Uint64, need), slots: make([]atomic.Uint32, nslots),
			taken: make([]atomic.Uint64, nwords), closed: make([]atomic.Uint64, ncl)}
		*made++
	}
	t.size, t.words, t.stride, t.gen = capacity, words, 1+words, gen
	return t
}
