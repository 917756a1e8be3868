package index

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
)

// dev is the score of a worker holding its leading blocks on device only.
func dev(w WorkerID, blocks int) Score {
	return Score{Worker: w, Blocks: blocks, Tiers: [NumTiers]int{blocks, blocks, blocks, blocks}}
}

func sortScores(s []Score) []Score {
	slices.SortFunc(s, func(a, b Score) int { return cmp.Compare(a.Worker, b.Worker) })
	return s
}

// privateKey is block i of a chain only worker id ever stores.
func privateKey(id WorkerID, i int) uint64 { return 1<<40 | uint64(id)<<16 | uint64(i) }

// stableKeys is a chain that one worker stores first and never touches again.
func stableKeys() []uint64 {
	keys := make([]uint64, 16)
	for i := range keys {
		keys[i] = 1<<50 + uint64(i)
	}
	return keys
}

// sharedQuery is a random request over a small key space, 0 included, so
// workers overlap and prefixes end anywhere.
func sharedQuery(rng *rand.Rand, q []uint64) []uint64 {
	for range 1 + rng.IntN(8) {
		q = append(q, rng.Uint64N(40))
	}
	return q
}

// validScore reports whether s is a score a request of n keys can get: a
// worker reported holds the first key in some tier, Blocks is the device
// count, and the counts never decrease with the tier.
func validScore(s Score, n int) bool {
	if s.Blocks != s.Tiers[TierDevice] || s.Blocks < 0 || s.Tiers[NumTiers-1] < 1 || s.Tiers[NumTiers-1] > n {
		return false
	}
	for t := 1; t < NumTiers; t++ {
		if s.Tiers[t] < s.Tiers[t-1] {
			return false
		}
	}
	return true
}

// randomTier is device half the time, else a lower tier.
func randomTier(rng *rand.Rand) Tier {
	if rng.IntN(2) == 0 {
		return TierDevice
	}
	return Tier(1 + rng.IntN(NumTiers-1))
}

// reader checks, while the writer runs, what holds for any answer the
// Shards doc allows: the stable worker scores its whole chain, a private
// chain is only ever its worker's, and shared keys name only workers that
// exist, once each, with a score within the request.
type reader struct {
	find    func(dst []Score, hashes []uint64) []Score
	stable  WorkerID
	nextID  *atomic.Uint32 // workers below it have been created
	private func(WorkerID) bool
	stop    chan struct{}
	reads   atomic.Int64
	failed  atomic.Bool
}

// overlap returns once the readers have made a few more reads (or failed),
// so that they run interleaved with the writer however the goroutines are
// scheduled.
func (r *reader) overlap() {
	for n := r.reads.Load(); r.reads.Load() < n+4 && !r.failed.Load(); {
		runtime.Gosched()
	}
}

func (r *reader) run(t *testing.T, seed uint64) {
	defer func() {
		if t.Failed() {
			r.failed.Store(true)
		}
	}()
	rng := rand.New(rand.NewPCG(seed, 1))
	keys := stableKeys()
	dst := make([]Score, 0, 512)
	q := make([]uint64, 0, 32)
	seen := map[WorkerID]bool{}
	for {
		select {
		case <-r.stop:
			return
		default:
		}
		if r.reads.Add(1)%16 == 0 {
			runtime.Gosched() // two readers must not keep the writer off both Ps
		}
		dst = r.find(dst[:0], keys)
		if len(dst) != 1 || dst[0] != dev(r.stable, len(keys)) {
			t.Errorf("stable chain answered %v, want [{%d %d}]", dst, r.stable, len(keys))
			return
		}
		id := WorkerID(rng.Uint32N(r.nextID.Load()))
		if r.private(id) {
			q = q[:0]
			for i := range 1 + rng.IntN(12) {
				q = append(q, privateKey(id, i))
			}
			dst = r.find(dst[:0], q)
			if len(dst) > 1 || len(dst) == 1 && (dst[0].Worker != id || !validScore(dst[0], len(q))) {
				t.Errorf("worker %d's private chain %v answered %v", id, q, dst)
				return
			}
		}
		q = sharedQuery(rng, q[:0])
		dst = r.find(dst[:0], q)
		n := WorkerID(r.nextID.Load())
		clear(seen)
		for _, s := range dst {
			if s.Worker >= n || seen[s.Worker] || !validScore(s, len(q)) {
				t.Errorf("shared %v answered %v (workers below %d exist)", q, dst, n)
				return
			}
			seen[s.Worker] = true
		}
	}
}

// The table against the Tree: random stores, removes, clears and removed
// workers, well over 64 workers live and hundreds churned through, on a table
// so small that it is rebuilt and widened all along, while readers query it
// concurrently. On the writer's goroutine every answer must equal the
// Tree's; the readers check what must hold mid-batch. Tiered, the ops act
// on random tiers (OpClearTier too), private chains are spread over tiers,
// and the stable worker also keeps host copies, so every lower tier's table
// is rebuilt, widened and re-generationed under the readers.
func TestTableAgainstTreeWithConcurrentReaders(t *testing.T) {
	for _, tiered := range []bool{false, true} {
		name := map[bool]string{false: "device", true: "tiered"}[tiered]
		t.Run(name, func(t *testing.T) {
			for seed := range uint64(4) {
				tableAgainstTree(t, seed, tiered)
			}
		})
	}
}

func tableAgainstTree(t *testing.T, seed uint64, tiered bool) {
	rng := rand.New(rand.NewPCG(seed, 7))
	tier := func() Tier {
		if tiered {
			return randomTier(rng)
		}
		return TierDevice
	}
	w, ref := newWriter(8), NewTree()
	const stable = WorkerID(0)
	for i, k := range stableKeys() {
		w.Store(stable, k)
		ref.Store(stable, k)
		if tiered && i%2 == 0 { // a host copy changes nothing: the device has them all
			w.StoreTier(stable, TierHost, k)
			ref.StoreTier(stable, TierHost, k)
		}
	}
	var nextID atomic.Uint32
	nextID.Store(1)
	live := []WorkerID{}
	private := map[WorkerID][]Tier{} // the tier of each block of its private chain each worker holds
	maxLive := 0
	newWorker := func() {
		id := WorkerID(nextID.Add(1) - 1) // counted before the writer sees it
		live = append(live, id)
		maxLive = max(maxLive, len(live))
	}
	for range 100 {
		newWorker()
	}

	r := &reader{find: w.findMatches, stable: stable, nextID: &nextID, stop: make(chan struct{}),
		private: func(id WorkerID) bool { return id != stable }}
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Go(func() { r.run(t, seed*10+uint64(i)) })
	}

	var q []uint64
	for step := range 6000 {
		id := live[rng.IntN(len(live))]
		switch x := rng.IntN(100); {
		case x < 45:
			k, tr := rng.Uint64N(40), tier()
			w.StoreTier(id, tr, k)
			ref.StoreTier(id, tr, k)
		case x < 70:
			k, tr := rng.Uint64N(40), tier()
			w.RemoveTier(id, tr, k)
			ref.RemoveTier(id, tr, k)
		case x < 82:
			if n := len(private[id]); n < 12 {
				tr := tier()
				w.StoreTier(id, tr, privateKey(id, n))
				ref.StoreTier(id, tr, privateKey(id, n))
				private[id] = append(private[id], tr)
			}
		case x < 87:
			if n := len(private[id]); n > 0 {
				tr := private[id][n-1]
				w.RemoveTier(id, tr, privateKey(id, n-1))
				ref.RemoveTier(id, tr, privateKey(id, n-1))
				private[id] = private[id][:n-1]
			}
		case x < 89:
			if tr := tier(); tiered && rng.IntN(2) == 0 {
				w.clearTier(id, tr)
				ref.ClearTier(id, tr)
				private[id] = private[id][:0] // a hole in the chain: stop extending it
				for i := range 12 {
					w.RemoveTier(id, TierDevice, privateKey(id, i)) // and drop it all (mostly unknown removes)
					ref.RemoveTier(id, TierDevice, privateKey(id, i))
					for lt := TierHost; lt < NumTiers; lt++ {
						w.RemoveTier(id, lt, privateKey(id, i))
						ref.RemoveTier(id, lt, privateKey(id, i))
					}
				}
				break
			}
			w.clearWorker(id)
			ref.ClearWorker(id)
			delete(private, id)
		case x < 95:
			w.removeWorker(id)
			ref.RemoveWorker(id)
			delete(private, id)
			live = slices.DeleteFunc(live, func(x WorkerID) bool { return x == id })
			if len(live) == 0 {
				newWorker()
			}
		default:
			if len(live) < 150 {
				newWorker()
			}
		}
		if step%100 == 0 {
			r.overlap()
		}
		if step%20 != 0 {
			continue
		}
		for range 4 {
			q = sharedQuery(rng, q[:0])
			if rng.IntN(3) == 0 {
				id := live[rng.IntN(len(live))]
				q = q[:0]
				for i := range 1 + rng.IntN(12) {
					q = append(q, privateKey(id, i))
				}
			}
			got, want := sortScores(w.findMatches(nil, q)), sortScores(ref.FindMatches(nil, q))
			if !slices.Equal(got, want) {
				t.Fatalf("seed %d step %d: FindMatches(%v) = %v, tree says %v", seed, step, q, got, want)
			}
			for _, s := range got {
				if !validScore(s, len(q)) {
					t.Fatalf("seed %d step %d: FindMatches(%v) scored %v", seed, step, q, s)
				}
			}
		}
		for tr := range Tier(NumTiers) {
			if w.tierNodes(tr) != ref.TierNodes(tr) {
				t.Fatalf("seed %d step %d: %v nodes %d, tree %d", seed, step, tr, w.tierNodes(tr), ref.TierNodes(tr))
			}
		}
		if w.tierNodes(TierDevice) != ref.Nodes() || w.unknownRemoves != ref.UnknownRemoves {
			t.Fatalf("seed %d step %d: nodes %d, unknown removes %d; tree %d and %d",
				seed, step, w.tierNodes(TierDevice), w.unknownRemoves, ref.Nodes(), ref.UnknownRemoves)
		}
	}
	close(r.stop)
	wg.Wait()
	if r.reads.Load() == 0 {
		t.Fatal("the readers never ran")
	}
	t.Logf("seed %d: %d reads, %d tables made, width %d, generation %d", seed, r.reads.Load(), w.made, w.t.words, w.gen)
	// Wide enough for the most workers live at once, and no wider: freed
	// slots were reused, though hundreds of ids went through.
	words := w.t.words
	if words < 2 || words*64 >= maxLive+1+64 || nextID.Load() < 300 {
		t.Errorf("seed %d: %d bitset words for at most %d live workers of %d", seed, words, maxLive+1, nextID.Load())
	}
	for i := range w.lower {
		x := w.lower[i].Load()
		if tiered != (x != nil) {
			t.Errorf("seed %d: tier %v's table made: %v", seed, Tier(i+1), x != nil)
		}
		if x != nil && (x.t.words != words || x.t.gen != w.t.gen) {
			t.Errorf("seed %d: tier %v's table: width %d generation %d, the device's %d and %d",
				seed, Tier(i+1), x.t.words, x.t.gen, words, w.t.gen)
		}
	}
}

// A reader that pinned a version keeps it whole: the writer neither
// recycles it nor lets a new worker's slot show under the old worker's id,
// and once unpinned the steady state reuses tables instead of allocating.
func TestPinnedVersionIsNeitherRecycledNorRemapped(t *testing.T) {
	w := newWriter(256)
	for id := range WorkerID(64) { // every slot of one word taken
		w.Store(id, 1000+uint64(id))
	}
	old := w.pin()
	slot := w.holders[5].slot
	w.removeWorker(5)
	w.Store(100, 7) // no free slot: 5's is handed out again, in a new version
	cur := w.cur.Load()
	if cur == old || w.holders[100].slot != slot || cur.words != 1 {
		t.Fatalf("worker 100 got slot %d (5 had %d) in a new version: %v, width %d", w.holders[100].slot, slot, cur != old, cur.words)
	}
	if got := WorkerID(old.slots[slot].Load()); got != 5 {
		t.Fatalf("the pinned version maps worker 5's slot to %d", got)
	}
	churn := func(round int) { // fresh keys stored and removed: tombstones, rebuilds at the same size
		for i := range 200 {
			k := uint64(round)<<20 | uint64(i) + 1<<32
			w.Store(100, k)
			w.Remove(100, k)
		}
	}
	for round := range 20 {
		churn(round)
		if w.cur.Load() == old {
			t.Fatal("a pinned version was recycled and published again")
		}
	}
	if got := old.match(nil, []uint64{1000 + 7}, &w.opened); !slices.Equal(got, []Score{dev(7, 1)}) {
		t.Fatalf("the pinned version now answers %v for worker 7's block", got)
	}
	unpin(old)
	made := w.made
	for round := 20; round < 40; round++ {
		churn(round)
	}
	if w.made != made {
		t.Errorf("steady churn allocated %d tables", w.made-made)
	}
	if got := w.findMatches(nil, []uint64{7}); !slices.Equal(got, []Score{dev(100, 1)}) {
		t.Errorf("worker 100's block answered %v", got)
	}
}

// An engine filling its cache with new blocks and clearing it, over and
// over, costs the writer no allocation once warm (tombstones are dropped by
// rebuilds into the spare table), and a lookup none either.
func TestWarmWriterAndReaderAllocateNothing(t *testing.T) {
	w := newWriter(minCap)
	round := 0
	cycle := func() {
		round++
		for id := range WorkerID(4) {
			for i := range 500 {
				w.Store(id, uint64(round)<<32|uint64(id)<<16|uint64(i))
			}
		}
		for id := range WorkerID(4) {
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
	for i := range 10 {
		w.Store(1, uint64(i)+1)
	}
	keys := []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
	dst := make([]Score, 0, 8)
	if a := testing.AllocsPerRun(100, func() { dst = w.findMatches(dst[:0], keys) }); a != 0 {
		t.Errorf("FindMatches allocated %v times", a)
	}
	if !slices.Equal(dst, []Score{dev(1, 10)}) {
		t.Errorf("FindMatches = %v, want [{1 10}]", dst)
	}
}

func TestShardsFindMatchesSortedWithoutAllocating(t *testing.T) {
	s := NewShards(3, 4)
	defer s.Close()
	for id := range WorkerID(9) { // worker id holds the first id+1 blocks
		b := &Batch{Worker: id}
		for i := range int(id) + 1 {
			b.Ops = append(b.Ops, Op{Kind: OpStore, Hash: uint64(i)})
		}
		s.Queue(id) <- b
	}
	ctx := context.Background()
	if err := s.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	keys := []uint64{0, 1, 2, 3, 4, 5}
	dst := make([]Score, 0, 16)
	if a := testing.AllocsPerRun(100, func() { dst, _ = s.FindMatches(ctx, dst[:0], keys) }); a != 0 {
		t.Errorf("FindMatches allocated %v times", a)
	}
	want := []Score{dev(0, 1), dev(1, 2), dev(2, 3), dev(3, 4), dev(4, 5), dev(5, 6), dev(6, 6), dev(7, 6), dev(8, 6)}
	if !slices.Equal(dst, want) {
		t.Errorf("FindMatches = %v, want %v", dst, want)
	}
	var total int64
	for i := range s.Len() {
		total += s.Nodes(i)
	}
	if total != 7+8+9 { // shard i's longest chain is worker 6+i's
		t.Errorf("nodes %d, want 24", total)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.FindMatches(cctx, nil, keys); !errors.Is(err, context.Canceled) {
		t.Errorf("FindMatches with a canceled context: %v", err)
	}
}

// Through the shard goroutines: more than 64 workers per shard, workers
// removed and new ones added (ids never reused, as the supervisor does),
// ops on random tiers, readers asking all along. After each Sync the
// answers and each tier's node counts equal the Tree's.
func TestShardsWorkerChurnAgainstTree(t *testing.T) {
	const n = 2
	rng := rand.New(rand.NewPCG(3, 4))
	s := newShards(n, 8, 8)
	ref := NewTree()
	ctx := context.Background()
	keys := stableKeys()
	send := func(b *Batch) {
		for _, op := range b.Ops {
			ref.Apply(b.Worker, op)
		}
		s.Queue(b.Worker) <- b
	}
	// Worker 0 (shard 0) holds the stable chain; worker 1 (shard 1) nothing
	// stable, so readers check shard 0's under the others' churn.
	st := &Batch{Worker: 0}
	for _, k := range keys {
		st.Ops = append(st.Ops, Op{Kind: OpStore, Hash: k})
	}
	send(st)
	if err := s.Sync(ctx); err != nil { // the readers' premise
		t.Fatal(err)
	}
	var nextID atomic.Uint32
	nextID.Store(2)
	var live []WorkerID
	for range 300 {
		live = append(live, WorkerID(nextID.Add(1)-1))
	}
	r := &reader{stable: 0, nextID: &nextID, stop: make(chan struct{}), private: func(WorkerID) bool { return false },
		find: func(dst []Score, hashes []uint64) []Score {
			dst, err := s.FindMatches(ctx, dst, hashes)
			if err != nil {
				t.Error(err)
			}
			return dst
		}}
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Go(func() { r.run(t, uint64(i)) })
	}
	var q []uint64
	for round := range 400 {
		for range 1 + rng.IntN(8) {
			id := live[rng.IntN(len(live))]
			b := &Batch{Worker: id}
			for range rng.IntN(10) {
				switch x := rng.IntN(40); {
				case x < 24:
					b.Ops = append(b.Ops, Op{Kind: OpStore, Tier: randomTier(rng), Hash: rng.Uint64N(40)})
				case x < 38:
					b.Ops = append(b.Ops, Op{Kind: OpRemove, Tier: randomTier(rng), Hash: rng.Uint64N(40)})
				case x < 39:
					b.Ops = append(b.Ops, Op{Kind: OpClearTier, Tier: randomTier(rng)})
				default:
					b.Ops = append(b.Ops, Op{Kind: OpClearWorker})
				}
			}
			if rng.IntN(15) == 0 {
				b.Ops = append(b.Ops, Op{Kind: OpRemoveWorker})
				live = slices.DeleteFunc(live, func(x WorkerID) bool { return x == id })
				live = append(live, WorkerID(nextID.Add(1)-1))
			}
			send(b)
		}
		if err := s.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		if round%10 == 0 {
			r.overlap()
		}
		for range 3 {
			q = sharedQuery(rng, q[:0])
			got, err := s.FindMatches(ctx, nil, q)
			if err != nil {
				t.Fatal(err)
			}
			if want := sortScores(ref.FindMatches(nil, q)); !slices.Equal(got, want) {
				t.Fatalf("round %d: FindMatches(%v) = %v, tree says %v", round, q, got, want)
			}
		}
		var nodes int64
		for i := range n {
			nodes += s.Nodes(i)
		}
		if want := perShardNodes(ref, n, TierDevice); nodes != want {
			t.Fatalf("round %d: nodes %d, tree says %d", round, nodes, want)
		}
		for tier := range Tier(NumTiers) {
			var nodes int64
			for i := range n {
				nodes += s.tierNodes(i, tier)
			}
			if want := perShardNodes(ref, n, tier); nodes != want {
				t.Fatalf("round %d: %v nodes %d, tree says %d", round, tier, nodes, want)
			}
		}
	}
	close(r.stop)
	wg.Wait()
	s.Close()
	if r.reads.Load() == 0 {
		t.Fatal("the readers never ran")
	}
	if _, err := s.FindMatches(ctx, nil, keys); err != ErrClosed {
		t.Errorf("FindMatches after Close: %v, want ErrClosed", err)
	}
}

// perShardNodes is how many (shard, block) pairs some worker holds in tier:
// a block two shards' workers hold is a node on each.
func perShardNodes(t *Tree, n int, tier Tier) (total int64) {
	for _, nd := range t.tiers[tier].nodes {
		var on [64]bool
		for _, w := range nd.workers {
			on[int(w)%n] = true
		}
		for _, b := range on[:n] {
			if b {
				total++
			}
		}
	}
	return total
}

// Past 512 workers on one shard, a reader scores the bitset 8 words at a
// time; every chunk's workers must come out, with their own scores, on
// device alone and with blocks in every tier.
func TestWideTableAgainstTree(t *testing.T) {
	for _, tc := range []struct {
		name string
		tier func(*rand.Rand) Tier
	}{
		{"device", func(*rand.Rand) Tier { return TierDevice }},
		{"tiered", randomTier},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(5, 6))
			w, ref := newWriter(8), NewTree()
			for id := range WorkerID(700) {
				for i := range 1 + rng.IntN(12) { // a chain of its own length
					tier := tc.tier(rng)
					w.StoreTier(id, tier, uint64(i))
					ref.StoreTier(id, tier, uint64(i))
				}
				if id%7 == 3 { // and some churn of the slots
					w.removeWorker(id - 2)
					ref.RemoveWorker(id - 2)
				}
			}
			if w.t.words <= chunk {
				t.Fatalf("%d words: the test must span more than one chunk", w.t.words)
			}
			for n := range 14 {
				q := []uint64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}[:n+1]
				got, want := sortScores(w.findMatches(nil, q)), sortScores(ref.FindMatches(nil, q))
				if !slices.Equal(got, want) || len(got) < 500 {
					t.Fatalf("FindMatches(%v): %d scores, tree %d; differ: %v", q, len(got), len(want), !slices.Equal(got, want))
				}
			}
		})
	}
}

// Matches that end on either side of a lookahead group's edge score exactly.
func TestMatchesAcrossLookaheadGroups(t *testing.T) {
	w := newWriter(minCap)
	keys := make([]uint64, 3*lookahead+5)
	for i := range keys {
		keys[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
	}
	holds := map[WorkerID]int{0: 1, 1: lookahead, 2: lookahead + 1, 3: 2*lookahead + 1, 4: len(keys), 5: lookahead - 1}
	for id, n := range holds {
		for _, k := range keys[:n] {
			w.Store(id, k)
		}
	}
	got := map[WorkerID]int{}
	for _, sc := range w.findMatches(nil, keys) {
		got[sc.Worker] = sc.Blocks
	}
	if len(got) != len(holds) {
		t.Errorf("scores %v, want %v", got, holds)
	}
	for id, n := range holds {
		if got[id] != n {
			t.Errorf("worker %d scores %d, want %d", id, got[id], n)
		}
	}
}

// A table is sized to the entries it holds (a load of 3/5 to 4/5 while the
// held ones do not change, emptied ones aside), and a large one keeps no
// spare version once unpublished: the index's memory is its tables', once.
// Small ones keep theirs (TestWarmWriterAndReaderAllocateNothing).
func TestTableSizedToItsEntries(t *testing.T) {
	const n = 3 * maxSpare
	w := newWriter(minCap)
	check := func(stage string) {
		t.Helper()
		if w.spare != nil {
			t.Errorf("%s: a table of %d entries kept a spare of %d", stage, w.t.size, w.spare.size)
		}
		if w.live != n {
			t.Fatalf("%s: %d keys held, want %d", stage, w.live, n)
		}
		if w.live*buildDen < w.t.size*buildNum-buildDen || w.used*growDen > w.t.size*growNum {
			t.Errorf("%s: %d held and %d used of %d entries", stage, w.live, w.used, w.t.size)
		}
	}
	for i := range n {
		w.Store(1, uint64(i)+1)
	}
	check("filled")
	for round := range 3 { // every key replaced by a fresh one: emptied entries, rebuilds
		for i := range n {
			w.Remove(1, uint64(round*n+i)+1)
			w.Store(1, uint64((round+1)*n+i)+1)
		}
		check(fmt.Sprintf("round %d", round))
	}
}
