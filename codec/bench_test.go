package codec_test

import (
	. "github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// realisticBatch is one engine step: 8 BlockStored of 4 blocks of 16
// tokens, a BlockRemoved of 8 blocks, as vLLM publishes them.
func realisticBatch() Batch {
	b := Batch{TS: 1733000000.123, HasDPRank: true}
	h := uint64(0x9e3779b97f4a7c15)
	for i := range 8 {
		e := Event{Type: BlockStored, BlockSize: 16, Medium: "GPU", HasParent: i > 0, ParentHash: h}
		for range 4 {
			h = h*6364136223846793005 + 1442695040888963407
			e.BlockHashes = append(e.BlockHashes, h)
		}
		for t := range 64 {
			e.TokenIDs = append(e.TokenIDs, uint32(i*1000+t*37)%151936)
		}
		b.Events = append(b.Events, e)
	}
	rm := Event{Type: BlockRemoved, Medium: "GPU"}
	for i := range 8 {
		rm.BlockHashes = append(rm.BlockHashes, uint64(i)*0x1234567)
	}
	b.Events = append(b.Events, rm)
	return b
}

// realisticPayload is realisticBatch encoded in layout l.
func realisticPayload(l engineenc.Layout) []byte {
	b := realisticBatch()
	return engineenc.AppendBatch(nil, &b, l)
}

// encodeLayouts are the layouts BenchmarkAppendBatch and the zero-allocation
// test encode: both event forms, and the hash forms that take other paths.
var encodeLayouts = []struct {
	name string
	l    engineenc.Layout
}{
	{"vllm-map", engineenc.CurrentVLLM},
	{"array", engineenc.Layout{ArrayEvents: true}},
	{"array-8-signed", engineenc.Layout{ArrayEvents: true, StoredSlots: 8, SignedHashes: true}},
	{"array-bin", engineenc.Layout{ArrayEvents: true, BinHashes: true}},
}

// BenchmarkAppendBatch encodes into a reused buffer, as a publisher would.
func BenchmarkAppendBatch(b *testing.B) {
	for _, tc := range encodeLayouts {
		b.Run(tc.name, func(b *testing.B) {
			batch := realisticBatch()
			dst := engineenc.AppendBatch(nil, &batch, tc.l)
			b.SetBytes(int64(len(dst)))
			b.ReportAllocs()
			for b.Loop() {
				dst = engineenc.AppendBatch(dst[:0], &batch, tc.l)
			}
			b.ReportMetric(float64(b.N*eventsPerPayload)/b.Elapsed().Seconds(), "events/s")
		})
	}
}

const eventsPerPayload = 9

func BenchmarkDecode(b *testing.B) {
	for _, tc := range []struct {
		name string
		l    engineenc.Layout
	}{{"vllm-map", engineenc.CurrentVLLM}, {"array", engineenc.Layout{ArrayEvents: true}}} {
		b.Run("kvpipe/"+tc.name, func(b *testing.B) {
			payload := realisticPayload(tc.l)
			d := NewDecoder()
			var batch Batch
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			for b.Loop() {
				if err := d.Decode(payload, &batch); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*eventsPerPayload)/b.Elapsed().Seconds(), "events/s")
		})
	}
	// Every BlockStored with an adapter, images and (the root) a salt in its
	// extra keys, half raw tuples, half typed.
	b.Run("kvpipe/vllm-map-extra-keys", func(b *testing.B) {
		in := extraKeysBatch()
		payload := engineenc.AppendBatch(nil, &in, engineenc.CurrentVLLM)
		d := NewDecoder()
		var batch Batch
		b.SetBytes(int64(len(payload)))
		b.ReportAllocs()
		for b.Loop() {
			if err := d.Decode(payload, &batch); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N*eventsPerPayload)/b.Elapsed().Seconds(), "events/s")
	})
	// An SGLang engine with EAGLE: 8 BlockStored of 4 blocks of 16 tokens as
	// bigrams (each with the token after its last block), a BlockRemoved.
	b.Run("kvpipe/sglang-eagle-map", func(b *testing.B) {
		in := realisticBatch()
		for i := range in.Events[:8] {
			e := &in.Events[i]
			e.TokenIDs, e.Bigram = append(e.TokenIDs, 1), true
		}
		payload := engineenc.AppendBatch(nil, &in, engineenc.Layout{SignedHashes: true, SaltKey: true})
		d := NewDecoder()
		var batch Batch
		b.SetBytes(int64(len(payload)))
		b.ReportAllocs()
		for b.Loop() {
			if err := d.Decode(payload, &batch); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N*eventsPerPayload)/b.Elapsed().Seconds(), "events/s")
	})
	// The same map-form payload through a reflection decoder, the way the Go
	// peer (llm-d) decodes: a fresh value per message.
	b.Run("reflection-vmihailenco/vllm-map", func(b *testing.B) {
		payload := realisticPayload(engineenc.CurrentVLLM)
		b.SetBytes(int64(len(payload)))
		b.ReportAllocs()
		for b.Loop() {
			var batch reflBatch
			if err := msgpack.Unmarshal(payload, &batch); err != nil {
				b.Fatal(err)
			}
			if len(batch.Events) != eventsPerPayload {
				b.Fatalf("decoded %d events", len(batch.Events))
			}
		}
		b.ReportMetric(float64(b.N*eventsPerPayload)/b.Elapsed().Seconds(), "events/s")
	})
}

type reflBatch struct {
	_msgpack struct{} `msgpack:",as_array"` //lint:ignore U1000 vmihailenco reads the tag: the batch is an array
	TS       float64
	Events   []reflEvent
	DPRank   *int64
}

type reflEvent struct {
	Type            string             `msgpack:"type"`
	BlockHashes     []uint64           `msgpack:"block_hashes"`
	ParentBlockHash *uint64            `msgpack:"parent_block_hash"`
	TokenIDs        []uint32           `msgpack:"token_ids"`
	BlockSize       int                `msgpack:"block_size"`
	LoraID          *int64             `msgpack:"lora_id"`
	Medium          *string            `msgpack:"medium"`
	LoraName        *string            `msgpack:"lora_name"`
	ExtraKeys       msgpack.RawMessage `msgpack:"extra_keys"`
	GroupIdx        *int               `msgpack:"group_idx"`
	SpecKind        *string            `msgpack:"kv_cache_spec_kind"`
	SlidingWindow   *int               `msgpack:"kv_cache_spec_sliding_window"`
}

// The reflection decoder must read the same thing, or the comparison means nothing.
func TestReflectionBaselineAgrees(t *testing.T) {
	payload := realisticPayload(engineenc.CurrentVLLM)
	var refl reflBatch
	if err := msgpack.Unmarshal(payload, &refl); err != nil {
		t.Fatal(err)
	}
	var b Batch
	if err := NewDecoder().Decode(payload, &b); err != nil {
		t.Fatal(err)
	}
	if len(refl.Events) != len(b.Events) {
		t.Fatalf("reflection: %d events, kvpipe: %d", len(refl.Events), len(b.Events))
	}
	for i, e := range refl.Events {
		if e.Type != b.Events[i].Type.String() || len(e.BlockHashes) != len(b.Events[i].BlockHashes) ||
			e.BlockHashes[0] != b.Events[i].BlockHashes[0] || len(e.TokenIDs) != len(b.Events[i].TokenIDs) {
			t.Errorf("event %d differs: reflection %+v", i, e)
		}
	}
}
