package relay

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The follower's collector reads its counters at each scrape, under names
// that pass the Prometheus lint.
func TestFollowerCollector(t *testing.T) {
	var st FollowerStats
	reg := prometheus.NewRegistry()
	reg.MustRegister(newFollowerCollector(func() FollowerStats { return st }))
	st.Applied, st.Lag = 9, 4 // after registering: read at the scrape
	want := `
# HELP kvpipe_relay_follower_applied_total Messages applied.
# TYPE kvpipe_relay_follower_applied_total counter
kvpipe_relay_follower_applied_total 9
# HELP kvpipe_relay_follower_lag Messages in the stream after the last one handled.
# TYPE kvpipe_relay_follower_lag gauge
kvpipe_relay_follower_lag 4
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvpipe_relay_follower_applied_total", "kvpipe_relay_follower_lag"); err != nil {
		t.Error(err)
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) != 0 {
		t.Errorf("lint: %v %v", err, problems)
	}
	if n := testutil.CollectAndCount(reg); n != 12 {
		t.Errorf("%d metrics, want 12", n)
	}
}
