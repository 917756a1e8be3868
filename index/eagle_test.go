package index

import (
	"encoding/json"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
)

// EaglePrompt's keys are dynamo's for is_eagle, computed by a reference
// written from dynamo's rule in Python with the C xxh3: a window of
// block_size+1 tokens, stride block_size, only whole windows; each window's
// seeded xxh3 chained by the xxh3 of (parent, hash) little-endian.
func TestEaglePromptMatchesReference(t *testing.T) {
	py := enginepeer.Python(t)
	if exec.Command(py, "-c", "import xxhash").Run() != nil {
		enginepeer.Missing(t, "python3-xxhash")
	}
	const bs = 4
	prompts := [][]uint32{{}, {1, 2, 3, 4}, {1, 2, 3, 4, 5}, {1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, make([]uint32, 37)}
	for i := range prompts[5] {
		prompts[5][i] = uint32(i * 7919)
	}
	in, _ := json.Marshal(prompts)
	script := `import json, struct, sys, xxhash
bs = int(sys.argv[2])
for toks in json.loads(sys.argv[1]):
    keys, start, parent = [], 0, None
    while start + bs + 1 <= len(toks):
        w = toks[start:start + bs + 1]
        h = xxhash.xxh3_64_intdigest(struct.pack("<%dI" % len(w), *w), seed=1337)
        if parent is not None:
            h = xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, h), seed=1337)
        keys.append(str(h))
        parent, start = h, start + bs
    print(",".join(keys) or "-")`
	out, err := exec.Command(py, "-c", script, string(in), strconv.Itoa(bs)).Output()
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Fields(string(out))
	var h Hasher
	for i, p := range prompts {
		var got []string
		for _, k := range h.EaglePrompt(nil, p, bs) {
			got = append(got, strconv.FormatUint(k, 10))
		}
		if g := strings.Join(got, ","); g != strings.TrimPrefix(lines[i], "-") {
			t.Errorf("prompt of %d tokens: EaglePrompt %s, reference %s", len(p), g, lines[i])
		}
	}
}

// A block is keyed once the token after it is known; the windows overlap
// by one token, so a change at a block's first token also changes the
// block before it, unlike plain keys.
func TestEagleWindows(t *testing.T) {
	var h Hasher
	p := make([]uint32, 4*16)
	for i := range p {
		p[i] = uint32(i + 1)
	}
	if n := len(h.EaglePrompt(nil, p, 16)); n != 3 {
		t.Errorf("4 blocks of tokens: %d EAGLE keys, want 3 (the last needs token 64)", n)
	}
	if n := len(h.EaglePrompt(nil, append(p, 0), 16)); n != 4 {
		t.Errorf("4 blocks and a token: %d EAGLE keys, want 4", n)
	}
	q := slices.Clone(p)
	q[32]++ // the first token of block 2
	a, b := h.EaglePrompt(nil, p, 16), h.EaglePrompt(nil, q, 16)
	if a[0] != b[0] || a[1] == b[1] {
		t.Errorf("a change at token 32 must change EAGLE block 1 (its window ends there) and not block 0")
	}
	if pa, pb := h.Prompt(nil, p, 16), h.Prompt(nil, q, 16); pa[1] != pb[1] {
		t.Error("a change at token 32 changed plain block 1")
	}
	if slices.Equal(h.Prompt(nil, p, 16)[:3], a) {
		t.Error("EAGLE keys equal plain keys")
	}
}

// EagleKeys is EaglePrompt on the base model, and takes the namespace and
// multimodal digests exactly as RequestKeys does.
func TestEagleKeysAsRequestKeys(t *testing.T) {
	var h Hasher
	toks := make([]uint32, 5*16+3)
	for i := range toks {
		toks[i] = uint32(i * 31)
	}
	if a, b := h.EagleKeys(nil, &Request{Tokens: toks}, 16), h.EaglePrompt(nil, toks, 16); !slices.Equal(a, b) {
		t.Errorf("EagleKeys of a base request %x, EaglePrompt %x", a, b)
	}
	base := h.EagleKeys(nil, &Request{Tokens: toks}, 16)
	for _, r := range []Request{
		{Tokens: toks, Salt: "s"}, {Tokens: toks, Lora: "a"}, {Tokens: toks, LoraID: 2, HasLoraID: true},
		{Tokens: toks, MultiModal: []MultiModal{{Hash: "img", Offset: 20, Length: 30}}},
		{Tokens: toks, MultiModal: []MultiModal{{Hash: "b", Offset: 40, Length: 4}, {Hash: "a", Offset: 3, Length: 2}}},
	} {
		got := h.EagleKeys(nil, &r, 16)
		if len(got) != len(base) || got[len(got)-1] == base[len(base)-1] {
			t.Errorf("%+v: keys %x do not differ from the base request's", r, got)
		}
	}
	// The same inputs in another order digest alike (RequestKeys' rule).
	x := h.EagleKeys(nil, &Request{Tokens: toks, MultiModal: []MultiModal{{Hash: "a", Offset: 3, Length: 2}, {Hash: "b", Offset: 40, Length: 4}}}, 16)
	y := h.EagleKeys(nil, &Request{Tokens: toks, MultiModal: []MultiModal{{Hash: "b", Offset: 40, Length: 4}, {Hash: "a", Offset: 3, Length: 2}}}, 16)
	if !slices.Equal(x, y) {
		t.Error("sorted and unsorted inputs key differently")
	}
}

// EagleKeys allocates nothing when dst has room.
func TestEagleKeysAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	var h Hasher
	toks := make([]uint32, 5*16+3)
	dst := make([]uint64, 0, 8)
	r := &Request{Tokens: toks, Salt: "s", MultiModal: []MultiModal{{Hash: "img", Offset: 20, Length: 30}}}
	if n := testing.AllocsPerRun(50, func() { dst = h.EagleKeys(dst[:0], r, 16) }); n != 0 {
		t.Errorf("EagleKeys allocates %.0f times", n)
	}
}
