package index

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// Jump search over every tier against the reference Tree: workers store,
// evict, move and copy chains between any two of the four tiers (each lower
// tier's table made at a random step, in a random order), with holes,
// unknown removes, duplicate and badly linked stores, clears and removed
// workers. After every op each level's closed bit must say what its chains
// count; at every check the answers must be the Tree's, and each level's
// chains must hold exactly the references of the tiers up to it.

// tiersStep is an op of a worker, or (chk set) a prompt to check.
type tiersStep struct {
	id  WorkerID
	op  Op
	chk []uint64
}

// tiersReplay runs steps on a new writer and Tree, and returns the index of
// the first step that fails and why (-1 when none does); jumps counts the
// answers of workers closed at every level ([0]) and those whose Tiers[l]
// reached past Tiers[l-1] by more than a jump step ([l]).
func tiersReplay(steps []tiersStep, capacity int, jumps *[NumTiers]int) (int, string) {
	w, ref := newWriter(capacity), NewTree()
	var got, want []Score
	for i, s := range steps {
		if s.chk == nil {
			w.apply(s.id, s.op)
			ref.Apply(s.id, s.op)
			if msg := levelsInvariant(w, false); msg != "" {
				return i, msg
			}
			continue
		}
		if msg := levelsInvariant(w, true); msg != "" {
			return i, msg
		}
		if w.unknownRemoves != ref.UnknownRemoves {
			return i, fmt.Sprintf("unknown removes %d, ref %d", w.unknownRemoves, ref.UnknownRemoves)
		}
		for tr := range Tier(NumTiers) {
			if w.tierNodes(tr) != ref.TierNodes(tr) {
				return i, fmt.Sprintf("tier %v nodes %d, ref %d", tr, w.tierNodes(tr), ref.TierNodes(tr))
			}
		}
		for id := range WorkerID(8) {
			for tr := range Tier(NumTiers) {
				n := 0
				for _, c := range ref.tiers[tr].held[id] {
					n += int(c)
				}
				if w.heldIn(id, tr) != n {
					return i, fmt.Sprintf("worker %d tier %v held %d, ref %d", id, tr, w.heldIn(id, tr), n)
				}
			}
		}
		got = sortScores(w.findMatches(got[:0], s.chk))
		want = sortScores(ref.FindMatches(want[:0], s.chk))
		if !slices.Equal(got, want) {
			return i, fmt.Sprintf("index %v\nref   %v", got, want)
		}
		for _, sc := range got {
			h := w.holders[sc.Worker]
			all := true
			for l := range Tier(NumTiers) {
				if h.level(l, w.lowerSet.Load()) != nil && !h.closed[l] {
					all = false
				}
			}
			if !all {
				continue
			}
			jumps[0]++
			for l := 1; l < NumTiers; l++ {
				if w.lowerSet.Load()&(1<<(l-1)) != 0 && sc.Tiers[l] > sc.Tiers[l-1]+jumpStep {
					jumps[l]++
				}
			}
		}
	}
	return -1, ""
}

func TestTiersJumpAgainstTree(t *testing.T) {
	seeds := 24 // 300 pass too, in two minutes
	if testing.Short() || raceEnabled {
		seeds = 8
	}
	var jumps [NumTiers]int
	for seed := range uint64(seeds) {
		rng := rand.New(rand.NewPCG(seed, 5))
		workers := []int{3, 6, 70}[seed%3] // 70: two bitset words
		f := newForest(rng.IntN, 8, 200)
		capacity := []int{16, 64}[seed/3%2]
		if i, msg := tiersReplay(tiersScript(seed, 1500, workers, 0, f), capacity, &jumps); i >= 0 {
			t.Fatalf("seed %d (workers %d, capacity %d), step %d: %s", seed, workers, capacity, i, msg)
		}
	}
	t.Logf("answers of workers closed at every level %d; jumped past the level below, by tier: %v", jumps[0], jumps[1:])
	if jumps[0] < 1000 || slices.Min(jumps[1:]) == 0 {
		t.Errorf("jumps %v: the test no longer jumps over every tier", jumps)
	}
}

// The workers of the script in a later word of the bitsets: 520 others
// hold one block each.
func TestTiersJumpAgainstTreeInALaterWord(t *testing.T) {
	for seed := range uint64(2) {
		rng := rand.New(rand.NewPCG(seed, 5))
		f := newForest(rng.IntN, 8, 200)
		var jumps [NumTiers]int
		if i, msg := tiersReplay(tiersScript(seed, 3000, 8, 520, f), 64, &jumps); i >= 0 {
			t.Fatalf("seed %d, step %d: %s", seed, i, msg)
		}
	}
}

func tiersScript(seed uint64, nsteps, workers, base int, f *forest) []tiersStep {
	rng := rand.New(rand.NewPCG(seed, 77))
	next := rng.IntN
	var out []tiersStep
	for i := range base {
		out = append(out, tiersStep{id: WorkerID(i), op: Op{Kind: OpStore, Link: LinkRoot, Hash: 1<<62 | uint64(i)}})
	}
	apply := func(id WorkerID, op Op) { out = append(out, tiersStep{id: id, op: op}) }
	// tiers become usable in a random order at random times
	order := []Tier{TierHost, TierDisk, TierRemote}
	rng.Shuffle(3, func(a, b int) { order[a], order[b] = order[b], order[a] })
	nUse := next(4)
	at := [3]int{next(nsteps), next(nsteps), next(nsteps)}
	slices.Sort(at[:])
	usable := func(step int) []Tier {
		ts := []Tier{TierDevice}
		for i := range nUse {
			if step >= at[i] {
				ts = append(ts, order[i])
			}
		}
		return ts
	}
	pick := func(ts []Tier) Tier {
		if next(2) == 0 {
			return TierDevice
		}
		return ts[next(len(ts))]
	}
	var q []uint64
	for step := range nsteps {
		ts := usable(step)
		id := WorkerID(base + next(workers))
		node := next(len(f.keys))
		q = f.path(q[:0], node)
		t := pick(ts)
		withTier := func(o Op, t Tier) Op { o.Tier = t; return o }
		switch r := next(100); {
		case r < 25:
			nodes := pathNodes(f, node)
			from := 0
			if next(3) == 0 {
				from = next(len(nodes))
			}
			for _, i := range nodes[from:] {
				apply(id, withTier(f.op(i), t))
			}
		case r < 38:
			for i, n := node, next(40); i >= 0 && n > 0; i, n = f.par[i], n-1 {
				apply(id, Op{Kind: OpRemove, Tier: t, Hash: f.keys[i]})
			}
		case r < 50: // move or copy to another tier, leaf first or root first
			t2 := pick(ts)
			move := next(2) == 0
			var nodes []int
			for i, n := node, next(40); i >= 0 && n > 0; i, n = f.par[i], n-1 {
				nodes = append(nodes, i)
			}
			if next(2) == 0 {
				slices.Reverse(nodes)
			}
			for _, i := range nodes {
				apply(id, withTier(f.op(i), t2))
				if move {
					apply(id, Op{Kind: OpRemove, Tier: t, Hash: f.keys[i]})
				}
			}
		case r < 56:
			apply(id, Op{Kind: OpRemove, Tier: t, Hash: q[next(len(q))]})
		case r < 61:
			nodes := pathNodes(f, node)
			for j := len(nodes) - 1; j >= 0 && j >= len(nodes)-1-next(50); j-- {
				apply(id, withTier(f.op(nodes[j]), t))
			}
		case r < 65:
			o := withTier(f.op(node), t)
			switch next(4) {
			case 0:
				o.Link, o.Parent = LinkNone, 0
			case 1:
				o.Link, o.Parent = LinkChild, o.Hash
			case 2:
				o.Link, o.Parent = LinkNone, uint64(next(1000))
			case 3: // a link no producer makes
				o.Link = LinkChild + 1 + Link(next(3))
			}
			apply(id, o)
		case r < 68: // duplicate store
			o := withTier(f.op(node), t)
			apply(id, o)
			apply(id, o)
		case r < 70:
			apply(id, Op{Kind: OpClearTier, Tier: t})
		case r < 72:
			apply(id, Op{Kind: OpClearWorker})
		case r < 74:
			apply(id, Op{Kind: OpRemoveWorker})
		case r < 75: // a tier op outside the range
			apply(id, Op{Kind: OpStore, Tier: Tier(4 + next(3)), Hash: f.keys[node]})
		default:
			if next(4) == 0 {
				q = append(q, uint64(next(1<<30)), uint64(next(1<<30)))
			}
			out = append(out, tiersStep{chk: slices.Clone(q[:next(len(q))+1])})
		}
	}
	return out
}

func levelsInvariant(w *writer, full bool) string {
	set := w.lowerSet.Load()
	for id, h := range w.holders {
		for l := range Tier(NumTiers) {
			c := h.level(l, set)
			if c == nil {
				continue
			}
			tb := w.ix(l).t
			bit := tb.closed[h.slot>>6].Load()>>(h.slot&63)&1 == 1
			if bit != h.closed[l] || h.closed[l] != (c.orphans == 0) {
				return fmt.Sprintf("worker %d level %d: bit %v closed %v orphans %d", id, l, bit, h.closed[l], c.orphans)
			}
			if full {
				// the orphans counted are the held keys of unknown link
				// or whose parent is not held
				orphans := 0
				for _, r := range c.recs {
					if r.refs == 0 {
						continue
					}
					if r.link() == LinkNone {
						orphans++
					} else if r.link() == LinkChild {
						if pi, ok := c.find(r.parent); !ok || c.recs[pi].refs == 0 {
							orphans++
						}
					}
				}
				if orphans != c.orphans {
					return fmt.Sprintf("worker %d level %d: %d orphans counted, %d in its chains", id, l, c.orphans, orphans)
				}
			}
			if l > 0 && full {
				// the level's chains hold exactly the refs of tiers <= l
				want := map[uint64]uint32{}
				h.dev.each(func(k uint64, r uint32) { want[k] += r })
				for t := TierHost; t <= l; t++ {
					for k, n := range h.held[t] {
						want[k] += uint32(n)
					}
				}
				got := map[uint64]uint32{}
				c.each(func(k uint64, r uint32) { got[k] += r })
				if len(got) != len(want) {
					return fmt.Sprintf("worker %d level %d: %d keys, want %d", id, l, len(got), len(want))
				}
				for k, n := range want {
					if got[k] != n {
						return fmt.Sprintf("worker %d level %d key %d: refs %d want %d", id, l, k, got[k], n)
					}
				}
			}
		}
	}
	return ""
}

// A link no producer makes (index.Op is public) is an unknown one: the
// block is an orphan, and the worker is read key by key.
func TestUnknownLinkIsNone(t *testing.T) {
	for _, tier := range []Tier{TierDevice, TierHost} {
		w := newWriter(16)
		w.apply(1, Op{Kind: OpStore, Tier: tier, Link: LinkRoot, Hash: 10})
		w.apply(1, Op{Kind: OpStore, Tier: tier, Link: LinkChild + 1, Hash: 14, Parent: 13})
		got := w.findMatches(nil, []uint64{10, 13, 14})
		if len(got) != 1 || got[0].Tiers[TierHost] != 1 {
			t.Errorf("tier %v: %v, want worker 1 holding 1 block", tier, got)
		}
	}
}

// A key first stored unlinked, then stored again with its link, counts as
// linked: the worker is closed at that level (and so read by jumping)
// without waiting for the unlinked reference to leave, and stays so while
// either reference is held.
func TestLinkedStoreClosesAnUnlinkedKey(t *testing.T) {
	for _, tier := range []Tier{TierDevice, TierHost} {
		w := newWriter(16)
		w.apply(1, Op{Kind: OpStore, Tier: tier, Link: LinkRoot, Hash: 10})
		w.apply(1, Op{Kind: OpStore, Tier: tier, Hash: 11}) // LinkNone
		h := w.holders[1]
		if h.closed[tier] {
			t.Fatalf("tier %v: closed with an unlinked key", tier)
		}
		w.apply(1, Op{Kind: OpStore, Tier: tier, Link: LinkChild, Hash: 11, Parent: 10})
		if !h.closed[tier] {
			t.Errorf("tier %v: still open once the key's link is known", tier)
		}
		w.apply(1, Op{Kind: OpRemove, Tier: tier, Hash: 11})
		if !h.closed[tier] {
			t.Errorf("tier %v: opened by the removal of one of two references", tier)
		}
		if got := w.findMatches(nil, []uint64{10, 11, 12}); len(got) != 1 || got[0].Tiers[tier] != 2 {
			t.Errorf("tier %v: %v, want worker 1 holding 2 blocks", tier, got)
		}
		w.apply(1, Op{Kind: OpRemove, Tier: tier, Hash: 10})
		if h.closed[tier] {
			t.Errorf("tier %v: closed with its key's parent gone", tier)
		}
	}
}
