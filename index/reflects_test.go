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
// state n-1 to state n; flips[k][w] lists the ops after which worker w's
// holding of key k changed, in order (state 0 holds nothing).
type opLog struct {
	begun atomic.Int64 // ops the writer started applying
	done  atomic.Int64 // ops applied
	refs  map[WorkerID]map[uint64]int
	flips map[uint64]map[WorkerID][]int64
}

func newOpLog() *opLog {
	return &opLog{refs: map[WorkerID]map[uint64]int{}, flips: map[uint64]map[WorkerID][]int64{}}
}

func (l *opLog) flip(id WorkerID, k uint64, n int64) {
	byW := l.flips[k]
	if byW == nil {
		byW = map[WorkerID][]int64{}
		l.flips[k] = byW
	}
	byW[id] = append(byW[id], n)
}

// record notes op n of worker id: the device holdings it changes, as the
// writer counts references (a store adds one, a remove of a held key takes
// one, a clear or a removal takes them all).
func (l *opLog) record(id WorkerID, op Op, n int64) {
	held := l.refs[id]
	if held == nil {
		held = map[uint64]int{}
		l.refs[id] = held
	}
	switch op.Kind {
	case OpStore:
		if held[op.Hash]++; held[op.Hash] == 1 {
			l.flip(id, op.Hash, n)
		}
	case OpRemove:
		switch held[op.Hash] {
		case 0:
		case 1:
			delete(held, op.Hash)
			l.flip(id, op.Hash, n)
		default:
			held[op.Hash]--
		}
	case OpClearWorker, OpRemoveWorker:
		for k := range held {
			l.flip(id, k, n)
		}
		clear(held)
	}
}

// heldAt reports whether w held k in state n, and the first op after n
// that changes it (past every op when none does).
func (l *opLog) heldAt(k uint64, w WorkerID, n int64) (held bool, next int64) {
	fs := l.flips[k][w]
	i := sort.Search(len(fs), func(i int) bool { return fs[i] > n })
	if i < len(fs) {
		return i%2 == 1, fs[i]
	}
	return i%2 == 1, 1 << 62
}

// explains reports whether worker w scoring blocks of q fits states from
// lo to hi: instants in key order, each in [lo, hi], at which w held
// q[0..blocks), then one at which it did not hold q[blocks] (if any).
func (l *opLog) explains(q []uint64, w WorkerID, blocks int, lo, hi int64) bool {
	at := lo
	for j := range blocks {
		held, next := l.heldAt(q[j], w, at)
		if !held {
			if next > hi {
				return false
			}
			at = next // it starts holding q[j] then
		}
	}
	if blocks == len(q) {
		return true
	}
	held, next := l.heldAt(q[blocks], w, at)
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
	const workers = 5 // jumpScript's
	steps, seeds := 4000, uint64(2)
	if testing.Short() {
		steps, seeds = 1500, 1
	}
	for seed := range seeds {
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
					after := log.begun.Load()
					if len(seen[r]) < 200_000 {
						seen[r] = append(seen[r], seenAnswer{node, prefix, before, after, slices.Clone(dst)})
					}
				}
			})
		}

		var n int64
		jumped := 0
		var want []Score
		jumpScript(f, rng.IntN, steps, func(id WorkerID, op Op) {
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
				t.Fatalf("seed %d: prompt of %d keys: index %v, sequential reference %v", seed, len(q), got, want)
			}
			for _, s := range got {
				if h := w.holders[s.Worker]; h != nil && h.closed && s.Blocks > jumpStep {
					jumped++
					break
				}
			}
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
				scored := map[WorkerID]int{}
				for _, s := range a.answer {
					if _, dup := scored[s.Worker]; dup || s.Worker >= workers || s.Blocks < 1 || s.Blocks > len(q) {
						t.Fatalf("seed %d: prompt of %d keys answered %v", seed, len(q), a.answer)
					}
					scored[s.Worker] = s.Blocks
				}
				for id := range WorkerID(workers) {
					if !log.explains(q, id, scored[id], a.before, hi) {
						t.Fatalf("seed %d: worker %d scored %d of a prompt of %d keys between ops %d and %d, which no instants in key order explain (answer %v)",
							seed, id, scored[id], len(q), a.before, a.after, a.answer)
					}
				}
				checked++
			}
		}
		t.Logf("seed %d: %d ops, %d answers checked, %d of them with ops applied during the call; %d writer-side answers jumped", seed, n, checked, during, jumped)
		if during < 100 || jumped < 10 {
			t.Errorf("seed %d: %d answers overlapped a batch, %d jumped: the test no longer tests the concurrent jump", seed, during, jumped)
		}
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
		if got := log.explains(q, 1, tc.blocks, tc.lo, tc.hi); got != tc.want {
			t.Errorf("score %d in states %d to %d: explained %v, want %v", tc.blocks, tc.lo, tc.hi, got, tc.want)
		}
	}
}
