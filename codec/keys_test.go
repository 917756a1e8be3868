package codec_test

import (
	"fmt"
	. "github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"slices"
	"testing"

	"github.com/kvpipe/kvpipe/index"
)

// The cross-check of docs/FORMAT.md §10: an engine publishes BlockStored
// events for a request in its own layout, the events are encoded and
// decoded, keys are computed from the decoded events alone (Namespace, Key,
// BlockExtra, as the actor does), and they must equal what a router computes
// from the request alone (RequestKeys).

const xBlock = 4 // tokens per block in these tests

// engineLayout is one engine version's way of publishing a request.
type engineLayout struct {
	name string
	l    engineenc.Layout
	form engineenc.ExtraForm
	// sglang: no extra_keys, the salt as SGLang's cache_salt, the adapter by
	// lora_id only; vLLM otherwise (lora_name and lora_id, salt in extra_keys).
	sglang bool
}

var engineLayouts = []engineLayout{
	{name: "vllm-tuples", l: engineenc.CurrentVLLM, form: engineenc.ExtraTuples},
	{name: "vllm-typed", l: engineenc.CurrentVLLM, form: engineenc.ExtraTyped},
	{name: "vllm-0.25-array-tuples", l: engineenc.Layout{ArrayEvents: true, NoDPRank: false}, form: engineenc.ExtraTuples},
	{name: "vllm-bin-hashes-typed", l: engineenc.Layout{BinHashes: true}, form: engineenc.ExtraTyped},
	{name: "sglang-map-salt", l: engineenc.Layout{SignedHashes: true, SaltKey: true}, sglang: true},
	{name: "sglang-array-metadata", l: engineenc.Layout{ArrayEvents: true, StoredSlots: 8, SignedHashes: true, SaltKey: true}, sglang: true},
}

// vllmExtraKeys is what vLLM's generate_block_hash_extra_keys gives each
// block of r, written here from vLLM's description and independently of
// index.RequestKeys: the adapter's name, then each multimodal input the
// block overlaps (walked with a running index, as vLLM threads
// curr_mm_idx), then the salt on the block at token 0. bareIDs is the form
// before vLLM 0.19.1: identifiers without offsets, and its boundary tests.
func vllmExtraKeys(r *index.Request, nBlocks int, bareIDs bool) [][]engineenc.ExtraKey {
	out := make([][]engineenc.ExtraKey, nBlocks)
	cur := 0
	mm := r.MultiModal
	for b := range nBlocks {
		start, end := b*xBlock, (b+1)*xBlock
		var keys []engineenc.ExtraKey
		if r.Lora != "" {
			keys = append(keys, engineenc.ExtraKey{Kind: engineenc.ExtraLoRA, Name: r.Lora})
		}
		last := len(mm) - 1
		passed := last < 0 || mm[last].Offset+mm[last].Length <= start
		if bareIDs && last >= 0 {
			passed = mm[last].Offset+mm[last].Length < start
		}
		for !passed && cur < len(mm) {
			off, n := mm[cur].Offset, mm[cur].Length
			if end <= off {
				break
			}
			if start >= off+n && !bareIDs || start > off+n && bareIDs {
				cur++
				continue
			}
			keys = append(keys, engineenc.ExtraKey{Kind: engineenc.ExtraMultiModal, Modality: "image", Hash: mm[cur].Hash, Offset: int64(off - start)})
			if end >= off+n {
				cur++
			} else {
				break
			}
		}
		if start == 0 && r.Salt != "" {
			keys = append(keys, engineenc.ExtraKey{Kind: engineenc.ExtraCacheSalt, Name: r.Salt})
		}
		out[b] = keys // nil when empty, as vLLM sends None
	}
	return out
}

// publish is the payload of the events an engine of layout el sends for r:
// its first two blocks in one root event, the rest in a second event whose
// parent is the first event's last block. Engine hashes are made up: the
// keys must not depend on them.
func publish(r *index.Request, el engineLayout, bareIDs bool, seed uint64) []byte {
	n := len(r.Tokens) / xBlock
	var extra [][]engineenc.ExtraKey
	if !el.sglang {
		extra = vllmExtraKeys(r, n, bareIDs)
	}
	var b Batch
	for _, span := range [][2]int{{0, 2}, {2, n}} {
		e := Event{Type: BlockStored, BlockSize: xBlock, Medium: "GPU", TokenIDs: r.Tokens[span[0]*xBlock : span[1]*xBlock]}
		for i := span[0]; i < span[1]; i++ {
			e.BlockHashes = append(e.BlockHashes, seed+uint64(i)*0x9e3779b97f4a7c15)
		}
		if span[0] > 0 {
			e.ParentHash, e.HasParent = seed+uint64(span[0]-1)*0x9e3779b97f4a7c15, true
		}
		if el.sglang {
			e.LoraID, e.HasLoraID, e.CacheSalt = r.LoraID, r.HasLoraID, r.Salt
		} else {
			e.LoraName, e.LoraID, e.HasLoraID = r.Lora, r.LoraID, r.HasLoraID
			if blocks := extra[span[0]:span[1]]; slices.ContainsFunc(blocks, func(k []engineenc.ExtraKey) bool { return k != nil }) {
				form := el.form
				if bareIDs {
					form = engineenc.ExtraBareIDs
				}
				e.ExtraKeys = engineenc.AppendExtraKeys(nil, blocks, form)
			}
		}
		b.Events = append(b.Events, e)
	}
	return engineenc.AppendBatch(nil, &b, el.l)
}

// eventKeys decodes payload and keys its blocks the way the actor does: a
// root's first block takes the event's namespace, every block its digest,
// and a parent is looked up among the keys learned so far.
func eventKeys(t *testing.T, payload []byte) []uint64 {
	t.Helper()
	var b Batch
	if err := NewDecoder().Decode(payload, &b); err != nil {
		t.Fatal(err)
	}
	var h index.Hasher
	learned := map[uint64]uint64{}
	var keys []uint64
	for _, e := range b.Events {
		ns := index.Namespace(e.LoraName, e.LoraID, e.HasLoraID, e.CacheSalt)
		parent, hasParent := uint64(0), e.HasParent
		if hasParent {
			var ok bool
			if parent, ok = learned[e.ParentHash]; !ok {
				t.Fatalf("parent %x never stored", e.ParentHash)
			}
		}
		for i, eh := range e.BlockHashes {
			var extra uint64
			if len(e.BlockExtra) > 0 {
				extra = e.BlockExtra[i]
			}
			parent = h.Key(parent, hasParent, ns, extra, e.TokenIDs[i*e.BlockSize:(i+1)*e.BlockSize])
			hasParent = true
			learned[eh] = parent
			keys = append(keys, parent)
		}
	}
	return keys
}

// crossRequests share one prompt of 16 tokens, placeholders (7777) at 5..12.
func crossRequests() map[string]*index.Request {
	toks := []uint32{1, 2, 3, 4, 5, 7777, 7777, 7777, 7777, 7777, 7777, 7777, 7777, 14, 15, 16}
	img := func(h string, off, n int) index.MultiModal { return index.MultiModal{Hash: h, Offset: off, Length: n} }
	return map[string]*index.Request{
		"base":             {Tokens: toks},
		"lora":             {Tokens: toks, Lora: "ad", LoraID: 3, HasLoraID: true},
		"lora-2":           {Tokens: toks, Lora: "other", LoraID: 4, HasLoraID: true},
		"salt":             {Tokens: toks, Salt: "t1"},
		"lora+salt":        {Tokens: toks, Lora: "ad", LoraID: 3, HasLoraID: true, Salt: "t1"},
		"image-A":          {Tokens: toks, MultiModal: []index.MultiModal{img("A", 5, 8)}},
		"image-B":          {Tokens: toks, MultiModal: []index.MultiModal{img("B", 5, 8)}},
		"lora+salt+A":      {Tokens: toks, Lora: "ad", LoraID: 3, HasLoraID: true, Salt: "t1", MultiModal: []index.MultiModal{img("A", 5, 8)}},
		"images-A-B":       {Tokens: toks, MultiModal: []index.MultiModal{img("A", 5, 4), img("B", 9, 4)}},
		"images-B-A":       {Tokens: toks, MultiModal: []index.MultiModal{img("B", 5, 4), img("A", 9, 4)}},
		"image-A-at-block": {Tokens: toks, MultiModal: []index.MultiModal{img("A", 4, 8)}},
	}
}

func TestEventKeysEqualRequestKeys(t *testing.T) {
	var h index.Hasher
	reqs := crossRequests()
	perLayout := map[string]map[string][]uint64{}
	for _, el := range engineLayouts {
		perLayout[el.name] = map[string][]uint64{}
		for name, r := range reqs {
			if el.sglang && len(r.MultiModal) > 0 {
				continue // SGLang's events carry no multimodal input
			}
			rr := *r
			if el.sglang {
				rr.Lora = "" // SGLang states the adapter by id only; the router must too
			}
			t.Run(el.name+"/"+name, func(t *testing.T) {
				got := eventKeys(t, publish(&rr, el, false, 0x1000))
				want := h.RequestKeys(nil, &rr, xBlock)
				if !slices.Equal(got, want) {
					t.Errorf("keys from events %x\n      from request %x", got, want)
				}
				perLayout[el.name][name] = got
			})
		}
	}
	// Every vLLM layout keys a request alike.
	for _, el := range engineLayouts[1:4] {
		for name, keys := range perLayout[el.name] {
			if first := perLayout[engineLayouts[0].name][name]; !slices.Equal(first, keys) {
				t.Errorf("%s: %s keys differ from %s's", name, el.name, engineLayouts[0].name)
			}
		}
	}
}

// Requests that an engine would serve from different cache entries never
// share a key at or after the first block where they differ; the same
// request always gets the same keys.
func TestRequestKeysSeparateWhatEnginesSeparate(t *testing.T) {
	var h index.Hasher
	reqs := crossRequests()
	keys := map[string][]uint64{}
	for name, r := range reqs {
		keys[name] = h.RequestKeys(nil, r, xBlock)
	}
	// From block 0 on: a namespace changes the root, so every block.
	for _, pair := range [][2]string{{"base", "lora"}, {"base", "salt"}, {"lora", "lora-2"}, {"lora", "lora+salt"}, {"salt", "lora+salt"}, {"image-A", "lora+salt+A"}} {
		a, b := keys[pair[0]], keys[pair[1]]
		for _, k := range a {
			if slices.Contains(b, k) {
				t.Errorf("%s and %s share key %x", pair[0], pair[1], k)
			}
		}
	}
	// Images behind the same placeholders: equal keys before the first image
	// block (block 1, tokens 4..7), different from it on.
	for _, pair := range [][2]string{{"image-A", "image-B"}, {"base", "image-A"}, {"images-A-B", "images-B-A"}, {"image-A", "image-A-at-block"}} {
		a, b := keys[pair[0]], keys[pair[1]]
		if a[0] != b[0] {
			t.Errorf("%s and %s differ in block 0, before any image", pair[0], pair[1])
		}
		for i := 1; i < len(a); i++ {
			if a[i] == b[i] {
				t.Errorf("%s and %s share block %d's key", pair[0], pair[1], i)
			}
		}
	}
	for name, r := range reqs {
		if again := h.RequestKeys(nil, r, xBlock); !slices.Equal(again, keys[name]) {
			t.Errorf("%s: keys changed between two calls", name)
		}
	}
	if !slices.Equal(keys["base"], h.Prompt(nil, reqs["base"].Tokens, xBlock)) {
		t.Error("a bare request's keys are not Prompt's")
	}
}

// vLLM before 0.19.1 wrote bare identifiers, so its multimodal blocks cannot
// be keyed as a router keys a request: they must then miss, never match
// another request's blocks. Its text blocks, adapters and salts still key
// right.
func TestBareIdentifierEventsMissNeverCollide(t *testing.T) {
	var h index.Hasher
	reqs := crossRequests()
	all := map[uint64]string{}
	for name, r := range reqs {
		for _, k := range h.RequestKeys(nil, r, xBlock) {
			all[k] = name
		}
	}
	for name, r := range reqs {
		got := eventKeys(t, publish(r, engineLayouts[0], true, 0x2000))
		want := h.RequestKeys(nil, r, xBlock)
		if len(r.MultiModal) == 0 {
			if !slices.Equal(got, want) {
				t.Errorf("%s: text request keyed apart from its events", name)
			}
			continue
		}
		if slices.Equal(got, want) {
			t.Errorf("%s: pre-0.19.1 multimodal events keyed like the request: nothing is tested", name)
		}
		for i, k := range got {
			if owner, ok := all[k]; ok && k != want[i] {
				t.Errorf("%s: block %d of a pre-0.19.1 event has %s's key", name, i, owner)
			}
		}
	}
}

func ExampleAppendExtraKeys() {
	blocks := [][]engineenc.ExtraKey{{{Kind: engineenc.ExtraLoRA, Name: "ad"}, {Kind: engineenc.ExtraMultiModal, Hash: "h1", Offset: 3}}, nil}
	fmt.Printf("%x\n", engineenc.AppendExtraKeys(nil, blocks, engineenc.ExtraTuples))
	// Output: 9292a2616492a2683103c0
}
