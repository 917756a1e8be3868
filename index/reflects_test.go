package index

import (
	"math/rand/v2"
	"runtime"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
)

// What an answer reflects (README): it reads the request's keys in order,
// each key's holders at one instant between the call's start and its
// return, and a worker scores the leading keys it was seen holding. These
// tests hold the read path to that while the writer applies jumpScript's
// ops (linked chains, so that workers are closed and lookups jump; holes,
// re-indexes, bad links, clears) under readers on other goroutines. The
// writer numbers its ops; a reader notes the number before and after each
// call, and once the writer is done every answer is checked against the
// history of each (worker, key): for each worker, instants in the call's
// span, in key order, at which it held each key it was scored for, and
// then one at which it did not hold the next. The span is from the last op
// done before the call to the last op begun before it returned (which may
// be seen in part).

// opLog is the writer's history: op n (1-based) is the state change from
// state n-1 to state n; flips[v][k][w] lists the ops after which worker w's
// holding of key k at level v (0 the device, 1 the device or the host)
// changed, in order (state 0 holds nothing).
type opLog struct {
	begun atomic.Int64 // ops the writer started applying
	done  atomic.Int64 // ops applied
	refs  map[WorkerID]*[2]map[uint64]int
	flips [2]map[uint64]map[WorkerID][]int64
}

func newOpLog() *opLog {
	return &opLog{refs: map[WorkerID]*[2]map[uint64]int{},
		flips: [2]map[uint64]map[WorkerID][]int64{{}, {}}}
}

func (l *opLog) flip(v int, id WorkerID, k uint64, n int64) {
	byW := l.flips[v][k]
	if byW == nil {
		byW = map[WorkerID][]int64{}
		l.flips[v][k] = byW
	}
	byW[id] = append(byW[id], n)
}

// record notes op n of worker id: the holdings it changes, as the writer
// counts references per tier (a store adds one, a remove of a held key
// takes one, a clear of a tier or all of them, or a removal, takes them
// all).
func (l *opLog) record(id WorkerID, op Op, n int64) {
	held := l.refs[id]
	if held == nil {
		held = &[2]map[uint64]int{{}, {}}
		l.refs[id] = held
	}
	levels := func(k uint64) [2]bool {
		return [2]bool{held[0][k] > 0, held[0][k] > 0 || held[1][k] > 0}
	}
	var keys []uint64
	switch op.Kind {
	case OpStore, OpRemove:
		keys = []uint64{op.Hash}
	default:
		for k := range held[0] {
			keys = append(keys, k)
		}
		for k := range held[1] {
			if held[0][k] == 0 { // listed once
				keys = append(keys, k)
			}
		}
	}
	before := make([][2]bool, len(keys))
	for i, k := range keys {
		before[i] = levels(k)
	}
	tier := held[op.Tier&1]
	switch op.Kind {
	case OpStore:
		tier[op.Hash]++
	case OpRemove:
		switch tier[op.Hash] {
		case 0:
		case 1:
			delete(tier, op.Hash)
		default:
			tier[op.Hash]--
		}
	case OpClearTier:
		clear(tier)
	case OpClearWorker, OpRemoveWorker:
		clear(held[0])
		clear(held[1])
	}
	for i, k := range keys {
		now := levels(k)
		for v := range now {
			if now[v] != before[i][v] {
				l.flip(v, id, k, n)
			}
		}
	}
}

// heldAt reports whether w held k in state n at level v, and the first op
// after n that changes it (past every op when none does).
func (l *opLog) heldAt(v int, k uint64, w WorkerID, n int64) (held bool, next int64) {
	fs := l.flips[v][k][w]
	i := sort.Search(len(fs), func(i int) bool { return fs[i] > n })
	if i < len(fs) {
		return i%2 == 1, fs[i]
	}
	return i%2 == 1, 1 << 62
}

// explains reports whether worker w scoring blocks of q at level v fits
// states from lo to hi: instants in key order, each in [lo, hi], at which w
// held q[0..blocks), then (with end) one at which it did not hold
// q[blocks] (if any).
func (l *opLog) explains(v int, q []uint64, w WorkerID, blocks int, lo, hi int64, end bool) bool {
	at := lo
	for j := range blocks {
		held, next := l.heldAt(v, q[j], w, at)
		if !held {
			if next > hi {
				return false
			}
			at = next // it starts holding q[j] then
		}
	}
	if blocks == len(q) || !end {
		return true
	}
	held, next := l.heldAt(v, q[blocks], w, at)
	return !held || next <= hi
}

// seenAnswer is a reader's call: the prompt (a forest node's path), the
// ops done before it started and begun before it returned, and its answer.
type seenAnswer struct {
	node   int
	prefix int // keys of the path asked
	before int64
	after  int64
	answer []Score
}

func TestAnswersReflectBatchesAppliedMeanwhile(t *testing.T) {
	steps, seeds := 4000, uint64(2)
	if testing.Short() {
		steps, seeds = 1500, 1
	}
	for _, tiered := range []bool{false, true} {
		for seed := range seeds {
			reflectsMeanwhile(t, seed, steps, tiered)
		}
	}
}

// reflectsMeanwhile is one run of TestAnswersReflectBatchesAppliedMeanwhile.
// With tiered, the host's score is checked too, for claiming no block the
// worker did not hold in either tier at instants in key order (that it
// drops out where it should is left to the writer-side answers: a block
// moved between tiers meanwhile may be seen in neither).
func reflectsMeanwhile(t *testing.T, seed uint64, steps int, tiered bool) {
	const workers = 5 // jumpScript's
	rng := rand.New(rand.NewPCG(seed, 11))
	f := newForest(rng.IntN, 12, 400)
	w, ref, log := newWriter(16), NewTree(), newOpLog()

	stop := make(chan struct{})
	var wg sync.WaitGroup
	seen := make([][]seenAnswer, 2)
	for r := range seen {
		wg.Go(func() {
			rr := rand.New(rand.NewPCG(seed, uint64(r)+100))
			var dst []Score
			var q []uint64
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if i%16 == 0 {
					runtime.Gosched() // let the writer on with two readers on two Ps
				}
				node := rr.IntN(len(f.keys))
				q = f.path(q[:0], node)
				prefix := 1 + rr.IntN(len(q))
				before := log.done.Load()
				dst = w.findMatches(dst[:0], q[:prefix])
				sortByWorker(dst)
				dst = mergeByWorker(dst, 0) // as FindMatches does
				after := log.begun.Load()
				if len(seen[r]) < 200_000 {
					seen[r] = append(seen[r], seenAnswer{node, prefix, before, after, slices.Clone(dst)})
				}
			}
		})
	}

	var n int64
	jumped, hostJumped := 0, 0
	var want []Score
	jumpScript(f, rng.IntN, steps, tiered, func(id WorkerID, op Op) {
		n++
		log.record(id, op, n)
		log.begun.Store(n)
		w.apply(id, op)
		log.done.Store(n)
		ref.Apply(id, op)
	}, func(q []uint64) {
		// The writer's own answers stay exact, and some jump.
		got := sortScores(w.findMatches(nil, q))
		want = sortScores(ref.FindMatches(want[:0], q))
		if !slices.Equal(got, want) {
			t.Fatalf("seed %d tiered %v: prompt of %d keys: index %v, sequential reference %v", seed, tiered, len(q), got, want)
		}
		dev, host := jumpedOver(w, got)
		jumped, hostJumped = jumped+dev, hostJumped+host
	})
	close(stop)
	wg.Wait()

	checked, during := 0, 0
	var q []uint64
	for _, answers := range seen {
		for _, a := range answers {
			q = f.path(q[:0], a.node)[:a.prefix]
			hi := a.after
			if a.after > a.before {
				during++
			}
			scored := map[WorkerID]Score{}
			for _, s := range a.answer {
				if _, dup := scored[s.Worker]; dup || s.Worker >= workers || s.Tiers[TierHost] < 1 || s.Tiers[TierHost] > len(q) ||
					s.Blocks > s.Tiers[TierHost] || s.Tiers[NumTiers-1] != s.Tiers[TierHost] || !tiered && s.Blocks < 1 {
					t.Fatalf("seed %d tiered %v: prompt of %d keys answered %v", seed, tiered, len(q), a.answer)
				}
				scored[s.Worker] = s
			}
			for id := range WorkerID(workers) {
				s := scored[id]
				if !log.explains(0, q, id, s.Blocks, a.before, hi, true) {
					t.Fatalf("seed %d tiered %v: worker %d scored %d of a prompt of %d keys between ops %d and %d, which no instants in key order explain (answer %v)",
						seed, tiered, id, s.Blocks, len(q), a.before, a.after, a.answer)
				}
				if !log.explains(1, q, id, s.Tiers[TierHost], a.before, hi, false) {
					t.Fatalf("seed %d tiered %v: worker %d scored %d of a prompt of %d keys with the host between ops %d and %d, which no instants in key order explain (answer %v)",
						seed, tiered, id, s.Tiers[TierHost], len(q), a.before, a.after, a.answer)
				}
			}
			checked++
		}
	}
	t.Logf("seed %d tiered %v: %d ops, %d answers checked, %d of them with ops applied during the call; %d writer-side answers jumped, %d over host blocks",
		seed, tiered, n, checked, during, jumped, hostJumped)
	if during < 100 || jumped < 10 || tiered && hostJumped == 0 {
		t.Errorf("seed %d tiered %v: %d answers overlapped a batch, %d jumped, %d over host blocks: the test no longer tests the concurrent jump", seed, tiered, during, jumped, hostJumped)
	}
}

// The check itself: explains refuses what no instants explain.
func TestOpLogExplains(t *testing.T) {
	log := newOpLog()
	q := []uint64{10, 11, 12}
	ops := []Op{
		{Kind: OpStore, Hash: 10},  // 1
		{Kind: OpStore, Hash: 11},  // 2
		{Kind: OpRemove, Hash: 10}, // 3: a hole at the root
		{Kind: OpStore, Hash: 12},  // 4
		{Kind: OpStore, Hash: 10},  // 5
		{Kind: OpStore, Hash: 10},  // 6: a second reference
		{Kind: OpRemove, Hash: 10}, // 7: still held
		{Kind: OpClearWorker},      // 8
	}
	for i, op := range ops {
		log.record(1, op, int64(i+1))
	}
	for _, tc := range []struct {
		blocks int
		lo, hi int64
		want   bool
	}{
		{0, 0, 0, true},  // nothing held
		{1, 0, 0, false}, // 10 not yet stored
		{1, 0, 1, true},
		{2, 2, 2, true},
		{3, 2, 2, false}, // 12 not yet stored, and 11 held: must stop at 2
		{2, 2, 3, true},  // 10 then 11 at state 2, 12 absent
		{0, 3, 3, true},  // the hole
		{3, 3, 3, false}, // 10 missing throughout
		{3, 3, 5, true},  // all three at state 5
		{3, 4, 4, false}, // 10 missing at 4
		{3, 5, 7, true},  // still held after one of two references goes
		{2, 5, 7, false}, // 12 held throughout: the score is 3
		{3, 7, 8, true},  // before the clear
		{0, 7, 8, true},  // after it
		{0, 5, 7, false}, // 10 held throughout
	} {
		if got := log.explains(0, q, 1, tc.blocks, tc.lo, tc.hi, true); got != tc.want {
			t.Errorf("score %d in states %d to %d: explained %v, want %v", tc.blocks, tc.lo, tc.hi, got, tc.want)
		}
	}
}
