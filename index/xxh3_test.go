package index

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/zeebo/xxh3"
)

// The fast paths give zeebo/xxh3's hashes of the same bytes, for every
// length they take, random inputs and the edge values.
func TestXXH3FastPathsMatch(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var h Hasher
	for n := 0; n <= 40; n++ {
		for range 200 {
			toks := make([]uint32, n)
			for i := range toks {
				switch rng.IntN(4) {
				case 0:
					toks[i] = 0xffffffff
				case 1:
					toks[i] = 0
				default:
					toks[i] = rng.Uint32()
				}
			}
			b := make([]byte, 0, 4*n)
			for _, x := range toks {
				b = binary.LittleEndian.AppendUint32(b, x)
			}
			if got, want := h.tokenHash(toks), xxh3.HashSeed(b, Seed); got != want {
				t.Fatalf("%d tokens %v: TokenHash %x, xxh3 %x", n, toks, got, want)
			}
		}
	}
	for range 1000 {
		p, th := rng.Uint64(), rng.Uint64()
		var b [16]byte
		binary.LittleEndian.PutUint64(b[:8], p)
		binary.LittleEndian.PutUint64(b[8:], th)
		if got, want := chain(p, true, th), xxh3.HashSeed(b[:], Seed); got != want {
			t.Fatalf("Chain(%x, %x) = %x, xxh3 %x", p, th, got, want)
		}
	}
}

// Prompt's 16-token path gives the keys of the general one.
func TestPrompt16MatchesBlocks(t *testing.T) {
	r, _ := benchRequest()
	var h Hasher
	got := h.Prompt(nil, r.Tokens[:16*50+7], 16)
	var want []uint64
	var parent uint64
	for i := 0; i+16 <= 16*50+7; i += 16 {
		parent = h.block(parent, i > 0, r.Tokens[i:i+16])
		want = append(want, parent)
	}
	if len(got) != 50 || len(got) != len(want) {
		t.Fatalf("%d keys, want 50", len(got))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("key %d: %x, want %x", i, got[i], want[i])
		}
	}
}
