package index

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"testing"
)

// forest is a set of chained keys, as prompts make them: node i's key is
// chained from its parent's (par[i], -1 for a root).
type forest struct {
	keys []uint64
	par  []int
}

// newForest makes a few long chains that share prefixes and branch, so
// that prompts are hundreds of keys long and workers drop out anywhere.
func newForest(next func(n int) int, branches, length int) *forest {
	f := &forest{}
	for range 3 {
		f.add(-1, next)
	}
	for range branches {
		from := next(len(f.keys)) // branch off any block so far
		for range 1 + next(length) {
			from = f.add(from, next)
		}
	}
	return f
}

func (f *forest) add(parent int, next func(int) int) int {
	th := uint64(next(1<<30))<<32 | uint64(len(f.keys))
	k := th
	if parent >= 0 {
		k = chain(f.keys[parent], true, th)
	}
	f.keys, f.par = append(f.keys, k), append(f.par, parent)
	return len(f.keys) - 1
}

// path is the keys from node i's root down to i.
func (f *forest) path(dst []uint64, i int) []uint64 {
	start := len(dst)
	for ; i >= 0; i = f.par[i] {
		dst = append(dst, f.keys[i])
	}
	slices.Reverse(dst[start:])
	return dst
}

// op is the store of node i with its link.
func (f *forest) op(i int) Op {
	if p := f.par[i]; p >= 0 {
		return Op{Kind: OpStore, Link: LinkChild, Hash: f.keys[i], Parent: f.keys[p]}
	}
	return Op{Kind: OpStore, Link: LinkRoot, Hash: f.keys[i]}
}

// jumpScript drives a worker set through what engines do to a prefix
// cache, chains stored in order with links, evictions leaf first, and what
// breaks closure: middle blocks evicted (holes), chains stored child first
// (a re-index), stores without links or with a bad one, double stores and
// removes, clears and removed workers. With tiered, a quarter of the steps
// are a host tier's: blocks offloaded (copied, or moved off the device) leaf
// first, the host's evictions, its holes and clears. apply gets every op;
// check is called with a prompt now and then.
func jumpScript(f *forest, next func(n int) int, steps int, tiered bool, apply func(WorkerID, Op), check func(q []uint64)) {
	const workers = 5
	var q []uint64
	for range steps {
		id := WorkerID(next(workers))
		node := next(len(f.keys))
		q = f.path(q[:0], node)
		if tiered && next(4) == 0 {
			hostStep(f, next, id, node, q, apply)
			continue
		}
		switch r := next(100); {
		case r < 35: // a request: its prompt stored root first
			for _, i := range pathNodes(f, node) {
				apply(id, f.op(i))
			}
		case r < 55: // an eviction of the prompt's last blocks, leaf first
			for i, n := node, next(40); i >= 0 && n > 0; i, n = f.par[i], n-1 {
				apply(id, Op{Kind: OpRemove, Hash: f.keys[i]})
			}
		case r < 65: // a middle block evicted: a hole
			apply(id, Op{Kind: OpRemove, Hash: q[next(len(q))]})
		case r < 72: // a re-index: the prompt stored leaf first
			nodes := pathNodes(f, node)
			for j := len(nodes) - 1; j >= 0 && j >= len(nodes)-1-next(50); j-- {
				apply(id, f.op(nodes[j]))
			}
		case r < 76: // stores without a link, or linked to themselves
			o := f.op(node)
			if o.Link, o.Parent = Link(next(2))*LinkChild, o.Hash; o.Link == LinkNone {
				o.Parent = 0
			}
			apply(id, o)
		case r < 80:
			apply(id, Op{Kind: OpClearWorker})
		case r < 81:
			apply(id, Op{Kind: OpRemoveWorker})
		default:
			if next(4) == 0 { // a prompt past what anyone stored
				q = append(q, uint64(next(1<<30)), uint64(next(1<<30)))
			}
			check(q[:next(len(q))+1])
		}
	}
}

// hostStep is one of jumpScript's host tier steps for worker id, on the
// path q to node.
func hostStep(f *forest, next func(n int) int, id WorkerID, node int, q []uint64, apply func(WorkerID, Op)) {
	host := func(o Op) Op { o.Tier = TierHost; return o }
	switch r := next(100); {
	case r < 45: // the prompt's last blocks offloaded, leaf first, moved or copied
		move := next(2) == 0
		for i, n := node, next(40); i >= 0 && n > 0; i, n = f.par[i], n-1 {
			apply(id, host(f.op(i)))
			if move {
				apply(id, Op{Kind: OpRemove, Hash: f.keys[i]})
			}
		}
	case r < 75: // the host evicts the prompt's last blocks, leaf first
		for i, n := node, next(40); i >= 0 && n > 0; i, n = f.par[i], n-1 {
			apply(id, Op{Kind: OpRemove, Tier: TierHost, Hash: f.keys[i]})
		}
	case r < 85: // a middle host block evicted: a hole
		apply(id, Op{Kind: OpRemove, Tier: TierHost, Hash: q[next(len(q))]})
	case r < 93: // the prompt offloaded root first, from its start
		for _, i := range pathNodes(f, node) {
			apply(id, host(f.op(i)))
		}
	case r < 97: // a host store without its link
		apply(id, Op{Kind: OpStore, Tier: TierHost, Hash: f.keys[node]})
	default:
		apply(id, Op{Kind: OpClearTier, Tier: TierHost})
	}
}

func pathNodes(f *forest, i int) []int {
	var out []int
	for ; i >= 0; i = f.par[i] {
		out = append(out, i)
	}
	slices.Reverse(out)
	return out
}

// jumpAgainstTree runs jumpScript on a writer and a Tree and compares every
// answer; it returns how many answers jumped for some worker, and how many
// jumped over its host blocks.
func jumpAgainstTree(t *testing.T, f *forest, next func(n int) int, steps int, tiered bool) (jumped, hostJumped int) {
	w, ref := newWriter(64), NewTree()
	var got, want []Score
	jumpScript(f, next, steps, tiered, func(id WorkerID, op Op) {
		w.apply(id, op)
		ref.Apply(id, op)
	}, func(q []uint64) {
		got = sortScores(w.findMatches(got[:0], q))
		want = sortScores(ref.FindMatches(want[:0], q))
		if !slices.Equal(got, want) {
			t.Fatalf("prompt of %d keys: index %v, sequential reference %v", len(q), got, want)
		}
		dev, host := jumpedOver(w, got)
		jumped, hostJumped = jumped+dev, hostJumped+host
	})
	return jumped, hostJumped
}

// jumpedOver reports (as 0 or 1) whether some score of got jumped over a
// closed worker's device chain, and whether one jumped over its host
// blocks (closed at both levels, scoring a step past its device blocks).
func jumpedOver(w *writer, got []Score) (dev, host int) {
	for _, s := range got {
		h := w.holders[s.Worker]
		if h == nil {
			continue
		}
		if h.closed[TierDevice] && s.Blocks > jumpStep {
			dev = 1
		}
		if h.closed == [NumTiers]bool{true, true} && s.Tiers[TierHost] > s.Blocks+jumpStep {
			host = 1
		}
	}
	return dev, host
}

// The jump search answers what the key-by-key scan does, whatever the
// workers' chains look like.
func TestJumpAgainstTree(t *testing.T) {
	for _, tiered := range []bool{false, true} {
		jumped, hostJumped := 0, 0
		for seed := range uint64(20) {
			rng := rand.New(rand.NewPCG(seed, 7))
			j, h := jumpAgainstTree(t, newForest(rng.IntN, 12, 400), rng.IntN, 3000, tiered)
			jumped, hostJumped = jumped+j, hostJumped+h
		}
		t.Logf("tiered %v: %d answers jumped, %d over host blocks", tiered, jumped, hostJumped)
		if jumped < 100 || tiered && hostJumped < 100 {
			t.Errorf("tiered %v: only %d answers jumped over a closed worker's chain, %d over its host blocks", tiered, jumped, hostJumped)
		}
	}
}

// FuzzJumpAgainstTree: jumpScript driven by the fuzzer's bytes. Run it with
// -fuzzminimizetime 20x: nearly every mutation is new coverage, and shrinking
// each such input for the default minute stalls the fuzzer.
func FuzzJumpAgainstTree(f *testing.F) {
	for seed := range uint64(4) {
		rng := rand.New(rand.NewPCG(seed, 9))
		b := make([]byte, 2048)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		next := func(n int) int {
			if n <= 1 {
				return 0
			}
			if len(data) < 2 {
				return 0
			}
			v := int(binary.LittleEndian.Uint16(data))
			data = data[2:]
			return v % n
		}
		tiered := len(data) > 0 && data[0]&1 == 1
		jumpAgainstTree(t, newForest(rand.New(rand.NewPCG(1, 2)).IntN, 6, 120), next, min(len(data)/6, 400), tiered) // about three draws a step
	})
}

// A hole in a closed worker's chain opens it, and the answer stops at the
// hole; filled again, the worker is closed and answers its whole chain.
func TestJumpHole(t *testing.T) {
	w := newWriter(64)
	f := &forest{}
	var q []uint64
	n := f.add(-1, func(int) int { return 1 })
	for range 299 {
		n = f.add(n, func(int) int { return 1 })
	}
	q = f.path(q, n)
	for i := range q {
		w.apply(3, f.op(i))
	}
	check := func(closed bool, blocks int) {
		t.Helper()
		if h := w.holders[3]; h.closed[TierDevice] != closed {
			t.Errorf("closed %v, want %v (orphans %d)", h.closed[TierDevice], closed, h.dev.orphans)
		}
		if got := w.findMatches(nil, q); !slices.Equal(got, []Score{dev(3, blocks)}) {
			t.Errorf("answer %v, want %v", got, dev(3, blocks))
		}
	}
	check(true, 300)
	w.apply(3, Op{Kind: OpRemove, Hash: q[100]})
	check(false, 100)
	w.apply(3, f.op(100))
	check(true, 300)
	for i := 299; i >= 150; i-- { // evicted leaf first: still closed
		w.apply(3, Op{Kind: OpRemove, Hash: q[i]})
	}
	check(true, 150)
}

// A lookup that jumps allocates nothing, through the Shards too.
func TestJumpAllocatesNothing(t *testing.T) {
	s := NewShards(2, 4)
	defer s.Close()
	f := &forest{}
	n := f.add(-1, func(int) int { return 5 })
	for range 999 {
		n = f.add(n, func(int) int { return 5 })
	}
	q := f.path(nil, n)
	for id := range WorkerID(4) {
		b := &Batch{Worker: id}
		for i := range 200 + 200*int(id) {
			b.Ops = append(b.Ops, f.op(i))
		}
		s.Queue(id) <- b
	}
	ctx := context.Background()
	if err := s.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	dst := make([]Score, 0, 8)
	if a := testing.AllocsPerRun(100, func() { dst, _ = s.FindMatches(ctx, dst[:0], q) }); a != 0 {
		t.Errorf("FindMatches allocated %v times", a)
	}
	want := []Score{dev(0, 200), dev(1, 400), dev(2, 600), dev(3, 800)}
	if !slices.Equal(dst, want) {
		t.Errorf("FindMatches = %v, want %v", dst, want)
	}
}

// The chains' records go with the blocks: after every block is removed, in
// any order, none is left, ghosts included.
func TestChainsForgetEverything(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	f := newForest(rng.IntN, 6, 100)
	var c chains
	for round := range 20 {
		var held []int
		for range 200 {
			i := rng.IntN(len(f.keys))
			o := f.op(i)
			c.store(o.Hash, o.Link, o.Parent)
			held = append(held, i)
		}
		rng.Shuffle(len(held), func(a, b int) { held[a], held[b] = held[b], held[a] })
		for _, i := range held {
			if known, _ := c.remove(f.keys[i]); !known {
				t.Fatalf("round %d: block %d not known", round, i)
			}
		}
		if c.n != 0 || c.orphans != 0 {
			t.Fatalf("round %d: %d records and %d orphans left", round, c.n, c.orphans)
		}
	}
}
