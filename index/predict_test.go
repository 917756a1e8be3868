package index

import (
	"context"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/predict"
)

func predictKeys(s *Shards, w WorkerID, c *predict.Counts, until int64, keys ...uint64) {
	s.Predict(w, &predict.Batch{Keys: keys, Until: until, Max: 1000, Counts: c})
}

// score returns worker w's Score for hashes, and whether it has one.
func score(t *testing.T, s *Shards, hashes []uint64, w WorkerID) (Score, bool) {
	t.Helper()
	if err := s.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, err := s.FindMatches(context.Background(), nil, hashes)
	if err != nil {
		t.Fatal(err)
	}
	for _, sc := range got {
		if sc.Worker == w {
			return sc, true
		}
	}
	return Score{}, false
}

// Predictions beside the index: Predicted runs on from the blocks held,
// device stores confirm, a clear, a removal and a sweep end them.
func TestPredictionsBesideTheIndex(t *testing.T) {
	s := NewShards(2, 8)
	defer s.Close()
	var c1, c3 predict.Counts
	hashes := []uint64{11, 12, 13, 14, 15}
	predictKeys(s, 1, &c1, 100, hashes...)
	predictKeys(s, 3, &c3, 200, hashes[:2]...) // on the same shard as 1
	if sc, ok := score(t, s, hashes, 1); !ok || sc.Blocks != 0 || sc.Predicted != 5 {
		t.Fatalf("worker 1 predicted only: %+v %v, want Predicted 5", sc, ok)
	}
	// Its engine stores the first three on device, and 14 on the host only.
	s.Queue(1) <- &Batch{Worker: 1, Ops: []Op{{Kind: OpStore, Hash: 11}, {Kind: OpStore, Hash: 12}, {Kind: OpStore, Hash: 13},
		{Kind: OpStore, Hash: 14, Tier: TierHost}}}
	if sc, _ := score(t, s, hashes, 1); sc.Blocks != 3 || sc.Predicted != 5 || c1.Confirmed.Load() != 3 || c1.Live.Load() != 2 {
		t.Fatalf("after the stores: %+v, counts %d confirmed %d live; want Blocks 3, Predicted 5, 3 confirmed, 2 live", sc,
			c1.Confirmed.Load(), c1.Live.Load())
	}
	if sc, _ := score(t, s, hashes, 3); sc.Predicted != 2 {
		t.Fatalf("worker 3: %+v, want Predicted 2 (another worker's stores confirm nothing of its)", sc)
	}
	s.Queue(1) <- &Batch{Worker: 1, Ops: []Op{{Kind: OpClearWorker}}}
	if sc, ok := score(t, s, hashes, 1); ok || c1.Ended.Load() != 2 || c1.Live.Load() != 0 {
		t.Fatalf("after a clear: %+v %v, %d ended; want no score, 2 ended", sc, ok, c1.Ended.Load())
	}
	if err := s.Sweep(context.Background(), time.Unix(0, 199)); err != nil {
		t.Fatal(err)
	}
	if _, ok := score(t, s, hashes, 3); !ok {
		t.Fatal("worker 3's prediction ended before its time")
	}
	s.Queue(3) <- &Batch{Worker: 3, Ops: []Op{{Kind: OpRemoveWorker}}}
	if _, ok := score(t, s, hashes, 3); ok || c3.Ended.Load() != 2 {
		t.Fatalf("worker 3 removed: still scored, or %d ended, want 2", c3.Ended.Load())
	}
	predictKeys(s, 3, &c3, 300, hashes...)
	if err := s.Sweep(context.Background(), time.Unix(0, 300)); err != nil {
		t.Fatal(err)
	}
	if _, ok := score(t, s, hashes, 3); ok || c3.Expired.Load() != 5 {
		t.Fatalf("swept at its until: still scored, or %d expired, want 5", c3.Expired.Load())
	}
	if l := s.shards[1].preds.list.Load(); l != nil {
		t.Fatalf("no prediction left, yet the readers' list holds %d workers", len(*l))
	}
}

// A read with predictions allocates nothing when dst has room, as one
// without does.
func TestFindMatchesWithPredictionsAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	s := NewShards(2, 8)
	defer s.Close()
	hashes := []uint64{21, 22, 23, 24}
	s.Queue(0) <- &Batch{Worker: 0, Ops: []Op{{Kind: OpStore, Hash: 21, Link: LinkRoot}, {Kind: OpStore, Hash: 22, Link: LinkChild, Parent: 21}}}
	dst := make([]Score, 0, 8)
	ctx := context.Background()
	for _, predicted := range []bool{false, true} {
		if predicted {
			var c predict.Counts
			predictKeys(s, 0, &c, 1<<62, hashes...)
			predictKeys(s, 2, &c, 1<<62, hashes[:3]...)
			predictKeys(s, 1, &c, 1<<62, 99)
		}
		if err := s.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		dst, _ = s.FindMatches(ctx, dst[:0], hashes)
		if want := map[bool]int{false: 1, true: 2}[predicted]; len(dst) != want {
			t.Fatalf("predictions %v: %d scores %+v, want %d", predicted, len(dst), dst, want)
		}
		if n := testing.AllocsPerRun(100, func() { dst, _ = s.FindMatches(ctx, dst[:0], hashes) }); n != 0 {
			t.Errorf("predictions %v: FindMatches allocates %.1f times", predicted, n)
		}
	}
}

// BenchmarkShardsFindMatchesPredicted: BenchmarkShardsFindMatches (2
// shards) with no predictions, and with every recent prompt predicted
// for one of 8 workers, as Routed would leave them.
func BenchmarkShardsFindMatchesPredicted(b *testing.B) {
	steps, prompts := trace(b)
	prompts = prompts[len(prompts)-recent:]
	for _, predicted := range []bool{false, true} {
		b.Run(map[bool]string{false: "none", true: "predicted"}[predicted], func(b *testing.B) {
			s := loadedShards(b, 2, steps)
			ctx := context.Background()
			var c predict.Counts
			if predicted {
				for i, p := range prompts {
					predictKeys(s, WorkerID(i%8), &c, 1<<62, p...)
				}
				if err := s.Sync(ctx); err != nil {
					b.Fatal(err)
				}
				if predictedBeyond(ctx, s, prompts) == 0 {
					b.Fatal("no block predicted beyond those held")
				}
			}
			timeLookups(b, ctx, s, prompts)
		})
	}
}

// predictedBeyond sums, over prompts, the blocks predicted beyond those held.
func predictedBeyond(ctx context.Context, s *Shards, prompts [][]uint64) int {
	n := 0
	for _, p := range prompts {
		dst, _ := s.FindMatches(ctx, nil, p)
		for _, sc := range dst {
			n += max(sc.Predicted-sc.Blocks, 0)
		}
	}
	return n
}
