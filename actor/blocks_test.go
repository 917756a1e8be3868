package actor

import (
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/kvpipe/kvpipe/index"
)

// randomBlock is a block with every field drawn, split ones if splits.
func randomBlock(r *rand.Rand, splits bool) block {
	b := block{key: r.Uint64(), parent: r.Uint64(), split: -1, gen: uint16(r.IntN(genCount)),
		tiers: uint8(r.IntN(1 << index.NumTiers)), flags: uint8(r.IntN(restoredMask | flagParent + 1))}
	if splits && r.IntN(4) == 0 {
		b.split = r.Int32N(1 << 20)
	}
	return b
}

// The table answers as a Go map does through sets, replacements and
// deletions, hash 0 and clustered hashes included, every field of a block
// kept (split slots from the first split block on), and all visits every
// block once even while deleting the blocks it visits.
func TestBlockTableAgainstMap(t *testing.T) {
	for _, c := range []struct {
		name   string
		hashes func(r *rand.Rand) uint64
		splits bool
	}{
		{"random", func(r *rand.Rand) uint64 { return r.Uint64() >> r.IntN(64) }, false},
		{"small", func(r *rand.Rand) uint64 { return r.Uint64N(300) }, false},
		{"clustered", func(r *rand.Rand) uint64 { return r.Uint64N(200) << 40 }, false},
		{"random with splits", func(r *rand.Rand) uint64 { return r.Uint64() >> r.IntN(64) }, true},
		{"clustered with splits", func(r *rand.Rand) uint64 { return r.Uint64N(200) << 40 }, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(1, 2))
			var tb blockTable
			model := map[uint64]block{}
			for step := range 20_000 {
				h := c.hashes(r)
				switch r.IntN(4) {
				case 0, 1:
					b := randomBlock(r, c.splits && step > 1000)
					tb.set(h, b)
					model[h] = b
				case 2:
					tb.del(h)
					delete(model, h)
				default:
					got, ok := tb.get(h)
					want, wok := model[h]
					if ok != wok || got != want {
						t.Fatalf("step %d: get(%x) = %v %v, want %v %v", step, h, got, ok, want, wok)
					}
				}
				if tb.len() != len(model) {
					t.Fatalf("step %d: len %d, want %d", step, tb.len(), len(model))
				}
			}
			seen := map[uint64]int{}
			for h, b := range tb.all() {
				if seen[h]++; model[h] != b {
					t.Fatalf("all yields %x: %v, want %v", h, b, model[h])
				}
				if h%2 == 0 {
					tb.del(h)
				}
			}
			for h := range model {
				if seen[h] == 0 {
					t.Errorf("all left out %x", h)
				}
				if _, ok := tb.get(h); ok != (h%2 == 1) {
					t.Errorf("after deleting the even hashes, get(%x) reports %v", h, ok)
				}
			}
		})
	}
}

// Hash 0 is a block like any other, also when it is the only one: the
// slots are not made for it.
func TestBlockTableHashZeroAlone(t *testing.T) {
	var tb blockTable
	tb.set(0, block{key: 1, split: -1})
	if b, ok := tb.get(0); !ok || b.key != 1 {
		t.Errorf("get(0) = %v %v, want key 1", b, ok)
	}
	if _, ok := tb.get(5); ok {
		t.Error("get(5) found a block never set")
	}
	tb.del(5)
	if tb.len() != 1 {
		t.Errorf("len %d after deleting an unknown hash, want 1", tb.len())
	}
	tb.del(0)
	if _, ok := tb.get(0); ok || tb.len() != 0 {
		t.Errorf("hash 0 deleted: get reports %v, len %d", ok, tb.len())
	}
}

// A slot is a 24 B record and 2 B of meta (without split blocks): what
// BenchmarkIndexMemory counts.
func TestBlockRecordSize(t *testing.T) {
	if s := unsafe.Sizeof(blockRec{}) + unsafe.Sizeof(blockMeta(0)); s != 26 {
		t.Errorf("a block slot takes %d B, want 26", s)
	}
}

// A block indexed in an earlier generation is not held once the 7-bit
// generation counter wraps around to its generation again.
func TestGenerationWrap(t *testing.T) {
	m := mapping{out: &outbox{}, stats: &counters{}}
	m.gen = 7
	m.routerOf.set(1, block{key: 10, gen: 7, tiers: bit(index.TierDevice), split: -1})
	m.routerOf.set(2, block{key: 20, gen: 7, tiers: bit(index.TierHost), split: -1})
	for range genCount {
		m.dropped()
	}
	if m.gen != 7 {
		t.Fatalf("gen %d after %d generations, want 7 again", m.gen, genCount)
	}
	for h, b := range m.routerOf.all() {
		if held := b.held(m.gen); held != 0 {
			t.Errorf("block %d held in %b after the counter wrapped", h, held)
		}
	}
}
