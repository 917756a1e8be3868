package index

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

func TestTierString(t *testing.T) {
	for tier, want := range map[Tier]string{TierDevice: "device", TierHost: "host", TierDisk: "disk", TierRemote: "remote", 7: "tier(7)"} {
		if got := tier.String(); got != want {
			t.Errorf("Tier(%d).String() = %q, want %q", tier, got, want)
		}
	}
	if NumTiers != 4 || TierRemote != NumTiers-1 || (Op{}).Tier != TierDevice {
		t.Error("tiers: device is the zero value, remote the last of 4")
	}
}

// wop is one op of one worker.
type wop struct {
	w  WorkerID
	op Op
}

func store(w WorkerID, t Tier, h uint64) wop  { return wop{w, Op{Kind: OpStore, Tier: t, Hash: h}} }
func remove(w WorkerID, t Tier, h uint64) wop { return wop{w, Op{Kind: OpRemove, Tier: t, Hash: h}} }
func clearTier(w WorkerID, t Tier) wop        { return wop{w, Op{Kind: OpClearTier, Tier: t}} }

// storeChain stores keys 1..n in tier.
func storeChain(w WorkerID, t Tier, n int) []wop {
	var ops []wop
	for k := range n {
		ops = append(ops, store(w, t, uint64(k+1)))
	}
	return ops
}

func tiers(w WorkerID, c ...int) Score {
	return Score{Worker: w, Blocks: c[0], Tiers: [NumTiers]int(c)}
}

var tieredCases = []struct {
	name  string
	ops   []wop
	want  []Score // for keys 1..5
	nodes [NumTiers]int
}{
	{"host only: reported with Blocks 0", storeChain(1, TierHost, 2),
		[]Score{tiers(1, 0, 2, 2, 2)}, [NumTiers]int{0, 2, 0, 0}},
	{"remote only", storeChain(1, TierRemote, 5),
		[]Score{tiers(1, 0, 0, 0, 5)}, [NumTiers]int{0, 0, 0, 5}},
	{"device prefix extended on host", append(storeChain(1, TierDevice, 2), storeChain(1, TierHost, 4)...),
		[]Score{tiers(1, 2, 4, 4, 4)}, [NumTiers]int{2, 4, 0, 0}},
	{"same key in two tiers, removed from one", append(append(storeChain(1, TierDevice, 3), storeChain(1, TierHost, 3)...),
		remove(1, TierDevice, 2)),
		[]Score{tiers(1, 1, 3, 3, 3)}, [NumTiers]int{2, 3, 0, 0}},
	{"a remove acts on its tier only", append(append(storeChain(1, TierDevice, 3), storeChain(1, TierHost, 3)...),
		remove(1, TierHost, 1), remove(1, TierHost, 2), remove(1, TierHost, 3)),
		[]Score{dev(1, 3)}, [NumTiers]int{3, 0, 0, 0}},
	{"each key in a tier of its own", []wop{store(1, TierDevice, 1), store(1, TierDisk, 2), store(1, TierHost, 3), store(1, TierRemote, 4)},
		[]Score{tiers(1, 1, 1, 3, 4)}, [NumTiers]int{1, 1, 1, 1}},
	{"a lower tier's block past a device gap", []wop{store(1, TierDevice, 1), store(1, TierDevice, 3), store(1, TierHost, 2)},
		[]Score{tiers(1, 1, 3, 3, 3)}, [NumTiers]int{2, 1, 0, 0}},
	{"refcounts per tier", []wop{store(1, TierHost, 1), store(1, TierHost, 1), remove(1, TierHost, 1), store(1, TierDevice, 1), remove(1, TierDevice, 1)},
		[]Score{tiers(1, 0, 1, 1, 1)}, [NumTiers]int{0, 1, 0, 0}},
	{"clear tier host", append(append(storeChain(1, TierDevice, 2), storeChain(1, TierHost, 4)...), clearTier(1, TierHost)),
		[]Score{dev(1, 2)}, [NumTiers]int{2, 0, 0, 0}},
	{"clear tier device", append(append(storeChain(1, TierDevice, 2), storeChain(1, TierHost, 4)...), clearTier(1, TierDevice)),
		[]Score{tiers(1, 0, 4, 4, 4)}, [NumTiers]int{0, 4, 0, 0}},
	{"clear worker clears every tier", append(append(append(storeChain(1, TierDevice, 2), storeChain(1, TierDisk, 4)...),
		storeChain(2, TierHost, 1)...), wop{1, Op{Kind: OpClearWorker}}),
		[]Score{tiers(2, 0, 1, 1, 1)}, [NumTiers]int{0, 1, 0, 0}},
	{"remove worker", append(append(storeChain(1, TierDevice, 2), storeChain(1, TierRemote, 4)...), wop{1, Op{Kind: OpRemoveWorker}}),
		nil, [NumTiers]int{}},
	{"workers over tiers", append(append(append(storeChain(1, TierDevice, 3), storeChain(2, TierHost, 4)...),
		store(3, TierRemote, 1), store(3, TierDevice, 2)), store(3, TierDisk, 3)),
		[]Score{dev(1, 3), tiers(2, 0, 4, 4, 4), tiers(3, 0, 0, 0, 3)}, [NumTiers]int{3, 4, 1, 1}},
	{"an invalid tier is ignored", []wop{store(1, TierDevice, 1), store(1, NumTiers, 2), remove(1, 9, 1), clearTier(1, 9)},
		[]Score{dev(1, 1)}, [NumTiers]int{1, 0, 0, 0}},
}

// Each case's ops through the Tree, a table and Shards give the same scores
// for keys 1..5, and the same node counts per tier.
func TestTieredOps(t *testing.T) {
	query := []uint64{1, 2, 3, 4, 5}
	for _, tc := range tieredCases {
		t.Run(tc.name, func(t *testing.T) {
			ref, w := NewTree(), newWriter(8)
			s := NewShards(2, 4)
			defer s.Close()
			for _, o := range tc.ops {
				ref.Apply(o.w, o.op)
				switch o.op.Kind {
				case OpStore:
					w.StoreTier(o.w, o.op.Tier, o.op.Hash)
				case OpRemove:
					w.RemoveTier(o.w, o.op.Tier, o.op.Hash)
				case OpClearTier:
					w.clearTier(o.w, o.op.Tier)
				case OpClearWorker:
					w.clearWorker(o.w)
				case OpRemoveWorker:
					w.removeWorker(o.w)
				}
				s.Queue(o.w) <- &Batch{Worker: o.w, Ops: []Op{o.op}}
			}
			if err := s.Sync(context.Background()); err != nil {
				t.Fatal(err)
			}
			sharded, err := s.FindMatches(context.Background(), nil, query)
			if err != nil {
				t.Fatal(err)
			}
			for name, got := range map[string][]Score{"tree": ref.FindMatches(nil, query), "table": w.findMatches(nil, query), "shards": sharded} {
				if got = sortScores(got); !slices.Equal(got, tc.want) {
					t.Errorf("%s: FindMatches = %v, want %v", name, got, tc.want)
				}
			}
			for tier := range Tier(NumTiers) {
				var sn int64
				for i := range s.Len() {
					sn += s.tierNodes(i, tier)
				}
				if ref.TierNodes(tier) != tc.nodes[tier] || w.tierNodes(tier) != tc.nodes[tier] || sn != int64(tc.nodes[tier]) {
					t.Errorf("%v nodes: tree %d, table %d, shards %d, want %d", tier, ref.TierNodes(tier), w.tierNodes(tier), sn, tc.nodes[tier])
				}
			}
			if s.tierNodes(0, NumTiers) != 0 {
				t.Error("an invalid tier has nodes")
			}
		})
	}
}

func TestScoreWeighted(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    Score
		w    Weights
		want float64
	}{
		{"device only", dev(1, 10), DefaultWeights, 10},
		{"host only", tiers(1, 0, 10, 10, 10), DefaultWeights, 8},
		{"each tier extends", tiers(1, 4, 6, 9, 10), DefaultWeights, 4 + 2*0.8 + 3*0.5 + 0.3},
		{"nothing", Score{Worker: 1}, DefaultWeights, 0},
		{"host turned off", tiers(1, 4, 6, 9, 10), Weights{1, 0, 0.5, 0.3}, 4 + 3*0.5 + 0.3},
		{"only device counts", tiers(1, 4, 6, 9, 10), Weights{1, 0, 0, 0}, 4},
		{"device turned off", tiers(1, 4, 6, 6, 6), Weights{0, 1, 1, 1}, 2},
	} {
		if got := tc.s.Weighted(tc.w); got < tc.want-1e-9 || got > tc.want+1e-9 {
			t.Errorf("%s: %v.Weighted(%v) = %v, want %v", tc.name, tc.s, tc.w, got, tc.want)
		}
	}
	if DefaultWeights != (Weights{1, 0.8, 0.5, 0.3}) {
		t.Errorf("DefaultWeights = %v", DefaultWeights)
	}
}

// A deployment without offload pays nothing for tiers: no lower-tier table
// is made by device ops, nor by removes or clears of lower tiers.
func TestDeviceOnlyMakesNoLowerTierTables(t *testing.T) {
	w := newWriter(8)
	for k := range uint64(100) {
		w.Store(1, k)
	}
	w.RemoveTier(1, TierHost, 3)
	w.clearTier(1, TierDisk)
	w.clearWorker(1)
	w.Store(2, 5)
	w.removeWorker(2)
	if w.lowerSet.Load() != 0 {
		t.Errorf("lower tiers %b", w.lowerSet.Load())
	}
	for i := range w.lower {
		if w.lower[i].Load() != nil {
			t.Errorf("tier %v has a table", Tier(i+1))
		}
	}
	if w.unknownRemoves != 1 {
		t.Errorf("unknown removes %d, want 1", w.unknownRemoves)
	}
}

// A reader's pinned versions are of one slot generation, and a worker
// that took its slot after the pinned device version was unpublished is
// left out of the lower tiers, rather than scored under the id that version
// maps the slot to (none).
func TestTieredReaderMapsOnlyItsDeviceVersionsSlots(t *testing.T) {
	w := newWriter(8)
	w.Store(1, 1)
	w.StoreTier(1, TierHost, 2)
	var ts [NumTiers]*table
	w.pinTiers(&ts)
	for k := range uint64(20) { // the device table grows: a new version, the same generation
		w.Store(1, 100+k)
	}
	host := w.lower[TierHost-1].Load()
	if w.cur.Load() == ts[0] || host.cur.Load() != ts[TierHost] || w.t.gen != ts[0].gen {
		t.Fatal("want a new device version and the host's still current, in one generation")
	}
	w.StoreTier(2, TierHost, 7) // worker 2 takes a free slot, in the new device version only
	if got := matchTiers(nil, []uint64{7}, &ts, &w.opened); len(got) != 0 {
		t.Errorf("the pinned versions score %v for worker 2's host block", got)
	}
	for _, x := range ts {
		if x != nil {
			unpin(x)
		}
	}
	if got := w.findMatches(nil, []uint64{7}); !slices.Equal(got, []Score{tiers(2, 0, 1, 1, 1)}) {
		t.Errorf("now %v", got)
	}
}

// A slot freed with lower tiers in use is handed out again only in a new
// generation, whose versions of every tier the pinned ones are not: they
// keep the old worker's mapping and never show the new worker's bits.
func TestTieredPinnedGenerationKeepsSlotOwners(t *testing.T) {
	w := newWriter(256)
	for id := range WorkerID(64) { // every slot of one word taken
		w.StoreTier(id, TierHost, 1000+uint64(id))
	}
	var old [NumTiers]*table
	w.pinTiers(&old)
	slot := w.holders[5].slot
	w.removeWorker(5)
	w.StoreTier(100, TierHost, 7) // no free slot: 5's is handed out again, in a new generation
	var cur [NumTiers]*table
	w.pinTiers(&cur)
	if w.holders[100].slot != slot || cur[0] == old[0] || cur[TierHost] == old[TierHost] || cur[0].gen != old[0].gen+1 || cur[TierHost].gen != cur[0].gen {
		t.Fatalf("worker 100 got slot %d (5 had %d); generations %d and %d", w.holders[100].slot, slot, old[0].gen, cur[0].gen)
	}
	if got := matchTiers(nil, []uint64{7}, &old, &w.opened); len(got) != 0 {
		t.Errorf("the old generation scores worker 100's block: %v", got)
	}
	if got := matchTiers(nil, []uint64{1007}, &old, &w.opened); !slices.Equal(got, []Score{tiers(7, 0, 1, 1, 1)}) {
		t.Errorf("the old generation scores worker 7's block %v", got)
	}
	if got := WorkerID(old[0].slots[slot].Load()); got != 5 {
		t.Errorf("the old generation maps worker 5's slot to %d", got)
	}
	if got := matchTiers(nil, []uint64{7}, &cur, &w.opened); !slices.Equal(got, []Score{tiers(100, 0, 1, 1, 1)}) {
		t.Errorf("the new generation scores %v", got)
	}
	for i := range old {
		if old[i] != nil {
			unpin(old[i])
			unpin(cur[i])
		}
	}
}

// Matches ending on either side of a lookahead group's edge, in any tier,
// score exactly.
func TestTieredMatchesAcrossLookaheadGroups(t *testing.T) {
	w, ref := newWriter(minCap), NewTree()
	keys := make([]uint64, 3*lookahead+5)
	for i := range keys {
		keys[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
	}
	ends := []int{1, lookahead - 1, lookahead, lookahead + 1, 2*lookahead + 1, len(keys)}
	rng := rand.New(rand.NewPCG(1, 1))
	for id := range WorkerID(40) {
		for tier := range Tier(NumTiers) {
			n := ends[rng.IntN(len(ends))]
			if rng.IntN(3) == 0 {
				continue
			}
			for _, k := range keys[:n] {
				w.StoreTier(id, tier, k)
				ref.StoreTier(id, tier, k)
			}
		}
	}
	for _, n := range ends {
		got, want := sortScores(w.findMatches(nil, keys[:n])), sortScores(ref.FindMatches(nil, keys[:n]))
		if !slices.Equal(got, want) || len(want) == 0 {
			t.Errorf("%d keys: %v, tree %v", n, got, want)
		}
	}
}

// With tiers in use, a warm writer filling and clearing tiers allocates
// nothing, nor does a lookup, on a table or through Shards.
func TestTieredWarmWriterAndReaderAllocateNothing(t *testing.T) {
	w := newWriter(minCap)
	round := 0
	cycle := func() {
		round++
		for id := range WorkerID(4) {
			for i := range 300 {
				k := uint64(round)<<32 | uint64(id)<<16 | uint64(i)
				w.Store(id, k)
				w.StoreTier(id, Tier(1+i%3), k)
			}
		}
		for id := range WorkerID(4) {
			w.clearTier(id, TierHost)
			w.clearWorker(id)
		}
	}
	for range 20 {
		cycle()
	}
	made := w.made
	if a := testing.AllocsPerRun(20, cycle); a != 0 {
		t.Errorf("a warm fill-and-clear cycle allocated %v times", a)
	}
	if w.made != made {
		t.Errorf("warm cycles allocated %d tables", w.made-made)
	}
	keys := []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
	for i := range 10 {
		w.Store(1, uint64(i)+1)
		w.StoreTier(2, TierDisk, uint64(i)+1)
	}
	dst := make([]Score, 0, 8)
	if a := testing.AllocsPerRun(100, func() { dst = w.findMatches(dst[:0], keys) }); a != 0 {
		t.Errorf("FindMatches allocated %v times", a)
	}
	if got := sortScores(dst); !slices.Equal(got, []Score{dev(1, 10), tiers(2, 0, 0, 10, 10)}) {
		t.Errorf("FindMatches = %v", got)
	}

	s := NewShards(2, 4)
	defer s.Close()
	for id := range WorkerID(6) {
		b := &Batch{Worker: id}
		for i := range 6 {
			b.Ops = append(b.Ops, Op{Kind: OpStore, Tier: Tier(int(id)+i) % NumTiers, Hash: uint64(i)})
		}
		s.Queue(id) <- b
	}
	ctx := context.Background()
	if err := s.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	keys = []uint64{0, 1, 2, 3, 4, 5}
	if a := testing.AllocsPerRun(100, func() { dst, _ = s.FindMatches(ctx, dst[:0], keys) }); a != 0 {
		t.Errorf("Shards.FindMatches allocated %v times", a)
	}
	if len(dst) != 6 || dst[0] != tiers(0, 1, 2, 3, 6) || dst[3] != tiers(3, 0, 0, 0, 6) {
		t.Errorf("Shards.FindMatches = %v", dst)
	}
}

// While the writer is between publishing a new generation's device version
// and its host version, a reader pinning both retries instead of mixing
// the generations, and gets the new pair once both are out.
func TestPinTiersWaitsOutAGenerationBeingPublished(t *testing.T) {
	w := newWriter(8)
	w.StoreTier(1, TierHost, 1)
	host := w.lower[TierHost-1].Load()
	// rebuildAll's steps, stopped half way.
	w.gen++
	nd, nh := w.build(&w.tierIx, 1), w.build(host, 1)
	w.publish(nd)
	done := make(chan [NumTiers]*table)
	go func() {
		var ts [NumTiers]*table
		w.pinTiers(&ts)
		done <- ts
	}()
	select {
	case ts := <-done:
		t.Fatalf("pinned generations %d and %d", ts[0].gen, ts[TierHost].gen)
	case <-time.After(20 * time.Millisecond):
	}
	host.publish(nh)
	ts := <-done
	if ts[0] != nd || ts[TierHost] != nh {
		t.Errorf("pinned %p %p, want the new versions %p %p", ts[0], ts[TierHost], nd, nh)
	}
	unpin(ts[0])
	unpin(ts[TierHost])
}
