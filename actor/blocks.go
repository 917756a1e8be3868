package actor

import (
	"iter"
	"math/bits"
)

// blockTable maps the engine's block hashes to blocks: an open-addressing
// table (linear probing, deletion by backward shift, so no tombstones),
// sized to its count. A Go map took 40 B a slot, and its tombstones made it
// grow without bound under an engine's steady churn (a third of its slots
// live at the end of the Mooncake trace). A slot is 26 B: a 24 B record of
// the hashes, 2 B of tiers, flags and generation (blockMeta), and, only in
// a worker with split blocks, 4 B of split slot.
type blockTable struct {
	recs    []blockRec  // hash 0 marks an empty slot
	meta    []blockMeta // recs[i]'s tiers, flags and generation
	split   []int32     // recs[i]'s split slot; nil until a split block is set (then -1 for the others)
	zero    block       // hash 0's block
	hasZero bool
	n       int // blocks, hash 0's included
}

type blockRec struct {
	hash   uint64
	key    uint64
	parent uint64
}

// blockMeta packs a block's tiers (bits 0-3), flags (bits 4-8) and
// generation (bits 9-15, so that the generation counter is 7 bits).
type blockMeta uint16

const (
	metaFlagsShift = 4
	metaGenShift   = 9
)

// packBlock and unpackBlock move a block in and out of slot i.
func (t *blockTable) packBlock(i int, h uint64, b block) {
	t.recs[i] = blockRec{hash: h, key: b.key, parent: b.parent}
	t.meta[i] = blockMeta(b.tiers) | blockMeta(b.flags)<<metaFlagsShift | blockMeta(b.gen)<<metaGenShift
	if b.split >= 0 && t.split == nil {
		t.split = make([]int32, len(t.recs))
		for j := range t.split {
			t.split[j] = -1
		}
	}
	if t.split != nil {
		t.split[i] = b.split
	}
}

func (t *blockTable) unpackBlock(i int) block {
	m := t.meta[i]
	b := block{key: t.recs[i].key, parent: t.recs[i].parent, split: -1,
		tiers: uint8(m & (1<<metaFlagsShift - 1)), flags: uint8(m>>metaFlagsShift) & (1<<(metaGenShift-metaFlagsShift) - 1),
		gen: uint16(m >> metaGenShift)}
	if t.split != nil {
		b.split = t.split[i]
	}
	return b
}

// move moves slot j's block to slot i.
func (t *blockTable) move(i, j int) {
	t.recs[i], t.meta[i] = t.recs[j], t.meta[j]
	if t.split != nil {
		t.split[i] = t.split[j]
	}
}

// empty empties slot i.
func (t *blockTable) empty(i int) {
	t.recs[i], t.meta[i] = blockRec{}, 0
	if t.split != nil {
		t.split[i] = -1
	}
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
	if !ok {
		return block{}, false
	}
	return t.unpackBlock(i), true
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
			t.packBlock(i, h, b)
			return
		}
	}
	if (t.n+1)*maxLoadDen > len(t.recs)*maxLoadNum {
		t.resize(max(minBlockSlots, (t.n+1)*growNum/growDen))
	}
	i, _ := t.find(h)
	t.packBlock(i, h, b)
	t.n++
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (t *blockTable) resize(size int) {
	old := *t
	t.recs, t.meta = make([]blockRec, size), make([]blockMeta, size)
	if old.split != nil {
		t.split = make([]int32, size)
		for i := range t.split {
			t.split[i] = -1
		}
	}
	for j, r := range old.recs {
		if r.hash != 0 {
			i, _ := t.find(r.hash)
			t.packBlock(i, r.hash, old.unpackBlock(j))
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
			t.move(i, j)
			i = j
		}
	}
	t.empty(i)
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
			if !yield(h, t.unpackBlock(i)) {
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
		t.recs, t.meta, t.split = nil, nil, nil
	} else {
		clear(t.recs)
		clear(t.meta)
		t.split = nil
	}
	t.zero, t.hasZero, t.n = block{}, false, 0
}
