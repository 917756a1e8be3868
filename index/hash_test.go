package index

import (
	"encoding/json"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
	"github.com/kvpipe/kvpipe/internal/extrakeys"
)

// The token hash must equal what a Python or Rust router computes with the
// reference xxh3 (python3-xxhash wraps the C xxHash library).
func TestTokenHashMatchesReferenceXXH3(t *testing.T) {
	py := enginepeer.Python(t)
	if exec.Command(py, "-c", "import xxhash").Run() != nil {
		enginepeer.Missing(t, "python3-xxhash")
	}
	blocks := [][]uint32{{1, 2, 3, 4}, {}, {0xffffffff, 0, 151935}, make([]uint32, 16)}
	for i := range blocks[3] {
		blocks[3][i] = uint32(i * 7919)
	}
	in, _ := json.Marshal(blocks)
	script := `import json, struct, sys, xxhash
for b in json.loads(sys.argv[1]):
    print(xxhash.xxh3_64_intdigest(struct.pack("<%dI" % len(b), *b), seed=1337))
chain = struct.pack("<QQ", 11, 22)
print(xxhash.xxh3_64_intdigest(chain, seed=1337))`
	out, err := exec.Command(py, "-c", script, string(in)).Output()
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Fields(string(out))
	var h Hasher
	for i, b := range blocks {
		if got := h.tokenHash(b); lines[i] != strconv.FormatUint(got, 10) {
			t.Errorf("block %v: TokenHash = %d, reference xxh3 = %s", b, got, lines[i])
		}
	}
	if got := chain(11, true, 22); lines[len(blocks)] != strconv.FormatUint(got, 10) {
		t.Errorf("Chain(11, 22) = %d, reference = %s", got, lines[len(blocks)])
	}
}

// Namespace is 0 only for the base model without salt, and its encoding
// tells every input apart: no shift of bytes between name and salt, and no
// adapter by id, collides.
func TestNamespace(t *testing.T) {
	if ns := Namespace("", 0, false, ""); ns != 0 {
		t.Fatalf("base namespace = %x, want 0", ns)
	}
	type in struct {
		lora  string
		id    int64
		hasID bool
		salt  string
	}
	inputs := []in{
		{lora: "a"}, {lora: "ab"}, {lora: "a", salt: "b"}, {lora: "ab", salt: "c"}, {lora: "a", salt: "bc"},
		{salt: "a"}, {salt: "ab"}, {id: 0, hasID: true}, {id: 1, hasID: true}, {id: 1, hasID: true, salt: "a"},
		{lora: "\x01"}, {salt: "\x01"}, {lora: "s\x01\x00\x00\x00\x00\x00\x00\x00a"},
	}
	seen := map[uint64]in{}
	for _, x := range inputs {
		ns := Namespace(x.lora, x.id, x.hasID, x.salt)
		if ns == 0 {
			t.Errorf("%+v: namespace 0", x)
		}
		if prev, dup := seen[ns]; dup {
			t.Errorf("%+v and %+v share namespace %x", prev, x, ns)
		}
		seen[ns] = x
	}
	// A name wins over an id: vLLM hashes the name, the id is deprecated.
	if Namespace("a", 1, true, "") != Namespace("a", 2, true, "") || Namespace("a", 1, true, "") != Namespace("a", 0, false, "") {
		t.Error("lora id changes the namespace of a named adapter")
	}
}

func TestNamespaceAllocatesNothing(t *testing.T) {
	if testing.AllocsPerRun(100, func() { Namespace("sql-lora", 0, false, "tenant-0042") }) != 0 {
		t.Error("Namespace allocates")
	}
}

func TestKeyExtendsBlock(t *testing.T) {
	var h Hasher
	toks := []uint32{1, 2, 3, 4}
	plain := h.block(0, false, toks)
	if got := h.Key(0, false, 0, 0, toks); got != plain {
		t.Errorf("bare root: Key %x, Block %x", got, plain)
	}
	if got, want := h.Key(plain, true, 0, 0, toks), h.block(plain, true, toks); got != want {
		t.Errorf("bare child: Key %x, Block %x", got, want)
	}
	if got, want := h.Key(plain, true, 77, 0, toks), h.block(plain, true, toks); got != want {
		t.Errorf("a child inherits its namespace: Key %x, want Block %x", got, want)
	}
	keys := map[uint64]string{}
	for name, k := range map[string]uint64{
		"bare root": plain, "root ns": h.Key(0, false, 5, 0, toks), "root extra": h.Key(0, false, 0, 5, toks),
		"root both": h.Key(0, false, 5, 5, toks), "root ns 6": h.Key(0, false, 6, 0, toks),
		"child": h.Key(plain, true, 0, 0, toks), "child extra": h.Key(plain, true, 0, 5, toks), "child extra 6": h.Key(plain, true, 0, 6, toks),
	} {
		if other, dup := keys[k]; dup {
			t.Errorf("%s and %s share key %x", name, other, k)
		}
		keys[k] = name
	}
}

// RequestKeys of a bare request is Prompt; adapters, salts and images change
// exactly the keys they should.
func TestRequestKeys(t *testing.T) {
	var h Hasher
	const bs = 4
	toks := make([]uint32, 20) // five blocks, an image's placeholders in blocks 1..3
	for i := range toks {
		toks[i] = uint32(i)
	}
	for i := 6; i < 14; i++ {
		toks[i] = 9999
	}
	base := &Request{Tokens: toks}
	if got, want := h.RequestKeys(nil, base, bs), h.Prompt(nil, toks, bs); !slices.Equal(got, want) {
		t.Fatalf("bare request: %x, Prompt %x", got, want)
	}
	keys := func(r Request) []uint64 { return h.RequestKeys(nil, &r, bs) }
	imgA := keys(Request{Tokens: toks, MultiModal: []MultiModal{{Hash: "A", Offset: 6, Length: 8}}})
	imgB := keys(Request{Tokens: toks, MultiModal: []MultiModal{{Hash: "B", Offset: 6, Length: 8}}})
	plain := keys(*base)
	if imgA[0] != plain[0] || imgA[1] == plain[1] {
		t.Errorf("an image must leave the block before it alone and change its first block")
	}
	for i := 1; i < 5; i++ {
		if imgA[i] == imgB[i] || imgA[i] == plain[i] {
			t.Errorf("block %d: images A and B, or A and none, share a key", i)
		}
	}
	if again := keys(Request{Tokens: toks, MultiModal: []MultiModal{{Hash: "A", Offset: 6, Length: 8}}}); !slices.Equal(again, imgA) {
		t.Error("the same image gives other keys")
	}
	lora := keys(Request{Tokens: toks, Lora: "ad"})
	salted := keys(Request{Tokens: toks, Salt: "t"})
	for i := range plain {
		if lora[i] == plain[i] || salted[i] == plain[i] || lora[i] == salted[i] {
			t.Errorf("block %d: base, adapter and salt keys not all distinct", i)
		}
	}
	// Input order does not matter.
	two := []MultiModal{{Hash: "A", Offset: 2, Length: 3}, {Hash: "B", Offset: 5, Length: 6}, {Hash: "C", Offset: 11, Length: 1}}
	sorted := keys(Request{Tokens: toks, MultiModal: two})
	rev := []MultiModal{two[2], two[0], two[1]}
	if got := keys(Request{Tokens: toks, MultiModal: rev}); !slices.Equal(got, sorted) {
		t.Errorf("unsorted inputs: %x, sorted %x", got, sorted)
	}
	// Block 1 ([4, 8)) covers A's tail at -2 and B's head at 1, in that order.
	var want extrakeys.Digest
	want.MultiModal("A", -2)
	want.MultiModal("B", 1)
	if got := h.Key(sorted[0], true, 0, want.Sum(), toks[4:8]); got != sorted[1] {
		t.Errorf("block 1: key %x, want %x", sorted[1], got)
	}
}

func TestRequestKeysAllocatesNothing(t *testing.T) {
	r, bs := benchRequest()
	var h Hasher
	dst := h.RequestKeys(nil, r, bs)
	if allocs := testing.AllocsPerRun(100, func() { dst = h.RequestKeys(dst[:0], r, bs) }); allocs != 0 {
		t.Errorf("RequestKeys allocates %.1f times, want 0", allocs)
	}
}

// benchRequest is a 2,048-token LoRA request with a salt and four images.
func benchRequest() (*Request, int) {
	toks := make([]uint32, 2048)
	for i := range toks {
		toks[i] = uint32(i*7919) % 151936
	}
	r := &Request{Tokens: toks, Lora: "sql-lora", Salt: "tenant-0042"}
	for i := range 4 {
		r.MultiModal = append(r.MultiModal, MultiModal{Hash: strings.Repeat("ab", 32), Offset: 100 + 400*i, Length: 300})
	}
	return r, 16
}

func BenchmarkRequestKeys(b *testing.B) {
	r, bs := benchRequest()
	var h Hasher
	dst := h.RequestKeys(nil, r, bs)
	b.SetBytes(int64(4 * len(r.Tokens)))
	b.ReportAllocs()
	for b.Loop() {
		dst = h.RequestKeys(dst[:0], r, bs)
	}
	b.ReportMetric(float64(b.N*len(dst))/b.Elapsed().Seconds(), "blocks/s")
}

func BenchmarkPrompt(b *testing.B) {
	r, bs := benchRequest()
	var h Hasher
	dst := h.Prompt(nil, r.Tokens, bs)
	b.SetBytes(int64(4 * len(r.Tokens)))
	b.ReportAllocs()
	for b.Loop() {
		dst = h.Prompt(dst[:0], r.Tokens, bs)
	}
	b.ReportMetric(float64(b.N*len(dst))/b.Elapsed().Seconds(), "blocks/s")
}
