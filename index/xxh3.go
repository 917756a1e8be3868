package index

import "math/bits"

// The two hashes the prompt path runs per block, xxh3-64 seeded with Seed
// of a block's tokens and of a (parent, token hash) pair, computed here on
// the values themselves rather than on their little-endian bytes: the same
// results as zeebo/xxh3 (TestXXH3FastPathsMatch), without encoding the
// tokens first or dispatching on the length. Only the short-input branches
// of xxh3 are here: 17-128 bytes, and 16 for Chain; anything else goes to
// zeebo/xxh3.

// xxh3 secret words (the default secret at byte offset n is kNNN).
const (
	k000 = 0xbe4ba423396cfeb8
	k008 = 0x1cad21f72c81017c
	k016 = 0xdb979083e96dd4de
	k024 = 0x1f67b3b7a4a44072
	k032 = 0x78e5c0cc4ee679cb
	k040 = 0x2172ffcc7dd05a82
	k048 = 0x8e2443f7744608b8
	k056 = 0x4c263a81e69035e0
	k064 = 0xcb00c391bb52283c
	k072 = 0xa32e531b8b65d088
	k080 = 0x4ef90da297486471
	k088 = 0xd8acdea946ef1938
	k096 = 0x3f349ce33f76faa8
	k104 = 0x1d4f0bc7c7bbdcf9
	k112 = 0x3159b4cd4be0518a
	k120 = 0x647378d9c97e9fc8

	prime64x1 = 11400714785074694791
)

func avalanche(x uint64) uint64 {
	x ^= x >> 37
	x *= 0x165667919e3779f9
	return x ^ x>>32
}

func mulFold(x, y uint64) uint64 {
	hi, lo := bits.Mul64(x, y)
	return hi ^ lo
}

// pairHash is xxh3-64 with Seed of the 16 bytes a, b (little-endian).
func pairHash(a, b uint64) uint64 {
	lo := a ^ (k024 ^ k032 + Seed)
	hi := b ^ (k040 ^ k048 - Seed)
	return avalanche(16 + bits.ReverseBytes64(lo) + hi + mulFold(lo, hi))
}

// word is the 8 bytes of t's little-endian encoding from byte off (a
// multiple of 4).
func word(t []uint32, off int) uint64 {
	i := off >> 2
	return uint64(t[i]) | uint64(t[i+1])<<32
}

// mix16 is one 16-byte round of xxh3's short path at byte off, against the
// secret words s0, s1.
func mix16(t []uint32, off int, s0, s1 uint64) uint64 {
	return mulFold(word(t, off)^(s0+Seed), word(t, off+8)^(s1-Seed))
}

// tokensHash is xxh3-64 with Seed of 5 to 32 tokens' little-endian
// encoding (17-128 bytes): xxh3's 17-128 branch.
func tokensHash(t []uint32) uint64 {
	l := 4 * len(t)
	acc := uint64(l) * prime64x1
	if l > 32 {
		if l > 64 {
			if l > 96 {
				acc += mix16(t, 48, k096, k104)
				acc += mix16(t, l-64, k112, k120)
			}
			acc += mix16(t, 32, k064, k072)
			acc += mix16(t, l-48, k080, k088)
		}
		acc += mix16(t, 16, k032, k040)
		acc += mix16(t, l-32, k048, k056)
	}
	acc += mix16(t, 0, k000, k008)
	acc += mix16(t, l-16, k016, k024)
	return avalanche(acc)
}

// block16Hash is tokensHash of 16 tokens, the usual block, with the
// words at fixed offsets.
func block16Hash(t *[16]uint32) uint64 {
	w := func(i int) uint64 { return uint64(t[i]) | uint64(t[i+1])<<32 }
	acc := uint64(64 * prime64x1 & (1<<64 - 1))
	acc += mulFold(w(4)^(k032+Seed), w(6)^(k040-Seed))
	acc += mulFold(w(8)^(k048+Seed), w(10)^(k056-Seed))
	acc += mulFold(w(0)^(k000+Seed), w(2)^(k008-Seed))
	acc += mulFold(w(12)^(k016+Seed), w(14)^(k024-Seed))
	return avalanche(acc)
}
