package index

import (
	"context"
	"slices"
	"testing"
	"time"
)

// BenchmarkShardsFindMatchesTail: the latency distribution of the recent
// prompts against 2 shards the trace left behind, nothing else running: the
// tail is the longest matches' own work (p99-match keys), not scheduling.
func BenchmarkShardsFindMatchesTail(b *testing.B) {
	steps, prompts := trace(b)
	prompts = prompts[len(prompts)-recent:]
	s := NewShards(2, 256)
	defer s.Close()
	for i := range steps {
		st := steps[i]
		s.Queue(st.Worker) <- &st
	}
	s.Sync(context.Background())
	var dst []Score
	var lat []time.Duration
	var lens []int
	for b.Loop() {
		for _, p := range prompts {
			t := time.Now()
			dst, _ = s.FindMatches(context.Background(), dst[:0], p)
			lat = append(lat, time.Since(t))
			best := 0
			for _, sc := range dst {
				best = max(best, sc.Blocks)
			}
			lens = append(lens, best)
		}
	}
	slices.Sort(lat)
	slices.Sort(lens)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
	b.ReportMetric(float64(lens[len(lens)*99/100]), "p99-match")
	b.ReportMetric(float64(lens[len(lens)-1]), "max-match")
}
