package predict

import (
	"runtime"
	"testing"
)

// BenchmarkSetMemory: the heap one worker's predictions take, per
// prediction, at 100,000 live (a cap's worth of 1.6 M tokens), after
// churn (prompts predicted again, some confirmed), reported as
// bytes/prediction; and the time an Add of a 64-key prompt takes.
func BenchmarkSetMemory(b *testing.B) {
	const live = 100_000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var c Counts
	s := NewSet(&c)
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		s.Add(&Batch{Keys: keys(1+(i%4000)*64, 64), Until: int64(i + 1), Max: live})
		s.End(uint64(1 + (i*31)%(4000*64)))
		i++
	}
	b.StopTimer()
	for j := range 2 * live / 64 { // fill to the cap, whatever b.N was
		s.Add(&Batch{Keys: keys(1+((i+j)%4000)*64, 64), Until: int64(i + j + 1), Max: live})
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if s.Len() != live {
		b.Fatalf("%d live, want %d", s.Len(), live)
	}
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(s.Len()), "bytes/prediction")
	runtime.KeepAlive(s)
}
