package codec

import (
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
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

// The expected values are read off the annotations of each file, not the decoder.
func TestGoldenVectors(t *testing.T) {
	want := map[string]Batch{
		"vllm_map.hex": {TS: 1.5, HasDPRank: true, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{18446744073709551615, 7}, TokenIDs: []uint32{1, 2, 3, 256}, BlockSize: 2, Medium: "GPU"},
			{Type: BlockRemoved, BlockHashes: []uint64{7}, Medium: "CPU"},
		}},
		"vllm_array_v025.hex": {TS: 2, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{0xdeadbeef}, ParentHash: 5, HasParent: true, TokenIDs: []uint32{10, 11}, BlockSize: 2, Medium: "GPU", HasGroupIdx: true},
			{Type: AllBlocksCleared},
		}},
		"sglang_signed.hex": {TS: 1, DPRank: 1, HasDPRank: true, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{0xfffffffffffffffe, 0xffffffffffffffff}, ParentHash: 0xffffffffffffff9c, HasParent: true, TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 2},
		}},
		"vllm_bin_map_batch.hex": {TS: 0, DPRank: 3, HasDPRank: true, Skipped: 1, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{258}, ParentHash: 9, HasParent: true, TokenIDs: []uint32{5, 6}, BlockSize: 2, Medium: "GPU",
				ExtraKeys: []byte{0x91, 0x92, 0xa3, 'i', 'm', 'g', 0x00}, GroupIdx: 1, HasGroupIdx: true, SpecKind: "full_attention"},
		}},
	}
	files, _ := filepath.Glob("testdata/golden/*.hex")
	if len(files) != len(want) {
		t.Fatalf("found %d golden files, have expectations for %d", len(files), len(want))
	}
	d := NewDecoder()
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			exp, ok := want[filepath.Base(f)]
			if !ok {
				t.Fatalf("no expectation for %s", f)
			}
			var got Batch
			if err := d.Decode(readHex(t, f), &got); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(exp, got, batchCmp); diff != "" {
				t.Errorf("decode mismatch (-want +got):\n%s", diff)
			}
		})
	}
}
