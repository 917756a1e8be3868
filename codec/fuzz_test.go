package codec_test

import (
	. "github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"path/filepath"
	"testing"

	gocmp "github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// FuzzDecode: no input panics, and whatever decodes survives a re-encode
// unchanged: in the map layout with SGLang's salt key, which carries every
// field the decoder keeps, and in the full array layout, which carries them
// all but a salt beside a lora name (both want slot 7).
func FuzzDecode(f *testing.F) {
	files, _ := filepath.Glob("testdata/golden/*.hex")
	for _, file := range files {
		f.Add(readHex(f, file))
	}
	for _, l := range []engineenc.Layout{engineenc.CurrentVLLM, {ArrayEvents: true}, {ArrayEvents: true, StoredSlots: 6, NoDPRank: true}, {MapBatch: true, BinHashes: true},
		{SaltKey: true}, {ArrayEvents: true, StoredSlots: 8, SaltKey: true, SignedHashes: true}} {
		f.Add(realisticPayload(l))
		full := fullBatch()
		f.Add(engineenc.AppendBatch(nil, &full, l))
		extra := extraKeysBatch()
		f.Add(engineenc.AppendBatch(nil, &extra, l))
		eagle := eagleBatch()
		f.Add(engineenc.AppendBatch(nil, &eagle, l))
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
		first.Skipped, first.Invalid = 0, nil // unknown and unreadable events are not re-encoded
		for _, l := range []engineenc.Layout{{SaltKey: true}, {ArrayEvents: true, SaltKey: true}} {
			if l.ArrayEvents && saltBesideLora(&first) {
				continue
			}
			again := engineenc.AppendBatch(nil, &first, l)
			if err := d.Decode(again, &second); err != nil {
				t.Fatalf("batch re-encoded in %+v does not decode: %v", l, err)
			}
			if diff := gocmp.Diff(first, second, batchCmp, cmpopts.EquateNaNs()); diff != "" {
				t.Fatalf("re-encode in %+v changed the batch (-first +second):\n%s", l, diff)
			}
		}
	})
}

// saltBesideLora reports whether an event of b has both a lora name and a
// salt, which the array form cannot both carry unless extra_keys repeat the salt.
func saltBesideLora(b *Batch) bool {
	for i := range b.Events {
		if e := &b.Events[i]; e.LoraName != "" && e.CacheSalt != "" {
			return true
		}
	}
	return false
}
