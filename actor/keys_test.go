package actor

import (
	"slices"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
)

// The actor's keys for an engine's events of a request are the router's
// keys for that request (index.Hasher.RequestKeys), for each engine layout:
// codec/keys_test.go checks the same of the decoded events, this of the
// actor itself.
func TestActorKeysEqualRequestKeys(t *testing.T) {
	const bs = 4
	toks := []uint32{1, 2, 3, 4, 5, 7777, 7777, 7777, 7777, 7777, 7777, 7777, 7777, 14, 15, 16}
	image := []index.MultiModal{{Hash: "A", Offset: 5, Length: 8}}
	// vllmExtra: what vLLM attaches to each block: adapter, the image where
	// the block overlaps it (offset from the block's start), salt on block 0.
	vllmExtra := func(r *index.Request) [][]engineenc.ExtraKey {
		out := make([][]engineenc.ExtraKey, len(r.Tokens)/bs)
		for b := range out {
			var keys []engineenc.ExtraKey
			if r.Lora != "" {
				keys = append(keys, engineenc.ExtraKey{Kind: engineenc.ExtraLoRA, Name: r.Lora})
			}
			for _, m := range r.MultiModal {
				if start := b * bs; m.Offset < start+bs && start < m.Offset+m.Length {
					keys = append(keys, engineenc.ExtraKey{Kind: engineenc.ExtraMultiModal, Modality: "image", Hash: m.Hash, Offset: int64(m.Offset - start)})
				}
			}
			if b == 0 && r.Salt != "" {
				keys = append(keys, engineenc.ExtraKey{Kind: engineenc.ExtraCacheSalt, Name: r.Salt})
			}
			out[b] = keys
		}
		return out
	}
	for _, tc := range []struct {
		name   string
		req    index.Request
		layout engineenc.Layout
		form   engineenc.ExtraForm
		sglang bool
	}{
		{"vLLM typed", index.Request{Lora: "ad", Salt: "t1", MultiModal: image}, engineenc.CurrentVLLM, engineenc.ExtraTyped, false},
		{"vLLM tuples", index.Request{Lora: "ad", Salt: "t1", MultiModal: image}, engineenc.CurrentVLLM, engineenc.ExtraTuples, false},
		{"vLLM positional", index.Request{MultiModal: image}, engineenc.Layout{ArrayEvents: true}, engineenc.ExtraTuples, false},
		{"SGLang map", index.Request{LoraID: 3, HasLoraID: true, Salt: "t1"}, engineenc.Layout{SignedHashes: true, SaltKey: true}, 0, true},
		{"SGLang array", index.Request{Salt: "t1"}, engineenc.Layout{ArrayEvents: true, StoredSlots: 8, SignedHashes: true, SaltKey: true}, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.req
			r.Tokens = toks
			var batch codec.Batch
			extra := vllmExtra(&r)
			for _, span := range [][2]int{{0, 2}, {2, 4}} { // a root event, then one chained to it
				e := codec.Event{Type: codec.BlockStored, BlockSize: bs, Medium: "GPU", TokenIDs: toks[span[0]*bs : span[1]*bs]}
				for i := span[0]; i < span[1]; i++ {
					e.BlockHashes = append(e.BlockHashes, uint64(100+i))
				}
				if span[0] > 0 {
					e.ParentHash, e.HasParent = uint64(100+span[0]-1), true
				}
				if tc.sglang {
					e.LoraID, e.HasLoraID, e.CacheSalt = r.LoraID, r.HasLoraID, r.Salt
				} else {
					e.LoraName = r.Lora
					e.ExtraKeys = engineenc.AppendExtraKeys(nil, extra[span[0]:span[1]], tc.form)
				}
				batch.Events = append(batch.Events, e)
			}
			ch := make(chan *index.Batch, 16)
			h := &harness{t: t, a: New(Config{Worker: 1, BlockSize: bs, Sink: index.NewSender(1, ch, nil)}), shard: ch}
			h.a.HandleBatch(0, engineenc.AppendBatch(nil, &batch, tc.layout))
			h.collect()
			var got []uint64
			for _, o := range h.ops {
				got = append(got, o.Hash)
			}
			var hasher index.Hasher
			if want := hasher.RequestKeys(nil, &r, bs); !slices.Equal(got, want) {
				t.Errorf("actor's keys %x\nrequest's keys %x (decode errors %d)", got, want, h.a.Stats().DecodeErrors)
			}
			if plain := hasher.Prompt(nil, toks, bs); slices.Equal(plain, got) {
				t.Error("the keys are the bare tokens': adapter, salt and image made no difference")
			}
		})
	}
}
