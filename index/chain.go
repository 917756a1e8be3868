package index

import "math/bits"

// Link is what an OpStore says of its block's place in a chain of keys:
// nothing (LinkNone, the zero value), a chain's first block (LinkRoot), or
// a block chained from Op.Parent (LinkChild). The index uses links to
// answer without reading every key of a prompt: a worker all of whose
// device blocks have their parent on device too (or are roots) holds a
// prompt's keys up to some point and none after it, so its score can be
// found by jumping ahead and bisecting back. A worker with a block of
// unknown link, or whose parent it does not hold (an engine evicted a middle
// block and kept its descendants), is read key by key, as before.
type Link uint8

const (
	LinkNone  Link = iota // unknown: the block counts as one whose parent is missing
	LinkRoot              // the block starts a chain
	LinkChild             // the block's parent is Op.Parent
)

// chains is one worker's device blocks for the writer: per block its
// reference count, link and how many of the worker's device blocks name it
// as their parent, and the count of orphans, blocks held whose parent is
// not (or unknown). A block with children but no references stays as a
// ghost, so that storing it again knows the orphans it adopts.
//
// It is its own open-addressing table (linear probing, deletion by
// backward shift, so no tombstones): a store or remove of a chain's next
// block finds its parent's record in the cache lines it just touched, and
// a lookup of a key never stored ends at the first empty slot. It is sized
// to its records (a load of 0.7 to 0.875), not to a power of two. A slot
// is 17 B: its keys, and a byte of link and counts (chainMeta), as a
// worker's blocks are nearly all one reference and at most a few
// children; the rare larger counts live in big.
type chains struct {
	recs    []chainRec           // size slots, then key 0's; key 0 marks an empty slot
	meta    []chainMeta          // recs[i]'s link and counts
	big     map[uint64]bigCounts // the counts of keys whose meta has a field at fieldMax; nil until one does
	hasZero bool                 // key 0 has a record
	n       int                  // records, key 0's included
	size    int                  // len(recs) - 1
	orphans int
	sink    uint64 // what touch loads, so that the load stays
}

type chainRec struct {
	key    uint64
	parent uint64
}

// chainMeta is a record's link (bits 6-7), references (bits 3-5) and
// children (bits 0-2). A count field at fieldMax means the count is in
// chains.big.
type chainMeta uint8

const (
	fieldMax  = 7
	kidsShift = 0
	refsShift = 3
	linkShift = 6
)

// bigCounts holds a key's counts whose meta field is at fieldMax; the
// other is stale.
type bigCounts struct{ refs, kids uint32 }

func (c *chains) link(i int) Link { return Link(c.meta[i] >> linkShift) }

func (c *chains) setLink(i int, l Link) {
	c.meta[i] = c.meta[i]&^(3<<linkShift) | chainMeta(l)<<linkShift
}

func (c *chains) refs(i int) uint32 { return c.count(i, refsShift) }
func (c *chains) kids(i int) uint32 { return c.count(i, kidsShift) }

// count is the count of the field at shift of recs[i].
func (c *chains) count(i int, shift uint) uint32 {
	if v := uint32(c.meta[i]>>shift) & fieldMax; v < fieldMax {
		return v
	}
	b := c.big[c.recs[i].key]
	if shift == refsShift {
		return b.refs
	}
	return b.kids
}

// setCount sets the count of the field at shift of recs[i] to n, in big
// from fieldMax on; a key leaves big once neither field is there.
func (c *chains) setCount(i int, shift uint, n uint32) {
	m := c.meta[i]
	was := uint32(m>>shift)&fieldMax == fieldMax
	c.meta[i] = m&^(fieldMax<<shift) | chainMeta(min(n, fieldMax))<<shift
	if n < fieldMax && !was {
		return
	}
	k := c.recs[i].key
	if n < fieldMax {
		other := uint(refsShift + kidsShift - shift)
		if uint32(m>>other)&fieldMax != fieldMax {
			delete(c.big, k)
		}
		return
	}
	if c.big == nil {
		c.big = make(map[uint64]bigCounts)
	}
	b := c.big[k]
	if shift == refsShift {
		b.refs = n
	} else {
		b.kids = n
	}
	c.big[k] = b
}

const minChains = 64

func (c *chains) home(k uint64) int { return homeOf(k, c.size) }

// homeOf is key k's first slot of size: the high bits of a multiplicative
// hash, scaled to size.
func homeOf(k uint64, size int) int {
	hi, _ := bits.Mul64(k*0x9e3779b97f4a7c15, uint64(size))
	return int(hi)
}

// find returns the index of k's record, or of the empty slot that would
// take it (found false). The table must have room (reserve).
func (c *chains) find(k uint64) (i int, found bool) {
	if k == 0 {
		return c.size, c.hasZero
	}
	for i = c.home(k); ; {
		switch c.recs[i].key {
		case k:
			return i, true
		case 0:
			return i, false
		}
		if i++; i == c.size {
			i = 0
		}
	}
}

// touch loads k's home slot, so that its cache misses overlap other work.
func (c *chains) touch(k uint64) {
	if c.size > 0 {
		h := c.home(k)
		c.sink ^= c.recs[h].key ^ uint64(c.meta[h])
	}
}

// reserve makes room for n more records, so that the indices of those
// there stay put while they are added: past a load of 7/8 the table grows
// to a load of 7/10.
func (c *chains) reserve(n int) {
	if (c.n+n)*8 > c.size*7 || c.size <= 0 {
		c.resize(max(minChains, (c.n+n)*10/7))
	}
}

// add makes the empty slot i (from find) k's record.
func (c *chains) add(i int, k uint64) {
	c.n++
	if k == 0 {
		c.hasZero = true
	}
	c.recs[i], c.meta[i] = chainRec{key: k}, 0
}

func (c *chains) resize(size int) {
	old, oldMeta := c.recs, c.meta
	c.recs, c.meta = make([]chainRec, size+1), make([]chainMeta, size+1)
	c.size = size
	for j := range old {
		if r := old[j]; r.key != 0 {
			i, _ := c.find(r.key)
			c.recs[i], c.meta[i] = r, oldMeta[j]
		}
	}
	if c.hasZero {
		c.recs[size], c.meta[size] = old[len(old)-1], oldMeta[len(old)-1]
	}
}

// del removes the record at i, shifting back the records after it that
// would not be found past the hole. Its counts must be 0 (not in big).
func (c *chains) del(i int) {
	c.n--
	if i == c.size {
		c.hasZero = false
		c.recs[i], c.meta[i] = chainRec{}, 0
		return
	}
	for j := c.next(i); c.recs[j].key != 0; j = c.next(j) {
		if h := c.home(c.recs[j].key); ring(j-h, c.size) >= ring(j-i, c.size) { // h is not in (i, j]
			c.recs[i], c.meta[i] = c.recs[j], c.meta[j]
			i = j
		}
	}
	c.recs[i], c.meta[i] = chainRec{}, 0
}

// next is the slot after i, cyclically.
func (c *chains) next(i int) int {
	if i++; i == c.size {
		return 0
	}
	return i
}

// ring is d, a difference of two slots of size, as a distance forward.
func ring(d, size int) int {
	if d < 0 {
		return d + size
	}
	return d
}

// store adds a reference to k, of link and parent, and reports whether
// the worker did not hold k before.
func (c *chains) store(k uint64, link Link, parent uint64) (first bool) {
	if link == LinkChild && parent == k {
		link = LinkNone // not a chain: a key is never its own parent
	}
	c.reserve(2)
	i, ok := c.find(k)
	if ok {
		if refs := c.refs(i); refs > 0 {
			c.setCount(i, refsShift, refs+1)
			return false
		}
	} else {
		c.add(i, k)
	}
	c.recs[i].parent = parent
	c.setCount(i, refsShift, 1)
	c.setLink(i, link)
	c.orphans -= int(c.kids(i)) // its children held have their parent now
	switch link {
	case LinkNone:
		c.orphans++
	case LinkChild:
		pi, ok := c.find(parent)
		if !ok {
			c.add(pi, parent)
		}
		c.setCount(pi, kidsShift, c.kids(pi)+1)
		if c.refs(pi) == 0 {
			c.orphans++
		}
	}
	return true
}

// remove drops one reference to k and reports whether the worker held it
// (known) and no longer does (last).
func (c *chains) remove(k uint64) (known, last bool) {
	if c.n == 0 {
		return false, false
	}
	i, ok := c.find(k)
	if !ok {
		return false, false
	}
	switch refs := c.refs(i); refs {
	case 0:
		return false, false
	case 1:
	default:
		c.setCount(i, refsShift, refs-1)
		return true, false
	}
	c.setCount(i, refsShift, 0)
	link, parent, kids := c.link(i), c.recs[i].parent, c.kids(i)
	c.setLink(i, LinkNone) // a ghost has no link
	c.orphans += int(kids)
	switch link {
	case LinkNone:
		c.orphans--
	case LinkChild:
		pi, _ := c.find(parent)
		pk := c.kids(pi) - 1
		c.setCount(pi, kidsShift, pk)
		if c.refs(pi) == 0 {
			c.orphans--
			if pk == 0 {
				// Deleted first: deleting k could move p's record.
				c.del(pi)
				if kids == 0 {
					i, _ = c.find(k)
				}
			}
		}
	}
	if kids == 0 {
		c.del(i)
	}
	return true, true
}

// keys calls f with every key the worker holds.
func (c *chains) keys(f func(k uint64)) {
	for i, m := range c.meta {
		if m>>refsShift&fieldMax != 0 {
			f(c.recs[i].key)
		}
	}
}

// reset forgets every block.
func (c *chains) reset() {
	clear(c.recs)
	clear(c.meta)
	c.big = nil
	c.hasZero, c.n, c.orphans = false, 0, 0
}
