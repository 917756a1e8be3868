package kvpipe

import (
	"slices"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/wire"
)

// Stats are the pipeline's counters as of one call of Pipeline.Stats:
// every worker's, by name, every shard's, and the read path's latency.
type Stats struct {
	Workers     []WorkerStats
	Shards      []ShardStats
	FindMatches Latency
}

// WorkerStats are one worker's counters.
type WorkerStats struct {
	Name     string
	Wire     wire.Stats
	Actor    actor.Stats
	Restarts uint64 // goroutine restarts after a panic
	// Approximate: the worker has no Endpoint; only predictions.
	Approximate bool
	Predictions PredictionStats // of its blocks predicted (Pipeline.Routed)
}

// ShardStats are one shard's state.
type ShardStats struct {
	QueueDepth     int
	Nodes          int64
	UnknownRemoves int64
}

// Total sums the workers' counters (Partial when any worker is).
func (s Stats) Total() WorkerStats {
	var t WorkerStats
	for i := range s.Workers {
		w := &s.Workers[i]
		t.Wire.Add(w.Wire)
		t.Actor.Add(w.Actor)
		t.Restarts += w.Restarts
		t.Predictions.add(w.Predictions)
	}
	return t
}

// Worker returns the named worker's counters.
func (s Stats) Worker(name string) (WorkerStats, bool) {
	for _, w := range s.Workers {
		if w.Name == name {
			return w, true
		}
	}
	return WorkerStats{}, false
}

// Stats returns the pipeline's counters, workers by name; its Total method
// sums them. It reads the published worker list, so it never waits for a
// worker or the lifecycle.
func (p *Pipeline) Stats() Stats {
	var st Stats
	ws := slices.SortedFunc(slices.Values(p.read.workers.all()), byWorkerName)
	for _, w := range ws {
		switch {
		case w.fed != nil:
			st.Workers = append(st.Workers, WorkerStats{Name: w.name, Actor: w.fed.stats(), Predictions: predictionStats(&w.preds)})
			continue
		case w.approx:
			st.Workers = append(st.Workers, WorkerStats{Name: w.name, Approximate: true, Predictions: predictionStats(&w.preds),
				Actor: actor.Stats{Eagle: w.eagleCfg}})
			continue
		}
		ws := WorkerStats{Name: w.name, Wire: w.sub.Stats(), Restarts: w.restarts.Load(), Predictions: predictionStats(&w.preds)}
		if a := w.actor.Load(); a != nil {
			ws.Actor = a.Stats()
		} else {
			ws.Actor.Partial = true // not started: nothing of it is known
			ws.Actor.Eagle = w.eagleCfg
		}
		st.Workers = append(st.Workers, ws)
	}
	if shards := p.read.shards.Load(); shards != nil {
		for i := range shards.Len() {
			st.Shards = append(st.Shards, ShardStats{QueueDepth: shards.QueueDepth(i), Nodes: shards.Nodes(i),
				UnknownRemoves: shards.UnknownRemoves(i)})
		}
	}
	st.FindMatches = p.read.latency.load()
	return st
}
