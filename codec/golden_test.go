package codec_test

import (
	"bytes"
	"encoding/hex"
	. "github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/kvpipe/kvpipe/internal/extrakeys"
)

// readHex reads an annotated hex file: '#' starts a comment, white space is ignored.
func readHex(t testing.TB, path string) []byte {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var digits strings.Builder
	for line := range strings.SplitSeq(string(raw), "\n") {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		digits.WriteString(strings.Join(strings.Fields(line), ""))
	}
	b, err := hex.DecodeString(digits.String())
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return b
}

var batchCmp = cmp.Options{cmpopts.IgnoreUnexported(Batch{}), cmpopts.EquateEmpty()}

// goldens are the expected values of each file, read off its annotations,
// not off the decoder. layout is the Layout whose AppendBatch output must be
// the file byte for byte; nil where the encoder cannot write the file (why
// says what it lacks).
var goldens = []struct {
	file    string
	want    Batch
	invalid []string // the errors of the events left out, in Batch.Invalid
	layout  *engineenc.Layout
	why     string
}{
	{file: "vllm_map.hex", layout: &engineenc.CurrentVLLM, want: Batch{TS: 1.5, HasDPRank: true, Events: []Event{
		{Type: BlockStored, BlockHashes: []uint64{18446744073709551615, 7}, TokenIDs: []uint32{1, 2, 3, 256}, BlockSize: 2, Medium: "GPU"},
		{Type: BlockRemoved, BlockHashes: []uint64{7}, Medium: "CPU"},
	}}},
	{file: "vllm_array_v025.hex", layout: &engineenc.Layout{ArrayEvents: true, StoredSlots: 10, NoDPRank: true}, want: Batch{TS: 2, Events: []Event{
		{Type: BlockStored, BlockHashes: []uint64{0xdeadbeef}, ParentHash: 5, HasParent: true, TokenIDs: []uint32{10, 11}, BlockSize: 2, Medium: "GPU", HasGroupIdx: true},
		{Type: AllBlocksCleared},
	}}},
	{file: "vllm_array_12_slots.hex", layout: &engineenc.Layout{ArrayEvents: true}, want: Batch{TS: 3.25, DPRank: 5, HasDPRank: true, Events: []Event{
		{Type: BlockStored, BlockHashes: []uint64{0xa1a2a3a4a5a6a7a8, 0xb1}, ParentHash: 0xc1c2c3c4, HasParent: true,
			TokenIDs: []uint32{100, 101, 300, 70000}, BlockSize: 2, LoraID: 200, HasLoraID: true, Medium: "CPU", LoraName: "sql-lora",
			ExtraKeys: []byte{0x92, 0x91, 0x92, 0xa4, 'i', 'm', 'g', '0', 0x03, 0xc0}, BlockExtra: []uint64{mmDigest("img0", 3), 0},
			GroupIdx: 3, HasGroupIdx: true,
			SpecKind: "sliding_window", SlidingWindow: 4096, HasSlidingWindow: true},
	}}},
	{file: "vllm_array_removed.hex", layout: &engineenc.Layout{ArrayEvents: true}, want: Batch{TS: 0.5, Events: []Event{
		{Type: BlockRemoved, BlockHashes: []uint64{0x8000000000000001, 42}, Medium: "DISK", GroupIdx: 2, HasGroupIdx: true,
			SpecKind: "sliding_window", SlidingWindow: 1024, HasSlidingWindow: true},
		{Type: BlockRemoved, BlockHashes: []uint64{65536}, Medium: "GPU", HasGroupIdx: true},
		{Type: BlockRemoved, BlockHashes: []uint64{7}},
		{Type: AllBlocksCleared, Medium: "CPU_PINNED"},
	}}},
	{file: "sglang_signed.hex", why: "a metadata map without cache_salt has no encoding, and -2 is an int64 where the encoder writes a fixint",
		want: Batch{TS: 1, DPRank: 1, HasDPRank: true, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{0xfffffffffffffffe, 0xffffffffffffffff}, ParentHash: 0xffffffffffffff9c, HasParent: true, TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 2},
		}}},
	// The metadata map yields the salt and must leave every other field, and
	// the slot after it, intact; "salt-b" is not this event's salt.
	{file: "sglang_cache_salt.hex", why: "the metadata map has a key the encoder does not write, and the encoder writes BlockRemoved's medium slot",
		want: Batch{TS: 4, DPRank: 3, HasDPRank: true, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{1 << 63, 1<<63 - 1}, ParentHash: 0xfffffffffffe7960, HasParent: true,
				TokenIDs: []uint32{7, 8, 9, 10}, BlockSize: 2, Medium: "GPU", CacheSalt: "tenant-42",
				ExtraKeys:  []byte{0x92, 0xc0, 0x91, 0xa6, 's', 'a', 'l', 't', '-', 'b'},
				BlockExtra: []uint64{0, digestOf(func(d *extrakeys.Digest) { d.Raw(RawStr, []byte("salt-b"), 0) })}},
			{Type: BlockRemoved, BlockHashes: []uint64{0xffffffffffffffff}},
		}}},
	{file: "vllm_bin_map_batch.hex", why: "keys out of order, an unknown key and event, other digest filler bytes, an int ts",
		want: Batch{TS: 0, DPRank: 3, HasDPRank: true, Skipped: 1, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{258}, ParentHash: 9, HasParent: true, TokenIDs: []uint32{5, 6}, BlockSize: 2, Medium: "GPU",
				ExtraKeys: []byte{0x91, 0x92, 0xa3, 'i', 'm', 'g', 0x00}, BlockExtra: []uint64{digestOf(func(d *extrakeys.Digest) { d.Raw(RawStr, []byte("img"), 0); d.Raw(RawUint, nil, 0) })},
				GroupIdx: 1, HasGroupIdx: true, SpecKind: "full_attention"},
		}}},
	// The same request in vLLM's three extra_keys encodings: equal digests.
	{file: "vllm_typed_extra_keys.hex", layout: &engineenc.CurrentVLLM, want: adapterImageBatch(typedAdapterImage)},
	{file: "vllm_tuple_extra_keys.hex", layout: &engineenc.CurrentVLLM, want: adapterImageBatch(tupleAdapterImage)},
	{file: "vllm_extra_keys_wide.hex", why: "str8, str16, int16, int64 and array16 where msgspec writes shorter forms",
		want: adapterImageBatch(wideAdapterImage)},
	{file: "sglang_map_salt.hex", layout: &engineenc.Layout{SignedHashes: true, SaltKey: true}, want: Batch{TS: 6, DPRank: 1, HasDPRank: true, Events: []Event{
		{Type: BlockStored, BlockHashes: []uint64{uint64(1<<64 - 0x123456789abcdef)}, TokenIDs: []uint32{1, 2}, BlockSize: 2,
			Medium: "GPU", CacheSalt: "tenant-a"},
	}}},
	{file: "sglang_array_salt.hex", layout: &engineenc.Layout{ArrayEvents: true, StoredSlots: 8, SignedHashes: true, SaltKey: true},
		want: Batch{TS: 7, HasDPRank: true, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{0xfedcba9876543210}, ParentHash: 0x9000000000000000, HasParent: true,
				TokenIDs: []uint32{3, 4}, BlockSize: 2, LoraID: 3, HasLoraID: true, Medium: "GPU", CacheSalt: "tenant-b"},
		}}},
	{file: "sglang_eagle_map.hex", layout: &engineenc.Layout{SignedHashes: true, SaltKey: true}, want: Batch{TS: 9, HasDPRank: true, Events: []Event{
		{Type: BlockStored, BlockHashes: []uint64{0xfedcba9876543211}, ParentHash: 0x8123456789abcdf0, HasParent: true,
			TokenIDs: []uint32{7, 8, 9, 10}, Bigram: true, BlockSize: 3, Medium: "GPU"},
	}}},
	{file: "sglang_eagle_array.hex", why: "an unreadable event, and a string in the group_idx slot",
		want: Batch{TS: 8, HasDPRank: true, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{0xeeeeeeeeeeeeeeef}, TokenIDs: []uint32{5, 6, 7}, Bigram: true, BlockSize: 2, Medium: "GPU"},
			{Type: BlockStored, BlockHashes: []uint64{4}, TokenIDs: []uint32{1, 2}, BlockSize: 2, SpecKind: "mamba"},
		}},
		invalid: []string{"event 1: token_ids: [1]: bigram starts with 9, not 8, the second token of the one before"}},
}

// The extra_keys of vllm_{typed,tuple}_extra_keys.hex and
// vllm_extra_keys_wide.hex, as their annotations give them.
var (
	typedAdapterImage = engineenc.AppendExtraKeys(nil, [][]engineenc.ExtraKey{
		{{Kind: engineenc.ExtraLoRA, Name: "ad"}, {Kind: engineenc.ExtraMultiModal, Modality: "image", Hash: "h1", Offset: 1}, {Kind: engineenc.ExtraCacheSalt, Name: "t1"}},
		{{Kind: engineenc.ExtraLoRA, Name: "ad"}, {Kind: engineenc.ExtraMultiModal, Modality: "image", Hash: "h1", Offset: -1}},
	}, engineenc.ExtraTyped)
	tupleAdapterImage = []byte{0x92,
		0x93, 0xa2, 'a', 'd', 0x92, 0xa2, 'h', '1', 0x01, 0xa2, 't', '1',
		0x92, 0xa2, 'a', 'd', 0x92, 0xa2, 'h', '1', 0xff}
	wideAdapterImage = []byte{0xdc, 0x00, 0x02,
		0x93, 0xd9, 0x02, 'a', 'd', 0x92, 0xda, 0x00, 0x02, 'h', '1', 0xd3, 0, 0, 0, 0, 0, 0, 0, 1, 0xd9, 0x02, 't', '1',
		0x92, 0xa2, 'a', 'd', 0x92, 0xa2, 'h', '1', 0xd1, 0xff, 0xff}
)

// adapterImageBatch is the batch of those three files, with extra keys raw.
func adapterImageBatch(raw []byte) Batch {
	return Batch{TS: 5, HasDPRank: true, Events: []Event{
		{Type: BlockStored, BlockHashes: []uint64{0x1111, 0x2222}, TokenIDs: []uint32{9, 9, 9, 9}, BlockSize: 2,
			LoraID: 1, HasLoraID: true, Medium: "GPU", LoraName: "ad", CacheSalt: "t1", ExtraKeys: raw,
			BlockExtra: []uint64{mmDigest("h1", 1), mmDigest("h1", -1)}},
	}}
}

func TestGoldenVectors(t *testing.T) {
	files, _ := filepath.Glob("testdata/golden/*.hex")
	if len(files) != len(goldens) {
		t.Fatalf("found %d golden files, have expectations for %d", len(files), len(goldens))
	}
	d := NewDecoder()
	for _, g := range goldens {
		t.Run(g.file, func(t *testing.T) {
			raw := readHex(t, filepath.Join("testdata/golden", g.file))
			var got Batch
			if err := d.Decode(raw, &got); err != nil {
				t.Fatal(err)
			}
			var invalid []string
			for _, e := range got.Invalid {
				invalid = append(invalid, e.Error())
			}
			if diff := cmp.Diff(g.invalid, invalid); diff != "" {
				t.Errorf("unreadable events (-want +got):\n%s", diff)
			}
			got.Invalid = nil
			if diff := cmp.Diff(g.want, got, batchCmp); diff != "" {
				t.Errorf("decode mismatch (-want +got):\n%s", diff)
			}
			if g.layout == nil {
				if g.why == "" {
					t.Error("no layout and no reason why the encoder cannot write this file")
				}
				return
			}
			// The expected batch, not the decoded one: the encoder is checked
			// against the hand-written bytes on its own.
			if enc := engineenc.AppendBatch(nil, &g.want, *g.layout); !bytes.Equal(enc, raw) {
				t.Errorf("AppendBatch(%+v) differs from the file:\n got %x\nwant %x", *g.layout, enc, raw)
			}
		})
	}
}
