package actor

import (
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
)

// FuzzActor: no payload, however it decodes, makes the actor panic; and the
// ops it sends, applied to a model of the index, never remove a key the
// worker does not hold there, and leave each tier holding exactly the
// blocks the actor counts. A shard queue of one batch, read only between
// payloads, makes big events overflow it under Drop.
func FuzzActor(f *testing.F) {
	split := codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1, 2}, TokenIDs: tokens(3, 2, 32), BlockSize: 32}
	seeds := []codec.Batch{
		{Events: []codec.Event{stored(1, 16), stored(2, 4), cleared()}},
		{Events: []codec.Event{stored(1, 16, group(1, "mamba")), {Type: codec.BlockRemoved, BlockHashes: []uint64{1, 9}}}},
		{Events: []codec.Event{{Type: codec.BlockStored, BlockHashes: []uint64{1, 2, 3}, TokenIDs: []uint32{1}, BlockSize: 1 << 20, HasParent: true, ParentHash: 7}}},
		{Events: []codec.Event{split, {Type: codec.BlockStored, BlockHashes: []uint64{1, 2}, BlockSize: 32, Medium: "CPU"},
			{Type: codec.BlockRemoved, BlockHashes: []uint64{2}, Medium: "GPU"}, {Type: codec.AllBlocksCleared, Medium: "CPU"}}},
		{Events: []codec.Event{{Type: codec.BlockStored, BlockHashes: make([]uint64, 300), TokenIDs: tokens(4, 300, 16), BlockSize: 16}}},
		// SGLang with EAGLE: bigram events, a split one, one a plain event
		// chains to, and one short of its last window.
		{Events: []codec.Event{
			{Type: codec.BlockStored, BlockHashes: []uint64{1, 2}, TokenIDs: append(tokens(5, 2, 16), 1), Bigram: true, BlockSize: 16},
			stored(3, 16, func(e *codec.Event) { e.HasParent, e.ParentHash = true, 2 }),
			{Type: codec.BlockStored, BlockHashes: []uint64{4, 5}, TokenIDs: append(tokens(6, 2, 32), 1), Bigram: true, BlockSize: 32},
			{Type: codec.BlockStored, BlockHashes: []uint64{6, 7}, TokenIDs: tokens(7, 2, 16), Bigram: true, BlockSize: 16},
			{Type: codec.BlockRemoved, BlockHashes: []uint64{2, 5}}}},
	}
	for _, b := range seeds {
		f.Add(engineenc.AppendBatch(nil, &b, engineenc.CurrentVLLM))
		f.Add(engineenc.AppendBatch(nil, &b, engineenc.Layout{ArrayEvents: true}))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		for _, drop := range []bool{false, true} {
			checkOps(t, payload, drop)
		}
	})
}

func checkOps(t *testing.T, payload []byte, drop bool) {
	ch := make(chan *index.Batch, 1)
	done := make(chan struct{})
	close(done) // blocking then gives up on a full queue rather than hang the fuzzer
	a := New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, done), Drop: drop})
	var held [index.NumTiers]map[uint64]int // key -> stores not yet removed
	for i := range held {
		held[i] = map[uint64]int{}
	}
	apply := func() {
		for {
			select {
			case b := <-ch:
				for _, op := range b.Ops {
					switch op.Kind {
					case index.OpStore:
						held[op.Tier][op.Hash]++
					case index.OpRemove:
						if held[op.Tier][op.Hash] == 0 {
							t.Fatalf("remove of %x in %v, which the worker does not hold", op.Hash, op.Tier)
						}
						held[op.Tier][op.Hash]--
					case index.OpClearWorker:
						for i := range held {
							clear(held[i])
						}
					case index.OpClearTier:
						clear(held[op.Tier])
					}
				}
			default:
				return
			}
		}
	}
	for seq := range uint64(3) { // later rounds see the state the first left
		a.HandleBatch(seq, payload)
		apply()
		st := a.Stats()
		if a.out.resync { // the last batch was dropped: the next one clears the worker first
			for tier := range held {
				clear(held[tier])
			}
		}
		for tier := range held {
			n := 0
			for _, c := range held[tier] {
				n += c
			}
			if int64(n) != st.TierBlocks[tier] {
				t.Fatalf("round %d: the index holds %d blocks in %v, the actor counts %d", seq, n, index.Tier(tier), st.TierBlocks[tier])
			}
		}
		// What the mapping says is in the index is what is.
		var mapped [index.NumTiers]map[uint64]int
		for i := range mapped {
			mapped[i] = map[uint64]int{}
		}
		for _, b := range a.m.routerOf.all() {
			for tier := range index.Tier(index.NumTiers) {
				if b.held(a.m.gen)&bit(tier) == 0 {
					continue
				}
				mapped[tier][b.key]++
				if b.split >= 0 {
					for _, k := range a.m.splitKeys[int(b.split)*(a.m.splitK-1) : int(b.split+1)*(a.m.splitK-1)] {
						mapped[tier][k]++
					}
				}
			}
		}
		for tier := range held {
			for k, c := range held[tier] {
				if c > 0 && mapped[tier][k] != c {
					t.Fatalf("round %d: the index holds %x in %v %d times, the mapping says %d", seq, k, index.Tier(tier), c, mapped[tier][k])
				}
			}
			for k, c := range mapped[tier] {
				if held[tier][k] != c {
					t.Fatalf("round %d: the mapping says %x is in %v %d times, the index holds it %d", seq, k, index.Tier(tier), c, held[tier][k])
				}
			}
		}
		if st.IndexedBlocks != st.TierBlocks[index.TierDevice] {
			t.Fatalf("indexed blocks %d, device blocks %d", st.IndexedBlocks, st.TierBlocks[index.TierDevice])
		}
	}
}
