package snapshot

import (
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/kvpipe/kvpipe/index"
)

const (
	benchBlocks  = 1_000_000
	benchWorkers = 8
	benchChain   = 64 // blocks per prefix chain: its first has no parent
)

// benchSnapshot is a router's index of benchBlocks over benchWorkers, as
// an engine's events would leave it: random 64-bit hashes and keys, chains
// of parents, a third of the blocks offloaded to host memory as well, one
// in a thousand split (split_k 2), and a few known but not indexed.
func benchSnapshot() *Snapshot {
	rng := rand.New(rand.NewPCG(1, 2))
	s := &Snapshot{Version: Version, BlockSize: 16, Created: 1_754_000_000_000_000_000}
	per := benchBlocks / benchWorkers
	for i := range benchWorkers {
		w := Worker{
			Name:        []byte("vllm-decode-" + strconv.Itoa(i)),
			HasSeq:      true,
			Seq:         rng.Uint64N(1 << 40),
			Fingerprint: rng.Uint64(),
			StreamSeq:   rng.Uint64N(1 << 30),
			FullSeen:    true,
			SplitK:      2,
			UsedTiers:   0b11,
			GroupIdx:    []int64{0, 1},
			GroupMain:   []bool{true, false},
			Hashes:      make([]uint64, per),
			Keys:        make([]uint64, per),
			Parents:     make([]uint64, per),
			Flags:       make([]uint8, per),
		}
		for j := range per {
			w.Hashes[j] = rng.Uint64()
			w.Keys[j] = rng.Uint64()
			f := uint8(1) << (TierShift + index.TierDevice)
			if j%benchChain != 0 {
				f |= FlagParent
				w.Parents[j] = w.Hashes[j-1]
			}
			if rng.IntN(3) == 0 {
				f |= 1 << (TierShift + index.TierHost)
			}
			switch rng.IntN(1000) {
			case 0:
				f |= FlagSplit
				w.Split = append(w.Split, rng.Uint64())
			case 1:
				f &^= tierMask
			}
			w.Flags[j] = f
		}
		s.Workers = append(s.Workers, w)
	}
	return s
}

func reportSize(b *testing.B, s *Snapshot, encoded int) {
	blocks := s.Blocks()
	b.ReportMetric(float64(blocks)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
	b.ReportMetric(float64(encoded)/float64(blocks), "bytes/block")
	b.ReportMetric(float64(encoded)/(1<<20)/(float64(blocks)/1e6), "MiB/Mblocks")
}

func BenchmarkAppend(b *testing.B) {
	s := benchSnapshot()
	buf, err := Append(nil, s)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if buf, err = Append(buf[:0], s); err != nil {
			b.Fatal(err)
		}
	}
	reportSize(b, s, len(buf))
}

func BenchmarkDecode(b *testing.B) {
	data, err := Append(nil, benchSnapshot())
	if err != nil {
		b.Fatal(err)
	}
	var s Snapshot
	if err := Decode(data, &s); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if err := Decode(data, &s); err != nil {
			b.Fatal(err)
		}
	}
	reportSize(b, &s, len(data))
}

func BenchmarkAppendOps(b *testing.B) {
	s := benchSnapshot()
	n := 0
	for i := range s.Workers {
		n = max(n, s.Workers[i].OpCount())
	}
	ops := make([]index.Op, 0, n)
	b.ReportAllocs()
	for b.Loop() {
		for i := range s.Workers {
			ops = s.Workers[i].AppendOps(ops[:0])
		}
	}
	b.ReportMetric(float64(s.Blocks())*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
}
