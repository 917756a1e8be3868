package index

import (
	"encoding/json"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
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
		if got := h.TokenHash(b); lines[i] != strconv.FormatUint(got, 10) {
			t.Errorf("block %v: TokenHash = %d, reference xxh3 = %s", b, got, lines[i])
		}
	}
	if got := Chain(11, true, 22); lines[len(blocks)] != strconv.FormatUint(got, 10) {
		t.Errorf("Chain(11, 22) = %d, reference = %s", got, lines[len(blocks)])
	}
}
