package kvpipe

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/wire"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
)

// The zmq4 PUB writer that Close never stops (see ztest.VerifyNoLeaks).
var zmqPubWriter = goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run")

// New and AddWorker start nothing; a pipeline dropped without Run leaks
// nothing, and answers as one that holds nothing.
func TestNewStartsNothing(t *testing.T) {
	base := goleak.IgnoreCurrent()
	p, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AddWorker("w", WorkerConfig{Endpoint: "tcp://127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	if err := goleak.Find(base); err != nil {
		t.Errorf("goroutines after New and AddWorker: %v", err)
	}
	if ms, err := p.FindMatches(context.Background(), prompt(1, 1)); err != nil || len(ms) != 0 {
		t.Errorf("FindMatches before Run = %v, %v; want none, nil", ms, err)
	}
	if err := p.Sync(context.Background()); err != nil {
		t.Errorf("Sync before Run = %v, want nil", err)
	}
	st := p.Stats()
	if w, ok := st.Worker("w"); !ok || !w.Actor.Partial || len(st.Shards) != 0 {
		t.Errorf("Stats before Run = %+v, want worker w (partial) and no shards", st)
	}
}

// Run returns once every goroutine it started has stopped: nil after
// Shutdown, the context's cause when the context ends; it runs once.
func TestRunOwnsEveryGoroutine(t *testing.T) {
	for _, tc := range []struct {
		name string
		stop func(p *Pipeline, cancel context.CancelCauseFunc)
		want error
	}{
		{"Shutdown", func(p *Pipeline, _ context.CancelCauseFunc) { p.Shutdown(context.Background()) }, nil},
		{"context", func(_ *Pipeline, cancel context.CancelCauseFunc) { cancel(errRouterStopping) }, errRouterStopping},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEngine(t)
			base := goleak.IgnoreCurrent()
			p, err := New(Config{BlockSize: 16, Subscriber: wire.Options{ReconnectMin: 10 * time.Millisecond}})
			if err != nil {
				t.Fatal(err)
			}
			if err := p.AddWorker("before", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			done := make(chan error, 1)
			go func() { done <- p.Run(ctx) }()
			if err := p.AddWorker("after", WorkerConfig{Endpoint: e.ep}); err != nil {
				t.Fatal(err)
			}
			eventually(t, "both workers indexing", func() { e.parent = 0; e.store(prompt(1, 1), 16) }, func() bool {
				s := scores(t, p, prompt(1, 1))
				return s["before"] == 1 && s["after"] == 1
			})
			if err := p.Run(ctx); !errors.Is(err, ErrRunning) {
				t.Errorf("a second Run = %v, want ErrRunning", err)
			}
			tc.stop(p, cancel)
			select {
			case err := <-done:
				if !errors.Is(err, tc.want) && err != tc.want {
					t.Errorf("Run = %v, want %v", err, tc.want)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Run did not return")
			}
			e.pub.Close() // its connections go too
			if err := goleak.Find(base, zmqPubWriter); err != nil {
				t.Errorf("goroutines left once Run returned: %v", err)
			}
			if err := p.AddWorker("late", WorkerConfig{Endpoint: e.ep}); !errors.Is(err, ErrClosed) {
				t.Errorf("AddWorker after Run = %v, want ErrClosed", err)
			}
			if err := p.Run(context.Background()); !errors.Is(err, ErrClosed) {
				t.Errorf("Run after Run = %v, want ErrClosed", err)
			}
			if _, err := p.FindMatches(context.Background(), prompt(1, 1)); !errors.Is(err, ErrClosed) {
				t.Errorf("FindMatches after Run = %v, want ErrClosed", err)
			}
		})
	}
}

var errRouterStopping = errors.New("router stopping")

// The read path a router calls per request allocates nothing once dst has
// room: no channel, no goroutine, a pooled scratch for the shards' scores.
func TestAppendMatchesAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates; test.sh runs this without it")
	}
	e := newEngine(t)
	p := startPipeline(t, Config{Shards: 2})
	for _, name := range []string{"a", "b", "c"} {
		if err := p.AddWorker(name, WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
			t.Fatal(err)
		}
	}
	toks := prompt(7, 3)
	var h index.Hasher
	keys := h.Prompt(nil, toks, 16)
	eventually(t, "every worker indexing all 3 blocks", func() { e.parent = 0; e.store(toks, 16) }, func() bool {
		s := scores(t, p, toks)
		return s["a"] == 3 && s["b"] == 3 && s["c"] == 3
	})
	ctx := context.Background()
	dst := make([]Match, 0, 8)
	allocs := testing.AllocsPerRun(200, func() {
		var err error
		if dst, err = p.AppendMatchesKeys(ctx, dst[:0], keys, nil); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("AppendMatchesKeys allocated %.1f times per call", allocs)
	}
	if len(dst) != 3 || dst[0].Blocks != 3 {
		t.Errorf("AppendMatchesKeys = %+v, want 3 workers of 3 blocks", dst)
	}
}

// FindMatches from tokens hashes them into a pooled Hasher's scratch, as
// the search needs them: the answer it returns is all it allocates.
func TestFindMatchesAllocatesOnlyItsAnswer(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates; test.sh runs this without it")
	}
	e := newEngine(t)
	p := startPipeline(t, Config{Shards: 2})
	for _, name := range []string{"a", "b"} {
		if err := p.AddWorker(name, WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
			t.Fatal(err)
		}
	}
	toks := prompt(9, 300) // past the first rounds of keys
	eventually(t, "every worker indexing all 300 blocks", func() { e.parent = 0; e.store(toks, 16) }, func() bool {
		s := scores(t, p, toks)
		return s["a"] == 300 && s["b"] == 300
	})
	ctx := context.Background()
	r := &Request{Tokens: toks}
	var ms []Match
	allocs := testing.AllocsPerRun(100, func() {
		var err error
		if ms, err = p.FindMatchesRequest(ctx, r); err != nil {
			t.Fatal(err)
		}
	})
	var copied []Match
	answer := testing.AllocsPerRun(100, func() {
		copied = nil
		//lint:ignore S1011 appended one at a time, as the pipeline appends its answer
		for _, m := range ms {
			copied = append(copied, m)
		}
	})
	if allocs != answer {
		t.Errorf("FindMatchesRequest allocated %.1f times per call, want %.1f (its answer)", allocs, answer)
	}
	if len(ms) != 2 || ms[0].Blocks != 300 || ms[1].Blocks != 300 {
		t.Errorf("FindMatchesRequest = %+v, want 2 workers of 300 blocks", ms)
	}
}

// New registers nothing: pipelines built, run or not, leave a registry to
// whoever registers a collector on it, once at a time.
func TestNewRegistersNothing(t *testing.T) {
	for i, run := range []bool{false, true, false} {
		reg := prometheus.NewRegistry()
		p, err := New(Config{BlockSize: 16})
		if err != nil {
			t.Fatalf("pipeline %d: %v", i, err)
		}
		if families, err := reg.Gather(); err != nil || len(families) != 0 {
			t.Fatalf("pipeline %d: the registry holds %d families (%v), want none", i, len(families), err)
		}
		if err := RegisterMetrics(reg, p); err != nil {
			t.Fatalf("pipeline %d's collector: %v", i, err)
		}
		if err := RegisterMetrics(reg, p); err == nil {
			t.Fatalf("a second collector registered beside pipeline %d's", i)
		}
		done := make(chan error, 1)
		if run {
			go func() { done <- p.Run(context.Background()) }()
			eventually(t, "Run started", nil, func() bool { return p.read.shards.Load() != nil })
		}
		if err := p.Shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
		if run {
			if err := <-done; err != nil {
				t.Fatalf("Run = %v", err)
			}
		}
	}
}

func TestRemoveWorkerErrors(t *testing.T) {
	p, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AddWorker("w", WorkerConfig{Endpoint: "tcp://127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	if err := p.RemoveWorker(context.Background(), "nobody"); !errors.Is(err, ErrNoWorker) {
		t.Errorf("RemoveWorker of an unknown name = %v, want ErrNoWorker", err)
	}
	if err := p.RemoveWorker(context.Background(), "w"); err != nil {
		t.Errorf("RemoveWorker before Run = %v, want nil", err)
	}
	if err := p.AddWorker("w", WorkerConfig{Endpoint: "tcp://127.0.0.1:1"}); err != nil {
		t.Errorf("AddWorker of a removed name = %v", err)
	}
	p.Shutdown(context.Background())
	if err := p.RemoveWorker(context.Background(), "w"); !errors.Is(err, ErrClosed) {
		t.Errorf("RemoveWorker after Shutdown = %v, want ErrClosed", err)
	}
	if err := p.AddWorker("", WorkerConfig{}); !errors.Is(err, ErrClosed) {
		t.Errorf("AddWorker after Shutdown = %v, want ErrClosed before any validation", err)
	}
}

// held blocks the first batch in the handler until release is closed.
type held struct {
	wire.Handler
	entered chan struct{} // capacity 1
	release chan struct{}
}

func (h held) HandleBatch(seq uint64, payload []byte) {
	select {
	case h.entered <- struct{}{}:
		<-h.release
	default:
	}
	h.Handler.HandleBatch(seq, payload)
}

// A removal still under way when the pipeline shuts down hands its last op
// to the shard before the shards close: Run waits for it, so the send does
// not meet a closed queue.
func TestShutdownWaitsForARemovalUnderWay(t *testing.T) {
	e := newEngine(t)
	p, err := New(Config{BlockSize: 16, Subscriber: wire.Options{ReconnectMin: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	h := held{entered: make(chan struct{}, 1), release: make(chan struct{})}
	p.wrap = func(inner wire.Handler) wire.Handler { h.Handler = inner; return h }
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	eventually(t, "a batch held in the handler", func() { e.parent = 0; e.store(prompt(1, 1), 16) },
		func() bool { return len(h.entered) == 1 })
	expired, cancel := context.WithCancel(context.Background())
	cancel()
	if err := p.RemoveWorker(expired, "w"); !errors.Is(err, context.Canceled) {
		t.Fatalf("RemoveWorker with its goroutine held = %v, want context.Canceled", err)
	}
	p.Shutdown(expired) // starts the stop and returns
	eventually(t, "Run draining", nil, func() bool { p.mu.Lock(); defer p.mu.Unlock(); return p.phase == draining })
	close(h.release) // the worker stops, then its removal sends to the shard
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
	}
}
