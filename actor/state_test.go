package actor

import (
	"cmp"
	"context"
	"math/rand/v2"
	"slices"
	"testing"

	gocmp "github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/kvpipe/kvpipe/wire"
)

// roundTrip exports a, encodes and decodes the snapshot, and imports it
// into a new actor on shard: what a restarted router does.
func roundTrip(t *testing.T, a *Actor, cfg Config, resumed bool) *Actor {
	t.Helper()
	s := snapshot.Snapshot{Version: snapshot.Version, BlockSize: a.cfg.BlockSize, Workers: make([]snapshot.Worker, 1)}
	a.Export(&s.Workers[0])
	s.Workers[0].Name = []byte("w")
	data, err := snapshot.Append(nil, &s)
	if err != nil {
		t.Fatalf("the actor's export does not encode: %v", err)
	}
	var back snapshot.Snapshot
	if err := snapshot.Decode(data, &back); err != nil {
		t.Fatalf("the actor's export does not decode: %v", err)
	}
	b := New(cfg)
	b.Import(&back.Workers[0])
	if resumed { // else the first batch proves it
		b.HandleResumed()
	}
	return b
}

// sortedExport is a's export with its blocks in hash order, to compare two
// actors' states.
type exportedBlock struct {
	Hash, Key, Parent uint64
	Flags             uint8
	Split             []uint64
}

func sortedExport(a *Actor) (snapshot.Worker, []exportedBlock) {
	var w snapshot.Worker
	a.Export(&w)
	var blocks []exportedBlock
	next := 0
	for i, h := range w.Hashes {
		b := exportedBlock{Hash: h, Key: w.Keys[i], Parent: w.Parents[i], Flags: w.Flags[i]}
		if w.Flags[i]&snapshot.FlagSplit != 0 {
			b.Split = w.Split[next : next+w.SplitK-1]
			next += w.SplitK - 1
		}
		blocks = append(blocks, b)
	}
	slices.SortFunc(blocks, func(x, y exportedBlock) int { return cmp.Compare(x.Hash, y.Hash) })
	type group struct {
		idx  int64
		main bool
	}
	groups := make([]group, len(w.GroupIdx))
	for i := range groups {
		groups[i] = group{w.GroupIdx[i], w.GroupMain[i]}
	}
	slices.SortFunc(groups, func(x, y group) int { return cmp.Compare(x.idx, y.idx) })
	for i, g := range groups {
		w.GroupIdx[i], w.GroupMain[i] = g.idx, g.main
	}
	w.Hashes, w.Keys, w.Parents, w.Flags, w.Split = nil, nil, nil, nil, nil
	return w, blocks
}

// A router restarted from a snapshot goes on exactly as the one that took
// it: simulated engines (offloading to a host tier, hybrid with a sliding
// window, publishing partial tails, engine blocks of two router blocks)
// serve a trace with clears and lost history; at a random step every actor
// is snapshotted into a new one on shards of its own, and from then on
// both get the same batches. Both indexes answer every prompt alike, tier
// by tier, and the two actors' states stay equal.
func TestRestoredActorGoesOnLikeTheOriginal(t *testing.T) {
	configs := []struct {
		name            string
		engineBS, bs    int
		opts            []sim.Option
		restoreAfterMin int
	}{
		{"plain", 16, 16, nil, 10},
		{"offload window tails", 16, 16, []sim.Option{sim.WithCPUOffload(60), sim.WithSlidingWindow(64), sim.WithPartialTails()}, 10},
		{"split", 32, 16, []sim.Option{sim.WithCPUOffload(40), sim.WithLoRA()}, 10},
	}
	for _, c := range configs {
		t.Run(c.name, func(t *testing.T) {
			seeds := uint64(3)
			if raceEnabled { // some forty times slower: one seed still runs every path
				seeds = 1
			}
			for seed := range seeds {
				rng := rand.New(rand.NewPCG(seed, 11))
				const workers = 3
				reqs := sim.SyntheticTrace(150, seed)
				restoreAt := c.restoreAfterMin + rng.IntN(60)
				orig, restored := index.NewShards(2, 8), index.NewShards(2, 8)
				var engines [workers]*sim.Engine
				var as, bs [workers]*Actor
				for w := range workers {
					engines[w] = sim.NewEngine(c.engineBS, 30+rng.IntN(100), c.opts...)
					as[w] = New(Config{Worker: index.WorkerID(w), BlockSize: c.bs, Sink: index.NewSender(index.WorkerID(w), orig.Queue(index.WorkerID(w)), nil)})
				}
				sync := func(s *index.Shards) {
					if err := s.Sync(context.Background()); err != nil {
						t.Fatal(err)
					}
				}
				var h index.Hasher
				var evs []codec.Event
				for i := range reqs {
					if i == restoreAt {
						for w := range workers {
							bs[w] = roundTrip(t, as[w], Config{Worker: index.WorkerID(w), BlockSize: c.bs, Sink: index.NewSender(index.WorkerID(w), restored.Queue(index.WorkerID(w)), nil)}, true)
						}
					}
					w := rng.IntN(workers)
					var reset *wire.ResetReason
					switch r := rng.IntN(40); {
					case r == 0:
						evs = append(evs[:0], engines[w].Clear())
					case r == 1:
						why := wire.ResetGapLost // the engine still holds what it held
						reset = &why
						evs = evs[:0]
					default:
						evs, _ = engines[w].ServeResult(evs[:0], &reqs[i], sim.InputTokens(nil, &reqs[i]))
					}
					for _, set := range [][workers]*Actor{as, bs} {
						a := set[w]
						if a == nil {
							continue
						}
						if reset != nil {
							a.HandleReset(*reset)
						}
						if len(evs) > 0 {
							a.HandleBatch(uint64(i), engineenc.AppendBatch(nil, &codec.Batch{Events: evs}, engineenc.CurrentVLLM))
						}
					}
					if i < restoreAt {
						continue
					}
					sync(orig)
					sync(restored)
					q := &reqs[rng.IntN(i+1)]
					keys := h.RequestKeys(nil, &index.Request{Tokens: sim.InputTokens(nil, q), Lora: q.Lora}, c.bs)
					want, err := orig.FindMatches(context.Background(), nil, keys)
					if err != nil {
						t.Fatal(err)
					}
					got, err := restored.FindMatches(context.Background(), nil, keys)
					if err != nil {
						t.Fatal(err)
					}
					byWorker := func(x, y index.Score) int { return cmp.Compare(x.Worker, y.Worker) }
					slices.SortFunc(want, byWorker)
					slices.SortFunc(got, byWorker)
					if d := gocmp.Diff(want, got); d != "" {
						t.Fatalf("seed %d step %d (restored at %d): the restored index answers otherwise (-original +restored):\n%s", seed, i, restoreAt, d)
					}
				}
				for w := range workers {
					if bs[w] == nil {
						continue
					}
					wa, ba := sortedExport(as[w])
					wb, bb := sortedExport(bs[w])
					if d := gocmp.Diff(wa, wb, cmpopts.EquateEmpty()); d != "" {
						t.Errorf("seed %d worker %d: states differ (-original +restored):\n%s", seed, w, d)
					}
					if d := gocmp.Diff(ba, bb, cmpopts.EquateEmpty()); d != "" {
						t.Errorf("seed %d worker %d: mappings differ (-original +restored):\n%s", seed, w, d)
					}
					if sa, sb := as[w].Stats().TierBlocks, bs[w].Stats().TierBlocks; sa != sb {
						t.Errorf("seed %d worker %d: tier blocks %v, restored %v", seed, w, sa, sb)
					}
				}
				orig.Close()
				restored.Close()
			}
		})
	}
}

// Import rebuilds the index from the blocks the snapshot says are indexed,
// and only those: a block kept through a resync is known but not indexed,
// and is put back once a block is stored under it. Nothing of it is
// published: the stream a relay feeds already has it.
func TestImportRebuildsTheIndexedBlocksOnly(t *testing.T) {
	var hasher index.Hasher
	toks := tokens(2, 3, 16)
	k := hasher.Prompt(nil, toks, 16)
	h := newHarness(t)
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1, 2}, TokenIDs: toks[:32], BlockSize: 16})
	h.a.HandleReset(wire.ResetGapLost) // 1 and 2 known, no longer indexed
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{9}, TokenIDs: tokens(5, 1, 16), BlockSize: 16})
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{9}, BlockSize: 16, Medium: "CPU"})
	h.collect()

	published := 0
	ch := make(chan *index.Batch, 16)
	b := roundTrip(t, h.a, Config{Worker: 1, BlockSize: 16, Sink: tapping{index.NewSender(1, ch, nil), func([]index.Op) { published++ }}}, false)
	r := &harness{t: t, a: b, shard: ch}
	r.collect()
	if d := gocmp.Diff([]op{{index.OpClearWorker, 0, 0}}, r.took(), gocmp.AllowUnexported(op{})); d != "" {
		t.Fatalf("ops of the import before its position is proven (-want +got):\n%s", d)
	}
	if !b.Partial() {
		t.Error("a worker imported and not yet proven is not partial")
	}
	var w snapshot.Worker
	b.Export(&w)
	if n := len(w.Flags); n != 3 || w.Flags[slices.Index(w.Hashes, 9)]>>snapshot.TierShift != bit(index.TierDevice)|bit(index.TierHost) {
		t.Errorf("an unproven import exports %d blocks, flags %v: want the snapshot as imported", n, w.Flags)
	}
	b.HandleResumed()
	r.collect()
	k9 := hasher.Prompt(nil, tokens(5, 1, 16), 16)[0]
	want := []op{{index.OpStore, index.TierDevice, k9}, {index.OpStore, index.TierHost, k9}}
	if d := gocmp.Diff(want, r.took(), gocmp.AllowUnexported(op{})); d != "" {
		t.Fatalf("ops once proven (-want +got):\n%s", d)
	}
	if published != 0 {
		t.Errorf("the import published %d batches, want none", published)
	}
	if b.Partial() != h.a.Partial() {
		t.Errorf("restored partial %v, the original's %v", b.Partial(), h.a.Partial())
	}
	// Stored under the kept prefix, the block brings its parents back.
	r.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{3}, ParentHash: 2, HasParent: true, TokenIDs: toks[32:], BlockSize: 16})
	want = []op{{index.OpStore, index.TierDevice, k[1]}, {index.OpStore, index.TierDevice, k[0]}, {index.OpStore, index.TierDevice, k[2]}}
	if d := gocmp.Diff(want, r.took(), gocmp.AllowUnexported(op{})); d != "" {
		t.Fatalf("ops of a store under the kept prefix (-want +got):\n%s", d)
	}
	if published != 1 {
		t.Errorf("published %d batches after the import, want 1", published)
	}

	// Without HandleResumed, the first batch proves the position; a reset
	// before it drops the snapshot's entries.
	for _, resetFirst := range []bool{false, true} {
		ch := make(chan *index.Batch, 16)
		c := roundTrip(t, h.a, Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, nil)}, false)
		r := &harness{t: t, a: c, shard: ch}
		if resetFirst {
			c.HandleReset(wire.ResetRestart)
		}
		r.send(stored(77, 16))
		st := c.Stats()
		if want := map[bool]int64{false: 2, true: 1}[resetFirst]; st.TierBlocks[index.TierDevice] != want {
			t.Errorf("reset first %v: %d device blocks after the first batch, want %d", resetFirst, st.TierBlocks[index.TierDevice], want)
		}
	}
}

// tapping shows a func every batch of ops before its Sink has it, but
// those for the index only (Batch.IndexOnly), as the
// pipeline's Tap is shown them.
type tapping struct {
	Sink
	see func([]index.Op)
}

func (t tapping) Send(b *index.Batch, wait bool) bool {
	if !b.IndexOnly {
		t.see(b.Ops)
	}
	return t.Sink.Send(b, wait)
}

// A Sink sees every batch of ops, in shard-sized parts, those of a reset
// too.
func TestTapSeesEveryBatch(t *testing.T) {
	var sizes []int
	ch := make(chan *index.Batch, 16)
	a := New(Config{Worker: 1, BlockSize: 16, Sink: tapping{index.NewSender(1, ch, nil), func(ops []index.Op) { sizes = append(sizes, len(ops)) }}})
	h := &harness{t: t, a: a, shard: ch}
	big := codec.Event{Type: codec.BlockStored, BlockHashes: make([]uint64, 300), TokenIDs: tokens(4, 300, 16), BlockSize: 16}
	for i := range big.BlockHashes {
		big.BlockHashes[i] = uint64(i + 1)
	}
	a.HandleBatch(7, engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{big}}, engineenc.CurrentVLLM))
	h.collect()
	a.HandleReset(wire.ResetRestart)
	h.collect()
	if d := gocmp.Diff([]int{maxOps, 300 - maxOps, 1}, sizes); d != "" {
		t.Errorf("ops per batch (-want +got):\n%s", d)
	}
	if got := len(h.ops); got != 301 {
		t.Errorf("the shard got %d ops, want the 301 the Tap saw", got)
	}
}
