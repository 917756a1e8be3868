package index

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestPromptHashesChainEqualPrefixes(t *testing.T) {
	var h Hasher
	a := h.Prompt(nil, []uint32{1, 2, 3, 4, 5, 6, 7}, 2) // the partial last block is left out
	b := h.Prompt(nil, []uint32{1, 2, 3, 4, 9, 9}, 2)
	c := h.Prompt(nil, []uint32{3, 4}, 2)
	if len(a) != 3 || a[0] != b[0] || a[1] != b[1] || a[2] == b[2] {
		t.Errorf("equal prefixes must give equal keys, others not: %x %x", a, b)
	}
	if c[0] == a[1] {
		t.Error("a block's key must depend on its parent, not only its tokens")
	}
}

func TestTreeFindMatches(t *testing.T) {
	tr := NewTree()
	for i, h := range []uint64{1, 2, 3, 4} {
		tr.Store(10, h)
		if i < 2 {
			tr.Store(20, h)
		}
	}
	tr.Store(30, 2) // holds block 2 but not block 1: no leading match
	got := tr.FindMatches(nil, []uint64{1, 2, 3, 9})
	slices.SortFunc(got, func(a, b Score) int { return int(a.Worker) - int(b.Worker) })
	want := []Score{dev(10, 3), dev(20, 2)}
	if !slices.Equal(got, want) {
		t.Errorf("FindMatches = %v, want %v", got, want)
	}
	if got := tr.FindMatches(nil, []uint64{7}); len(got) != 0 {
		t.Errorf("unknown prefix matched %v", got)
	}
}

func TestTreeRemoveFreesNodesAndCountsUnknown(t *testing.T) {
	tr := NewTree()
	tr.Store(1, 100)
	tr.Store(1, 100) // two engine blocks, one router block
	tr.Store(2, 100)
	tr.Remove(1, 100)
	tr.Remove(1, 100)
	tr.Remove(1, 100) // no longer held
	tr.Remove(3, 5)   // never held
	if tr.UnknownRemoves != 2 || tr.Nodes() != 1 {
		t.Errorf("unknown removes %d, nodes %d; want 2 and 1", tr.UnknownRemoves, tr.Nodes())
	}
	tr.RemoveWorker(2)
	if tr.Nodes() != 0 || tr.Blocks(1) != 0 || tr.Blocks(2) != 0 || tr.tiers[TierDevice].held[2] != nil {
		t.Errorf("after clearing the last holder: %d nodes, blocks %d and %d, worker 2's entries %v",
			tr.Nodes(), tr.Blocks(1), tr.Blocks(2), tr.tiers[TierDevice].held[2])
	}
}

// Hours of store/remove churn, compressed: the node count returns to its baseline.
func TestChurnDoesNotGrow(t *testing.T) {
	tr := NewTree()
	rng := rand.New(rand.NewPCG(1, 2))
	for w := range WorkerID(4) { // a warm baseline every worker keeps
		for h := range uint64(100) {
			tr.Store(w, h)
		}
	}
	base := tr.Nodes()
	for round := range 200 {
		live := map[WorkerID][]uint64{}
		for range 500 {
			w, h := WorkerID(rng.IntN(4)), 1000+rng.Uint64N(5000)+uint64(round)*10_000
			tr.Store(w, h)
			live[w] = append(live[w], h)
		}
		for w, hs := range live {
			for _, h := range hs {
				tr.Remove(w, h)
			}
		}
	}
	if tr.Nodes() != base {
		t.Errorf("nodes = %d after churn, want the baseline %d", tr.Nodes(), base)
	}
}

// model is the plain reference: per worker and tier, the set of blocks it
// holds there.
type model map[WorkerID]*[NumTiers]map[uint64]int

// scores is FindMatches by the definition: Tiers[t] is the leading keys held
// each in some tier <= t.
func (m model) scores(hashes []uint64) map[WorkerID]Score {
	out := map[WorkerID]Score{}
	for w, held := range m {
		s := Score{Worker: w}
		for t := range NumTiers {
			n := 0
		keys:
			for _, h := range hashes {
				for u := range t + 1 {
					if held[u][h] > 0 {
						n++
						continue keys
					}
				}
				break
			}
			s.Tiers[t] = n
		}
		s.Blocks = s.Tiers[TierDevice]
		if s.Tiers[NumTiers-1] > 0 {
			out[w] = s
		}
	}
	return out
}

// Random stores, removes and clears of several workers, device only and on
// random tiers, go through the sharded pipeline; every FindMatches answer
// equals the reference's.
func TestShardsAgainstModel(t *testing.T) {
	for seed := range uint64(30) {
		tiered := seed%2 == 1
		rng := rand.New(rand.NewPCG(seed, 99))
		// Past shardGroup shards, a lookup reads them in groups.
		shards := NewShards([]int{1, 2, 3, 4, shardGroup + 2}[seed%5], 8)
		ref := model{}
		const workers = 12
		for range 300 {
			w := WorkerID(rng.IntN(workers))
			b := &Batch{Worker: w}
			held := ref[w]
			if held == nil {
				held = &[NumTiers]map[uint64]int{}
				for t := range held {
					held[t] = map[uint64]int{}
				}
				ref[w] = held
			}
			for range rng.IntN(12) {
				h := rng.Uint64N(40) // a small space, so prefixes overlap
				tier := TierDevice
				if tiered {
					tier = Tier(rng.IntN(NumTiers))
				}
				switch r := rng.IntN(40); {
				case r < 24:
					b.Ops = append(b.Ops, Op{Kind: OpStore, Tier: tier, Hash: h})
					held[tier][h]++
				case r < 38:
					b.Ops = append(b.Ops, Op{Kind: OpRemove, Tier: tier, Hash: h})
					if held[tier][h] > 0 {
						held[tier][h]--
					}
				case r < 39 && tiered:
					b.Ops = append(b.Ops, Op{Kind: OpClearTier, Tier: tier})
					clear(held[tier])
				default:
					b.Ops = append(b.Ops, Op{Kind: OpClearWorker})
					for t := range held {
						clear(held[t])
					}
				}
			}
			shards.Queue(w) <- b
			if err := shards.Sync(context.Background()); err != nil {
				t.Fatal(err)
			}
			query := make([]uint64, 1+rng.IntN(6))
			for i := range query {
				query[i] = rng.Uint64N(40)
			}
			got, err := shards.FindMatches(context.Background(), nil, query)
			if err != nil {
				t.Fatal(err)
			}
			gotMap := map[WorkerID]Score{}
			for _, s := range got {
				gotMap[s.Worker] = s
			}
			want := ref.scores(query)
			if len(gotMap) != len(want) || len(got) != len(want) {
				t.Fatalf("seed %d: FindMatches(%v) = %v, want %v", seed, query, got, want)
			}
			for w, s := range want {
				if gotMap[w] != s {
					t.Fatalf("seed %d: FindMatches(%v) = %v, want %v", seed, query, got, want)
				}
			}
		}
		shards.Close()
		if _, err := shards.FindMatches(context.Background(), nil, []uint64{1}); err != ErrClosed {
			t.Errorf("FindMatches after Close: %v, want ErrClosed", err)
		}
	}
}

// sortByWorker orders any number of scores by worker, on both of its paths
// (insertion up to 32, SortFunc past).
func TestSortByWorker(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, n := range []int{0, 1, 2, 16, 32, 33, 200} {
		var scores []Score
		for _, w := range rng.Perm(n) {
			scores = append(scores, Score{Worker: WorkerID(w), Blocks: w + 1})
		}
		sortByWorker(scores)
		for i, sc := range scores {
			if sc.Worker != WorkerID(i) || sc.Blocks != i+1 {
				t.Fatalf("%d scores: %v at %d", n, sc, i)
			}
		}
	}
}
