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
// to its records (a load of 0.7 to 0.875), not to a power of two.
type chains struct {
	recs    []chainRec // size slots, then key 0's; key 0 marks an empty slot
	hasZero bool       // key 0 has a record
	n       int        // records, key 0's included
	size    int        // len(recs) - 1
	orphans int
	sink    uint64 // what touch loads, so that the load stays
}

type chainRec struct {
	key    uint64
	parent uint64
	refs   uint32
	kids   uint32 // low 30 bits: the count; top 2: the Link
}

const kidsMask = 1<<30 - 1

func (r *chainRec) link() Link { return Link(r.kids >> 30) }

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

// touch loads k's home slot, so that its cache miss overlaps other work.
func (c *chains) touch(k uint64) {
	if c.size > 0 {
		c.sink ^= c.recs[c.home(k)].key
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
	c.recs[i] = chainRec{key: k}
}

func (c *chains) resize(size int) {
	old := c.recs
	c.recs = make([]chainRec, size+1)
	c.size = size
	for j := range old {
		if r := old[j]; r.key != 0 {
			i, _ := c.find(r.key)
			c.recs[i] = r
		}
	}
	if c.hasZero {
		c.recs[size] = old[len(old)-1]
	}
}

// del removes the record at i, shifting back the records after it that
// would not be found past the hole.
func (c *chains) del(i int) {
	c.n--
	if i == c.size {
		c.hasZero = false
		c.recs[i] = chainRec{}
		return
	}
	for j := c.next(i); c.recs[j].key != 0; j = c.next(j) {
		if h := c.home(c.recs[j].key); ring(j-h, c.size) >= ring(j-i, c.size) { // h is not in (i, j]
			c.recs[i] = c.recs[j]
			i = j
		}
	}
	c.recs[i] = chainRec{}
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
	if link == LinkChild && parent == k || link > LinkChild {
		link = LinkNone // not a chain (a key is never its own parent), or no link Op knows
	}
	c.reserve(2)
	i, ok := c.find(k)
	r := &c.recs[i]
	if first = !ok || r.refs == 0; first {
		if !ok {
			c.add(i, k)
		}
		c.orphans -= int(r.kids & kidsMask) // its children held have their parent now
		if link == LinkNone {
			c.orphans++
		}
	} else if r.link() == LinkNone && link != LinkNone {
		// Held, of unknown link, and known now (a block's parent is its
		// key's, whoever stored it): an orphan no more, unless its parent
		// is not held, so that the worker need not stay open until k leaves.
		c.orphans--
	} else {
		r.refs++
		return false
	}
	r.refs++
	r.parent = parent
	r.kids = r.kids&kidsMask | uint32(link)<<30
	if link == LinkChild {
		pi, ok := c.find(parent)
		if !ok {
			c.add(pi, parent)
		}
		p := &c.recs[pi]
		p.kids++
		if p.refs == 0 {
			c.orphans++
		}
	}
	return first
}

// remove drops one reference to k and reports whether the worker held it
// (known) and no longer does (last).
func (c *chains) remove(k uint64) (known, last bool) {
	if c.n == 0 {
		return false, false
	}
	i, ok := c.find(k)
	r := &c.recs[i]
	if !ok || r.refs == 0 {
		return false, false
	}
	if r.refs--; r.refs > 0 {
		return true, false
	}
	link, parent, kids := r.link(), r.parent, r.kids&kidsMask
	r.kids = kids // a ghost has no link
	c.orphans += int(kids)
	switch link {
	case LinkNone:
		c.orphans--
	case LinkChild:
		pi, _ := c.find(parent)
		p := &c.recs[pi]
		p.kids--
		if p.refs == 0 {
			c.orphans--
			if p.kids&kidsMask == 0 {
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

// each calls f with every key the worker holds and its references.
func (c *chains) each(f func(k uint64, refs uint32)) {
	for i := range c.recs {
		if r := &c.recs[i]; r.refs > 0 {
			f(r.key, r.refs)
		}
	}
}

// clone returns a copy of c.
func (c *chains) clone() chains {
	d := *c
	d.recs = append([]chainRec(nil), c.recs...)
	return d
}

// reset forgets every block.
func (c *chains) reset() {
	clear(c.recs)
	c.hasZero, c.n, c.orphans = false, 0, 0
}
