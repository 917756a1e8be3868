package kvpipe

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/kvpipe/kvpipe/wire"
)

// newSmallEngine is newEngine with a replay buffer of only steps batches.
func newSmallEngine(t *testing.T, steps int) *engine {
	t.Helper()
	e := &engine{ep: freeTCP(t), replay: freeTCP(t)}
	e.restart(t, steps)
	return e
}

// restart replaces the engine's publisher by a new incarnation on the same
// endpoints: its seqs start again from 0 and its buffer is empty.
func (e *engine) restart(t *testing.T, steps int) {
	t.Helper()
	if e.pub != nil {
		e.pub.Close()
	}
	pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: e.ep, ReplayEndpoint: e.replay, BufferSteps: steps})
	if err != nil {
		t.Fatal(err)
	}
	e.pub = pub
	t.Cleanup(func() { pub.Close() })
}

func (e *engine) remove(hashes ...uint64) {
	ev := codec.Event{Type: codec.BlockRemoved, BlockHashes: hashes}
	e.pub.Publish(engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{ev}}, engineenc.CurrentVLLM))
}

// snapshotTo takes p's snapshot and saves it in a file.
func snapshotTo(t *testing.T, p *Pipeline) FileStore {
	t.Helper()
	st := FileStore{Path: filepath.Join(t.TempDir(), "index.kvps")}
	if err := p.SaveSnapshot(context.Background(), st); err != nil {
		t.Fatal(err)
	}
	return st
}

// restoredPipeline runs a new pipeline from the snapshot in st.
func restoredPipeline(t *testing.T, st Store) *Pipeline {
	t.Helper()
	p, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	s, err := LoadSnapshot(context.Background(), st)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Restore(s); err != nil {
		t.Fatal(err)
	}
	return p
}

// A router restarted from its snapshot has the blocks stored before it,
// though the engine's replay buffer no longer does, and what the engine did
// while it was down: the snapshot's seq is proven and what follows replayed.
// An engine that restarted meanwhile, or one without a replay endpoint,
// cannot prove continuity: its worker is resynced, and holds only the new
// incarnation's blocks.
func TestRestartFromASnapshot(t *testing.T) {
	cases := []struct {
		name          string
		engineRestart bool
		noReplay      bool
	}{
		{"proven", false, false},
		{"engine restarted meanwhile", true, false},
		{"no replay endpoint", false, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newSmallEngine(t, 3)
			wc := WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}
			if c.noReplay {
				wc.ReplayEndpoint = ""
			}
			p1 := startPipeline(t, Config{})
			if err := p1.AddWorker("a", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
				t.Fatal(err)
			}
			e.store(prompt(1, 4), 16) // blocks 1-4
			e.parent = 0
			e.store(prompt(2, 3), 16) // 5-7
			eventually(t, "both prompts indexed", nil, func() bool {
				return scores(t, p1, prompt(1, 4))["a"] == 4 && scores(t, p1, prompt(2, 3))["a"] == 3
			})
			st := snapshotTo(t, p1)
			if err := p1.Shutdown(context.Background()); err != nil {
				t.Fatal(err)
			}
			// While no router listens: one block evicted, one prompt stored,
			// and the buffer of 3 has lost the first batch.
			if c.engineRestart {
				e.restart(t, 3)
				e.next = 100
			}
			e.remove(7)
			e.parent = 0
			e.store(prompt(3, 2), 16)
			e.pub.Flush() // sent to nobody: the next router cannot receive them live

			p2 := restoredPipeline(t, st)
			runUntilCleanup(t, p2)
			if err := p2.AddWorker("a", wc); err != nil {
				t.Fatal(err)
			}
			want := map[int]int{1: 4, 2: 2, 3: 2} // prompt -> blocks held
			resyncs := uint64(0)
			switch {
			case c.engineRestart:
				want, resyncs = map[int]int{1: 0, 2: 0, 3: 2}, 1
			case c.noReplay: // nothing can be proven, and nothing replayed: the live stream goes on
				want, resyncs = map[int]int{1: 0, 2: 0, 3: 0}, 1
			}
			lens := map[int]int{1: 4, 2: 3, 3: 2}
			var seen string // what the last look found, should it be the last
			defer func() {
				if t.Failed() {
					t.Logf("last seen: %s", seen)
				}
			}()
			eventually(t, "the index as the engine", nil, func() bool {
				st := p2.Stats()
				got := map[int]int{}
				for pr := range want {
					got[pr] = scores(t, p2, prompt(pr, lens[pr]))["a"]
				}
				seen = fmt.Sprintf("blocks held %v (want %v), workers %+v", got, want, st.Workers)
				if len(st.Workers) != 1 || st.Workers[0].Actor.Resyncs != resyncs {
					return false
				}
				return maps.Equal(got, want)
			})
			ws := p2.Stats().Workers[0]
			if !c.engineRestart && !c.noReplay {
				if ws.Actor.Partial {
					t.Error("a worker restored whole and proven is partial")
				}
				if ws.Wire.Lost != 0 || ws.Wire.Restarts != 0 {
					t.Errorf("lost %d restarts %d, want none", ws.Wire.Lost, ws.Wire.Restarts)
				}
			}
		})
	}
}

// runUntilCleanup runs an already built pipeline until the test ends.
func runUntilCleanup(t *testing.T, p *Pipeline) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	t.Cleanup(func() {
		p.Shutdown(context.Background())
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

func TestRestoreErrors(t *testing.T) {
	good := snapshot.Snapshot{Version: snapshot.Version, BlockSize: 16, KeySeed: index.Seed, Workers: []snapshot.Worker{{Name: []byte("a")}}}
	cases := []struct {
		name string
		s    snapshot.Snapshot
		want string
	}{
		{"block size", snapshot.Snapshot{Version: snapshot.Version, BlockSize: 32}, "block size is 32"},
		{"inconsistent", snapshot.Snapshot{Version: snapshot.Version, BlockSize: 16,
			Workers: []snapshot.Worker{{Name: []byte("a"), Hashes: []uint64{1}}}}, "keys"},
		{"version", snapshot.Snapshot{Version: 99, BlockSize: 16}, "version"},
		{"key seed", snapshot.Snapshot{Version: snapshot.Version, BlockSize: 16, KeySeed: index.Seed + 1}, "seed"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, err := New(Config{BlockSize: 16})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Shutdown(context.Background())
			err = p.Restore(&Snapshot{c.s})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Restore: %v, want an error naming %q", err, c.want)
			}
			if p.restored != nil {
				t.Error("a refused snapshot was kept")
			}
		})
	}
	p := startPipeline(t, Config{})
	eventually(t, "running", nil, func() bool { return p.read.shards.Load() != nil })
	if err := p.Restore(&Snapshot{good}); err == nil {
		t.Error("Restore after Run: no error")
	}
	var s Snapshot
	idle, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	if err := idle.Snapshot(context.Background(), &s); !errors.Is(err, ErrNotRunning) {
		t.Errorf("Snapshot before Run: %v, want ErrNotRunning", err)
	}
	idle.Shutdown(context.Background())
	if err := idle.Snapshot(context.Background(), &s); !errors.Is(err, ErrClosed) {
		t.Errorf("Snapshot after Shutdown: %v, want ErrClosed", err)
	}
}

// source is a Source that applies what the test sends it.
type source struct{ ops chan fedOps }

type fedOps struct {
	worker string
	st     FedState
	ops    []index.Op
	err    chan error
}

func (s source) Run(ctx context.Context, f *Feed) error {
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case o := <-s.ops:
			o.err <- f.Apply(ctx, o.worker, o.st, o.ops)
		}
	}
}

func (s source) apply(t *testing.T, worker string, st FedState, ops ...index.Op) error {
	t.Helper()
	errc := make(chan error, 1)
	s.ops <- fedOps{worker, st, ops, errc}
	select {
	case err := <-errc:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("the source never applied the ops")
		return nil
	}
}

// A Source's workers are made by its ops and removed by them, answer
// FindMatches like engine workers, and stay out of snapshots.
func TestSourceFeedsTheIndex(t *testing.T) {
	src := source{ops: make(chan fedOps)}
	p := startPipeline(t, Config{Source: src})
	var h index.Hasher
	keys := h.Prompt(nil, prompt(1, 3), 16)
	var ops []index.Op
	for _, k := range keys {
		ops = append(ops, index.Op{Kind: index.OpStore, Hash: k}, index.Op{Kind: index.OpStore, Tier: index.TierHost, Hash: k})
	}
	if err := src.apply(t, "remote", FedState{}, ops...); err != nil {
		t.Fatal(err)
	}
	if err := src.apply(t, "other", FedState{Partial: true}, ops[:2]...); err != nil {
		t.Fatal(err)
	}
	if err := p.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	ms, err := p.FindMatches(context.Background(), prompt(1, 3))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Match{}
	for _, m := range ms {
		got[m.Worker] = m
	}
	if m := got["remote"]; m.Blocks != 3 || m.Tiers[index.TierHost] != 3 || m.Partial {
		t.Errorf("remote: %+v, want 3 blocks on device and host, not partial", m)
	}
	if m := got["other"]; m.Blocks != 1 || !m.Partial {
		t.Errorf("other: %+v, want 1 block, partial", m)
	}
	st := p.Stats()
	if len(st.Workers) != 2 || st.Workers[1].Actor.TierBlocks[index.TierHost] != 3 {
		t.Errorf("stats %+v, want two workers, remote's host tier of 3", st.Workers)
	}
	var snap Snapshot
	if err := p.Snapshot(context.Background(), &snap); err != nil || len(snap.s.Workers) != 0 {
		t.Errorf("snapshot of source workers: %d workers, err %v; want none", len(snap.s.Workers), err)
	}
	if err := p.AddWorker("remote", WorkerConfig{Endpoint: freeTCP(t)}); err == nil {
		t.Error("an engine worker took a source worker's name")
	}
	if err := p.RemoveWorker(context.Background(), "remote"); err == nil {
		t.Error("RemoveWorker took a source worker")
	}
	// Removed by its ops, then made again by the ones after.
	if err := src.apply(t, "remote", FedState{}, index.Op{Kind: index.OpRemoveWorker}, ops[0]); err != nil {
		t.Fatal(err)
	}
	if err := p.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := scores(t, p, prompt(1, 3))["remote"]; got != 1 {
		t.Errorf("remote after its removal and one store: %d blocks, want 1", got)
	}
}

// A Source's worker that joined its stream late removes blocks it never
// stored here: its held-block counts are what the index holds, not its
// stores less its removes.
func TestSourceWorkerCountsWhatItHolds(t *testing.T) {
	src := source{ops: make(chan fedOps)}
	p := startPipeline(t, Config{Source: src})
	var h index.Hasher
	keys := h.Prompt(nil, prompt(2, 6), 16) // 6 keys
	op := func(kind index.OpKind, tier index.Tier, i int) index.Op {
		return index.Op{Kind: kind, Tier: tier, Hash: keys[i]}
	}
	for _, c := range []struct {
		name         string
		ops          []index.Op
		device, host int64
	}{
		{"stores", []index.Op{op(index.OpStore, 0, 0), op(index.OpStore, 0, 1), op(index.OpStore, 0, 2), op(index.OpStore, index.TierHost, 3)}, 3, 1},
		{"removes of blocks never stored", []index.Op{op(index.OpRemove, 0, 4), op(index.OpRemove, 0, 5), op(index.OpRemove, index.TierHost, 0)}, 3, 1},
		{"a remove of a block held", []index.Op{op(index.OpRemove, 0, 0)}, 2, 1},
		{"one key stored twice, removed once", []index.Op{op(index.OpStore, 0, 1), op(index.OpRemove, 0, 1)}, 2, 1},
		{"the host tier cleared", []index.Op{{Kind: index.OpClearTier, Tier: index.TierHost}, op(index.OpRemove, index.TierHost, 3)}, 2, 0},
		{"cleared, then a store", []index.Op{{Kind: index.OpClearWorker}, op(index.OpRemove, 0, 1), op(index.OpStore, 0, 5)}, 1, 0},
	} {
		if err := src.apply(t, "late", FedState{Partial: true}, c.ops...); err != nil {
			t.Fatal(err)
		}
		if err := p.Sync(context.Background()); err != nil {
			t.Fatal(err)
		}
		w, ok := p.Stats().Worker("late")
		if tb := w.Actor.TierBlocks; !ok || tb[index.TierDevice] != c.device || tb[index.TierHost] != c.host || w.Actor.IndexedBlocks != c.device {
			t.Errorf("after %s: %+v, want %d on device and %d in host", c.name, w.Actor, c.device, c.host)
		}
	}
}

// Publish sees each worker's ops before its shard, and a removed worker's
// OpRemoveWorker last; a snapshot records what it last returned.
func TestPublishHook(t *testing.T) {
	type call struct {
		worker string
		ops    []index.Op
	}
	calls := make(chan call, 1000)
	var seq uint64 // only the worker's goroutine, then the remover, call it
	p := startPipeline(t, Config{Tap: tapFuncs{
		ops: func(_ context.Context, worker string, ops []index.Op, _ seam.Origin) uint64 {
			calls <- call{worker, append([]index.Op(nil), ops...)}
			seq++
			return seq
		},
		// Ops stores each batch before it returns: the last position covers all.
		flush: func(context.Context, string) (uint64, error) { return seq, nil },
	}})
	e := newEngine(t)
	if err := p.AddWorker("a", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	e.store(prompt(1, 2), 16)
	var h index.Hasher
	keys := h.Prompt(nil, prompt(1, 2), 16)
	for i, want := range [][]index.Op{
		{{Kind: index.OpClearWorker}}, // started afresh: what the stream held of "a" is not its
		{{Kind: index.OpStore, Link: index.LinkRoot, Hash: keys[0]}, {Kind: index.OpStore, Link: index.LinkChild, Hash: keys[1], Parent: keys[0]}},
	} {
		select {
		case c := <-calls:
			if c.worker != "a" || !slices.Equal(c.ops, want) {
				t.Fatalf("publish %d: %+v, want a's %v", i, c, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("nothing published")
		}
	}
	var snap Snapshot
	if err := p.Snapshot(context.Background(), &snap); err != nil {
		t.Fatal(err)
	}
	if len(snap.s.Workers) != 1 || snap.s.Workers[0].StreamSeq != 2 || !snap.s.Workers[0].HasSeq || snap.s.Workers[0].Seq != 0 {
		t.Fatalf("snapshot workers %+v, want a at seq 0, stream seq 2", snap.s.Workers)
	}
	if err := p.RemoveWorker(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	c := <-calls
	if len(c.ops) != 1 || c.ops[0].Kind != index.OpRemoveWorker {
		t.Fatalf("published on removal %+v, want one OpRemoveWorker", c)
	}
}

// Republish hands Publish the worker's whole state (a clear, then its
// blocks); a snapshot takes the position from Flush when it is set; both
// refuse what they cannot do.
func TestRepublishAndFlush(t *testing.T) {
	type call struct {
		ops []index.Op
		o   seam.Origin
	}
	calls := make(chan call, 1000)
	var republish seam.Republish
	p := startPipeline(t, Config{Tap: tapFuncs{
		bind: func(r seam.Republish) { republish = r },
		ops: func(_ context.Context, _ string, ops []index.Op, o seam.Origin) uint64 {
			calls <- call{append([]index.Op(nil), ops...), o}
			return 1
		},
		flush: func(ctx context.Context, worker string) (uint64, error) { return 42, nil },
	}})
	e := newEngine(t)
	if err := p.AddWorker("a", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	e.store(prompt(1, 3), 16)
	var h index.Hasher
	keys := h.Prompt(nil, prompt(1, 3), 16)
	for n := 0; n < 1+len(keys); { // the start's clear, then the stores
		select {
		case c := <-calls:
			n += len(c.ops)
		case <-time.After(10 * time.Second):
			t.Fatal("nothing published")
		}
	}
	if republish == nil {
		t.Fatal("New did not bind the Tap to the pipeline")
	}
	if err := republish(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	c := <-calls
	got := slices.Clone(c.ops[1:])
	slices.SortFunc(got, func(x, y index.Op) int { return cmp.Compare(x.Hash, y.Hash) })
	want := []index.Op{}
	for i, k := range keys { // each chained as the engine stored it
		op := index.Op{Kind: index.OpStore, Hash: k, Link: index.LinkRoot}
		if i > 0 {
			op.Link, op.Parent = index.LinkChild, keys[i-1]
		}
		want = append(want, op)
	}
	slices.SortFunc(want, func(x, y index.Op) int { return cmp.Compare(x.Hash, y.Hash) })
	if c.ops[0].Kind != index.OpClearWorker || !slices.Equal(got, want) || !c.o.Whole || c.o.Partial {
		t.Errorf("republished %+v (%+v), want a clear then the stores of %v, chained, whole and not partial", c.ops, c.o, keys)
	}
	if err := republish(context.Background(), "nobody"); !errors.Is(err, ErrNoWorker) {
		t.Errorf("Republish of an unknown worker: %v, want ErrNoWorker", err)
	}
	var snap Snapshot
	if err := p.Snapshot(context.Background(), &snap); err != nil {
		t.Fatal(err)
	}
	if len(snap.s.Workers) != 1 || snap.s.Workers[0].StreamSeq != 42 {
		t.Errorf("snapshot workers %+v, want a at stream seq 42, what Flush said", snap.s.Workers)
	}
}

// A restored worker's entries stay out of answers until its engine proves
// the snapshot's position: with the engine gone, the router serves nothing
// of it, and says it is partial; a snapshot taken meanwhile keeps the
// restored state.
func TestRestoredWorkerWaitsForItsProof(t *testing.T) {
	e := newSmallEngine(t, 100)
	p1 := startPipeline(t, Config{})
	if err := p1.AddWorker("a", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	e.store(prompt(1, 4), 16)
	eventually(t, "indexed", nil, func() bool { return scores(t, p1, prompt(1, 4))["a"] == 4 })
	st := snapshotTo(t, p1)
	p1.Shutdown(context.Background())
	e.pub.Close() // the engine is gone

	p2 := restoredPipeline(t, st)
	runUntilCleanup(t, p2)
	if err := p2.AddWorker("a", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if got := scores(t, p2, prompt(1, 4))["a"]; got != 0 {
			t.Fatalf("the restored worker answers %d blocks with its engine unreachable, want none until proven", got)
		}
		if ws := p2.Stats().Workers[0]; !ws.Actor.Partial {
			t.Fatal("an unproven restored worker is not partial")
		}
	}
	var again Snapshot
	if err := p2.Snapshot(context.Background(), &again); err != nil {
		t.Fatal(err)
	}
	if len(again.s.Workers) != 1 || again.s.Workers[0].Blocks() != 4 || again.s.Workers[0].Partial {
		t.Errorf("a snapshot of the unproven worker: %d workers, %d blocks: want the restored state kept", len(again.s.Workers), again.Blocks())
	}
}

// A Snapshot that the pipeline's shutdown overtakes fails rather than
// returning a snapshot without the workers it stopped.
func TestSnapshotDuringShutdownFails(t *testing.T) {
	p, e, h := heldPipeline(t)
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	holdABatch(t, e, h)
	snapped := make(chan error, 1)
	go func() {
		var s Snapshot
		snapped <- p.Snapshot(context.Background(), &s)
	}()
	expired, cancel := context.WithCancel(context.Background())
	cancel()
	p.Shutdown(expired)
	eventually(t, "Run draining", nil, func() bool { p.mu.Lock(); defer p.mu.Unlock(); return p.phase == draining })
	close(h.release)
	if err := <-snapped; !errors.Is(err, ErrClosed) {
		t.Errorf("Snapshot overtaken by Shutdown = %v, want ErrClosed", err)
	}
	if err := <-done; err != nil {
		t.Errorf("Run = %v", err)
	}
}

// A worker that cannot answer in time (here held in its handler, as in a
// long replay) does not cost the others their snapshot: with a deadline,
// it is recorded absent, the others are taken whole, and a restore keeps
// the absent one absent until it is added, when it starts afresh.
func TestSnapshotRecordsAWorkerThatCannotAnswerAbsent(t *testing.T) {
	e := newEngine(t)
	p, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	// One held batch for the whole pipeline: w's, published before v is added.
	h := held{entered: make(chan struct{}, 1), release: make(chan struct{})}
	p.wrap = func(inner wire.Handler) wire.Handler {
		return held{Handler: inner, entered: h.entered, release: h.release}
	}
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, p)
	holdABatch(t, e, h)
	defer close(h.release)
	e2 := newEngine(t)
	if err := p.AddWorker("v", WorkerConfig{Endpoint: e2.ep, ReplayEndpoint: e2.replay}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "v's prompt indexed", func() { e2.parent = 0; e2.store(prompt(2, 3), 16) },
		func() bool { return scores(t, p, prompt(2, 3))["v"] == 3 })

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var got Snapshot
	if err := p.Snapshot(ctx, &got); err != nil {
		t.Fatalf("Snapshot with a worker held = %v, want the others taken", err)
	}
	checkAbsent := func(what string, s *Snapshot) {
		t.Helper()
		if a := s.Absent(); !slices.Equal(a, []string{"w"}) || s.Workers() != 2 {
			t.Fatalf("%s: absent %q of %d workers, want [w] of 2", what, a, s.Workers())
		}
		for _, w := range s.s.Workers {
			switch string(w.Name) {
			case "w":
				if !w.Partial || w.HasSeq || w.Blocks() != 0 {
					t.Errorf("%s: absent worker %+v holds state", what, w)
				}
			case "v":
				if w.Absent || !w.HasSeq || w.Blocks() == 0 {
					t.Errorf("%s: worker v %+v, want its seq and blocks", what, w)
				}
			}
		}
	}
	checkAbsent("taken", &got)
	data, err := got.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	var decoded Snapshot
	if err := decoded.UnmarshalBinary(data); err != nil {
		t.Fatal(err)
	}
	checkAbsent("decoded", &decoded)

	p2, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	if err := p2.Restore(&decoded); err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, p2)
	var again Snapshot
	eventually(t, "running", nil, func() bool { return p2.Snapshot(context.Background(), &again) == nil })
	checkAbsent("restored, not added", &again)
}

// A snapshot in which every worker would be absent fails, and so does one
// without a deadline whose Tap cannot flush: an older snapshot is worth
// more than one that starts every worker afresh, and a caller that set no
// time limit did not ask for a worker to be given up.
func TestSnapshotRefusesToGiveUpEveryWorker(t *testing.T) {
	p, e, h := heldPipeline(t)
	runUntilCleanup(t, p)
	holdABatch(t, e, h)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var s Snapshot
	if err := p.Snapshot(ctx, &s); err == nil || !strings.Contains(err.Error(), "none of the 1 workers") {
		t.Errorf("Snapshot with its only worker held = %v, want a refusal", err)
	}
	close(h.release)

	failing := errors.New("stream unreachable")
	p2 := startPipeline(t, Config{Tap: tapFuncs{
		ops:   func(context.Context, string, []index.Op, seam.Origin) uint64 { return 1 },
		flush: func(context.Context, string) (uint64, error) { return 0, failing },
	}})
	e2 := newEngine(t)
	if err := p2.AddWorker("a", WorkerConfig{Endpoint: e2.ep, ReplayEndpoint: e2.replay}); err != nil {
		t.Fatal(err)
	}
	var err error
	eventually(t, "running", nil, func() bool { err = p2.Snapshot(context.Background(), &s); return !errors.Is(err, ErrNotRunning) })
	if !errors.Is(err, failing) {
		t.Errorf("Snapshot without a deadline, its Tap failing = %v, want %v", err, failing)
	}
}

// A name being removed cannot be added again until its removal is queued
// (and published) behind its last ops: the stream would otherwise remove
// the new worker.
func TestNameBeingRemovedIsNotTaken(t *testing.T) {
	p, e, h := heldPipeline(t)
	runUntilCleanup(t, p)
	holdABatch(t, e, h)
	expired, cancel := context.WithCancel(context.Background())
	cancel()
	if err := p.RemoveWorker(expired, "w"); !errors.Is(err, context.Canceled) {
		t.Fatalf("RemoveWorker = %v, want context.Canceled", err)
	}
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep}); err == nil || !strings.Contains(err.Error(), "being removed") {
		t.Fatalf("AddWorker during the removal = %v, want a refusal", err)
	}
	close(h.release)
	eventually(t, "the name free again", nil, func() bool { return p.AddWorker("w", WorkerConfig{Endpoint: e.ep}) == nil })
}

// A Source's bad op fails its call, applies none of it, and crashes
// nothing.
func TestFeedRefusesBadOps(t *testing.T) {
	src := source{ops: make(chan fedOps)}
	p := startPipeline(t, Config{Source: src})
	for _, bad := range []index.Op{{Kind: index.OpStore, Tier: index.NumTiers}, {Kind: index.OpClearTier + 1}, {Kind: index.OpStore, Link: index.LinkChild + 1}} {
		if err := src.apply(t, "remote", FedState{}, index.Op{Kind: index.OpStore, Hash: 1}, bad); err == nil {
			t.Errorf("op %+v applied", bad)
		}
	}
	if err := p.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(); len(st.Workers) != 0 {
		t.Errorf("workers %+v after refused calls, want none", st.Workers)
	}
}

// Restore keeps its own copy: the caller may reuse its Snapshot.
func TestRestoreCopiesTheSnapshot(t *testing.T) {
	s := snapshot.Snapshot{Version: snapshot.Version, BlockSize: 16, KeySeed: index.Seed,
		Workers: []snapshot.Worker{{Name: []byte("a"), HasSeq: true, Hashes: []uint64{1}, Keys: []uint64{2}, Parents: []uint64{0}, Flags: []byte{1 << snapshot.TierShift}}}}
	p, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	in := &Snapshot{s}
	if err := p.Restore(in); err != nil {
		t.Fatal(err)
	}
	in.s.Workers[0].Name[0], in.s.Workers[0].Keys[0] = 'b', 3
	runUntilCleanup(t, p)
	var got Snapshot
	eventually(t, "running", nil, func() bool { return p.Snapshot(context.Background(), &got) == nil })
	if len(got.s.Workers) != 1 || string(got.s.Workers[0].Name) != "a" || got.s.Workers[0].Keys[0] != 2 {
		t.Errorf("snapshot after the caller changed its copy: %+v, want worker a with key 2, not yet added, kept", got.s.Workers)
	}
}

// heldPipeline is a pipeline, not yet run, whose worker "w" holds its first
// batch in the handler until h.release is closed.
func heldPipeline(t *testing.T) (*Pipeline, *engine, held) {
	t.Helper()
	e := newEngine(t)
	p, err := New(Config{BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	h := held{entered: make(chan struct{}, 1), release: make(chan struct{})}
	p.wrap = func(inner wire.Handler) wire.Handler { h.Handler = inner; return h }
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	return p, e, h
}

// holdABatch publishes until the worker is held in its handler.
func holdABatch(t *testing.T, e *engine, h held) {
	t.Helper()
	eventually(t, "a batch held in the handler", func() { e.parent = 0; e.store(prompt(1, 1), 16) },
		func() bool { return len(h.entered) == 1 })
}
