package codec_test

import (
	. "github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"strings"
	"testing"

	"github.com/tinylib/msgp/msgp"

	"github.com/kvpipe/kvpipe/internal/extrakeys"
)

// digestOf is the Sum of a digest built by add.
func digestOf(add func(*extrakeys.Digest)) uint64 {
	var d extrakeys.Digest
	add(&d)
	return d.Sum()
}

// mmDigest is the digest of a block covering one multimodal input.
func mmDigest(hash string, off int64) uint64 {
	return digestOf(func(d *extrakeys.Digest) { d.MultiModal(hash, off) })
}

// extraKeysBatch is realisticBatch as a LoRA request with images and a salt
// publishes it: every BlockStored under adapter "adapter-1", the first one
// a root whose block 0 states the salt, an image in blocks 1 and 2 of every
// event; even events in raw tuples, odd ones in typed keys. BlockExtra is
// left for the decoder.
func extraKeysBatch() Batch {
	b := realisticBatch()
	for i := range b.Events {
		e := &b.Events[i]
		if e.Type != BlockStored {
			continue
		}
		e.LoraName, e.LoraID, e.HasLoraID = "adapter-1", 1, true
		blocks := make([][]engineenc.ExtraKey, len(e.BlockHashes))
		for j := range blocks {
			blocks[j] = []engineenc.ExtraKey{{Kind: engineenc.ExtraLoRA, Name: "adapter-1"}}
		}
		img := "c0ffee" + strings.Repeat("ab", 29) // a blake3 hex digest's length
		blocks[1] = append(blocks[1], engineenc.ExtraKey{Kind: engineenc.ExtraMultiModal, Modality: "image", Hash: img, Offset: 4})
		blocks[2] = append(blocks[2], engineenc.ExtraKey{Kind: engineenc.ExtraMultiModal, Modality: "image", Hash: img, Offset: -12})
		if !e.HasParent {
			blocks[0] = append(blocks[0], engineenc.ExtraKey{Kind: engineenc.ExtraCacheSalt, Name: "tenant-0042"})
		}
		form := engineenc.ExtraTuples
		if i%2 == 1 {
			form = engineenc.ExtraTyped
		}
		e.ExtraKeys = engineenc.AppendExtraKeys(nil, blocks, form)
	}
	return b
}

// Decoding events with extra keys and salts allocates nothing once the
// batch's storage has grown, in every form that carries them.
func TestSteadyStateDecodeWithExtraKeysAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	for _, l := range []engineenc.Layout{engineenc.CurrentVLLM, {ArrayEvents: true}, {SaltKey: true}} {
		in := extraKeysBatch()
		payload := engineenc.AppendBatch(nil, &in, l)
		d := NewDecoder()
		var b Batch
		if err := d.Decode(payload, &b); err != nil {
			t.Fatal(err)
		}
		if e := b.Events[0]; e.CacheSalt != "tenant-0042" || len(e.BlockExtra) != 4 || e.BlockExtra[0] != 0 || e.BlockExtra[1] == 0 {
			t.Fatalf("%+v: salt %q, digests %x", l, e.CacheSalt, e.BlockExtra)
		}
		allocs := testing.AllocsPerRun(100, func() {
			if err := d.Decode(payload, &b); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("%+v: steady-state Decode with extra keys allocates %.1f times per batch, want 0", l, allocs)
		}
	}
}

// storedWith is a batch of one root BlockStored of two blocks, map form,
// with the given extra fields (key, raw msgpack value) appended.
func storedWith(fields ...any) []byte {
	p := msgp.AppendArrayHeader(nil, 3)
	p = msgp.AppendFloat64(p, 0)
	p = msgp.AppendArrayHeader(p, 1)
	p = msgp.AppendMapHeader(p, uint32(4+len(fields)/2))
	p = engineenc.AppendKey(p, "type", "BlockStored")
	p = msgp.AppendString(p, "block_hashes")
	p = engineenc.AppendHashes(p, []uint64{1, 2}, engineenc.Layout{})
	p = msgp.AppendString(p, "token_ids")
	p = engineenc.AppendTokens(p, []uint32{1, 2, 3, 4}, false)
	p = msgp.AppendString(p, "block_size")
	p = engineenc.AppendInt(p, 2)
	for i := 0; i < len(fields); i += 2 {
		p = msgp.AppendString(p, fields[i].(string))
		p = append(p, fields[i+1].([]byte)...)
	}
	return msgp.AppendNil(p)
}

// raw encodes v with msgp's interface encoder, for building test payloads.
func raw(v any) []byte {
	p, err := msgp.AppendIntf(nil, v)
	if err != nil {
		panic(err)
	}
	return p
}

// typed is one typed extra key as a map in msgspec's field order.
func typed(kv ...any) []byte {
	p := msgp.AppendMapHeader(nil, uint32(len(kv)/2))
	for i := 0; i < len(kv); i += 2 {
		p = msgp.AppendString(p, kv[i].(string))
		if b, ok := kv[i+1].([]byte); ok && len(b) > 0 && b[0] == 0xff && len(b) > 1 { // pre-encoded: 0xff marker then msgpack
			p = append(p, b[1:]...)
			continue
		}
		p = append(p, raw(kv[i+1])...)
	}
	return p
}

// blocks2 is an extra_keys value of two blocks holding the given pre-encoded entries.
func blocks2(first, second [][]byte) []byte {
	p := msgp.AppendArrayHeader(nil, 2)
	for _, blk := range [][][]byte{first, second} {
		if blk == nil {
			p = msgp.AppendNil(p)
			continue
		}
		p = msgp.AppendArrayHeader(p, uint32(len(blk)))
		for _, e := range blk {
			p = append(p, e...)
		}
	}
	return p
}

// Wrong types where the format is known are *Errors naming block and entry;
// garbage never panics.
func TestExtraKeysErrors(t *testing.T) {
	mm := func(kv ...any) []byte { return typed(append([]any{"type", "mm"}, kv...)...) }
	cases := []struct {
		name    string
		payload []byte
		want    string
	}{
		{"not an array", storedWith("extra_keys", raw(7)), "event 0: extra_keys: expected array or nil, got int"},
		{"one entry for two blocks", storedWith("extra_keys", raw([]any{nil})), "extra_keys: 1 entries for 2 block hashes"},
		{"block as string", storedWith("extra_keys", raw([]any{nil, "x"})), "extra_keys: [1]: expected array or nil, got str"},
		{"mm hash as int", storedWith("extra_keys", blocks2(nil, [][]byte{mm("modality", "image", "hash", 5, "block_offset", 0)})),
			"extra_keys: [1][0]: mm: hash: expected str, got int"},
		{"mm offset as string", storedWith("extra_keys", blocks2([][]byte{mm("hash", "h", "block_offset", "0")}, nil)),
			"extra_keys: [0][0]: mm: block_offset: expected int, got str"},
		{"mm without offset", storedWith("extra_keys", blocks2([][]byte{mm("hash", "h")}, nil)),
			"extra_keys: [0][0]: mm: block_offset: missing"},
		{"mm modality as int", storedWith("extra_keys", blocks2([][]byte{mm("modality", 1, "hash", "h", "block_offset", 0)}, nil)),
			"extra_keys: [0][0]: mm: modality: expected str, got int"},
		{"lora name as int", storedWith("extra_keys", blocks2([][]byte{typed("type", "lora", "name", 3)}, nil)),
			"extra_keys: [0][0]: lora: name: expected str, got int"},
		{"salt missing", storedWith("extra_keys", blocks2([][]byte{typed("type", "cache_salt")}, nil)),
			"extra_keys: [0][0]: cache_salt: salt: missing"},
		{"prompt embeds as string", storedWith("extra_keys", blocks2(nil, [][]byte{typed("type", "prompt_embeds", "hash", "x")})),
			"extra_keys: [1][0]: prompt_embeds: hash: expected bin, got str"},
		{"type as int", storedWith("extra_keys", blocks2([][]byte{typed("type", 4, "hash", "h")}, nil)),
			"extra_keys: [0][0]: type: expected str, got int"},
		{"nested too deep", storedWith("extra_keys", blocks2([][]byte{raw([]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{[]any{1}}}}}}}}}}}}}}}}}})}, nil)),
			"extra_keys: [0][0]: nested deeper than 16 levels"},
		{"cache_salt key as int", storedWith("cache_salt", raw(9)), "event 0: cache_salt: expected str, got int"},
		{"metadata salt as int", storedWith("lora_name", raw(map[string]any{"cache_salt": 9})),
			"event 0: lora_name: cache_salt: expected str, got int"},
		{"truncated entry", storedWith("extra_keys", []byte{0x92, 0xc0, 0x91, 0x92, 0xa1}), "event 0: extra_keys:"},
	}
	d := NewDecoder()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var b Batch
			err, _ := firstErr(d, tc.payload, &b)
			if err == nil {
				t.Fatalf("no error; decoded %+v", b.Events)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q, want it to contain %q", err, tc.want)
			}
		})
	}
}

// What each shape of entry contributes, and what the namespace takes out.
func TestExtraKeysDigestRules(t *testing.T) {
	d := NewDecoder()
	decode := func(t *testing.T, payload []byte) Event {
		t.Helper()
		var b Batch
		if err := d.Decode(payload, &b); err != nil {
			t.Fatal(err)
		}
		return b.Events[0]
	}
	pair := func(h string, off int) []byte { return raw([]any{h, off}) }
	lora, salt := raw("ad"), raw("t1")
	cases := []struct {
		name      string
		fields    []any
		wantSalt  string
		wantExtra []uint64
	}{
		{"lora and salt only: no content", []any{"lora_name", raw("ad"), "extra_keys", blocks2([][]byte{lora, salt}, [][]byte{lora})},
			"t1", []uint64{0, 0}},
		{"salt on a non-root block is not adopted", []any{"parent_block_hash", raw(3), "extra_keys", blocks2([][]byte{salt}, nil)},
			"", []uint64{digestOf(func(d *extrakeys.Digest) { d.Raw(RawStr, []byte("t1"), 0) }), 0}},
		{"the last other string of a root is the salt", []any{"extra_keys", blocks2([][]byte{raw("a"), raw("b")}, nil)},
			"b", []uint64{digestOf(func(d *extrakeys.Digest) { d.Raw(RawStr, []byte("a"), 0) }), 0}},
		{"a stated salt wins; another string is content", []any{"cache_salt", raw("s"), "extra_keys", blocks2([][]byte{raw("x"), raw("s")}, nil)},
			"s", []uint64{digestOf(func(d *extrakeys.Digest) { d.Raw(RawStr, []byte("x"), 0) }), 0}},
		{"typed salt wins over strings", []any{"extra_keys", blocks2([][]byte{raw("x"), typed("type", "cache_salt", "salt", "y")}, nil)},
			"y", []uint64{digestOf(func(d *extrakeys.Digest) { d.Raw(RawStr, []byte("x"), 0) }), 0}},
		{"a lora prefix is stripped from identifiers", []any{"lora_name", raw("ad"), "extra_keys", blocks2(nil, [][]byte{pair("ad:h1", 2)})},
			"", []uint64{0, mmDigest("h1", 2)}},
		{"typed and tuple inputs agree, offsets count", []any{"extra_keys", blocks2(
			[][]byte{pair("h1", 2), typed("type", "mm", "modality", "audio", "hash", "h2", "block_offset", -3)},
			[][]byte{typed("type", "mm", "modality", "image", "hash", "h1", "block_offset", 2)})},
			"", []uint64{digestOf(func(d *extrakeys.Digest) { d.MultiModal("h1", 2); d.MultiModal("h2", -3) }), mmDigest("h1", 2)}},
		{"prompt embeds: bytes either way", []any{"parent_block_hash", raw(3), "extra_keys", blocks2(
			[][]byte{raw([]byte{1, 2})}, [][]byte{typed("type", "prompt_embeds", "hash", []byte{1, 2})})},
			"", []uint64{digestOf(func(d *extrakeys.Digest) { d.Raw(RawBin, []byte{1, 2}, 0) }), digestOf(func(d *extrakeys.Digest) { d.Raw(RawBin, []byte{1, 2}, 0) })}},
		{"an unknown kind is raw content", []any{"parent_block_hash", raw(3), "extra_keys", blocks2(
			[][]byte{typed("type", "future", "v", 1)}, [][]byte{typed("type", "legacy", "value", []any{"u", "v"})})},
			"", []uint64{
				digestOf(func(d *extrakeys.Digest) {
					d.Raw(RawMap, nil, 2)
					d.Raw(RawStr, []byte("type"), 0)
					d.Raw(RawStr, []byte("future"), 0)
					d.Raw(RawStr, []byte("v"), 0)
					d.Raw(RawUint, nil, 1)
				}),
				digestOf(func(d *extrakeys.Digest) {
					d.Raw(RawArray, nil, 2)
					d.Raw(RawStr, []byte("u"), 0)
					d.Raw(RawStr, []byte("v"), 0)
				})}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := decode(t, storedWith(tc.fields...))
			if e.CacheSalt != tc.wantSalt {
				t.Errorf("CacheSalt = %q, want %q", e.CacheSalt, tc.wantSalt)
			}
			if len(e.BlockExtra) != len(tc.wantExtra) {
				t.Fatalf("BlockExtra = %x, want %x", e.BlockExtra, tc.wantExtra)
			}
			for i := range e.BlockExtra {
				if e.BlockExtra[i] != tc.wantExtra[i] {
					t.Errorf("BlockExtra[%d] = %x, want %x", i, e.BlockExtra[i], tc.wantExtra[i])
				}
			}
		})
	}
	// Encodings do not matter: every width of one offset gives one digest.
	want := mmDigest("h", 7)
	for _, off := range [][]byte{{0x07}, {0xcc, 7}, {0xcd, 0, 7}, {0xce, 0, 0, 0, 7}, {0xd0, 7}, {0xd1, 0, 7}, {0xd2, 0, 0, 0, 7}, {0xd3, 0, 0, 0, 0, 0, 0, 0, 7}} {
		for _, str := range [][]byte{{0xa1, 'h'}, {0xd9, 1, 'h'}, {0xda, 0, 1, 'h'}} {
			entry := append(append([]byte{0x92}, str...), off...)
			e := decode(t, storedWith("parent_block_hash", raw(1), "extra_keys", blocks2([][]byte{entry}, nil)))
			if e.BlockExtra[0] != want {
				t.Errorf("entry %x: digest %x, want %x", entry, e.BlockExtra[0], want)
			}
		}
	}
}
