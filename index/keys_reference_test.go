package index

import (
	"encoding/json"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
)

// keysReference is docs/FORMAT.md §10.1-10.3 written again in Python over
// the reference xxh3 (python3-xxhash): a request's keys with an adapter, a
// salt and multimodal inputs. It reads requests as JSON lines and prints
// each one's keys on a line.
const keysReference = `import json, struct, sys, xxhash
M = (1 << 64) - 1
def h(b, seed): return xxhash.xxh3_64_intdigest(b, seed=seed)
def namespace(lora, lora_id, has_id, salt):
    if not lora and not has_id and not salt: return 0
    b = b""
    if lora: b += b"n" + struct.pack("<Q", len(lora.encode())) + lora.encode()
    elif has_id: b += b"i" + struct.pack("<q", lora_id)
    if salt: b += b"s" + struct.pack("<Q", len(salt.encode())) + salt.encode()
    return h(b, 0x6b76706970656e73) or 1
def digest(inputs, start, end):
    s, n = 0, 0
    for off, i, mm in sorted((mm["Offset"], i, mm) for i, mm in enumerate(inputs)):
        if off < end and off + mm["Length"] > start:
            s = h(bytes([1, 0]) + struct.pack("<QQQ", s, h(mm["Hash"].encode(), 0), (off - start) & M), 0x6b7670697065786b)
            n += 1
    return 0 if n == 0 else (s or 1)
for line in sys.stdin:
    r, bs = json.loads(line), 16
    toks = r["Tokens"]
    ns = namespace(r.get("Lora", ""), r.get("LoraID", 0), r.get("HasLoraID", False), r.get("Salt", ""))
    keys, parent = [], None
    for i in range(len(toks) // bs):
        th = h(struct.pack("<%dI" % bs, *toks[i*bs:(i+1)*bs]), 1337)
        extra = digest(r.get("MultiModal") or [], i*bs, (i+1)*bs)
        if parent is None:
            k = th if ns == 0 and extra == 0 else h(b"r" + struct.pack("<QQQ", ns, extra, th), 1337)
        elif extra == 0:
            k = h(struct.pack("<QQ", parent, th), 1337)
        else:
            k = h(b"c" + struct.pack("<QQQ", parent, th, extra), 1337)
        keys.append(str(k))
        parent = k
    print(" ".join(keys))
`

// RequestKeys computes what docs/FORMAT.md says, by an implementation of
// its own: adapters by name and by id, salts, multimodal inputs across
// and within blocks, unsorted, at negative block offsets.
func TestRequestKeysMatchReference(t *testing.T) {
	py := enginepeer.Python(t)
	if exec.Command(py, "-c", "import xxhash").Run() != nil {
		enginepeer.Missing(t, "python3-xxhash")
	}
	toks := make([]uint32, 100) // six whole blocks and a partial one
	for i := range toks {
		toks[i] = uint32(i*7919) % 151936
	}
	mm := []MultiModal{{Hash: "img-b", Offset: 40, Length: 30}, {Hash: "img-a", Offset: 3, Length: 20}, {Hash: "ç", Offset: 40, Length: 1}}
	reqs := []Request{
		{Tokens: toks},
		{Tokens: toks, Lora: "sql-lora"},
		{Tokens: toks, LoraID: 7, HasLoraID: true},
		{Tokens: toks, LoraID: -1, HasLoraID: true, Salt: "tenant-42"},
		{Tokens: toks, Lora: "named", LoraID: 7, HasLoraID: true}, // the name wins
		{Tokens: toks, Salt: "s"},
		{Tokens: toks, MultiModal: mm},
		{Tokens: toks, Lora: "sql-lora", Salt: "tenant-42", MultiModal: mm[:1]},
		{Tokens: toks[:16], MultiModal: []MultiModal{{Hash: "x", Offset: 0, Length: 16}}},
	}
	var in strings.Builder
	for _, r := range reqs {
		line, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		in.Write(line)
		in.WriteByte('\n')
	}
	cmd := exec.Command(py, "-c", keysReference)
	cmd.Stdin = strings.NewReader(in.String())
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("reference: %v", err)
	}
	lines := strings.Split(strings.TrimSuffix(string(out), "\n"), "\n")
	if len(lines) != len(reqs) {
		t.Fatalf("reference printed %d lines for %d requests", len(lines), len(reqs))
	}
	var h Hasher
	for i := range reqs {
		got := h.RequestKeys(nil, &reqs[i], 16)
		want := strings.Fields(lines[i])
		if len(got) != len(want) {
			t.Fatalf("request %d: %d keys, reference %d", i, len(got), len(want))
		}
		for j := range got {
			if strconv.FormatUint(got[j], 10) != want[j] {
				t.Errorf("request %d (%+v): key %d = %d, reference %s", i, reqs[i].MultiModal, j, got[j], want[j])
			}
		}
	}
}
