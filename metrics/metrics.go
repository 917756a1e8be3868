package metrics

import (
	"strconv"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/wire"
	"github.com/prometheus/client_golang/prometheus"
)

type desc struct {
	d   *prometheus.Desc
	typ prometheus.ValueType
}

func newDesc(name, help string, typ prometheus.ValueType, labels ...string) desc {
	return desc{prometheus.NewDesc("kvpipe_"+name, help, labels, nil), typ}
}

// collector turns a pipeline's Stats into metrics at every scrape.
type collector struct {
	stats                                                                                                        func() kvpipe.Stats
	latency                                                                                                      *prometheus.Desc
	counters                                                                                                     []workerMetric
	events, filtered, protocol, indexed, tiers, partial, eagle, predicted, connected, queue, nodes, shardUnknown desc
}

type workerMetric struct {
	desc
	value func(w *kvpipe.WorkerStats) uint64
}

// NewCollector returns a collector calling stats at every scrape: for a
// pipeline, NewCollector(p.Stats). The caller registers it (and may
// unregister it once the pipeline has stopped).
func NewCollector(stats func() kvpipe.Stats) prometheus.Collector {
	c := &collector{stats: stats}
	c.latency = prometheus.NewDesc("kvpipe_find_matches_duration_seconds", "Time to answer FindMatches across every shard.", nil, nil)
	counter := func(name, help string, value func(w *kvpipe.WorkerStats) uint64) {
		c.counters = append(c.counters, workerMetric{newDesc(name, help, prometheus.CounterValue, "worker"), value})
	}
	counter("batches_received_total", "Batches delivered in seq order to the worker's actor, live or replayed.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Batches })
	counter("malformed_messages_total", "Messages that were not [topic, 8-byte seq, payload]; skipped.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Malformed })
	counter("duplicate_batches_total", "Batches with a seq already applied; dropped.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Duplicates })
	counter("seq_gaps_total", "Jumps in seq: batches lost on the way.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Gaps })
	counter("replays_total", "Replay requests sent to the engine's ROUTER.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Replays })
	counter("replayed_batches_total", "Batches recovered through replay.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Replayed })
	counter("tail_checks_total", "Replays asked after a quiet spell, to find batches dropped at the end of a burst.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.TailChecks })
	counter("replay_failures_total", "Replay requests that timed out or broke after connecting; retried with backoff.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.ReplayFailures })
	counter("replay_unreachable_total", "Replay dials that failed (endpoint down or not speaking ZMTP); backed off, not a loss.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.ReplayUnreachable })
	counter("replay_abandoned_total", "Replays given up at once rather than retried: the endpoint answered garbage, or did not complete its handshake after a gap; the worker went on unproven.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.ReplayAbandoned })
	counter("history_missing_total", "Replays that found the engine no longer held a gap.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.HistoryMissing })
	counter("batches_lost_total", "Batches the engine sent that were never delivered (no replay, past its buffer, or its replay endpoint unreachable past the patience).", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Lost })
	counter("snapshots_total", "Engine snapshots (SGLang snapshot-v1) applied after a reset.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Snapshots })
	counter("snapshot_failures_total", "Engine snapshots refused, broken off or unreachable.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.SnapshotFailures })
	counter("snapshot_blocks_total", "Blocks engine snapshots put back into the index.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.SnapshotBlocks })
	counter("snapshot_unmapped_total", "Blocks engine snapshots named that the worker never told of; left out.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.SnapshotUnmapped })
	counter("live_overflow_total", "Live batches dropped past MaxReplayBuffer while a replay held them back; replayed later.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.LiveOverflow })
	counter("publisher_restarts_total", "Other publisher incarnations detected (seq back, or a replay that does not hold the last batch as applied).", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Restarts })
	counter("reconnects_total", "SUB sockets rebuilt after a failure or an idle spell.", func(w *kvpipe.WorkerStats) uint64 { return w.Wire.Reconnects })
	counter("decode_errors_total", "Payloads that did not decode; the batch is dropped.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.DecodeErrors })
	counter("resyncs_total", "Times the worker's index entries were cleared because history was unknown.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.Resyncs })
	counter("blocks_stored_total", "Router blocks sent to the index as stored.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.BlocksStored })
	counter("blocks_removed_total", "Router blocks sent to the index as removed.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.BlocksRemoved })
	counter("token_mismatch_total", "BlockStored events whose tokens did not cover their blocks.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.TokenMismatch })
	counter("unknown_parent_total", "BlockStored events whose parent the worker never told of; left out of the index.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.UnknownParent })
	counter("unknown_removes_total", "Removed blocks the worker was not known to hold.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.UnknownRemove })
	counter("block_size_warnings_total", "Blocks smaller than the router's before any full block; indexed at their own size.", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.SizeWarnings })
	counter("dropped_batches_total", "Batches dropped because the shard was behind (Drop backpressure).", func(w *kvpipe.WorkerStats) uint64 { return w.Actor.DroppedBatches })
	counter("worker_restarts_total", "Worker goroutines restarted after a panic.", func(w *kvpipe.WorkerStats) uint64 { return w.Restarts })
	counter("predictions_confirmed_total", "Predicted blocks (Pipeline.Routed) the engine's store confirmed.", func(w *kvpipe.WorkerStats) uint64 { return w.Predictions.Confirmed })
	counter("predictions_ended_total", "Predicted blocks ended by a remove, a clear, a resync or the worker's removal.", func(w *kvpipe.WorkerStats) uint64 { return w.Predictions.Ended })
	counter("predictions_expired_total", "Predicted blocks ended by their TTL.", func(w *kvpipe.WorkerStats) uint64 { return w.Predictions.Expired })
	counter("predictions_dropped_total", "Predicted blocks evicted by the worker's cap (an approximate worker's LRU).", func(w *kvpipe.WorkerStats) uint64 { return w.Predictions.Dropped })
	c.events = newDesc("events_received_total", "Events received, by type.", prometheus.CounterValue, "worker", "type")
	c.filtered = newDesc("filtered_events_total", "Events not indexed, by reason.", prometheus.CounterValue, "worker", "reason")
	c.protocol = newDesc("protocol_errors_total", "Connections closed because the peer broke ZMTP or the message size limit, by kind.", prometheus.CounterValue, "worker", "kind")
	c.indexed = newDesc("indexed_blocks", "Blocks the worker holds on device in the index.", prometheus.GaugeValue, "worker")
	c.tiers = newDesc("tier_blocks", "Blocks the worker holds in the index, by tier (device, host, disk, remote).", prometheus.GaugeValue, "worker", "tier")
	c.partial = newDesc("partial", "1 while the worker's entries may lack blocks its engine holds (after a resync, or a late start).", prometheus.GaugeValue, "worker")
	c.eagle = newDesc("eagle", "1 while the worker's blocks are keyed over EAGLE windows (SGLang bigram events, speculative decoding).", prometheus.GaugeValue, "worker")
	c.predicted = newDesc("predicted_blocks", "Blocks predicted for the worker now (Pipeline.Routed), not yet confirmed or ended.", prometheus.GaugeValue, "worker")
	c.connected = newDesc("connected", "1 while the worker's SUB socket is connected.", prometheus.GaugeValue, "worker")
	c.queue = newDesc("shard_queue_depth", "Batches waiting at a shard.", prometheus.GaugeValue, "shard")
	c.nodes = newDesc("index_nodes", "Blocks some worker of the shard holds (entries of its table).", prometheus.GaugeValue, "shard")
	c.shardUnknown = newDesc("index_unknown_removes_total", "Removes a shard got for blocks their worker did not hold there.", prometheus.CounterValue, "shard")
	return c
}

func (c *collector) all() []desc {
	out := []desc{c.events, c.filtered, c.protocol, c.indexed, c.tiers, c.partial, c.eagle, c.predicted, c.connected, c.queue, c.nodes, c.shardUnknown}
	for _, m := range c.counters {
		out = append(out, m.desc)
	}
	return out
}

// Describe implements prometheus.Collector.
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.all() {
		ch <- d.d
	}
	ch <- c.latency
}

// Collect implements prometheus.Collector.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	snap := c.stats()
	emit := func(d desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d.d, d.typ, v, labels...)
	}
	for i := range snap.Workers {
		w := &snap.Workers[i]
		for _, m := range c.counters {
			emit(m.desc, float64(m.value(w)), w.Name)
		}
		emit(c.events, float64(w.Actor.Stored), w.Name, "BlockStored")
		emit(c.events, float64(w.Actor.Removed), w.Name, "BlockRemoved")
		emit(c.events, float64(w.Actor.Cleared), w.Name, "AllBlocksCleared")
		for r := range actor.NumReasons {
			emit(c.filtered, float64(w.Actor.Filtered[r]), w.Name, r.String())
		}
		for k, name := range wire.ProtocolErrorKinds {
			emit(c.protocol, float64(w.Wire.ProtocolErrors[k]), w.Name, name)
		}
		emit(c.indexed, float64(w.Actor.IndexedBlocks), w.Name)
		for t, n := range w.Actor.TierBlocks {
			emit(c.tiers, float64(n), w.Name, index.Tier(t).String())
		}
		emit(c.partial, gauge(w.Actor.Partial), w.Name)
		emit(c.eagle, gauge(w.Actor.Eagle), w.Name)
		emit(c.predicted, float64(w.Predictions.Live), w.Name)
		emit(c.connected, gauge(w.Wire.Connected), w.Name)
	}
	for i, s := range snap.Shards {
		id := strconv.Itoa(i)
		emit(c.queue, float64(s.QueueDepth), id)
		emit(c.nodes, float64(s.Nodes), id)
		emit(c.shardUnknown, float64(s.UnknownRemoves), id)
	}
	c.collectLatency(ch, snap.FindMatches)
}

func gauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// collectLatency emits FindMatches' durations as a histogram.
func (c *collector) collectLatency(ch chan<- prometheus.Metric, l kvpipe.Latency) {
	buckets := make(map[float64]uint64, len(kvpipe.LatencyBounds))
	var n uint64
	for i, b := range kvpipe.LatencyBounds {
		n += l.Buckets[i]
		buckets[b.Seconds()] = n
	}
	n += l.Buckets[len(kvpipe.LatencyBounds)]
	ch <- prometheus.MustNewConstHistogram(c.latency, n, l.Sum.Seconds(), buckets)
}
