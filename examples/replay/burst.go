package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/internal/wiretest"
)

// The predictions' TTLs in trace time: kvpipe's defaults (10s and 120s), unless
// --prediction-ttl says otherwise.
const (
	defaultPredictionTTL = 10 * time.Second
	approximateTTL       = 120 * time.Second
)

func (o options) predictionTTL() time.Duration {
	if o.ttl > 0 {
		return o.ttl
	}
	return defaultPredictionTTL
}

// lagModel delays an engine's events by its prefill: each batch is
// published once the prefills queued before it and its own are done, at
// prefillRate tokens per second of trace time (so speedup times faster
// in wall time). Its goroutine publishes; stop waits for it.
type lagModel struct {
	tokensPerSecond float64 // of wall time
	blockSize       int
	speedup         float64
	pub             *wiretest.Publisher
	pending         chan delayed
	done            chan struct{}
	free            time.Time       // when the prefills queued so far are done
	lags            []time.Duration // per batch, trace time from routing to publication
}

type delayed struct {
	payload []byte
	due     time.Time
}

func newLagModel(o options, pub *wiretest.Publisher) *lagModel {
	l := &lagModel{tokensPerSecond: o.prefillRate * o.speedup, blockSize: o.blockSize, speedup: o.speedup, pub: pub,
		pending: make(chan delayed, 1<<14), done: make(chan struct{})}
	go l.run()
	return l
}

// queue publishes payload, the events of serving a request routed at
// routedAt, once its prefill is done; in the engine's goroutine.
func (l *lagModel) queue(payload []byte, res sim.Result, routedAt time.Time) {
	tokens := float64(res.Computed*l.blockSize + res.TailTokens)
	start := routedAt // the model's clock: the simulator's own delays are not the engine's
	if l.free.After(start) {
		start = l.free
	}
	l.free = start.Add(time.Duration(tokens / l.tokensPerSecond * float64(time.Second)))
	l.lags = append(l.lags, time.Duration(float64(l.free.Sub(routedAt))*l.speedup))
	l.pending <- delayed{payload, l.free}
}

func (l *lagModel) run() {
	defer close(l.done)
	for d := range l.pending {
		time.Sleep(time.Until(d.due))
		l.pub.Publish(d.payload)
	}
}

// stop returns once every batch queued is published.
func (l *lagModel) stop() {
	close(l.pending)
	<-l.done
}

// burstTrace makes each request n requests at its time, sharing its
// blocks as a prefix, each with one block of its own after them.
func burstTrace(reqs []sim.Request, n int) []sim.Request {
	out := make([]sim.Request, 0, len(reqs)*n)
	for i, r := range reqs {
		for j := range n {
			b := r
			b.HashIDs = append(slices.Clip(r.HashIDs), 1<<40+uint64(i*n+j)) // an id no trace uses
			b.InputLength = len(b.HashIDs) * sim.TraceBlockTokens
			out = append(out, b)
		}
	}
	return out
}

// burstResult is one routing's outcome on a burst trace.
type burstResult struct {
	hits       hits
	claims     claims // blocks predicted, and those not held when served
	duplicated int    // bursts' shared prefixes prefilled on a second (third...) worker
	bursts     int    // bursts whose prefix some worker prefilled
	lags       []time.Duration
	pred       kvpipe.PredictionStats
}

// duplicates counts, per burst of n requests, the workers beyond the
// first that prefilled some of its shared prefix.
func (b *burstResult) duplicates(o options, reqs []sim.Request, results []sim.Result, servedBy []int) {
	for first := 0; first+o.burst <= len(reqs); first += o.burst {
		shared := (len(reqs[first].HashIDs) - 1) * sim.TraceBlockTokens / o.blockSize
		var on []int
		for i := first; i < first+o.burst; i++ {
			if r := results[i]; r.DeviceHits+r.HostHits < shared && !slices.Contains(on, servedBy[i]) {
				on = append(on, servedBy[i])
			}
		}
		if len(on) > 0 {
			b.bursts++
			b.duplicated += len(on) - 1
		}
	}
}

// runBurst replays reqs as bursts with predictions, with events only,
// with approximate workers only, and at random. Its load weight is 0.5 by
// default: with load weighed as much as the blocks a worker lacks, a
// burst's second request is better off (by one block of waiting) on an
// idle worker than behind the first's prefill on the worker predicted to
// hold its prefix, and no prediction could keep a burst together; at 0.5 a
// worker predicted to hold a prefix wins while its queued work is below
// twice the prefix.
func runBurst(ctx context.Context, o options, reqs []sim.Request, source string, stdout, stderr io.Writer) error {
	if o.speedup <= 0 || o.prefillRate <= 0 {
		return errors.New("--burst needs a positive --speedup and --prefill-rate: the event lag is modelled in trace time")
	}
	o.eagle = 0 // one kind of keys: the comparison is of routings
	breqs := burstTrace(reqs, o.burst)
	fmt.Fprintf(stdout, "burst replay (%s, %d workers, capacity %d blocks, %d bursts of %d requests sharing a new prefix, prefill %.0f tokens/s, speed-up %g, load weight %g)\n",
		source, o.workers, o.capacity, len(reqs), o.burst, o.prefillRate, o.speedup, o.loadWeight)
	modes := []struct {
		name                 string
		predict, approximate bool
	}{{"with predictions", true, false}, {"events only", false, false}, {"approximate only", true, true}}
	var lags []time.Duration
	for _, m := range modes {
		mo := o
		mo.predict, mo.approximate = m.predict, m.approximate
		res, err := replayBurst(ctx, mo, breqs, stderr)
		if err != nil {
			return fmt.Errorf("%s: %w", m.name, err)
		}
		if lags == nil {
			lags = res.lags
		}
		printBurst(stdout, m.name, res, m.predict)
	}
	printBurst(stdout, "random", randomBurst(o, breqs), false)
	printLags(stdout, lags, o.predictionTTL())
	return nil
}

func printBurst(w io.Writer, name string, r burstResult, predicted bool) {
	fmt.Fprintf(w, "  %-18s hit rate %s, duplicated prefills %d in %d bursts", name, r.hits, r.duplicated, r.bursts)
	if predicted {
		fmt.Fprintf(w, ", predicted but not held when served %d of %d blocks predicted (%.2f%%); predictions confirmed %d, expired %d, dropped %d",
			r.claims.wrong, r.claims.predicted, 100*float64(r.claims.wrong)/float64(max(r.claims.predicted, 1)), r.pred.Confirmed, r.pred.Expired, r.pred.Dropped)
	}
	fmt.Fprintln(w)
}

// printLags prints the modelled event lag's distribution, in trace time.
func printLags(w io.Writer, lags []time.Duration, ttl time.Duration) {
	if len(lags) == 0 {
		return
	}
	slices.Sort(lags)
	q := func(f float64) float64 { return lags[min(int(f*float64(len(lags))), len(lags)-1)].Seconds() }
	fmt.Fprintf(w, "  event lag          p50 %.2fs, p90 %.2fs, p99 %.2fs, max %.2fs (routing to events, trace time, %d batches; PredictionTTL %s)\n",
		q(0.5), q(0.9), q(0.99), lags[len(lags)-1].Seconds(), len(lags), ttl)
}

// replayBurst routes reqs through a fresh router and engines as o says.
func replayBurst(ctx context.Context, o options, reqs []sim.Request, stderr io.Writer) (burstResult, error) {
	var res burstResult
	engines, err := startEngines(o, len(reqs))
	if err != nil {
		return res, err
	}
	defer stopEngines(engines)
	r, err := startRouter(ctx, o, engines, nil, nil, stderr)
	if err != nil {
		return res, err
	}
	defer r.stop()
	routed := route(ctx, o, reqs, 0, r.p, engines, stderr, time.Now())
	drainEngines(engines)
	if routed < len(reqs) {
		return res, ctx.Err()
	}
	res.pred = r.p.Stats().Total().Predictions
	if err := r.stop(); err != nil {
		return res, err
	}
	for _, e := range engines {
		res.hits.device += e.hits.device
		res.hits.host += e.hits.host
		res.hits.blocks += e.hits.blocks
		for _, c := range []*claims{&e.base, &e.onAdapters} {
			res.claims.predicted += c.predicted
			res.claims.wrong += c.wrong
		}
		res.lags = append(res.lags, e.lag.lags...)
	}
	res.duplicates(o, reqs, engines[0].results, engines[0].servedBy)
	return res, nil
}

// randomBurst serves reqs on fresh engines picked at random.
func randomBurst(o options, reqs []sim.Request) burstResult {
	rng := rand.New(rand.NewPCG(1, 2))
	caches := make([]*sim.Engine, o.workers)
	for i := range caches {
		caches[i] = sim.NewEngine(o.blockSize, o.capacity, o.engineOptions(i)...)
	}
	var res burstResult
	results, servedBy := make([]sim.Result, len(reqs)), make([]int, len(reqs))
	var tokens []uint32
	var events []codec.Event
	for i := range reqs {
		tokens = sim.InputTokens(tokens[:0], &reqs[i])
		servedBy[i] = rng.IntN(len(caches))
		events, results[i] = caches[servedBy[i]].ServeResult(events[:0], &reqs[i], tokens)
		res.hits.add(results[i])
	}
	res.duplicates(o, reqs, results, servedBy)
	return res
}
