package actor

import (
	"iter"
	"math/bits"
)

// blockTable maps the engine's block hashes to blocks: an open-addressing
// table of 32 B records (linear probing, deletion by backward shift, so no
// tombstones), sized to its count. A Go map took 40 B a slot, and its
// tombstones made it grow without bound under an engine's steady churn (a
// third of its slots live at the end of the Mooncake trace).
type blockTable struct {
	recs    []blockRec // hash 0 marks an empty slot
	zero    block      // hash 0's block
	hasZero bool
	n       int // blocks, hash 0's included
}

type blockRec struct {
	hash uint64
	block
}

const (
	minBlockSlots = 64
	// The table grows when more than 7/8 of its slots would be taken, to
	// 10/7 of its count: a load of 0.7 to 0.875.
	maxLoadNum, maxLoadDen = 7, 8
	growNum, growDen       = 10, 7
)

// home is h's first slot: the high bits of a multiplicative hash, scaled to
// the table's length (any length, not only powers of two).
func (t *blockTable) home(h uint64) int {
	hi, _ := bits.Mul64(h*0x9e3779b97f4a7c15, uint64(len(t.recs)))
	return int(hi)
}

// find returns the slot of h, or of the empty slot that would take it
// (found false). h != 0, and the table has an empty slot.
func (t *blockTable) find(h uint64) (i int, found bool) {
	for i = t.home(h); ; {
		switch t.recs[i].hash {
		case h:
			return i, true
		case 0:
			return i, false
		}
		if i++; i == len(t.recs) {
			i = 0
		}
	}
}

func (t *blockTable) len() int { return t.n }

// get returns h's block.
func (t *blockTable) get(h uint64) (block, bool) {
	if h == 0 {
		return t.zero, t.hasZero
	}
	if len(t.recs) == 0 {
		return block{}, false
	}
	i, ok := t.find(h)
	return t.recs[i].block, ok
}

// set makes b h's block. Replacing h's block moves no other.
func (t *blockTable) set(h uint64, b block) {
	if h == 0 {
		t.n += b2i(!t.hasZero)
		t.zero, t.hasZero = b, true
		return
	}
	if len(t.recs) > 0 {
		if i, ok := t.find(h); ok {
			t.recs[i].block = b
			return
		}
	}
	if (t.n+1)*maxLoadDen > len(t.recs)*maxLoadNum {
		t.resize(max(minBlockSlots, (t.n+1)*growNum/growDen))
	}
	i, _ := t.find(h)
	t.recs[i] = blockRec{hash: h, block: b}
	t.n++
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (t *blockTable) resize(size int) {
	old := t.recs
	t.recs = make([]blockRec, size)
	for _, r := range old {
		if r.hash != 0 {
			i, _ := t.find(r.hash)
			t.recs[i] = r
		}
	}
}

// del forgets h, if known.
func (t *blockTable) del(h uint64) {
	if h == 0 {
		t.n -= b2i(t.hasZero)
		t.zero, t.hasZero = block{}, false
		return
	}
	if len(t.recs) == 0 {
		return
	}
	i, ok := t.find(h)
	if !ok {
		return
	}
	t.n--
	n := len(t.recs)
	for j := (i + 1) % n; t.recs[j].hash != 0; j = (j + 1) % n {
		// j's record moves back into the hole at i unless its home lies
		// cyclically in (i, j]: then a lookup from its home would not pass i.
		if h := t.home(t.recs[j].hash); (j-h+n)%n >= (j-i+n)%n {
			t.recs[i] = t.recs[j]
			i = j
		}
	}
	t.recs[i] = blockRec{}
}

// all yields every block. The loop's body may replace or delete the block
// it is given, and nothing else: a record that a deletion moves back into
// the slot just read is read next (one that wraps around from the start of
// the table may be read twice).
func (t *blockTable) all() iter.Seq2[uint64, block] {
	return func(yield func(uint64, block) bool) {
		if t.hasZero && !yield(0, t.zero) {
			return
		}
		for i := 0; i < len(t.recs); {
			h := t.recs[i].hash
			if h == 0 {
				i++
				continue
			}
			if !yield(h, t.recs[i].block) {
				return
			}
			if t.recs[i].hash == h {
				i++
			}
		}
	}
}

// reset forgets every block, keeping the slots unless shrink.
func (t *blockTable) reset(shrink bool) {
	if shrink {
		t.recs = nil
	} else {
		clear(t.recs)
	}
	t.zero, t.hasZero, t.n = block{}, false, 0
}
