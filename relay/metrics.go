package relay

import (
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/prometheus/client_golang/prometheus"
)

// NewFollowerCollector returns a collector of f's counters, read at every
// scrape; the caller registers it.
func NewFollowerCollector(f *Follower) prometheus.Collector {
	return newFollowerCollector(f.Stats)
}

func newFollowerCollector(stats func() FollowerStats) prometheus.Collector {
	counter, gauge := opstream.Counter[FollowerStats], opstream.Gauge[FollowerStats]
	return &opstream.Collector[FollowerStats]{Stats: stats, Metrics: []opstream.Metric[FollowerStats]{
		counter("follower_applied_total", "Messages applied.", func(s *FollowerStats) uint64 { return s.Applied }),
		counter("follower_skipped_total", "Messages the snapshot already held.", func(s *FollowerStats) uint64 { return s.Skipped }),
		counter("follower_duplicates_total", "Messages at or before the last one handled: dropped.", func(s *FollowerStats) uint64 { return s.Duplicates }),
		counter("follower_bad_messages_total", "Messages that could not be decoded.", func(s *FollowerStats) uint64 { return s.BadMessages }),
		counter("follower_gaps_total", "Runs ended because the stream no longer held the next message.", func(s *FollowerStats) uint64 { return s.Gaps }),
		counter("follower_holes_total", "Gaps the stream lacks for good, gone past with every worker cleared.", func(s *FollowerStats) uint64 { return s.Holes }),
		counter("follower_streams_remade_total", "Runs ended because the stream was deleted and made again under them.", func(s *FollowerStats) uint64 { return s.StreamsRemade }),
		counter("follower_snapshots_loaded_total", "Snapshots a run started from.", func(s *FollowerStats) uint64 { return s.SnapshotsLoaded }),
		counter("follower_snapshots_refused_total", "Snapshots refused.", func(s *FollowerStats) uint64 { return s.SnapshotsRefused }),
		counter("follower_runs_total", "Times the follower started reading the stream.", func(s *FollowerStats) uint64 { return s.Runs }),
		gauge("follower_last_applied", "Stream sequence of the last message handled.", func(s *FollowerStats) float64 { return float64(s.LastApplied) }),
		gauge("follower_lag", "Messages in the stream after the last one handled.", func(s *FollowerStats) float64 { return float64(s.Lag) }),
	}}
}
