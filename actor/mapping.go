package actor

import (
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
)

// block is what the actor knows of one engine block, as blockTable hands it
// out (it keeps a block in 26 B with its hash).
type block struct {
	key    uint64 // the router's key (of its last router block, when split)
	parent uint64 // the engine's hash of its parent
	// split >= 0: the slot of its first router keys in splitKeys, for an
	// engine block of several router blocks.
	split int32
	gen   uint16 // the generation tiers was set in (see current), below genCount
	tiers uint8  // the tiers the index holds it in, as of gen
	// flags: the tiers a snapshot says it is in (restoredMask), indexed
	// once the snapshot's position is proven (Actor.pending), and
	// flagParent.
	flags uint8
}

// genCount is how many generations the counter tells apart: blockTable
// keeps a block's in 7 bits.
const genCount = 1 << (16 - metaGenShift)

const (
	restoredMask = 1<<index.NumTiers - 1
	flagParent   = 1 << index.NumTiers // the block has a parent (parent is set)
)

// current reports whether b was indexed in generation gen: a block whose
// tiers are empty never is (so that a wrapped generation counter can
// retire every block by emptying its tiers, mapping.nextGen).
func (b block) current(gen uint16) bool { return b.gen == gen && b.tiers != 0 }

// held returns the tiers the index holds b in now.
func (b block) held(gen uint16) uint8 {
	if !b.current(gen) {
		return 0
	}
	return b.tiers
}

// newBlock is a block of router key key, with its engine parent if
// hasParent, held in tiers, not split.
func newBlock(key, parent uint64, hasParent bool, tiers uint8) block {
	b := block{key: key, parent: parent, tiers: tiers, split: -1}
	if hasParent {
		b.flags = flagParent
	}
	return b
}

func (b block) hasParent() bool { return b.flags&flagParent != 0 }
func (b block) restored() uint8 { return b.flags & restoredMask }

func bit(t index.Tier) uint8 { return 1 << t }

// maxKept bounds the blocks a resync keeps mapped: a mapping this large
// after losses holds many blocks the engine evicted unseen, so it is dropped.
const maxKept = 1 << 21

// mapping is what one worker told of its blocks, and which of them the
// index holds: every change to it emits the ops that keep the index true.
type mapping struct {
	// routerOf maps the engine's block hash to the router's, for chaining
	// parents and for removes. It survives a resync within one engine
	// incarnation (engine hashes are content hashes), so that blocks under a
	// prefix the engine still holds keep their true keys.
	routerOf blockTable
	// gen counts the worker's index clears; a block is in the index only if
	// it was stored in the current generation.
	gen uint16
	// fullSeen: this worker published a block of the router's size that
	// passed group filtering.
	fullSeen bool
	// usedTiers: the tiers this worker stored blocks in since its entries
	// were last cleared whole.
	usedTiers uint8
	// sizeWarned: a block size the router cannot split was warned about.
	sizeWarned bool
	// rekeyed: a block took another router key since the last clear. Its
	// children's keys were hashed from the old one, which the mapping no
	// longer knows, so no parent's key is trusted as a child's link
	// (linkOf): a wrong LinkChild would let jump search claim blocks a
	// prompt does not reach.
	rekeyed bool
	// An engine block of splitK router blocks (splitK > 1) keeps its last
	// router key; its first splitK-1 live in a slot of splitKeys, reused
	// through freeSlots.
	splitK    int
	splitKeys []uint64
	freeSlots []int32
	keys      []uint64 // scratch: one engine block's router keys
	hasher    index.Hasher
	max       int // the most blocks routerOf may hold (Config.MaxBlocks)
	out       *outbox
	stats     *counters
}

// clear forgets every block of the worker and its full-block history: an
// engine that comes back with another block size must warn again.
func (m *mapping) clear() {
	m.routerOf.reset(false)
	m.usedTiers = 0
	m.rekeyed = false
	m.splitK, m.splitKeys, m.freeSlots = 0, m.splitKeys[:0], m.freeSlots[:0]
	m.sizeWarned = false
	m.unindex()
}

// clearTier empties one tier of the worker, in the index and in the
// mapping, and keeps what its other tiers hold. It walks the mapping, but
// only for an engine that clears one tier of several.
func (m *mapping) clearTier(t index.Tier) {
	m.out.room(1)
	for ext, b := range m.routerOf.all() {
		if b.held(m.gen)&bit(t) == 0 {
			continue // not in the tier (or kept through a resync, tiers unknown)
		}
		if b.tiers &^= bit(t); b.tiers == 0 {
			m.forget(ext, b)
		} else {
			m.routerOf.set(ext, b)
		}
	}
	m.usedTiers &^= bit(t)
	if t == index.TierDevice {
		m.fullSeen = false
	}
	m.out.emit(index.Op{Kind: index.OpClearTier, Tier: t})
}

// forget drops ext from the mapping, and its split keys' slot.
func (m *mapping) forget(ext uint64, b block) {
	m.routerOf.del(ext)
	if b.split >= 0 {
		m.freeSlots = append(m.freeSlots, b.split)
	}
}

// unindex clears the worker in the index but keeps the block mapping: its
// entries become known but not indexed. The tiers it used are kept: the
// engine may still hold blocks in them.
func (m *mapping) unindex() {
	m.out.room(1)
	if m.routerOf.len() > maxKept {
		m.routerOf.reset(true) // give its peak memory back
		m.splitK, m.splitKeys, m.freeSlots = 0, nil, nil
	}
	m.nextGen()
	m.fullSeen = false
	m.out.emit(index.Op{Kind: index.OpClearWorker})
}

// dropped: the outbox dropped a batch, so the index lost its ops: a new
// generation, with the mapping still true (the engine is the same).
func (m *mapping) dropped() {
	m.nextGen()
	m.fullSeen = false
}

// nextGen starts a generation: no block is indexed in it yet. When the
// counter wraps, every block's tiers are emptied first, so that none stored
// genCount generations ago looks current (block.current).
func (m *mapping) nextGen() {
	if m.gen = (m.gen + 1) % genCount; m.gen != 0 {
		return
	}
	for h, b := range m.routerOf.all() {
		if b.tiers != 0 {
			b.tiers = 0
			m.routerOf.set(h, b)
		}
	}
}

// remove takes the engine blocks hashes out of tier t.
func (m *mapping) remove(hashes []uint64, t index.Tier) {
	for _, ext := range hashes {
		b, ok := m.routerOf.get(ext)
		if !ok {
			m.stats.UnknownRemove.Add(1)
			continue
		}
		m.out.room(m.keysOf(b))
		if !b.current(m.gen) {
			// Kept through a resync, its tiers unknown: gone from the
			// device, it is forgotten as before tiers; gone from another
			// tier, the device may still hold it.
			if t == index.TierDevice {
				m.forget(ext, b)
			}
			continue
		}
		if b.tiers&bit(t) != 0 {
			m.emitKeys(index.OpRemove, t, b, index.LinkNone, 0)
		}
		if b.tiers &^= bit(t); b.tiers == 0 {
			m.forget(ext, b)
		} else {
			m.routerOf.set(ext, b) // still held in another tier
		}
	}
}

// store keys and stores the blocks of a BlockStored event with tokens, of
// k router blocks each, in tier t. It reports false when a new block met
// the mapping's cap: that block and the rest of the event are left out.
func (m *mapping) store(e *codec.Event, t index.Tier, k int) bool {
	bs := e.BlockSize
	n := len(e.BlockHashes)
	if whole := wholeBlocks(e); whole < n {
		m.stats.TokenMismatch.Add(1)
		n = whole
	}
	parent, hasParent := uint64(0), false
	if e.HasParent {
		p, ok := m.routerOf.get(e.ParentHash)
		if !ok {
			// Its key chains through blocks this worker never told us of
			// (history lost, or the router joined late): no prompt could
			// hash to a key made up here, so the blocks stay out. The
			// engine holds that parent, and the index lacks it: the worker
			// is partial until a cache clear (FORMAT.md §9).
			m.stats.UnknownParent.Add(1)
			m.stats.Partial.Store(true)
			return true
		}
		if t == index.TierDevice {
			// The engine built on the parent on device, so it holds the
			// parent's prefix there.
			m.reindex(e.ParentHash)
		}
		parent, hasParent = p.key, true
	}
	var ns uint64 // the adapter and salt, mixed into a root's key
	if !hasParent {
		ns = index.Namespace(e.LoraName, e.LoraID, e.HasLoraID, e.CacheSalt)
	}
	over := 0
	if e.Bigram {
		over = 1 // an EAGLE window runs one token past its block
	}
	unit := bs / k
	ext, extParent := e.ParentHash, e.HasParent
	for i := range n {
		link, linkParent := chainLink(hasParent), parent // of the block's first router key
		var extra uint64
		if i < len(e.BlockExtra) {
			extra = e.BlockExtra[i]
		}
		toks := e.TokenIDs[i*bs : (i+1)*bs+over]
		m.keys = m.keys[:0]
		for j := range k {
			parent = m.hasher.Key(parent, hasParent, ns, extra, toks[j*unit:(j+1)*unit+over])
			hasParent = true
			m.keys = append(m.keys, parent)
		}
		h := e.BlockHashes[i]
		if m.routerOf.len() >= m.max && !m.known(h) {
			return false
		}
		m.put(h, newBlock(parent, ext, extParent, bit(t)), t, k, link, linkParent)
		ext, extParent = h, true
	}
	return true
}

// wholeBlocks is how many blocks e's tokens cover: block i is tokens
// [i·size, (i+1)·size), and one more token for a bigram event, whose key
// is hashed over an EAGLE window (index.Hasher.EagleKeys).
func wholeBlocks(e *codec.Event) int {
	if e.Bigram {
		return (len(e.TokenIDs) - 1) / e.BlockSize
	}
	return len(e.TokenIDs) / e.BlockSize
}

// put stores the engine block h, keyed b.key (and m.keys before it), in
// tier t, its first key with link and parent (index.Op.Link): a block
// stored again under its key only gains the tier; one whose key changed
// leaves the index under its old keys first.
func (m *mapping) put(h uint64, b block, t index.Tier, k int, link index.Link, parent uint64) {
	old, known := m.routerOf.get(h)
	if known && old.key == b.key {
		m.hold(h, old, t) // stored again: in the index already, unless in another tier
		return
	}
	if known {
		m.out.room(m.keysOf(old)*index.NumTiers + k)
		for ot := range index.Tier(index.NumTiers) {
			if old.held(m.gen)&bit(ot) != 0 {
				m.emitKeys(index.OpRemove, ot, old, index.LinkNone, 0)
			}
		}
		m.forget(h, old)
		m.rekeyed = true
	} else {
		m.out.room(k)
	}
	b.gen = m.gen
	if k > 1 {
		b.split = m.slot(m.keys[:k-1])
	}
	m.routerOf.set(h, b)
	m.emitKeys(index.OpStore, t, b, link, parent)
}

func (m *mapping) known(h uint64) bool {
	_, ok := m.routerOf.get(h)
	return ok
}

// retier handles a BlockStored without tokens (vLLM's offloading connector
// names the blocks it copied to another tier by hash alone): blocks this
// worker told of go into the tier under their keys; others cannot be keyed.
func (m *mapping) retier(e *codec.Event, t index.Tier) {
	for _, h := range e.BlockHashes {
		b, ok := m.routerOf.get(h)
		if !ok {
			m.stats.TokenMismatch.Add(1)
			continue
		}
		m.hold(h, b, t)
	}
}

// slot stores the first router keys of a split engine block and returns
// their slot.
func (m *mapping) slot(keys []uint64) int32 {
	if n := len(m.freeSlots); n > 0 {
		s := m.freeSlots[n-1]
		m.freeSlots = m.freeSlots[:n-1]
		copy(m.splitKeys[int(s)*len(keys):], keys)
		return s
	}
	m.splitKeys = append(m.splitKeys, keys...)
	return int32(len(m.splitKeys)/len(keys) - 1)
}

// hold puts the known block h in tier t of the index, unless it is there,
// and reports whether it did.
func (m *mapping) hold(h uint64, b block, t index.Tier) bool {
	m.out.room(m.keysOf(b))
	held := b.held(m.gen)
	if held&bit(t) != 0 {
		return false
	}
	b.gen, b.tiers = m.gen, held|bit(t)
	m.routerOf.set(h, b)
	m.usedTiers |= bit(t)
	link, parent := m.linkOf(b) // in every tier: see index.writer on levels
	m.emitKeys(index.OpStore, t, b, link, parent)
	return true
}

// keysOf is the number of router keys of b.
func (m *mapping) keysOf(b block) int {
	if b.split >= 0 {
		return m.splitK
	}
	return 1
}

// emitKeys sends one op for each router key of b, first to last, the first
// with link and parent (index.Op.Link), each after it chained from the one
// before.
func (m *mapping) emitKeys(kind index.OpKind, t index.Tier, b block, link index.Link, parent uint64) {
	if b.split >= 0 {
		n := m.splitK - 1
		for _, k := range m.splitKeys[int(b.split)*n : int(b.split+1)*n] {
			m.out.emit(index.Op{Kind: kind, Tier: t, Hash: k, Link: link, Parent: parent})
			link, parent = index.LinkChild, k
		}
	}
	m.out.emit(index.Op{Kind: kind, Tier: t, Hash: b.key, Link: link, Parent: parent})
}

// chainLink is the link of a key chained from a parent, or a root.
func chainLink(hasParent bool) index.Link {
	if hasParent {
		return index.LinkChild
	}
	return index.LinkRoot
}

// linkOf is the link of b's first router key: its engine parent's last
// router key, as far as the mapping knows it, unless a block was rekeyed.
func (m *mapping) linkOf(b block) (index.Link, uint64) {
	if !b.hasParent() {
		return index.LinkRoot, 0
	}
	if p, ok := m.routerOf.get(b.parent); ok && !m.rekeyed { // else forgotten, or perhaps not its key's parent: unknown
		return index.LinkChild, p.key
	}
	return index.LinkNone, 0
}

// reindex puts the block ext and its ancestors back on device where an
// earlier clear or eviction took them out.
func (m *mapping) reindex(ext uint64) {
	for {
		b, ok := m.routerOf.get(ext)
		if !ok || !m.hold(ext, b, index.TierDevice) {
			return
		}
		if !b.hasParent() {
			return
		}
		ext = b.parent
	}
}
