package relaypub

import (
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/prometheus/client_golang/prometheus"
)

// NewCollector returns a collector of r's counters, and of its Lease's
// when it has one, read at every scrape; the caller registers it. The
// pipeline the relay runs now has its own (metrics.NewCollector over
// r.Pipeline's Stats).
func NewCollector(r *Relay) prometheus.Collector {
	relay := &opstream.Collector[Stats]{Stats: r.Stats, Metrics: relayMetrics()}
	if r.cfg.Lease == nil {
		return relay
	}
	return collectors{relay, newLeaseCollector(r.cfg.Lease.Stats)}
}

func relayMetrics() []opstream.Metric[Stats] {
	counter, gauge := opstream.Counter[Stats], opstream.Gauge[Stats]
	return []opstream.Metric[Stats]{
		counter("published_total", "Messages the stream acknowledged, duplicates included.", func(s *Stats) uint64 { return s.Published }),
		counter("duplicates_total", "Acknowledged messages the stream held already.", func(s *Stats) uint64 { return s.Duplicates }),
		counter("retries_total", "Publish attempts that failed and were tried again.", func(s *Stats) uint64 { return s.Retries }),
		counter("abandoned_total", "Publishes given up because their worker stopped.", func(s *Stats) uint64 { return s.Abandoned }),
		counter("encode_errors_total", "Batches no message can carry: not published.", func(s *Stats) uint64 { return s.EncodeErrors }),
		counter("snapshots_total", "Snapshots written.", func(s *Stats) uint64 { return s.Snapshots }),
		counter("snapshot_errors_total", "Snapshots that could not be taken or written.", func(s *Stats) uint64 { return s.SnapshotErrors }),
		counter("snapshot_absent_workers_total", "Workers snapshots were written without: not answered in time.", func(s *Stats) uint64 { return s.SnapshotAbsent }),
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
	counter, gauge := opstream.Counter[LeaseStats], opstream.Gauge[LeaseStats]
	return &opstream.Collector[LeaseStats]{Stats: stats, Metrics: []opstream.Metric[LeaseStats]{
		counter("lease_acquired_total", "Times the lease was taken.", func(s *LeaseStats) uint64 { return s.Acquired }),
		counter("lease_losses_total", "Holdings ended by the key taken or removed, or no renewal for TTL/2.", func(s *LeaseStats) uint64 { return s.Lost }),
		counter("lease_released_total", "Holdings given back for a standby to take at once.", func(s *LeaseStats) uint64 { return s.Released }),
		counter("lease_renew_errors_total", "Renewals that failed and were tried again.", func(s *LeaseStats) uint64 { return s.RenewErrors }),
		gauge("lease_holding", "1 while this relay holds the lease.", func(s *LeaseStats) float64 { return b2f(s.Holding) }),
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
