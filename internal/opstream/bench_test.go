package opstream

import (
	"testing"

	"github.com/kvpipe/kvpipe/index"
)

func benchOps(n int) []index.Op {
	ops := make([]index.Op, n)
	for i := range ops {
		ops[i] = index.Op{Kind: index.OpKind(i % 2), Tier: index.Tier(i % int(index.NumTiers)), Hash: uint64(i) * 0x9e3779b97f4a7c15, Link: index.LinkRoot}
		if i > 0 && i%8 != 0 { // chains of 8, each chained from the op before
			ops[i].Link, ops[i].Parent = index.LinkChild, ops[i-1].Hash
		}
	}
	return ops
}

func BenchmarkAppendMessage(b *testing.B) {
	ops := benchOps(256)
	buf, _ := AppendMessage(nil, Header{}, ops)
	b.ReportAllocs()
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		buf, _ = AppendMessage(buf[:0], Header{}, ops)
	}
	b.ReportMetric(float64(b.N)*256/b.Elapsed().Seconds(), "ops/s")
}

func BenchmarkDecodeMessage(b *testing.B) {
	buf, _ := AppendMessage(nil, Header{}, benchOps(256))
	dst, _, _ := DecodeMessage(buf, nil)
	b.ReportAllocs()
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		dst, _, _ = DecodeMessage(buf, dst)
	}
	b.ReportMetric(float64(b.N)*256/b.Elapsed().Seconds(), "ops/s")
}
