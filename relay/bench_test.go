package relay

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/supervisor"
)

func benchOps(n int) []index.Op {
	ops := make([]index.Op, n)
	for i := range ops {
		ops[i] = index.Op{Kind: index.OpKind(i % 2), Tier: index.Tier(i % int(index.NumTiers)), Hash: uint64(i) * 0x9e3779b97f4a7c15}
	}
	return ops
}

func BenchmarkAppendMessage(b *testing.B) {
	ops := benchOps(256)
	buf, _ := AppendMessage(nil, false, ops)
	b.ReportAllocs()
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		buf, _ = AppendMessage(buf[:0], false, ops)
	}
	b.ReportMetric(float64(b.N)*256/b.Elapsed().Seconds(), "ops/s")
}

func BenchmarkDecodeMessage(b *testing.B) {
	buf, _ := AppendMessage(nil, false, benchOps(256))
	dst, _, _ := DecodeMessage(buf, nil)
	b.ReportAllocs()
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		dst, _, _ = DecodeMessage(buf, dst)
	}
	b.ReportMetric(float64(b.N)*256/b.Elapsed().Seconds(), "ops/s")
}

// BenchmarkPublish publishes batches of 32 ops through the relay's Publish
// (synchronous, one acknowledged message at a time per worker) to the
// embedded server on loopback, with a router following the stream: batches
// and ops per second published, and the lag from a batch's Publish call to
// the router handing it to its index, p50 and p99.
func BenchmarkPublish(b *testing.B) {
	for _, workers := range []int{1, 4} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) { benchPublish(b, workers) })
	}
}

func benchPublish(b *testing.B, workers int) {
	_, js := startServer(b)
	s := testSettings()
	s.MaxBytes = 256 << 20
	r, err := New(js, relayConfig(s))
	if err != nil {
		b.Fatal(err)
	}
	ru := r.cur
	ctx := context.Background()
	if err := ru.setUp(ctx); err != nil {
		b.Fatal(err)
	}
	defer ru.p.Shutdown(ctx)

	var mu sync.Mutex
	sent, applied := map[uint64]time.Time{}, map[uint64]time.Time{} // by stream seq
	f, err := NewFollower(js, FollowerConfig{Settings: s})
	if err != nil {
		b.Fatal(err)
	}
	f.applied = func(seq uint64) {
		now := time.Now()
		mu.Lock()
		applied[seq] = now
		mu.Unlock()
	}
	p, err := supervisor.New(supervisor.Config{BlockSize: bs, Source: f})
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() { p.Shutdown(ctx); <-done }()

	ops := benchOps(32)
	per := max(b.N/workers, 1)
	total := per * workers
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			name := fmt.Sprintf("w%d", w)
			for i := range per {
				t0 := time.Now()
				seq := ru.publish(ctx, name, ops, actor.Origin{Batch: true, Seq: uint64(i), Fingerprint: uint64(i)})
				mu.Lock()
				sent[seq] = t0
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		n := len(applied)
		mu.Unlock()
		if n >= total {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("the router applied %d of %d batches", n, total)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(total)/elapsed.Seconds(), "batches/s")
	b.ReportMetric(float64(total*len(ops))/elapsed.Seconds(), "ops/s")
	mu.Lock()
	defer mu.Unlock()
	lags := make([]time.Duration, 0, total)
	for seq, t0 := range sent {
		lags = append(lags, applied[seq].Sub(t0))
	}
	slices.Sort(lags)
	b.ReportMetric(float64(lags[len(lags)/2].Microseconds()), "p50-lag-µs")
	b.ReportMetric(float64(lags[len(lags)*99/100].Microseconds()), "p99-lag-µs")
}
