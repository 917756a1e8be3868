package actor

import (
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/wire"
)

// op is an expected index op, for comparing with what the actor sent.
type op struct {
	kind index.OpKind
	tier index.Tier
	key  uint64
}

func (h *harness) took() []op {
	var out []op
	for _, o := range h.ops {
		out = append(out, op{o.Kind, o.Tier, o.Hash})
	}
	h.ops = nil
	return out
}

// A vLLM engine with CPU offload: device blocks are copied to the host tier
// (named by hash alone), evicted from the device, built on again, and the
// host tier is cleared. The index follows each tier on its own.
func TestOffloadedBlocksMoveBetweenTiers(t *testing.T) {
	var hasher index.Hasher
	toks := tokens(4, 3, 16)
	k := hasher.Prompt(nil, toks, 16)
	const dev, host = index.TierDevice, index.TierHost
	h := newHarness(t)
	steps := []struct {
		name        string
		events      []codec.Event
		want        []op
		device, cpu int64 // TierBlocks after the step
	}{
		{"stored on device",
			[]codec.Event{{Type: codec.BlockStored, BlockHashes: []uint64{1, 2}, TokenIDs: toks[:32], BlockSize: 16, Medium: "GPU"}},
			[]op{{index.OpStore, dev, k[0]}, {index.OpStore, dev, k[1]}}, 2, 0},
		{"copied to the host by hash alone",
			[]codec.Event{{Type: codec.BlockStored, BlockHashes: []uint64{1, 2, 99}, BlockSize: 16, Medium: "CPU"}},
			[]op{{index.OpStore, host, k[0]}, {index.OpStore, host, k[1]}}, 2, 2},
		{"evicted from the device: the host copies stay",
			[]codec.Event{{Type: codec.BlockRemoved, BlockHashes: []uint64{1, 2}, Medium: "GPU"}},
			[]op{{index.OpRemove, dev, k[0]}, {index.OpRemove, dev, k[1]}}, 0, 2},
		{"built on again on device: the prefix is back on device",
			[]codec.Event{{Type: codec.BlockStored, BlockHashes: []uint64{3}, ParentHash: 2, HasParent: true, TokenIDs: toks[32:], BlockSize: 16, Medium: "GPU"}},
			[]op{{index.OpStore, dev, k[1]}, {index.OpStore, dev, k[0]}, {index.OpStore, dev, k[2]}}, 3, 2},
		{"evicted from the host",
			[]codec.Event{{Type: codec.BlockRemoved, BlockHashes: []uint64{1}, Medium: "CPU"}},
			[]op{{index.OpRemove, host, k[0]}}, 3, 1},
		{"the host tier cleared: the device keeps its blocks",
			[]codec.Event{{Type: codec.AllBlocksCleared, Medium: "CPU"}},
			[]op{{index.OpClearTier, host, 0}}, 3, 0},
		{"the whole cache cleared",
			[]codec.Event{cleared()},
			[]op{{index.OpClearWorker, 0, 0}}, 0, 0},
	}
	for _, st := range steps {
		h.send(st.events...)
		if got := h.took(); !slices.Equal(got, st.want) {
			t.Errorf("%s: ops %v, want %v", st.name, got, st.want)
		}
		s := h.a.Stats()
		if s.TierBlocks[dev] != st.device || s.TierBlocks[host] != st.cpu || s.IndexedBlocks != st.device {
			t.Errorf("%s: tier blocks %v (indexed %d), want device %d, host %d", st.name, s.TierBlocks, s.IndexedBlocks, st.device, st.cpu)
		}
	}
	if s := h.a.Stats(); s.TokenMismatch != 1 || s.UnknownRemove != 0 {
		t.Errorf("token_mismatch %d (the unknown hash copied by hash alone), unknown_remove %d; want 1 and 0", s.TokenMismatch, s.UnknownRemove)
	}
}

// A tier weighted 0 is not indexed: its events are filtered as lower_tier.
func TestATierWeightedZeroIsNotIndexed(t *testing.T) {
	ch := make(chan *index.Batch, 16)
	h := &harness{t: t, a: New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, nil), Weights: index.Weights{1, 0, 0.5, 0}}), shard: ch}
	h.send(stored(1, 16, medium("CPU")), stored(2, 16, medium("EXTERNAL")), stored(3, 16, medium("DISK")),
		codec.Event{Type: codec.AllBlocksCleared, Medium: "CPU_PINNED"})
	got := h.took()
	if len(got) != 1 || got[0].tier != index.TierDisk {
		t.Errorf("ops %v, want the disk block alone", got)
	}
	if n := h.a.Stats().Filtered[LowerTier]; n != 3 {
		t.Errorf("lower_tier %d, want 3", n)
	}
}

// An engine block of 64 tokens is four router blocks of 16: their keys are
// the prompt's, a child chains on from the last, and a remove takes all four.
func TestEngineBlocksSplitIntoRouterBlocks(t *testing.T) {
	var hasher index.Hasher
	toks := tokens(9, 3, 64)
	keys := hasher.Prompt(nil, toks, 16)
	h := newHarness(t)
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1, 2}, TokenIDs: toks[:128], BlockSize: 64},
		codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{3}, ParentHash: 2, HasParent: true, TokenIDs: toks[128:], BlockSize: 64})
	var want []op
	for _, k := range keys {
		want = append(want, op{index.OpStore, index.TierDevice, k})
	}
	if got := h.took(); !slices.Equal(got, want) {
		t.Fatalf("ops %v, want the prompt's 12 keys stored in order", got)
	}
	h.send(codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{2}})
	want = want[:0]
	for _, k := range keys[4:8] {
		want = append(want, op{index.OpRemove, index.TierDevice, k})
	}
	if got := h.took(); !slices.Equal(got, want) {
		t.Errorf("remove of the second engine block: ops %v, want its four keys", got)
	}
	slots := len(h.a.m.splitKeys)
	for range 10 { // stored and evicted again: the freed slot is reused
		h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{2}, ParentHash: 1, HasParent: true, TokenIDs: toks[64:128], BlockSize: 64},
			codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{2}})
	}
	if len(h.a.m.splitKeys) != slots {
		t.Errorf("split keys grew from %d to %d over store/remove cycles", slots, len(h.a.m.splitKeys))
	}
	if st := h.a.Stats(); st.IndexedBlocks != 8 || st.SizeWarnings != 0 {
		t.Errorf("indexed %d, size warnings %d; want 8 and 0", st.IndexedBlocks, st.SizeWarnings)
	}
}

// The adapter and salt an event carries make its chain's keys those of the
// same request on that adapter, and no base-model request's.
func TestAdapterAndSaltKeys(t *testing.T) {
	var hasher index.Hasher
	toks := tokens(5, 2, 16)
	base := hasher.Prompt(nil, toks, 16)
	for _, tc := range []struct {
		name   string
		mod    func(*codec.Event)
		req    index.Request
		layout engineenc.Layout
	}{
		{"lora_name", func(e *codec.Event) { e.LoraName = "sql-lora" }, index.Request{Lora: "sql-lora"}, engineenc.CurrentVLLM},
		{"lora_id alone", func(e *codec.Event) { e.LoraID, e.HasLoraID = 7, true }, index.Request{LoraID: 7, HasLoraID: true}, engineenc.CurrentVLLM},
		{"SGLang's cache_salt", func(e *codec.Event) { e.CacheSalt = "tenant-a" }, index.Request{Salt: "tenant-a"}, engineenc.Layout{SaltKey: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			e := codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1, 2}, TokenIDs: toks, BlockSize: 16}
			tc.mod(&e)
			h.a.HandleBatch(0, engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{e}}, tc.layout))
			h.collect()
			req := tc.req
			req.Tokens = toks
			want := hasher.RequestKeys(nil, &req, 16)
			got := h.took()
			if len(got) != 2 || got[0].key != want[0] || got[1].key != want[1] {
				t.Fatalf("keys %v, want the request's %x", got, want)
			}
			if slices.Contains(base, got[0].key) || slices.Contains(base, got[1].key) {
				t.Errorf("an adapter or salted block has a base-model key")
			}
		})
	}
}

// A block size the router cannot use is warned about once per worker, and
// again after the engine clears its cache (it may come back configured
// otherwise).
func TestBadBlockSizeWarnsOncePerWorker(t *testing.T) {
	var log strings.Builder
	ch := make(chan *index.Batch, 16)
	h := &harness{t: t, shard: ch, a: New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, nil),
		Logger: slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelWarn}))})}
	h.send(stored(1, 24), stored(2, 24), stored(3, 40))
	h.send(cleared(), stored(4, 24))
	if n := strings.Count(log.String(), "cannot be split"); n != 2 {
		t.Errorf("%d warnings for 4 blocks of bad sizes across one clear, want 2:\n%s", n, log.String())
	}
	if n := h.a.Stats().Filtered[BlockSizeMismatch]; n != 4 {
		t.Errorf("block_size filtered %d, want 4", n)
	}
}

// After a resync the mapping is kept but what each tier holds is unknown:
// a lower-tier remove or clear must not forget blocks the device may hold,
// and a device clear must not mark complete a worker whose host tier may
// still hold blocks the index lacks.
func TestTiersAfterAResync(t *testing.T) {
	toks := tokens(6, 2, 16)
	h := newHarness(t)
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1}, TokenIDs: toks[:16], BlockSize: 16, Medium: "GPU"},
		codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1}, BlockSize: 16, Medium: "CPU"})
	h.a.HandleReset(wire.ResetGapLost)
	h.collect()
	h.send(codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{1}, Medium: "CPU"}, codec.Event{Type: codec.AllBlocksCleared, Medium: "CPU"})
	h.took()
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{2}, ParentHash: 1, HasParent: true, TokenIDs: toks[16:], BlockSize: 16, Medium: "GPU"})
	if st := h.a.Stats(); st.UnknownParent != 0 || st.IndexedBlocks != 2 {
		t.Errorf("unknown_parent %d, indexed %d: a host-tier remove and clear after the resync forgot a block the device held", st.UnknownParent, st.IndexedBlocks)
	}
	h.send(codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{2}, BlockSize: 16, Medium: "CPU"}) // offloaded again
	h.a.HandleReset(wire.ResetGapLost)
	h.a.HandleBatch(9, engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{{Type: codec.AllBlocksCleared, Medium: "GPU"}}}, engineenc.CurrentVLLM))
	if !h.a.Stats().Partial {
		t.Error("a device clear made complete a worker whose host tier may hold blocks unknown to the index")
	}
}

// An engine block split into router blocks that carries extra keys
// (multimodal input) gets keys no request computes: the engine's digest
// spans its whole block. A miss, never a wrong hit.
func TestSplitBlocksWithExtraKeysNeverMatchWrongly(t *testing.T) {
	var hasher index.Hasher
	toks := tokens(8, 1, 64)
	h := newHarness(t)
	h.a.apply(&codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1}, TokenIDs: toks, BlockSize: 64, BlockExtra: []uint64{0x5eed}})
	h.a.out.flush()
	h.collect()
	if len(h.ops) != 4 {
		t.Fatalf("ops %v, want the four router blocks stored", h.ops)
	}
	plain := hasher.Prompt(nil, toks, 16)
	for _, o := range h.took() {
		if slices.Contains(plain, o.key) {
			t.Errorf("a split block with extra keys has a bare-token key %x", o.key)
		}
	}
}

func TestMediumTier(t *testing.T) {
	const unknown = index.NumTiers
	tiers := map[string]index.Tier{"": index.TierDevice, "GPU": index.TierDevice, "CPU": index.TierHost, "CPU_PINNED": index.TierHost,
		"DISK": index.TierDisk, "NVME": index.TierDisk, "STORAGE": index.TierDisk, "EXTERNAL": index.TierRemote, "REMOTE": index.TierRemote,
		"TAPE": unknown, "gpu": unknown}
	for m, want := range tiers {
		got, ok := mediumTier(m)
		if !ok {
			got = unknown
		}
		if got != want {
			t.Errorf("mediumTier(%q) = %v, want %v", m, got, want)
		}
	}
}
