package codec

import (
	"path/filepath"
	"testing"

	gocmp "github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// FuzzDecode: no input panics, and whatever decodes survives a re-encode
// unchanged (the full array layout carries every field the decoder keeps).
func FuzzDecode(f *testing.F) {
	files, _ := filepath.Glob("testdata/golden/*.hex")
	for _, file := range files {
		f.Add(readHex(f, file))
	}
	for _, l := range []Layout{CurrentVLLM, {ArrayEvents: true}, {ArrayEvents: true, StoredSlots: 6, NoDPRank: true}, {MapBatch: true, BinHashes: true}} {
		f.Add(realisticPayload(l))
		full := fullBatch()
		f.Add(AppendBatch(nil, &full, l))
	}
	d := NewDecoder()
	var first, second Batch
	f.Fuzz(func(t *testing.T, payload []byte) {
		if err := d.Decode(payload, &first); err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("error %T is not a *codec.Error: %v", err, err)
			}
			return
		}
		again := AppendBatch(nil, &first, Layout{ArrayEvents: true})
		if err := d.Decode(again, &second); err != nil {
			t.Fatalf("re-encoded batch does not decode: %v", err)
		}
		first.Skipped = 0 // unknown events are not re-encoded
		if diff := gocmp.Diff(first, second, batchCmp, cmpopts.EquateNaNs()); diff != "" {
			t.Fatalf("re-encode changed the batch (-first +second):\n%s", diff)
		}
	})
}
