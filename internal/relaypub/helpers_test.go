package relaypub

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/natstest"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/kvpipe/kvpipe/internal/ztest"
	"github.com/kvpipe/kvpipe/relay"
	"github.com/kvpipe/kvpipe/wire"
	"github.com/nats-io/nats.go/jetstream"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }

// bs is the engines' and the routers' block size: a trace block of 512
// tokens is 8 of them.
const bs = 64

// testLogger logs to stderr with -v and KVPIPE_TEST_LOG set, else nowhere.
func testLogger() *slog.Logger {
	if os.Getenv("KVPIPE_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// engine is a simulated engine (a prefix cache that evicts, with a host
// tier) behind a real ZMQ PUB and replay ROUTER.
type engine struct {
	name       string
	sim        *sim.Engine
	pub        *wiretest.Publisher
	ep, replay string
	queries    []query // every request it served, once
	seen       map[*sim.Request]bool
}

// query is a served request and its router keys, hashed once.
type query struct {
	r    *sim.Request
	keys []uint64
}

func newEngine(t testing.TB, name string) *engine {
	t.Helper()
	return newEngineOf(t, name, sim.NewEngine(bs, 120, sim.WithCPUOffload(160)))
}

// newEngineOf is newEngine on the simulated cache c, of any size and tiers.
func newEngineOf(t testing.TB, name string, c *sim.Engine) *engine {
	t.Helper()
	e := &engine{name: name, sim: c, ep: ztest.FreeTCP(t), replay: ztest.FreeTCP(t)}
	pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: e.ep, ReplayEndpoint: e.replay})
	if err != nil {
		t.Fatal(err)
	}
	e.pub = pub
	t.Cleanup(func() { pub.Close() })
	return e
}

func (e *engine) config() kvpipe.WorkerConfig {
	return kvpipe.WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}
}

// serve runs the requests, publishing one batch for each that changed the
// cache; it returns the batches published.
func (e *engine) serve(reqs []sim.Request) int {
	n := 0
	for i := range reqs {
		r := &reqs[i]
		tokens := sim.PromptTokens(nil, r)
		evs, _ := e.sim.Serve(nil, r, tokens)
		if !e.seen[r] {
			if e.seen == nil {
				e.seen = map[*sim.Request]bool{}
			}
			e.seen[r] = true
			var h index.Hasher
			e.queries = append(e.queries, query{r, h.Prompt(nil, tokens, bs)})
		}
		if len(evs) > 0 {
			e.pub.Publish(engineenc.AppendBatch(nil, &codec.Batch{Events: evs}, engineenc.CurrentVLLM))
			n++
		}
	}
	return n
}

// trace returns n synthetic requests, the same for a seed.
func trace(n int, seed uint64) []sim.Request { return sim.SyntheticTrace(n, seed) }

// startServer starts an in-process nats-server and connects to it.
var startServer = natstest.StartJetStream

// testSettings are small enough for tests to trim.
func testSettings() relay.Settings {
	return relay.Settings{Prefix: "test.ops", Stream: "TEST_OPS", Bucket: "test-snapshots", Object: "snap"}
}

func relayConfig(s relay.Settings) Config {
	return Config{
		Settings: s,
		Pipeline: kvpipe.Config{BlockSize: bs, Logger: testLogger(),
			Subscriber: wire.Options{ReconnectMin: 10 * time.Millisecond, ReconnectMax: 100 * time.Millisecond}},
		SnapshotEvery:  time.Hour,       // tests write snapshots when they want them
		PublishTimeout: 2 * time.Second, // the default: a loaded machine acknowledges late, and each retry is a copy
		RetryMin:       10 * time.Millisecond, RetryMax: 100 * time.Millisecond,
	}
}

// running is a Relay run by a test.
type running struct {
	*Relay
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

// startRelay runs a relay of cfg for the engines until the test ends or
// stop is called.
func startRelay(t testing.TB, js jetstream.JetStream, cfg Config, engines ...*engine) *running {
	t.Helper()
	r, err := New(js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range engines {
		if err := r.AddWorker(e.name, e.config()); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	rr := &running{Relay: r, cancel: cancel, done: make(chan error, 1)}
	go func() { rr.done <- r.Run(ctx) }()
	t.Cleanup(rr.stop)
	return rr
}

// stop ends the relay's Run (it writes its last snapshot) and waits.
func (rr *running) stop() {
	rr.once.Do(func() {
		rr.cancel()
		rr.err = <-rr.done
	})
}

// snapshotNow writes the relay's snapshot now, as its ticker would.
func (rr *running) snapshotNow(t testing.TB) {
	t.Helper()
	rr.mu.Lock()
	ru := rr.cur
	rr.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	before := rr.Stats().Snapshots
	for ru.stream == nil || ru.p.Stats().Workers == nil { // not set up yet
		if ctx.Err() != nil {
			t.Fatal("relay not running")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := ru.snapshot(ctx); err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	if rr.Stats().Snapshots != before+1 {
		t.Fatal("snapshot not counted")
	}
}

// router is a router's Pipeline fed by a Follower.
type router struct {
	p *kvpipe.Pipeline
	f *relay.Follower
}

func startRouter(t testing.TB, js jetstream.JetStream, s relay.Settings) *router {
	t.Helper()
	f, err := relay.NewFollower(js, s, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvpipe.New(kvpipe.Config{BlockSize: bs, Source: f, Logger: testLogger(),
		RestartMin: 10 * time.Millisecond, RestartMax: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	t.Cleanup(func() {
		p.Shutdown(context.Background())
		if err := <-done; err != nil {
			t.Errorf("router Run: %v", err)
		}
	})
	return &router{p: p, f: f}
}

// eventually polls cond until it returns nil, for up to 30s.
func eventually(t testing.TB, what string, cond func() error) {
	t.Helper()
	eventuallyWhile(t, what, nil, cond)
}

// eventuallyWhile is eventually whose 30 s start again whenever progress
// (if not nil) returns another value: a relay publishing one message per
// round trip (a reconnect buffer) on a loaded machine with -race may need
// minutes for what takes seconds alone, and only a stall is a failure.
func eventuallyWhile(t testing.TB, what string, progress func() uint64, cond func() error) {
	t.Helper()
	var err error
	var seen uint64
	if progress != nil {
		seen = progress()
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		if err = cond(); err == nil {
			return
		}
		time.Sleep(10 * time.Millisecond)
		if progress != nil {
			if now := progress(); now != seen {
				seen, deadline = now, time.Now().Add(30*time.Second)
			}
		}
	}
	t.Fatalf("timed out waiting for %s (no progress for 30s): %v", what, err)
}

// exact reports where p's answers differ from what the engines hold: for
// every request an engine served, every engine's leading blocks on device
// and in device or host, and the worker not partial.
func exact(p *kvpipe.Pipeline, engines ...*engine) error {
	ctx := context.Background()
	for _, e := range engines {
		for _, q := range e.queries {
			ms, err := p.AppendMatchesKeys(ctx, nil, q.keys, nil)
			if err != nil {
				return err
			}
			for _, o := range engines {
				dev, any := o.sim.Held(q.r)
				var m kvpipe.Match
				for _, x := range ms {
					if x.Worker == o.name {
						m = x
					}
				}
				if m.Blocks != dev || m.Tiers[index.TierHost] != any {
					return fmt.Errorf("%s scores %d on device, %d with host; its engine holds %d, %d", o.name, m.Blocks, m.Tiers[index.TierHost], dev, any)
				}
				if m.Partial {
					return fmt.Errorf("%s partial", o.name)
				}
			}
		}
	}
	return nil
}

// sound reports a key p holds that an engine does not: p may lack blocks,
// never have extra ones.
func sound(p *kvpipe.Pipeline, engines ...*engine) error {
	ctx := context.Background()
	for _, e := range engines {
		for _, q := range e.queries {
			ms, err := p.AppendMatchesKeys(ctx, nil, q.keys, nil)
			if err != nil {
				return err
			}
			for _, o := range engines {
				dev, any := o.sim.Held(q.r)
				for _, m := range ms {
					if m.Worker == o.name && (m.Blocks > dev || m.Tiers[index.TierHost] > any) {
						return fmt.Errorf("%s scores %d on device, %d with host; its engine holds only %d, %d", o.name, m.Blocks, m.Tiers[index.TierHost], dev, any)
					}
				}
			}
		}
	}
	return nil
}

// sameBlocks reports where the routers' per-worker block counts differ
// from the relay's own pipeline's, tier by tier.
func sameBlocks(relay *kvpipe.Pipeline, routers ...*router) error {
	want := map[string][index.NumTiers]int64{}
	for _, w := range relay.Stats().Workers {
		want[w.Name] = w.Actor.TierBlocks
	}
	for i, r := range routers {
		got := map[string][index.NumTiers]int64{}
		for _, w := range r.p.Stats().Workers {
			got[w.Name] = w.Actor.TierBlocks
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("router %d holds %v blocks per worker and tier, the relay %v", i, got, want)
		}
	}
	return nil
}

// streamState is the stream's first and last sequence and message count.
func streamState(t testing.TB, js jetstream.JetStream, s relay.Settings) jetstream.StreamState {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, s.Stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return info.State
}

// caughtUp waits until the router has handled every message in the stream.
func caughtUp(t testing.TB, js jetstream.JetStream, s relay.Settings, rs ...*router) {
	t.Helper()
	last := streamState(t, js, s).LastSeq
	progress := func() uint64 {
		n := uint64(0)
		for _, r := range rs {
			n += r.f.Stats().LastApplied
		}
		return n
	}
	eventuallyWhile(t, "routers caught up", progress, func() error {
		for i, r := range rs {
			if st := r.f.Stats(); st.LastApplied < last {
				return fmt.Errorf("router %d at seq %d of %d", i, st.LastApplied, last)
			}
		}
		return nil
	})
	for _, r := range rs { // and its shards have applied all of it
		if err := r.p.Sync(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

// holdsSome reports whether p scores any worker above 0 for an engine's
// request.
func holdsSome(p *kvpipe.Pipeline, engines ...*engine) bool {
	for _, e := range engines {
		for _, q := range e.queries {
			if ms, _ := p.AppendMatchesKeys(context.Background(), nil, q.keys, nil); len(ms) > 0 {
				return true
			}
		}
	}
	return false
}

// converged waits until rr has relayed every batch of the engines and r
// has applied the whole stream, and then checks that r's index is the
// engines' caches and holds as many blocks per worker and tier as the
// relay's: the end state every fault must come back to.
func converged(t testing.TB, js jetstream.JetStream, s relay.Settings, rr *running, r *router, engines ...*engine) {
	t.Helper()
	relayed(t, rr, engines...)
	caughtUp(t, js, s, r)
	if err := exact(r.p, engines...); err != nil {
		t.Error(err)
	}
	if err := sameBlocks(rr.Pipeline(), r); err != nil {
		t.Error(err)
	}
}

// relayed waits until the relay's workers have each published all of their
// engine's batches (the relay's index is then the engines').
func relayed(t testing.TB, rr *running, engines ...*engine) {
	t.Helper()
	progress := func() uint64 { // messages acknowledged, and batches the workers took
		n := rr.Stats().Published
		if p := rr.Pipeline(); p != nil {
			n += p.Stats().Total().Actor.Batches
		}
		return n
	}
	eventuallyWhile(t, "relay caught up with the engines", progress, func() error {
		p := rr.Pipeline()
		if p == nil {
			return fmt.Errorf("no pipeline")
		}
		// Cheap first: as many blocks per tier as the engine holds.
		for _, e := range engines {
			w, _ := p.Stats().Worker(e.name)
			if tb := w.Actor.TierBlocks; tb[index.TierDevice] != int64(e.sim.Len()) || tb[index.TierHost] != int64(e.sim.HostLen()) {
				return fmt.Errorf("worker %s holds %v blocks, its engine %d and %d", e.name, tb, e.sim.Len(), e.sim.HostLen())
			}
		}
		if err := p.Sync(context.Background()); err != nil {
			return err
		}
		if err := exact(p, engines...); err != nil {
			return err
		}
		// And the stream has all of it. The engines are idle: nothing is
		// published beside these flushes.
		rr.mu.Lock()
		ru := rr.cur
		rr.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, e := range engines {
			if _, err := ru.Flush(ctx, e.name); err != nil {
				return err
			}
		}
		return nil
	})
}

// appendEvents is the payload of one batch of evs.
func appendEvents(evs ...codec.Event) []byte {
	return engineenc.AppendBatch(nil, &codec.Batch{Events: evs}, engineenc.CurrentVLLM)
}

// restart replaces the engine with a new incarnation on the same
// endpoints: an empty cache, seqs from 0 again.
func (e *engine) restart(t testing.TB) {
	t.Helper()
	e.pub.Close()
	pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: e.ep, ReplayEndpoint: e.replay})
	if err != nil {
		t.Fatal(err)
	}
	e.pub = pub
	t.Cleanup(func() { pub.Close() })
	e.sim = sim.NewEngine(bs, 120, sim.WithCPUOffload(160))
	e.queries, e.seen = nil, nil
}
