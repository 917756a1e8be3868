package relaypub

import (
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The relay's and the lease's collectors (the follower's is package
// relay's) read the counters at each scrape, under names that pass
// the Prometheus lint.
func TestCollectors(t *testing.T) {
	var st Stats
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		&opstream.Collector[Stats]{Stats: func() Stats { return st }, Metrics: relayMetrics()},
		newLeaseCollector(func() LeaseStats { return LeaseStats{Acquired: 2, Holding: true} }),
	)
	st.Published, st.Resets = 7, 1 // after registering: read at the scrape
	want := `
# HELP kvpipe_relay_published_total Messages the stream acknowledged, duplicates included.
# TYPE kvpipe_relay_published_total counter
kvpipe_relay_published_total 7
# HELP kvpipe_relay_resets_total Workers reset in the stream because their ops parted from it.
# TYPE kvpipe_relay_resets_total counter
kvpipe_relay_resets_total 1
# HELP kvpipe_relay_lease_holding 1 while this relay holds the lease.
# TYPE kvpipe_relay_lease_holding gauge
kvpipe_relay_lease_holding 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvpipe_relay_published_total", "kvpipe_relay_resets_total",
		"kvpipe_relay_lease_holding"); err != nil {
		t.Error(err)
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) != 0 {
		t.Errorf("lint: %v %v", err, problems)
	}
	if n := testutil.CollectAndCount(reg); n != 17+5 {
		t.Errorf("%d metrics, want 22", n)
	}
}
