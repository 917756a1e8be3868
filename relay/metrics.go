package relay

import "github.com/prometheus/client_golang/prometheus"

// metric is one value of a relay's, a follower's or a lease's Stats.
type metric[S any] struct {
	desc  *prometheus.Desc
	typ   prometheus.ValueType
	value func(*S) float64
}

func counter[S any](name, help string, value func(*S) uint64) metric[S] {
	return metric[S]{prometheus.NewDesc("kvpipe_relay_"+name, help, nil, nil), prometheus.CounterValue,
		func(s *S) float64 { return float64(value(s)) }}
}

func gauge[S any](name, help string, value func(*S) float64) metric[S] {
	return metric[S]{prometheus.NewDesc("kvpipe_relay_"+name, help, nil, nil), prometheus.GaugeValue, value}
}

// collector reads stats at every scrape and emits metrics.
type collector[S any] struct {
	stats   func() S
	metrics []metric[S]
}

func (c *collector[S]) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range c.metrics {
		ch <- m.desc
	}
}

func (c *collector[S]) Collect(ch chan<- prometheus.Metric) {
	s := c.stats()
	for _, m := range c.metrics {
		ch <- prometheus.MustNewConstMetric(m.desc, m.typ, m.value(&s))
	}
}

// NewCollector returns a collector of r's counters, and of its Lease's
// when it has one, read at every scrape; the caller registers it. The
// pipeline the relay runs now has its own (metrics.NewCollector over
// r.Pipeline's Stats).
func NewCollector(r *Relay) prometheus.Collector {
	relay := &collector[Stats]{stats: r.Stats, metrics: relayMetrics()}
	if r.cfg.Lease == nil {
		return relay
	}
	return collectors{relay, newLeaseCollector(r.cfg.Lease.Stats)}
}

func relayMetrics() []metric[Stats] {
	return []metric[Stats]{
		counter("published_total", "Messages the stream acknowledged, duplicates included.", func(s *Stats) uint64 { return s.Published }),
		counter("duplicates_total", "Acknowledged messages the stream held already.", func(s *Stats) uint64 { return s.Duplicates }),
		counter("retries_total", "Publish attempts that failed and were tried again.", func(s *Stats) uint64 { return s.Retries }),
		counter("abandoned_total", "Publishes given up because their worker stopped.", func(s *Stats) uint64 { return s.Abandoned }),
		counter("encode_errors_total", "Batches no message can carry: not published.", func(s *Stats) uint64 { return s.EncodeErrors }),
		counter("snapshots_total", "Snapshots written.", func(s *Stats) uint64 { return s.Snapshots }),
		counter("snapshot_errors_total", "Snapshots that could not be taken or written.", func(s *Stats) uint64 { return s.SnapshotErrors }),
		gauge("snapshot_bytes", "Size of the last snapshot written.", func(s *Stats) float64 { return float64(s.SnapshotBytes) }),
		gauge("restored_workers", "Workers started from the snapshot loaded at the last start.", func(s *Stats) float64 { return float64(s.Restored) }),
		counter("snapshots_ignored_total", "Snapshots loaded but not used.", func(s *Stats) uint64 { return s.SnapshotIgnored }),
		counter("stream_changes_total", "Times the stream was found deleted or made again.", func(s *Stats) uint64 { return s.StreamChanges }),
		counter("replayed_total", "A restored worker's messages the stream already held: not sent.", func(s *Stats) uint64 { return s.Replayed }),
		counter("resets_total", "Workers reset in the stream because their ops parted from it.", func(s *Stats) uint64 { return s.Resets }),
		counter("republished_total", "Resets made by publishing the worker's whole state.", func(s *Stats) uint64 { return s.Republished }),
		counter("terms_total", "Times the relay started writing.", func(s *Stats) uint64 { return s.Terms }),
		counter("lease_lost_total", "Terms that ended with the lease lost.", func(s *Stats) uint64 { return s.LeaseLost }),
	}
}

func newLeaseCollector(stats func() LeaseStats) prometheus.Collector {
	return &collector[LeaseStats]{stats: stats, metrics: []metric[LeaseStats]{
		counter("lease_acquired_total", "Times the lease was taken.", func(s *LeaseStats) uint64 { return s.Acquired }),
		counter("lease_losses_total", "Holdings ended by the key taken or removed, or no renewal for TTL/2.", func(s *LeaseStats) uint64 { return s.Lost }),
		counter("lease_released_total", "Holdings given back for a standby to take at once.", func(s *LeaseStats) uint64 { return s.Released }),
		counter("lease_renew_errors_total", "Renewals that failed and were tried again.", func(s *LeaseStats) uint64 { return s.RenewErrors }),
		gauge("lease_holding", "1 while this relay holds the lease.", func(s *LeaseStats) float64 { return b2f(s.Holding) }),
	}}
}

// NewFollowerCollector returns a collector of f's counters, read at every
// scrape; the caller registers it.
func NewFollowerCollector(f *Follower) prometheus.Collector {
	return newFollowerCollector(f.Stats)
}

func newFollowerCollector(stats func() FollowerStats) prometheus.Collector {
	return &collector[FollowerStats]{stats: stats, metrics: []metric[FollowerStats]{
		counter("follower_applied_total", "Messages applied.", func(s *FollowerStats) uint64 { return s.Applied }),
		counter("follower_skipped_total", "Messages the snapshot already held.", func(s *FollowerStats) uint64 { return s.Skipped }),
		counter("follower_duplicates_total", "Messages at or before the last one handled: dropped.", func(s *FollowerStats) uint64 { return s.Duplicates }),
		counter("follower_bad_messages_total", "Messages that could not be decoded.", func(s *FollowerStats) uint64 { return s.BadMessages }),
		counter("follower_gaps_total", "Runs ended because the stream no longer held the next message.", func(s *FollowerStats) uint64 { return s.Gaps }),
		counter("follower_snapshots_loaded_total", "Snapshots a run started from.", func(s *FollowerStats) uint64 { return s.SnapshotsLoaded }),
		counter("follower_snapshots_refused_total", "Snapshots refused.", func(s *FollowerStats) uint64 { return s.SnapshotsRefused }),
		counter("follower_runs_total", "Times the follower started reading the stream.", func(s *FollowerStats) uint64 { return s.Runs }),
		gauge("follower_last_applied", "Stream sequence of the last message handled.", func(s *FollowerStats) float64 { return float64(s.LastApplied) }),
		gauge("follower_lag", "Messages in the stream after the last one handled.", func(s *FollowerStats) float64 { return float64(s.Lag) }),
	}}
}

// collectors is several collectors as one.
type collectors []prometheus.Collector

func (cs collectors) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range cs {
		c.Describe(ch)
	}
}

func (cs collectors) Collect(ch chan<- prometheus.Metric) {
	for _, c := range cs {
		c.Collect(ch)
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
