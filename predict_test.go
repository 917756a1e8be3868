package kvpipe

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/seam"
)

// clock is a settable clock for the predictions' TTLs.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// predictingPipeline runs a pipeline of cfg on the clock c.
func predictingPipeline(t *testing.T, cfg Config, c *clock) *Pipeline {
	t.Helper()
	cfg.BlockSize = 16
	cfg.Subscriber.ReconnectMin, cfg.Subscriber.ReconnectMax = 10*time.Millisecond, 100*time.Millisecond
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	p.now = c.now
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	t.Cleanup(func() {
		p.Shutdown(context.Background())
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	eventually(t, "running", nil, func() bool { return p.read.shards.Load() != nil })
	return p
}

// sweepNow ends the predictions expired by the clock, as the sweep does.
func sweepNow(t *testing.T, p *Pipeline) {
	t.Helper()
	if err := p.read.shards.Load().Sweep(context.Background(), p.now()); err != nil {
		t.Fatal(err)
	}
}

// predicted returns each worker's Blocks and Predicted for tokens, after
// a Sync.
func predicted(t *testing.T, p *Pipeline, tokens []uint32) map[string][2]int {
	t.Helper()
	if err := p.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	ms, err := p.FindMatches(context.Background(), tokens)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][2]int{}
	for _, m := range ms {
		out[m.Worker] = [2]int{m.Blocks, m.Predicted}
	}
	return out
}

func keysOf(tokens []uint32) []uint64 {
	var h Hasher
	return h.Prompt(nil, tokens, 16)
}

func routed(t *testing.T, p *Pipeline, worker string, tokens []uint32) {
	t.Helper()
	if err := p.Routed(worker, keysOf(tokens)); err != nil {
		t.Fatal(err)
	}
}

// A prediction lasts its TTL and no longer than the sweep after it: an
// approximate worker's ApproximateTTL, an evented one's PredictionTTL.
func TestPredictionTTL(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	p := predictingPipeline(t, Config{PredictionTTL: 2 * time.Second, ApproximateTTL: 10 * time.Second}, c)
	e := newEngine(t)
	if err := p.AddWorker("evented", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	if err := p.AddWorker("approx", WorkerConfig{CacheBlocks: 100}); err != nil {
		t.Fatal(err)
	}
	tokens := prompt(1, 4)
	routed(t, p, "evented", tokens)
	routed(t, p, "approx", tokens)
	if got := predicted(t, p, tokens); got["evented"] != [2]int{0, 4} || got["approx"] != [2]int{0, 4} {
		t.Fatalf("after Routed: %v, want both 4 predicted, none held", got)
	}
	c.add(2*time.Second - time.Nanosecond)
	sweepNow(t, p)
	if got := predicted(t, p, tokens); got["evented"] != [2]int{0, 4} {
		t.Fatalf("a nanosecond before its TTL: %v, want still predicted", got)
	}
	c.add(time.Nanosecond)
	sweepNow(t, p)
	if got := predicted(t, p, tokens); len(got) != 1 || got["approx"] != [2]int{0, 4} {
		t.Fatalf("at its TTL: %v, want the evented worker's prediction ended, the approximate one's kept", got)
	}
	c.add(8 * time.Second)
	sweepNow(t, p)
	if got := predicted(t, p, tokens); len(got) != 0 {
		t.Fatalf("at ApproximateTTL: %v, want nothing", got)
	}
	st := p.Stats()
	for _, name := range []string{"evented", "approx"} {
		if ws, _ := st.Worker(name); ws.Predictions.Expired != 4 || ws.Predictions.Live != 0 {
			t.Errorf("%s: %+v, want 4 expired, none live", name, ws.Predictions)
		}
	}
	if ws, _ := st.Worker("approx"); !ws.Approximate {
		t.Error("the worker without an Endpoint is not reported approximate")
	}
}

// The engine's events settle predictions: a store confirms them (held
// now), a remove, a clear and a restart end them.
func TestPredictionsSettledByEvents(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	p := predictingPipeline(t, Config{PredictionTTL: time.Hour}, c)
	e := newEngine(t)
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "connected", func() { e.store(prompt(9, 1), 16) }, func() bool { return len(scores(t, p, prompt(9, 1))) == 1 })
	e.parent = 0
	tokens := prompt(1, 4)
	routed(t, p, "w", tokens)
	e.store(tokens[:2*16], 16) // the prefill's first chunk lands
	eventually(t, "2 held, 4 predicted", nil, func() bool { return predicted(t, p, tokens)["w"] == [2]int{2, 4} })
	if ws, _ := p.Stats().Worker("w"); ws.Predictions.Confirmed != 2 || ws.Predictions.Live != 2 {
		t.Fatalf("after the first chunk: %+v, want 2 confirmed, 2 live", ws.Predictions)
	}
	e.store(tokens[2*16:], 16)
	eventually(t, "4 held", nil, func() bool { return predicted(t, p, tokens)["w"] == [2]int{4, 4} })
	if ws, _ := p.Stats().Worker("w"); ws.Predictions.Confirmed != 4 || ws.Predictions.Live != 0 {
		t.Fatalf("after the prefill: %+v, want 4 confirmed, none live", ws.Predictions)
	}
	// Routed again to it: the held blocks are predicted too. A remove of
	// the last ends its prediction with its hold.
	routed(t, p, "w", tokens)
	e.remove(e.next)
	eventually(t, "3 held, 3 predicted", nil, func() bool { return predicted(t, p, tokens)["w"] == [2]int{3, 3} })
	e.pub.Publish(clearBatch())
	eventually(t, "cleared", nil, func() bool { return len(predicted(t, p, tokens)) == 0 })
	if ws, _ := p.Stats().Worker("w"); ws.Predictions.Ended != 4 || ws.Predictions.Live != 0 {
		t.Fatalf("after a remove and a clear: %+v, want 4 ended, none live", ws.Predictions)
	}
	// A restarted engine (a new incarnation) is resynced: its predictions end.
	routed(t, p, "w", tokens)
	e.restart(t, 100)
	e.parent = 0
	other := prompt(7, 1)
	eventually(t, "the restart resynced", func() { e.store(other, 16) }, func() bool {
		return scores(t, p, other)["w"] == 1 && len(predicted(t, p, tokens)) == 0
	})
}

// A worker removed takes its predictions with it; one added again under
// its name starts without them.
func TestPredictionsEndWithTheWorker(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	p := predictingPipeline(t, Config{}, c)
	for _, wc := range []WorkerConfig{{CacheBlocks: 10}, {Endpoint: freeTCP(t)}} {
		if err := p.AddWorker("w", wc); err != nil {
			t.Fatal(err)
		}
		tokens := prompt(1, 3)
		routed(t, p, "w", tokens)
		if got := predicted(t, p, tokens); got["w"] != [2]int{0, 3} {
			t.Fatalf("%+v: %v, want 3 predicted", wc, got)
		}
		if err := p.RemoveWorker(context.Background(), "w"); err != nil {
			t.Fatal(err)
		}
		if err := p.AddWorker("w", WorkerConfig{CacheBlocks: 10}); err != nil {
			t.Fatal(err)
		}
		if got := predicted(t, p, tokens); len(got) != 0 {
			t.Fatalf("%+v: after removal %v, want nothing", wc, got)
		}
		if err := p.RemoveWorker(context.Background(), "w"); err != nil {
			t.Fatal(err)
		}
	}
}

// An approximate worker's predictions are an LRU of its cache's size; an
// evented worker's are capped by MaxWorkerPredictions; both count what
// the cap drops.
func TestPredictionCaps(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	p := predictingPipeline(t, Config{MaxWorkerPredictions: 6}, c)
	if err := p.AddWorker("approx", WorkerConfig{CacheBlocks: 8}); err != nil {
		t.Fatal(err)
	}
	if err := p.AddWorker("evented", WorkerConfig{Endpoint: freeTCP(t)}); err != nil {
		t.Fatal(err)
	}
	a, b := prompt(1, 5), prompt(2, 5)
	for _, w := range []string{"approx", "evented"} {
		routed(t, p, w, a)
		routed(t, p, w, b)
	}
	// The older prompt loses its leaves first.
	if got := predicted(t, p, a); got["approx"] != [2]int{0, 3} || got["evented"] != [2]int{0, 1} {
		t.Fatalf("older prompt: %v, want approx 3 (8 kept), evented 1 (6 kept)", got)
	}
	if got := predicted(t, p, b); got["approx"] != [2]int{0, 5} || got["evented"] != [2]int{0, 5} {
		t.Fatalf("newer prompt: %v, want 5 for both", got)
	}
	// An evented worker whose engine's cache is smaller than the cap is
	// claimed no more of a prompt than it can hold: the leading blocks.
	if err := p.AddWorker("small", WorkerConfig{Endpoint: freeTCP(t), CacheBlocks: 3}); err != nil {
		t.Fatal(err)
	}
	routed(t, p, "small", a)
	if got := predicted(t, p, a); got["small"] != [2]int{0, 3} {
		t.Fatalf("an engine of 3 blocks: %v, want 3 predicted", got)
	}
	if err := p.AddWorker("bad", WorkerConfig{CacheBlocks: -1}); err == nil {
		t.Error("a negative CacheBlocks: no error")
	}
	st := p.Stats()
	for w, want := range map[string]uint64{"approx": 2, "evented": 4} {
		if ws, _ := st.Worker(w); ws.Predictions.Dropped != want || ws.Predictions.Live != int64(10-want) {
			t.Errorf("%s: %+v, want %d dropped", w, ws.Predictions, want)
		}
	}
	if tot := st.Total().Predictions; tot.Dropped != 8 || tot.Live != 17 {
		t.Errorf("total %+v, want 8 dropped, 17 live", tot)
	}
}

// Routed's errors, and a negative PredictionTTL, which leaves evented
// workers without predictions and approximate ones with theirs.
func TestRoutedErrorsAndOff(t *testing.T) {
	p, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AddWorker("a", WorkerConfig{}); err != nil {
		t.Fatal(err)
	}
	if err := p.Routed("a", []uint64{1}); !errors.Is(err, ErrNotRunning) {
		t.Errorf("Routed before Run: %v, want ErrNotRunning", err)
	}
	p.Shutdown(context.Background())
	if err := p.AddWorker("r", WorkerConfig{ReplayEndpoint: "tcp://127.0.0.1:1"}); err == nil {
		t.Error("an approximate worker with a replay endpoint: no error")
	}
	if _, err := New(Config{BlockSize: 16, MaxWorkerPredictions: -1}); err == nil || !strings.Contains(err.Error(), "MaxWorkerPredictions") {
		t.Errorf("a negative MaxWorkerPredictions: %v", err)
	}
	c := &clock{t: time.Unix(1000, 0)}
	p = predictingPipeline(t, Config{PredictionTTL: -1}, c)
	if err := p.Routed("nobody", []uint64{1}); !errors.Is(err, ErrNoWorker) {
		t.Errorf("Routed to an unknown worker: %v, want ErrNoWorker", err)
	}
	if err := p.AddWorker("approx", WorkerConfig{}); err != nil {
		t.Fatal(err)
	}
	if err := p.AddWorker("evented", WorkerConfig{Endpoint: freeTCP(t)}); err != nil {
		t.Fatal(err)
	}
	tokens := prompt(1, 2)
	routed(t, p, "approx", tokens)
	routed(t, p, "evented", tokens)
	if got := predicted(t, p, tokens); len(got) != 1 || got["approx"] != [2]int{0, 2} {
		t.Errorf("with PredictionTTL -1: %v, want the approximate worker's alone", got)
	}
}

// clearBatch is an engine's AllBlocksCleared.
func clearBatch() []byte {
	return engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{{Type: codec.AllBlocksCleared}}}, engineenc.CurrentVLLM)
}

// A Source's workers take predictions too, which the fed ops settle as an
// engine's events do; a Tap (a relay) sees none of them.
func TestPredictionsOfSourceWorkersStayLocal(t *testing.T) {
	src := source{ops: make(chan fedOps)}
	var tapped atomic.Int64
	tap := tapFuncs{ops: func(_ context.Context, _ string, ops []index.Op, _ seam.Origin) uint64 {
		tapped.Add(int64(len(ops)))
		return 0
	}}
	c := &clock{t: time.Unix(1000, 0)}
	p := predictingPipeline(t, Config{Source: src, Tap: tap}, c)
	tokens := prompt(1, 3)
	keys := keysOf(tokens)
	if err := src.apply(t, "remote", FedState{}, index.Op{Kind: index.OpStore, Hash: 77}); err != nil {
		t.Fatal(err)
	}
	if err := p.Routed("remote", keys); err != nil {
		t.Fatal(err)
	}
	if got := predicted(t, p, tokens); got["remote"] != [2]int{0, 3} {
		t.Fatalf("source worker predicted: %v, want 3 predicted", got)
	}
	if err := src.apply(t, "remote", FedState{}, index.Op{Kind: index.OpStore, Hash: keys[0]}); err != nil {
		t.Fatal(err)
	}
	if got := predicted(t, p, tokens); got["remote"] != [2]int{1, 3} {
		t.Fatalf("after a fed store: %v, want 1 held, 3 predicted", got)
	}
	if ws, _ := p.Stats().Worker("remote"); ws.Predictions.Confirmed != 1 || ws.Predictions.Live != 2 {
		t.Errorf("source worker: %+v, want 1 confirmed, 2 live", ws.Predictions)
	}
	if n := tapped.Load(); n != 0 {
		t.Errorf("the Tap saw %d ops: a Source's workers' and predictions are not tapped", n)
	}
}
