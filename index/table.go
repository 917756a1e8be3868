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
// writer rebuilds the table, which it does when used entries would pass
// growNum/growDen of its size or a worker needs a slot that only a new
// generation can give.

const (
	minCap = 1 << 10 // entries of a new shard's table
	// maxSpare is the largest table kept for reuse once unpublished (1 MiB
	// of one-word entries), so that small indexes rebuild without
	// allocating.
	maxSpare = 1 << 16
	chunk    = 8 // bitset words a reader scores at once, on its stack (512 workers)
	// lookahead is how many keys a reader looks up, at most, before
	// scoring them.
	lookahead = 32
)

// lineGap keeps what one core writes off the cache line of what others
// read: a field after it is on another line than one before it, however
// the struct is aligned.
type lineGap [64]byte

// table is one version of a shard's index.
type table struct {
	data   []atomic.Uint64 // size+1 entries of stride words: key, then bitset; entry size is key 0's
	slots  []atomic.Uint32 // device tables: bitset slot -> WorkerID, as of this version
	taken  []atomic.Uint64 // device tables: bit s set once slots[s] maps a worker in this version
	closed []atomic.Uint64 // bit s set while slot s's worker is closed at the table's level (writer.setClosed)
	gen    uint64          // the writer's slot generation when this version was made
	size   int             // entries, key 0's aside: any count, not only a power of two
	words  int             // bitset words per entry
	stride int             // 1 + words
	// readers is written by every lookup, the fields above read by the
	// writer on every op: on one line, each pin would take the line from
	// the writer's core and each op take it back.
	_       lineGap
	readers atomic.Int32 // readers that pinned this version
	_       lineGap
}

func (t *table) home(k uint64) int { return homeOf(k, t.size) }

// find returns the offset of k's entry in data, or -1. Key 0 marks an empty
// entry, so key 0 itself has the extra entry at the end.
func (t *table) find(k uint64) int {
	if k == 0 {
		return t.size * t.stride
	}
	for i := t.home(k); ; {
		e := i * t.stride
		switch t.data[e].Load() {
		case k:
			return e
		case 0:
			return -1
		}
		if i++; i == t.size {
			i = 0
		}
	}
}

// touch loads k's home entry, so that its cache miss overlaps other work.
func (t *table) touch(k uint64) { t.data[t.home(k)*t.stride].Load() }

// place returns the offset of k's entry, or of the empty entry that would
// take it (found false). The writer's alone.
func (t *table) place(k uint64) (e int, found bool) {
	if k == 0 {
		return t.size * t.stride, true
	}
	for i := t.home(k); ; {
		e := i * t.stride
		switch t.data[e].Load() {
		case k:
			return e, true
		case 0:
			return e, false
		}
		if i++; i == t.size {
			i = 0
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
// hashes[0]. A closed worker's score is found by jump search, the others'
// key by key; should a worker be opened meanwhile (opened moves), the
// chunk is read again key by key. Each key's bitset is loaded once per
// chunk of words.
func (t *table) match(dst []Score, hashes []uint64, opened *atomic.Uint64) []Score {
	for c := 0; c < t.words; c += chunk {
		n, start := min(chunk, t.words-c), len(dst)
		o := opened.Load() // before the closed masks: see writer.setClosed
		var jumped bool
		if dst, jumped = t.matchChunk(dst, hashes, c, n, true); jumped && opened.Load() != o {
			dst, _ = t.matchChunk(dst[:start], hashes, c, n, false)
		}
	}
	return dst
}

// matchChunk scores words c to c+n: with jump, closed workers by jump
// search (reporting whether there were any), the others key by key.
func (t *table) matchChunk(dst []Score, hashes []uint64, c, n int, jump bool) ([]Score, bool) {
	var active [chunk]uint64 // the workers holding every key so far
	e := t.find(hashes[0])
	if e < 0 {
		return dst, false
	}
	var any uint64
	jumped := false
	for j := range n {
		active[j] = t.data[e+1+c+j].Load()
		if jump {
			if set := active[j] & t.closed[c+j].Load(); set != 0 {
				dst, jumped = t.jump(dst, hashes, c+j, set), true
				active[j] &^= set
			}
		}
		any |= active[j]
	}
	if any == 0 {
		return dst, jumped
	}
	return t.scan(dst, hashes, c, n, &active), jumped
}

// scan scores the workers of active, each holding hashes[0], key by key.
// Keys are looked up a group at a time before their bitsets are read: the
// lookups are independent, so the CPU overlaps their cache misses, which
// are most of a long prompt's cost (a static table's p99 lookup, 3,500 keys
// on the trace, took a third less time than one key at a time). Up to
// lookahead-1 lookups past the end of a match are wasted.
func (t *table) scan(dst []Score, hashes []uint64, c, n int, active *[chunk]uint64) []Score {
	var ents [lookahead]int
	for i := 1; i < len(hashes); {
		g := min(lookahead, len(hashes)-i)
		for k := range g { // see bitsAt
			t.touch(hashes[i+k])
		}
		for k := range g {
			ents[k] = t.find(hashes[i+k])
		}
		for k := 0; k < g; k, i = k+1, i+1 {
			e := ents[k]
			var any uint64
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

const (
	// jumpStep is how many keys jump skips at a time, and jumpAhead how
	// many of those checkpoints it looks up at once.
	jumpStep  = 32
	jumpAhead = 8
)

// bits is word w of k's bitset, 0 if no worker holds k.
func (t *table) bits(k uint64, w int) uint64 {
	if e := t.find(k); e >= 0 {
		return t.data[e+1+w].Load()
	}
	return 0
}

// bitsAt sets got[k] to word w of the bitset of hashes[at[k]], for k < g.
// It loads every key's home entry before probing any: a probe's loop ends
// on the value it loads, so probing straight away would wait for each
// cache miss in turn (a mispredicted exit discards the loads issued past
// it), where the loads alone overlap.
func (t *table) bitsAt(got *[jumpAhead]uint64, hashes []uint64, at *[jumpAhead]int, g, w int) {
	for k := range g {
		t.touch(hashes[at[k]])
	}
	for k := range g {
		got[k] = t.bits(hashes[at[k]], w)
	}
}

// jump scores the workers of set, in word w, all holding hashes[0] and
// closed: each holds the keys up to its score and none after, so it is
// enough to read every jumpStep-th key, and to bisect the last step of a
// worker that dropped out in it. The first step's end is read alone (on
// the trace, most matches end in that step), the next checkpoints
// jumpAhead at a time, so that their cache misses overlap.
func (t *table) jump(dst []Score, hashes []uint64, w int, set uint64) []Score {
	last := len(hashes) - 1
	var at [jumpAhead]int
	var got [jumpAhead]uint64
	ahead := 1 // most matches end in the first step: read its end alone
	for lo := 0; set != 0 && lo < last; {
		g := checkpoints(&at, lo, last, ahead)
		t.bitsAt(&got, hashes, &at, g, w)
		for k := 0; k < g && set != 0; k++ {
			m := set & got[k]
			if gone := set &^ m; gone != 0 {
				dst = t.bisect(dst, hashes, w, gone, lo, at[k])
			}
			set, lo = m, at[k]
		}
		ahead = jumpAhead
	}
	return t.emit(dst, set, w, len(hashes))
}

// checkpoints sets at to the next ahead keys a jump from lo reads, every
// jumpStep-th up to last, and returns how many it set.
func checkpoints(at *[jumpAhead]int, lo, last, ahead int) int {
	g := 0
	for p := lo + jumpStep; g < ahead; p += jumpStep {
		at[g] = min(p, last)
		g++
		if p >= last {
			break
		}
	}
	return g
}

// bisect scores the workers of gone, in word w, each holding hashes[lo]
// and not hashes[hi], and closed: each one's score is where it drops out.
func (t *table) bisect(dst []Score, hashes []uint64, w int, gone uint64, lo, hi int) []Score {
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		m := gone & t.bits(hashes[mid], w)
		if m == gone {
			lo = mid
			continue
		}
		if m != 0 {
			dst = t.bisect(dst, hashes, w, m, mid, hi)
		}
		gone, hi = gone&^m, mid
	}
	return t.emit(dst, gone, w, hi)
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
// so of one width. A worker closed at every level is scored by jump search,
// the others key by key; should a worker be opened meanwhile, the chunk is
// read again key by key, as in match.
func matchTiers(dst []Score, hashes []uint64, ts *[NumTiers]*table, opened *atomic.Uint64) []Score {
	words := ts[0].words
	for c := 0; c < words; c += chunk {
		n, start := min(chunk, words-c), len(dst)
		o := opened.Load() // before the closed masks: see writer.setClosed
		var jumped bool
		if dst, jumped = matchTiersChunk(dst, hashes, ts, c, n, true); jumped && opened.Load() != o {
			dst, _ = matchTiersChunk(dst[:start], hashes, ts, c, n, false)
		}
	}
	return dst
}

// matchTiersChunk walks the keys once, looking each up in every tier's
// table (lookahead at a time, as scan does), and keeps per tier t the
// workers holding every key so far each in a tier <= t: a worker dropping
// out of tier t's set at key i scores Tiers[t] = i. Those sets only shrink,
// and tier NumTiers-1's holds the others, so the walk ends when it empties.
// The workers scored are those in that set at hashes[0]; their Scores are
// appended then, in slot order, and filled in as they drop out: a slot's
// Score is found by counting the scored slots below it. With jump, those
// closed at every level are scored first, by tierWalk.jump, and the walk
// has the others (reporting whether there were any jumped).
func matchTiersChunk(dst []Score, hashes []uint64, ts *[NumTiers]*table, c, n int, jump bool) ([]Score, bool) {
	m := tierWalk{ts: ts, c: c, n: n}
	if !m.start(hashes[0]) {
		return dst, false
	}
	jumped := false
	for j := 0; jump && j < n; j++ {
		if set := m.first[j] & m.closed(j); set != 0 {
			dst, jumped = m.jump(dst, hashes, j, set), true
			m.first[j] &^= set
			for t := range m.act {
				m.act[t][j] &^= set
			}
		}
	}
	base := len(dst)
	for j := range n {
		m.rank[j] = len(dst) - base
		for set := m.first[j]; set != 0; set &= set - 1 {
			b := bits.TrailingZeros64(set)
			dst = append(dst, Score{Worker: WorkerID(ts[0].slots[(c+j)*64+b].Load())})
		}
	}
	scores := dst[base:]
	if end, all := m.walk(scores, hashes); !all {
		for j := range n {
			for t := range NumTiers {
				record(scores, m.act[t][j], m.first[j], m.rank[j], t, end)
			}
		}
	}
	for i := range scores {
		scores[i].Blocks = scores[i].Tiers[TierDevice]
	}
	return dst, jumped
}

// tierWalk is matchTiersChunk's state over words c to c+n.
type tierWalk struct {
	ts    *[NumTiers]*table
	c, n  int
	act   [NumTiers][chunk]uint64
	mask  [chunk]uint64 // the slots ts[0] maps: lower-tier bits of other slots are ignored
	first [chunk]uint64 // the workers scored
	rank  [chunk]int    // index in the scores of word j's first scored worker
	ents  [NumTiers][lookahead]int
}

// start reads the first key's holders, and reports whether there are any.
func (m *tierWalk) start(k uint64) bool {
	for t, tb := range m.ts {
		if tb == nil {
			for i := range m.ents[t] {
				m.ents[t][i] = -1
			}
		} else {
			m.ents[t][0] = tb.find(k)
		}
	}
	var any uint64
	for j := range m.n {
		// After the pins, before any bit: see the memory order above.
		m.mask[j] = m.ts[0].taken[m.c+j].Load()
		var u uint64
		for t := range NumTiers {
			if e := m.ents[t][0]; e >= 0 {
				w := m.ts[t].data[e+1+m.c+j].Load()
				if t > 0 {
					w &= m.mask[j]
				}
				u |= w
			}
			m.act[t][j] = u
		}
		m.first[j] = u
		any |= u
	}
	return any != 0
}

// walk reads keys 1 on, recording in scores where workers drop out of each
// tier; it returns the count of keys walked, and all when every worker has
// dropped out of every tier (nothing left to record).
func (m *tierWalk) walk(scores []Score, hashes []uint64) (end int, all bool) {
	for i := 1; i < len(hashes); {
		g := min(lookahead, len(hashes)-i)
		for t, tb := range m.ts {
			if tb != nil {
				for k := range g {
					m.ents[t][k] = tb.find(hashes[i+k])
				}
			}
		}
		for k := 0; k < g; k, i = k+1, i+1 {
			var any uint64
			for j := range m.n {
				var u uint64
				if e := m.ents[0][k]; e >= 0 {
					u = m.ts[0].data[e+1+m.c+j].Load()
				}
				for t := range NumTiers {
					if e := m.ents[t][k]; t > 0 && e >= 0 {
						u |= m.ts[t].data[e+1+m.c+j].Load() & m.mask[j]
					}
					a := m.act[t][j]
					if gone := a &^ u; gone != 0 {
						record(scores, gone, m.first[j], m.rank[j], t, i)
					}
					m.act[t][j] = a & u
				}
				any |= m.act[NumTiers-1][j]
			}
			if any == 0 {
				return i, true
			}
		}
	}
	return len(hashes), false
}

// closed is the workers of word j closed at every level: in every tier's
// table's closed mask (a lower tier's bits of slots the device's version
// does not map are ignored, as their held bits are).
func (m *tierWalk) closed(j int) uint64 {
	set := m.ts[0].closed[m.c+j].Load()
	for _, tb := range m.ts[1:] {
		if tb != nil {
			set &= tb.closed[m.c+j].Load() | ^m.mask[j]
		}
	}
	return set
}

// jump scores the workers of set, in word j, each holding hashes[0] in
// some tier and closed at every level: at each level, a worker holds the
// keys up to its score there and none after, in the tiers up to it, so its
// Tiers there is found as table.jump finds a device score, over the union
// of those tiers' bits. A tier without a table scores as the one below it.
func (m *tierWalk) jump(dst []Score, hashes []uint64, j int, set uint64) []Score {
	base := len(dst)
	for s := set; s != 0; s &= s - 1 {
		b := bits.TrailingZeros64(s)
		dst = append(dst, Score{Worker: WorkerID(m.ts[0].slots[(m.c+j)*64+b].Load())})
	}
	scores := dst[base:]
	for l := range Tier(NumTiers) {
		if l > TierDevice && m.ts[l] == nil {
			for i := range scores {
				scores[i].Tiers[l] = scores[i].Tiers[l-1]
			}
			continue
		}
		m.jumpLevel(scores, set, hashes, j, l, set&m.act[l][j])
	}
	for i := range scores {
		sc := &scores[i]
		sc.Blocks = sc.Tiers[TierDevice]
		for l := TierHost; l < NumTiers; l++ {
			// Read at other instants, a level may have lost blocks that
			// the one below was seen holding, and so held too.
			sc.Tiers[l] = max(sc.Tiers[l], sc.Tiers[l-1])
		}
	}
	return dst
}

// jumpLevel records Tiers[l] of the workers of held, a subset of set (whose
// Scores are scores, in slot order), each holding hashes[0] in a tier <= l
// and closed at level l; the others of set score 0 there, as the Scores
// were made.
func (m *tierWalk) jumpLevel(scores []Score, set uint64, hashes []uint64, j int, l Tier, held uint64) {
	last := len(hashes) - 1
	var at [jumpAhead]int
	var got [jumpAhead]uint64
	ahead := 1 // most matches end in the first step: read its end alone
	for lo := 0; held != 0 && lo < last; {
		g := checkpoints(&at, lo, last, ahead)
		for k := range g { // see table.bitsAt
			for _, tb := range m.ts[:l+1] {
				if tb != nil {
					tb.touch(hashes[at[k]])
				}
			}
		}
		for k := range g {
			got[k] = m.bits(hashes[at[k]], j, l)
		}
		for k := 0; k < g && held != 0; k++ {
			h := held & got[k]
			if gone := held &^ h; gone != 0 {
				m.bisect(scores, set, hashes, j, l, gone, lo, at[k])
			}
			held, lo = h, at[k]
		}
		ahead = jumpAhead
	}
	record(scores, held, set, 0, int(l), len(hashes))
}

// bisect records Tiers[l] of the workers of gone, each holding hashes[lo]
// and not hashes[hi] in the tiers up to l, and closed at level l.
func (m *tierWalk) bisect(scores []Score, set uint64, hashes []uint64, j int, l Tier, gone uint64, lo, hi int) {
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		h := gone & m.bits(hashes[mid], j, l)
		if h == gone {
			lo = mid
			continue
		}
		if h != 0 {
			m.bisect(scores, set, hashes, j, l, h, mid, hi)
		}
		gone, hi = gone&^h, mid
	}
	record(scores, gone, set, 0, int(l), hi)
}

// bits is word j of k's holders in any tier <= l.
func (m *tierWalk) bits(k uint64, j int, l Tier) uint64 {
	var u uint64
	for t, tb := range m.ts[:l+1] {
		if tb == nil {
			continue
		}
		if e := tb.find(k); e >= 0 {
			w := tb.data[e+1+m.c+j].Load()
			if t > 0 {
				w &= m.mask[j]
			}
			u |= w
		}
	}
	return u
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
	tier  Tier   // whose index it is: its closed masks are that level's
	t     *table // == cur.Load(), without the atomic
	spare *table // the last version unpublished, if small: reused once no reader holds it
	used  int    // entries of t with a key (key 0's aside), held or emptied
	live  int    // entries some worker holds, key 0's included
	// used and live change with most ops, cur is loaded by every lookup.
	_   lineGap
	cur atomic.Pointer[table] // the version readers pin
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
	// An older spare that take could not reuse goes to the GC, readers or
	// not. A large table is not kept: it would double the index's memory,
	// and its rebuild's copying costs more than its allocation.
	x.spare = nil
	if x.t.size <= maxSpare {
		x.spare = x.t
	}
	x.t = nt
}
