package kvpipe

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/kvpipe/kvpipe/internal/ztest"
	"github.com/kvpipe/kvpipe/wire"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
)

var freeTCP = ztest.FreeTCP

// engine is a simulated engine: a real PUB and ROUTER on loopback.
type engine struct {
	pub          *wiretest.Publisher
	ep, replay   string
	next, parent uint64
}

func newEngine(t testing.TB) *engine {
	t.Helper()
	e := &engine{ep: freeTCP(t), replay: freeTCP(t)}
	pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: e.ep, ReplayEndpoint: e.replay})
	if err != nil {
		t.Fatal(err)
	}
	e.pub = pub
	t.Cleanup(func() { pub.Close() })
	return e
}

// store publishes the blocks of tokens as one BlockStored chained to the last.
func (e *engine) store(tokens []uint32, blockSize int, mods ...func(*codec.Event)) {
	ev := codec.Event{Type: codec.BlockStored, TokenIDs: tokens, BlockSize: blockSize, HasParent: e.parent != 0, ParentHash: e.parent}
	for range len(tokens) / blockSize {
		e.next++
		ev.BlockHashes = append(ev.BlockHashes, e.next)
	}
	for _, m := range mods {
		m(&ev)
	}
	e.parent = e.next
	e.pub.Publish(engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{ev}}, engineenc.CurrentVLLM))
}

func prompt(seed, blocks int) []uint32 {
	out := make([]uint32, blocks*16)
	for i := range out {
		out[i] = uint32(seed*1000 + i)
	}
	return out
}

func startPipeline(t testing.TB, cfg Config) *Pipeline {
	t.Helper()
	if cfg.BlockSize == 0 {
		cfg.BlockSize = 16
	}
	cfg.Subscriber.ReconnectMin, cfg.Subscriber.ReconnectMax = 10*time.Millisecond, 100*time.Millisecond
	return runPipeline(t, cfg)
}

// runPipeline runs a Pipeline of cfg as it is until the test ends.
func runPipeline(t testing.TB, cfg Config) *Pipeline {
	t.Helper()
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	t.Cleanup(func() {
		p.Shutdown(context.Background())
		// ErrClosed: the test ended before Run had started.
		if err := <-done; err != nil && err != ErrClosed {
			t.Errorf("Run: %v", err)
		}
	})
	return p
}

// eventually polls cond for up to 10s while feed keeps the engines talking
// (PUB/SUB drops what is sent before a subscription is in place).
func eventually(t *testing.T, what string, feed func(), cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		if feed != nil {
			feed()
		}
		if cond() {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s", what)
}

func scores(t *testing.T, p *Pipeline, tokens []uint32) map[string]int {
	t.Helper()
	ms, err := p.FindMatches(context.Background(), tokens)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, m := range ms {
		out[m.Worker] = m.Blocks
	}
	return out
}

func TestFindMatchesAcrossWorkersAndRemove(t *testing.T) {
	p := startPipeline(t, Config{Shards: 2})
	a, b := newEngine(t), newEngine(t)
	if err := p.AddWorker("a", WorkerConfig{Endpoint: a.ep, ReplayEndpoint: a.replay}); err != nil {
		t.Fatal(err)
	}
	if err := p.AddWorker("b", WorkerConfig{Endpoint: b.ep, ReplayEndpoint: b.replay}); err != nil {
		t.Fatal(err)
	}
	shared := prompt(1, 4)
	// Both engines publish a probe root until kvpipe has seen it: subscriptions are in place.
	eventually(t, "both workers connected", func() { a.store(prompt(9, 1), 16); b.store(prompt(8, 1), 16) }, func() bool {
		return len(scores(t, p, prompt(9, 1))) == 1 && len(scores(t, p, prompt(8, 1))) == 1
	})
	a.parent, b.parent = 0, 0
	a.store(shared, 16)        // a holds all 4 blocks
	b.store(shared[:2*16], 16) // b holds the first 2
	b.store(prompt(2, 3), 16)  // and something else
	eventually(t, "scores a=4 b=2", nil, func() bool {
		s := scores(t, p, append(append([]uint32{}, shared...), prompt(3, 2)...))
		return s["a"] == 4 && s["b"] == 2 && len(s) == 2
	})
	if err := p.RemoveWorker(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a gone", nil, func() bool {
		s := scores(t, p, shared)
		return len(s) == 1 && s["b"] == 2
	})
	if err := p.RemoveWorker(context.Background(), "a"); err == nil {
		t.Error("removing a removed worker: no error")
	}
}

func TestConfigAndWorkerErrors(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "BlockSize must be positive, got 0"},
		{Config{BlockSize: 16, Shards: -1}, "Shards must not be negative"},
		{Config{BlockSize: 16, Backpressure: 7}, "unknown Backpressure 7"},
	} {
		if _, err := New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v, want %q", tc.cfg, err, tc.want)
		}
	}
	p := startPipeline(t, Config{})
	if err := p.AddWorker("w", WorkerConfig{Endpoint: "tcp://127.0.0.1:1", ReplayEndpoint: ""}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, ep, replay, want string }{
		{"w", "tcp://127.0.0.1:2", "", `worker "w" already added`},
		{"x", "http://nowhere", "", `scheme "http" is not tcp or ipc`},
		{"y", "tcp://127.0.0.1:3", "tcp://noport", "want tcp://host:port"},
		{"", "tcp://127.0.0.1:3", "", "name must not be empty"},
	} {
		if err := p.AddWorker(tc.name, WorkerConfig{Endpoint: tc.ep, ReplayEndpoint: tc.replay}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("AddWorker(%q, %q, %q) = %v, want %q", tc.name, tc.ep, tc.replay, err, tc.want)
		}
	}
}

// panicky makes the handler panic on one payload, as a bug in an actor would.
type panicky struct {
	wire.Handler
	trigger string
	panics  *atomic.Int64
}

func (h panicky) HandleBatch(seq uint64, payload []byte) {
	if string(payload) == h.trigger {
		h.panics.Add(1)
		panic("boom")
	}
	h.Handler.HandleBatch(seq, payload)
}

func TestPanickingWorkerIsRestartedAndResynced(t *testing.T) {
	var panics atomic.Int64
	p, err := New(Config{BlockSize: 16, RestartMin: 10 * time.Millisecond, Subscriber: wire.Options{ReconnectMin: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	p.wrap = func(h wire.Handler) wire.Handler { return panicky{h, "poison", &panics} }
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	defer func() { p.Shutdown(context.Background()); <-done }()
	e := newEngine(t)
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "connected", func() { e.parent = 0; e.store(prompt(1, 1), 16) }, func() bool { return scores(t, p, prompt(1, 1))["w"] == 1 })
	e.pub.Publish([]byte("poison"))
	eventually(t, "restart after the panic", nil, func() bool { return workerStats(p, "w").Restarts == 1 })
	// Resynced: what it held before is gone; it indexes again what comes next.
	eventually(t, "stale entries cleared", nil, func() bool { return len(scores(t, p, prompt(1, 1))) == 0 })
	eventually(t, "indexing again", func() { e.parent = 0; e.store(prompt(2, 1), 16) }, func() bool { return scores(t, p, prompt(2, 1))["w"] == 1 })
	if panics.Load() != 1 {
		t.Errorf("panics = %d, want 1", panics.Load())
	}
}

func TestMetricsScrape(t *testing.T) {
	p := startPipeline(t, Config{Shards: 3})
	reg := withMetrics(t, p)
	e := newEngine(t)
	if err := p.AddWorker("engine-0", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "connected", func() { e.parent = 0; e.store(prompt(1, 2), 16) }, func() bool { return scores(t, p, prompt(1, 2))["engine-0"] == 2 })
	e.store(prompt(2, 1)[:4], 4)                                            // a partial tail: filtered
	e.store(prompt(3, 1), 16, func(ev *codec.Event) { ev.Medium = "TAPE" }) // unknown medium
	e.parent = 0
	e.store(prompt(5, 1), 16, func(ev *codec.Event) { ev.Medium = "CPU" })                     // host tier
	e.store(prompt(4, 1), 16, func(ev *codec.Event) { ev.GroupIdx, ev.HasGroupIdx = 5, true }) // unlearned group
	e.pub.Publish([]byte{0xc1})                                                                // garbage
	eventually(t, "the filters counted", nil, func() bool {
		st := workerStats(p, "engine-0").Actor
		return st.DecodeErrors == 1 && st.Filtered[actor.UnlearnedGroup] == 1
	})
	if _, err := p.FindMatches(context.Background(), prompt(1, 2)); err != nil {
		t.Fatal(err)
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) != 0 {
		t.Errorf("metric lint: %v %v", err, problems)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	value := func(name string, labels ...string) float64 {
		for _, f := range families {
			if f.GetName() != name {
				continue
			}
			for _, m := range f.GetMetric() {
				if hasLabels(m, labels...) {
					switch {
					case m.Counter != nil:
						return m.Counter.GetValue()
					case m.Gauge != nil:
						return m.Gauge.GetValue()
					case m.Histogram != nil:
						return float64(m.Histogram.GetSampleCount())
					}
				}
			}
		}
		t.Errorf("no metric %s%v", name, labels)
		return -1
	}
	for _, c := range []struct {
		name   string
		labels []string
		min    float64
		max    float64
	}{
		{"kvpipe_filtered_events_total", []string{"worker", "engine-0", "reason", "partial_block"}, 1, 1},
		{"kvpipe_filtered_events_total", []string{"worker", "engine-0", "reason", "unknown_medium"}, 1, 1},
		{"kvpipe_filtered_events_total", []string{"worker", "engine-0", "reason", "lower_tier"}, 0, 0},
		{"kvpipe_tier_blocks", []string{"worker", "engine-0", "tier", "host"}, 1, 1},
		{"kvpipe_filtered_events_total", []string{"worker", "engine-0", "reason", "unlearned_group"}, 1, 1},
		{"kvpipe_filtered_events_total", []string{"worker", "engine-0", "reason", "non_main_attention"}, 0, 0},
		{"kvpipe_decode_errors_total", []string{"worker", "engine-0"}, 1, 1},
		{"kvpipe_indexed_blocks", []string{"worker", "engine-0"}, 2, 1e9},
		{"kvpipe_blocks_stored_total", []string{"worker", "engine-0"}, 2, 1e9},
		{"kvpipe_events_received_total", []string{"worker", "engine-0", "type", "BlockStored"}, 5, 1e9},
		{"kvpipe_batches_lost_total", []string{"worker", "engine-0"}, 0, 0},
		{"kvpipe_connected", []string{"worker", "engine-0"}, 1, 1},
		{"kvpipe_index_nodes", []string{"shard", "0"}, 0, 1e9},
		{"kvpipe_shard_queue_depth", []string{"shard", "2"}, 0, 256},
		{"kvpipe_find_matches_duration_seconds", nil, 1, 1e9},
	} {
		if v := value(c.name, c.labels...); v < c.min || v > c.max {
			t.Errorf("%s%v = %v, want in [%v, %v]", c.name, c.labels, v, c.min, c.max)
		}
	}
}

func hasLabels(m *dto.Metric, kv ...string) bool {
	for i := 0; i < len(kv); i += 2 {
		found := false
		for _, l := range m.GetLabel() {
			if l.GetName() == kv[i] && l.GetValue() == kv[i+1] {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}

func TestShutdownBeforeRunAndTwice(t *testing.T) {
	p, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	p.Shutdown(context.Background())
	p.Shutdown(context.Background())
	if err := p.Run(context.Background()); err != ErrClosed {
		t.Errorf("Run after Shutdown = %v, want ErrClosed", err)
	}
	if err := p.AddWorker("w", WorkerConfig{Endpoint: "tcp://127.0.0.1:1", ReplayEndpoint: ""}); err != ErrClosed {
		t.Errorf("AddWorker after Shutdown = %v, want ErrClosed", err)
	}
	if _, err := p.FindMatches(context.Background(), prompt(1, 1)); err != ErrClosed {
		t.Errorf("FindMatches after Shutdown = %v, want ErrClosed", err)
	}
}

// Workers come and go while questions are asked: no race, no leak, and the
// pipeline ends up holding exactly the workers left.
func TestWorkersChurnWhileQuerying(t *testing.T) {
	p := startPipeline(t, Config{Shards: 3})
	engines := make([]*engine, 4)
	for i := range engines {
		engines[i] = newEngine(t)
	}
	stop := make(chan struct{})
	queried := make(chan struct{})
	go func() {
		defer close(queried)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := p.FindMatches(context.Background(), prompt(1, 3)); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for round := range 5 {
		for i, e := range engines {
			name := string(rune('a' + i))
			if err := p.AddWorker(name, WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
			e.parent = 0
			e.store(prompt(1, 3), 16)
		}
		for i := range engines[:3] {
			if err := p.RemoveWorker(context.Background(), string(rune('a'+i))); err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
		}
		if err := p.RemoveWorker(context.Background(), "d"); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.AddWorker("d", WorkerConfig{Endpoint: engines[3].ep, ReplayEndpoint: engines[3].replay}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "only d holds the prompt", func() { engines[3].parent = 0; engines[3].store(prompt(1, 3), 16) }, func() bool {
		s := scores(t, p, prompt(1, 3))
		return len(s) == 1 && s["d"] == 3
	})
	close(stop)
	<-queried
	if got := len(p.Stats().Workers); got != 1 {
		t.Errorf("%d workers left, want 1", got)
	}
}

// A worker whose stream kvpipe has from the engine's first batch is complete;
// after a loss its matches say partial.
func TestMatchSaysPartialAfterALoss(t *testing.T) {
	e := newEngine(t)
	p := startPipeline(t, Config{})
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	system := prompt(1, 4)
	match := func() Match {
		ms, err := p.FindMatches(context.Background(), system)
		if err != nil || len(ms) != 1 {
			return Match{}
		}
		return ms[0]
	}
	e.store(system, 16) // seq 0: the replay at connect brings it even if the PUB dropped it
	eventually(t, "the first batch indexed", nil, func() bool { return match().Blocks == 4 })
	if m := match(); m.Partial {
		t.Errorf("%+v: partial although the stream began at seq 0", m)
	}
	e.pub.SkipSeq() // a failed publish: a gap no replay can fill
	e.parent = 0
	e.store(prompt(2, 2), 16)
	eventually(t, "the loss seen", nil, func() bool { return workerStats(p, "w").Wire.HistoryMissing == 1 })
	// Counted before the batch after the gap reaches the actor: its blocks
	// are polled for.
	var ms []Match
	eventually(t, "the batch after the loss indexed, partial", nil, func() bool {
		ms, _ = p.FindMatches(context.Background(), prompt(2, 2))
		return len(ms) == 1 && ms[0].Blocks == 2 && ms[0].Partial
	})
	if workerStats(p, "w").Wire.HistoryMissing != 1 {
		t.Errorf("matches %+v after one loss, history missing %d times", ms, workerStats(p, "w").Wire.HistoryMissing)
	}
}

// After Sync, an answer reflects every batch the actors had handed on; Sync
// after Shutdown says so instead of touching closed shards.
func TestSync(t *testing.T) {
	e := newEngine(t)
	p := startPipeline(t, Config{})
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the subscription", nil, func() bool { return workerStats(p, "w").Wire.Connected })
	toks := prompt(3, 5)
	e.store(toks, 16)
	// A second batch reaching the actor means the first was handed on.
	e.parent = 0
	e.store(prompt(4, 1), 16)
	eventually(t, "both batches at the actor", nil, func() bool {
		st := workerStats(p, "w")
		return st.Actor.BlocksStored >= 6 && st.Actor.Batches >= 2
	})
	if err := p.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := scores(t, p, toks)["w"]; got != 5 {
		t.Errorf("after Sync the worker matches %d blocks, want 5", got)
	}
	if err := p.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := p.Sync(context.Background()); err != ErrClosed {
		t.Errorf("Sync after Shutdown: %v, want ErrClosed", err)
	}
}

// workerStats is one worker's counters, zero when there is no such worker.
func workerStats(p *Pipeline, name string) WorkerStats {
	w, _ := p.Stats().Worker(name)
	return w
}
