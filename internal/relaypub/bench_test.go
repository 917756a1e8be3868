package relaypub

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/relay"
	"github.com/nats-io/nats.go/jetstream"
)

func benchOps(n int) []index.Op {
	ops := make([]index.Op, n)
	for i := range ops {
		ops[i] = index.Op{Kind: index.OpKind(i % 2), Tier: index.Tier(i % int(index.NumTiers)), Hash: uint64(i) * 0x9e3779b97f4a7c15}
	}
	return ops
}

// BenchmarkPublish publishes batches of 32 ops through the relay's Publish
// (up to MaxInFlight unacknowledged per worker, then waiting) to the
// embedded server on loopback, with a router following the stream: batches
// and ops per second published, and the lag from a batch's Publish call to
// the router handing it to its index, p50 and p99. window=1 is the relay on
// a connection with a reconnect buffer: one message at a time.
func BenchmarkPublish(b *testing.B) {
	for _, window := range []int{1, 128} {
		for _, workers := range []int{1, 4} {
			b.Run(fmt.Sprintf("window=%d/workers=%d", window, workers), func(b *testing.B) { benchPublish(b, window, workers) })
		}
	}
}

func benchPublish(b *testing.B, window, workers int) {
	_, js := startServer(b)
	s := testSettings()
	s.MaxBytes = 256 << 20
	cfg := relayConfig(s)
	cfg.MaxInFlight = window
	r, err := New(js, cfg)
	if err != nil {
		b.Fatal(err)
	}
	ru := r.cur
	ctx := context.Background()
	if err := ru.setUp(ctx); err != nil {
		b.Fatal(err)
	}
	defer ru.endSettling(ctx)
	defer ru.p.Shutdown(ctx)

	var mu sync.Mutex
	// The n-th message a worker publishes is its n-th in the stream.
	sent, applied := make([][]time.Time, workers), make([][]time.Time, workers)
	total := 0
	f, err := relay.NewFollower(appliedJS{js, func(subject string) {
		now := time.Now()
		var w int
		fmt.Sscanf(strings.TrimPrefix(subject, s.Prefix+"."), "w%d", &w)
		mu.Lock()
		applied[w] = append(applied[w], now)
		total++
		mu.Unlock()
	}}, s, nil)
	if err != nil {
		b.Fatal(err)
	}
	p, err := kvpipe.New(kvpipe.Config{BlockSize: bs, Source: f})
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() { p.Shutdown(ctx); <-done }()

	ops := benchOps(32)
	per := max(b.N/workers, 1)
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		sent[w] = make([]time.Time, 0, per)
		wg.Go(func() {
			name := fmt.Sprintf("w%d", w)
			for i := range per {
				sent[w] = append(sent[w], time.Now())
				ru.Ops(ctx, name, ops, seam.Origin{Batch: true, Seq: uint64(i), Fingerprint: uint64(i)})
			}
			if _, err := ru.Flush(ctx, name); err != nil {
				b.Error(err)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		n := total
		mu.Unlock()
		if n >= per*workers {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("the router applied %d of %d batches", n, per*workers)
		}
	}
	b.StopTimer()
	if st := r.Stats(); st.Published != uint64(per*workers) || st.Resets != 0 {
		b.Fatalf("relay %+v: want %d published, no reset", st, per*workers)
	}
	b.ReportMetric(float64(per*workers)/elapsed.Seconds(), "batches/s")
	b.ReportMetric(float64(per*workers*len(ops))/elapsed.Seconds(), "ops/s")
	mu.Lock()
	defer mu.Unlock()
	lags := make([]time.Duration, 0, per*workers)
	for w := range workers {
		for i, t0 := range sent[w] {
			lags = append(lags, applied[w][i].Sub(t0))
		}
	}
	slices.Sort(lags)
	b.ReportMetric(float64(lags[len(lags)/2].Microseconds()), "p50-lag-µs")
	b.ReportMetric(float64(lags[len(lags)*99/100].Microseconds()), "p99-lag-µs")
}

// appliedJS is a follower's JetStream whose ordered consumers tell applied
// the subject of each message the follower has handled: the follower asks
// for its next message only once it has handed the last one to its
// pipeline.
type appliedJS struct {
	jetstream.JetStream
	applied func(subject string)
}

func (js appliedJS) OrderedConsumer(ctx context.Context, stream string, cfg jetstream.OrderedConsumerConfig) (jetstream.Consumer, error) {
	c, err := js.JetStream.OrderedConsumer(ctx, stream, cfg)
	return appliedConsumer{c, js.applied}, err
}

type appliedConsumer struct {
	jetstream.Consumer
	applied func(subject string)
}

func (c appliedConsumer) Messages(opts ...jetstream.PullMessagesOpt) (jetstream.MessagesContext, error) {
	it, err := c.Consumer.Messages(opts...)
	return &appliedMessages{MessagesContext: it, applied: c.applied}, err
}

type appliedMessages struct {
	jetstream.MessagesContext
	applied func(subject string)
	last    jetstream.Msg // returned by the last Next
}

func (m *appliedMessages) Next(opts ...jetstream.NextOpt) (jetstream.Msg, error) {
	if m.last != nil {
		m.applied(m.last.Subject())
	}
	var err error
	m.last, err = m.MessagesContext.Next(opts...)
	return m.last, err
}

// BenchmarkFollowerMatches matches every prompt the engines served, by its
// keys, on the relay's pipeline and on a router that followed the relay's
// stream, in one run: the stream carries each store's link, so that the
// follower jumps through a worker's chains as the relay does (before
// links, it read every matched key). Four engines of 4,000 blocks, on
// device only: a worker with blocks in a lower tier is read key by key.
func BenchmarkFollowerMatches(b *testing.B) {
	_, js := startServer(b)
	s := testSettings()
	s.MaxBytes = 256 << 20
	engines := make([]*engine, 4)
	for i := range engines {
		engines[i] = newEngineOf(b, fmt.Sprintf("e%d", i), sim.NewEngine(bs, 4000)) // no host tier: a tiered index reads key by key
	}
	rr := startRelay(b, js, relayConfig(s), engines...)
	r := startRouter(b, js, s)
	reqs := trace(2000, 21)
	for i, e := range engines {
		e.serve(reqs[i*500 : (i+1)*500])
	}
	relayed(b, rr, engines...)
	caughtUp(b, js, s, r)
	var prompts [][]uint64
	for _, e := range engines {
		for _, q := range e.queries {
			prompts = append(prompts, q.keys)
		}
	}
	for _, side := range []struct {
		name string
		p    *kvpipe.Pipeline
	}{{"relay", rr.Pipeline()}, {"follower", r.p}} {
		b.Run(side.name, func(b *testing.B) {
			ctx := context.Background()
			var dst []kvpipe.Match
			blocks, i := 0, 0
			for b.Loop() {
				var err error
				if dst, err = side.p.AppendMatchesKeys(ctx, dst[:0], prompts[i%len(prompts)], nil); err != nil {
					b.Fatal(err)
				}
				for _, m := range dst {
					blocks += m.Blocks
				}
				i++
			}
			b.ReportMetric(float64(blocks)/float64(i), "matched-blocks/op")
		})
	}
}
