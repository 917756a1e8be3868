package kvpipe

import (
	"context"
	"fmt"
	"time"

	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/predict"
)

const (
	// defaultPredictionTTL is Config.PredictionTTL's: the p99 of the event
	// lag (queued prefill, then the prefill) that the replay example models
	// on the Mooncake trace (3,000 requests on 4 engines prefilling 20,000
	// tokens/s: p50 1.8s, p90 5.9s, p99 10.2s). Events settle most
	// predictions first; the TTL ends those of a request that never ran.
	defaultPredictionTTL  = 10 * time.Second
	defaultApproximateTTL = 120 * time.Second // Config.ApproximateTTL's
	defaultMaxPredictions = 1 << 17           // Config.MaxWorkerPredictions'
	// maxSweepInterval bounds how often expired predictions are ended: a
	// tenth of the shorter TTL, at most this and at least a millisecond.
	// None outlives its TTL by more than that.
	maxSweepInterval = 100 * time.Millisecond
)

// PredictionStats are one worker's prediction counters (Pipeline.Routed).
type PredictionStats struct {
	Live      int64  // blocks predicted now
	Confirmed uint64 // ended by the engine's store of the block: held now
	Ended     uint64 // ended by a remove, a clear, a resync or the worker's removal
	Expired   uint64 // ended by their TTL
	Dropped   uint64 // evicted by the cap (the LRU of an approximate worker)
}

func (s *PredictionStats) add(o PredictionStats) {
	s.Live += o.Live
	s.Confirmed += o.Confirmed
	s.Ended += o.Ended
	s.Expired += o.Expired
	s.Dropped += o.Dropped
}

func predictionStats(c *predict.Counts) PredictionStats {
	return PredictionStats{Live: c.Live.Load(), Confirmed: c.Confirmed.Load(), Ended: c.Ended.Load(),
		Expired: c.Expired.Load(), Dropped: c.Dropped.Load()}
}

// Routed tells the pipeline that the router sent a request to worker:
// keys, the request's router keys (the ones the worker was matched with:
// Hasher.RequestKeys, or EagleKeys for a worker keyed over EAGLE windows),
// count as predicted there (Match.Predicted) until the engine's events
// confirm or end them, or for PredictionTTL (ApproximateTTL for an
// approximate worker). FindMatches sees them once it returns: a burst of
// requests with one new prefix, routed before any event of the first
// lands, finds the worker it went to. It waits for no shard, only for
// another writer of the worker's shard's predictions. Predictions are the router's own: not relayed, not in
// snapshots. It returns ErrNoWorker for an unknown worker and
// ErrNotRunning before Run; after Shutdown it does nothing.
func (p *Pipeline) Routed(worker string, keys []uint64) error {
	w := p.read.workers.named(worker) // a Source's too: its ops settle them as an engine's do
	if w == nil {
		return fmt.Errorf("%w: %q", ErrNoWorker, worker)
	}
	ttl, limit := p.cfg.PredictionTTL, w.cacheBlocks
	if w.approx {
		ttl = p.cfg.ApproximateTTL
	} else if w.fed != nil {
		limit = p.cfg.MaxWorkerPredictions // no WorkerConfig
	}
	shards := p.read.shards.Load()
	switch {
	case shards == nil:
		return ErrNotRunning
	case ttl < 0 || len(keys) == 0:
		return nil
	}
	shards.Predict(w.id, &predict.Batch{Keys: keys, Until: p.now().Add(ttl).UnixNano(), Max: limit, Counts: &w.preds})
	return nil
}

// sweepInterval is how often cfg's expired predictions are ended.
func sweepInterval(cfg *Config) time.Duration {
	ttl := cfg.ApproximateTTL
	if cfg.PredictionTTL > 0 {
		ttl = min(ttl, cfg.PredictionTTL)
	}
	return min(max(ttl/10, time.Millisecond), maxSweepInterval)
}

// sweep ends expired predictions every interval, as of now(), until ctx
// ends.
func sweep(ctx context.Context, shards *index.Shards, interval time.Duration, now func() time.Time) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if err := shards.Sweep(ctx, now()); err != nil && ctx.Err() == nil {
				return err
			}
		}
	}
}
