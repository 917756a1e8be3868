package index

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
type chains struct {
	at      map[uint64]int32 // key -> index in recs
	recs    []chainRec
	free    []int32
	orphans int
	// The block last looked up, the parent of the next store or the
	// parent a remove just decremented, both usual in chain order.
	lastKey uint64
	lastIdx int32 // -1: none
}

type chainRec struct {
	parent uint64
	refs   uint32
	kids   uint32 // low 30 bits: the count; top 2: the Link
}

const kidsMask = 1<<30 - 1

func (r *chainRec) link() Link { return Link(r.kids >> 30) }

func newChains() chains { return chains{at: make(map[uint64]int32), lastIdx: -1} }

// find returns k's index, or -1.
func (c *chains) find(k uint64) int32 {
	if c.lastIdx >= 0 && c.lastKey == k {
		return c.lastIdx
	}
	i, ok := c.at[k]
	if !ok {
		return -1
	}
	c.lastKey, c.lastIdx = k, i
	return i
}

// get returns k's index, adding an empty record if it has none.
func (c *chains) get(k uint64) int32 {
	if i := c.find(k); i >= 0 {
		return i
	}
	var i int32
	if n := len(c.free); n > 0 {
		i, c.free = c.free[n-1], c.free[:n-1]
		c.recs[i] = chainRec{}
	} else {
		i = int32(len(c.recs))
		c.recs = append(c.recs, chainRec{})
	}
	c.at[k] = i
	c.lastKey, c.lastIdx = k, i
	return i
}

// drop forgets the record of k at i.
func (c *chains) drop(k uint64, i int32) {
	delete(c.at, k)
	c.free = append(c.free, i)
	if c.lastIdx == i {
		c.lastIdx = -1
	}
}

// held reports whether the worker holds k.
func (c *chains) held(k uint64) bool {
	i := c.find(k)
	return i >= 0 && c.recs[i].refs > 0
}

// store adds a reference to k, of link and parent, and reports whether
// the worker did not hold k before.
func (c *chains) store(k uint64, link Link, parent uint64) (first bool) {
	i := c.get(k)
	r := &c.recs[i]
	if r.refs++; r.refs > 1 {
		return false
	}
	if link == LinkChild && parent == k {
		link = LinkNone // not a chain: a key is never its own parent
	}
	r.kids = r.kids&kidsMask | uint32(link)<<30
	r.parent = parent
	c.orphans -= int(r.kids & kidsMask) // its children held have their parent now
	switch link {
	case LinkNone:
		c.orphans++
	case LinkChild:
		p := &c.recs[c.get(parent)] // may move recs: r is not used after
		p.kids++
		if p.refs == 0 {
			c.orphans++
		}
	}
	return true
}

// remove drops one reference to k and reports whether the worker held it
// (known) and no longer does (last).
func (c *chains) remove(k uint64) (known, last bool) {
	i := c.find(k)
	if i < 0 || c.recs[i].refs == 0 {
		return false, false
	}
	r := &c.recs[i]
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
		pi := c.find(parent)
		p := &c.recs[pi]
		p.kids--
		if p.refs == 0 {
			c.orphans--
			if p.kids&kidsMask == 0 {
				c.drop(parent, pi)
			}
		}
	}
	if kids == 0 {
		c.drop(k, i)
	}
	return true, true
}

// reset forgets every block.
func (c *chains) reset() {
	clear(c.at)
	c.recs, c.free = c.recs[:0], c.free[:0]
	c.orphans, c.lastIdx = 0, -1
}
