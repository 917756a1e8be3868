package metrics

import (
	"github.com/kvpipe/kvpipe"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/internal/zmtp"
	"github.com/kvpipe/kvpipe/wire"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestCollectorReadsTheCountersAtScrape(t *testing.T) {
	snap := kvpipe.Stats{Workers: []kvpipe.WorkerStats{{Name: "w0", Restarts: 2}}, Shards: []kvpipe.ShardStats{{QueueDepth: 3, Nodes: 40, UnknownRemoves: 5}}}
	c := NewCollector(func() kvpipe.Stats { return snap })
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)

	// Set after registering: the collector reads the snapshot at scrape time.
	ws, as := &snap.Workers[0].Wire, &snap.Workers[0].Actor
	ws.Gaps = 4
	ws.Lost = 1
	ws.Connected = true
	as.Filtered[actor.PartialBlock] = 7
	as.IndexedBlocks = 12
	ws.ProtocolErrors[slices.Index(wire.ProtocolErrorKinds[:], zmtp.KindOversize)] = 3
	ws.ReplayUnreachable = 5
	as.Partial = true
	snap.Workers[0].Predictions = kvpipe.PredictionStats{Live: 6, Dropped: 2}
	want := `
# HELP kvpipe_seq_gaps_total Jumps in seq: batches lost on the way.
# TYPE kvpipe_seq_gaps_total counter
kvpipe_seq_gaps_total{worker="w0"} 4
# HELP kvpipe_batches_lost_total Batches the engine sent that were never delivered (no replay, past its buffer, or its replay endpoint unreachable past the patience).
# TYPE kvpipe_batches_lost_total counter
kvpipe_batches_lost_total{worker="w0"} 1
# HELP kvpipe_worker_restarts_total Worker goroutines restarted after a panic.
# TYPE kvpipe_worker_restarts_total counter
kvpipe_worker_restarts_total{worker="w0"} 2
# HELP kvpipe_indexed_blocks Blocks the worker holds on device in the index.
# TYPE kvpipe_indexed_blocks gauge
kvpipe_indexed_blocks{worker="w0"} 12
# HELP kvpipe_connected 1 while the worker's SUB socket is connected.
# TYPE kvpipe_connected gauge
kvpipe_connected{worker="w0"} 1
# HELP kvpipe_index_nodes Blocks some worker of the shard holds (entries of its table).
# TYPE kvpipe_index_nodes gauge
kvpipe_index_nodes{shard="0"} 40
# HELP kvpipe_index_unknown_removes_total Removes a shard got for blocks their worker did not hold there.
# TYPE kvpipe_index_unknown_removes_total counter
kvpipe_index_unknown_removes_total{shard="0"} 5
# HELP kvpipe_shard_queue_depth Batches waiting at a shard.
# TYPE kvpipe_shard_queue_depth gauge
kvpipe_shard_queue_depth{shard="0"} 3
`
	names := []string{"kvpipe_seq_gaps_total", "kvpipe_batches_lost_total", "kvpipe_worker_restarts_total",
		"kvpipe_indexed_blocks", "kvpipe_connected", "kvpipe_index_nodes", "kvpipe_index_unknown_removes_total", "kvpipe_shard_queue_depth"}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), names...); err != nil {
		t.Error(err)
	}
	if got := labelled(t, reg, "kvpipe_filtered_events_total", "reason", "partial_block"); got != 7 {
		t.Errorf("filtered partial_block = %v, want 7", got)
	}
	if got := labelled(t, reg, "kvpipe_protocol_errors_total", "kind", "oversize"); got != 3 {
		t.Errorf("protocol_errors oversize = %v, want 3", got)
	}
	if got := labelled(t, reg, "kvpipe_protocol_errors_total", "kind", "handshake_timeout"); got != 0 {
		t.Errorf("protocol_errors handshake_timeout = %v, want 0", got)
	}
	if got := labelled(t, reg, "kvpipe_predicted_blocks", "worker", "w0"); got != 6 {
		t.Errorf("predicted_blocks = %v, want 6", got)
	}
	if got := labelled(t, reg, "kvpipe_predictions_dropped_total", "worker", "w0"); got != 2 {
		t.Errorf("predictions_dropped = %v, want 2", got)
	}
	if got := labelled(t, reg, "kvpipe_partial", "worker", "w0"); got != 1 {
		t.Errorf("partial = %v, want 1", got)
	}
	if got := labelled(t, reg, "kvpipe_replay_unreachable_total", "worker", "w0"); got != 5 {
		t.Errorf("replay_unreachable = %v, want 5", got)
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) != 0 {
		t.Errorf("lint: %v %v", err, problems)
	}
}

// labelled returns the value of the counter or gauge name whose label has value.
func labelled(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue() + m.GetGauge().GetValue() // whichever it is
				}
			}
		}
	}
	t.Fatalf("no %s{%s=%q}", name, label, value)
	return 0
}

// Every metric the collector describes has its row in the README's metrics
// table, so the table cannot drift from the code.
func TestREADMEListsEveryMetric(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var table strings.Builder
	for _, line := range strings.Split(string(readme), "\n") {
		if strings.HasPrefix(line, "| `") {
			table.WriteString(line)
		}
	}
	descs := make(chan *prometheus.Desc, 256)
	NewCollector(func() kvpipe.Stats { return kvpipe.Stats{} }).Describe(descs)
	close(descs)
	n := 0
	for d := range descs {
		// Desc has no name accessor; its String form quotes fqName.
		s := d.String()
		i := strings.Index(s, `fqName: "`)
		if i < 0 {
			t.Fatalf("cannot read the name of %s", s)
		}
		name := s[i+len(`fqName: "`):]
		name = strings.TrimPrefix(name[:strings.IndexByte(name, '"')], "kvpipe_")
		n++
		if !strings.Contains(table.String(), "`"+name+"`") && !strings.Contains(table.String(), "`"+name+"{") {
			t.Errorf("metric %s has no row in the README's metrics table", name)
		}
	}
	if n < 30 {
		t.Errorf("only %d metrics described: the name parsing is broken", n)
	}
}

func TestTotalSumsEveryWorker(t *testing.T) {
	var snap kvpipe.Stats
	snap.Workers = make([]kvpipe.WorkerStats, 3)
	for i := range snap.Workers {
		w := &snap.Workers[i]
		w.Wire.Lost, w.Actor.BlocksStored, w.Restarts = uint64(i+1), uint64(10*(i+1)), 1
		w.Actor.IndexedBlocks = int64(100 * (i + 1))
	}
	snap.Workers[1].Actor.Partial = true
	tot := snap.Total()
	if tot.Wire.Lost != 6 || tot.Actor.BlocksStored != 60 || tot.Actor.IndexedBlocks != 600 || tot.Restarts != 3 || !tot.Actor.Partial {
		t.Errorf("Total = lost %d, stored %d, indexed %d, restarts %d, partial %v; want 6, 60, 600, 3, true",
			tot.Wire.Lost, tot.Actor.BlocksStored, tot.Actor.IndexedBlocks, tot.Restarts, tot.Actor.Partial)
	}
}
