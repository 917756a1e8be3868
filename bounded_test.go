package kvpipe

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
	"github.com/kvpipe/kvpipe/internal/ztest"
)

// within fails the test unless f returns within d.
func within(t *testing.T, what string, d time.Duration, f func()) {
	t.Helper()
	start := time.Now()
	f()
	if took := time.Since(start); took > d {
		t.Errorf("%s took %v, want at most %v", what, took.Round(time.Millisecond), d)
	}
}

// Peers that accept and never speak, stop mid-handshake, or are frozen with
// SIGSTOP after the handshake must not hold up any public call.
func TestPublicCallsAreBoundedAgainstStuckPeers(t *testing.T) {
	engine, ep, replay := startPyEngine(t)
	silent := ztest.RawPeer(t, nil)
	half := ztest.RawPeer(t, []byte{0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f}) // the first 10 greeting bytes, then nothing
	p := startPipeline(t, Config{})
	reg := withMetrics(t, p)
	for name, eps := range map[string][2]string{"frozen": {ep, replay}, "silent": {silent, silent}, "half": {half, half}} {
		if err := p.AddWorker(name, WorkerConfig{Endpoint: eps[0], ReplayEndpoint: eps[1]}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "the engine's subscription", nil, func() bool { return workerStats(p, "frozen").Wire.Batches > 0 })
	engine.Signal(syscall.SIGSTOP)
	time.Sleep(50 * time.Millisecond) // the stuck dials are under way

	const bound = time.Second
	within(t, "AddWorker", bound, func() {
		if err := p.AddWorker("late", WorkerConfig{Endpoint: silent, ReplayEndpoint: ""}); err != nil {
			t.Error(err)
		}
	})
	within(t, "WorkerStats", bound, func() {
		if got := len(p.Stats().Workers); got != 4 {
			t.Errorf("%d workers, want 4", got)
		}
	})
	within(t, "a metrics scrape", bound, func() {
		if _, err := reg.Gather(); err != nil {
			t.Error(err)
		}
	})
	within(t, "FindMatches", bound, func() { scores(t, p, enginepeer.ChainTokens(1000, 4)) })
	for _, name := range []string{"frozen", "silent", "half"} {
		within(t, "RemoveWorker "+name, bound, func() {
			ctx, cancel := context.WithTimeout(context.Background(), bound)
			defer cancel()
			if err := p.RemoveWorker(ctx, name); err != nil {
				t.Errorf("RemoveWorker %s: %v", name, err)
			}
		})
	}
	within(t, "Shutdown", bound, func() {
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		defer cancel()
		if err := p.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	engine.Signal(syscall.SIGCONT)
	engine.Send("quit")
}
