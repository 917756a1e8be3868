package index

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"hash/maphash"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/zeebo/xxh3"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/sim"
)

const benchWorkers = 8

// mooncake replays the Mooncake trace through benchWorkers simulated engines
// (16-token blocks, so 32 per trace block; sticky routing by conversation) and
// returns every engine step as an index batch, and each request's prompt keys.
// hostCap > 0 gives the engines a CPU offload tier of that many blocks, whose
// stores and removes go to TierHost.
func mooncake(b *testing.B, limit, hostCap int) (steps []Batch, prompts [][]uint64) {
	steps, prompts, _, _ = mooncakeAll(b, limit, hostCap)
	return steps, prompts
}

// mooncakeAll is mooncake, also returning the last recent prompts' tokens
// and how many (block, worker) memberships the engines hold at the end.
// Stores carry their links, as the actor's do, in every tier.
func mooncakeAll(b *testing.B, limit, hostCap int) (steps []Batch, prompts [][]uint64, tokens [][]uint32, live int) {
	if testing.Short() && limit <= 0 {
		limit = sim.ShortTraceRequests
	}
	reqs, source, err := sim.Trace(limit)
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("trace: %s, %d requests", source, len(reqs))
	var engines [benchWorkers]*sim.Engine
	var routerOf [benchWorkers]map[uint64]uint64
	var linkOf [benchWorkers]map[uint64]Op // router key -> its device store, for its link
	for w := range engines {
		if hostCap > 0 {
			engines[w] = sim.NewEngine(16, 40_000, sim.WithCPUOffload(hostCap))
		} else {
			engines[w] = sim.NewEngine(16, 40_000)
		}
		routerOf[w] = map[uint64]uint64{}
		linkOf[w] = map[uint64]Op{}
	}
	var h Hasher
	var evs []codec.Event
	for i := range reqs {
		r := &reqs[i]
		toks := sim.PromptTokens(nil, r)
		keys := h.Prompt(nil, toks, 16)
		prompts = append(prompts, keys)
		if i >= len(reqs)-recent {
			tokens = append(tokens, toks)
		}
		w := int(r.HashIDs[min(1, len(r.HashIDs)-1)] % benchWorkers) // sticky per conversation: every request starts with block 0
		var hit int
		evs, hit = engines[w].Serve(evs[:0], r, toks)
		step := Batch{Worker: WorkerID(w)}
		for _, e := range evs {
			if e.Medium == sim.MediumCPU {
				// Offloaded blocks the device held (no tokens, no parent):
				// router keys from the device's stores, kept while
				// offloading for this.
				for _, ext := range e.BlockHashes {
					k := linkOf[w][routerOf[w][ext]]
					k.Tier = TierHost
					if e.Type == codec.BlockRemoved {
						k = Op{Kind: OpRemove, Tier: TierHost, Hash: k.Hash}
					}
					step.Ops = append(step.Ops, k)
				}
				continue
			}
			switch e.Type {
			case codec.BlockStored:
				for j, ext := range e.BlockHashes {
					routerOf[w][ext] = keys[hit+j]
					op := Op{Kind: OpStore, Link: LinkRoot, Hash: keys[hit+j]}
					if hit+j > 0 {
						op.Link, op.Parent = LinkChild, keys[hit+j-1]
					}
					if hostCap > 0 {
						linkOf[w][op.Hash] = op
					}
					step.Ops = append(step.Ops, op)
				}
			case codec.BlockRemoved:
				for _, ext := range e.BlockHashes {
					step.Ops = append(step.Ops, Op{Kind: OpRemove, Hash: routerOf[w][ext]})
					if hostCap == 0 {
						delete(routerOf[w], ext)
					}
				}
			}
		}
		steps = append(steps, step)
	}
	for _, e := range engines {
		live += e.Len()
	}
	return steps, prompts, tokens, live
}

var (
	traceOnce    sync.Once
	traceSteps   []Batch
	tracePrompts [][]uint64
	traceTokens  [][]uint32 // the recent prompts'
	traceLive    int        // memberships the engines hold after the trace

	tieredOnce  sync.Once
	tieredSteps []Batch
)

// trace is mooncake(b, 0, 0), built once per run: the benchmarks below only
// read it (a Batch without Return is not written by the shard).
func trace(b *testing.B) ([]Batch, [][]uint64) {
	traceOnce.Do(func() { traceSteps, tracePrompts, traceTokens, traceLive = mooncakeAll(b, 0, 0) })
	if traceSteps == nil {
		b.Fatal("no trace")
	}
	return traceSteps, tracePrompts
}

// tieredHost is the tiered benchmarks' host tier: four times the device.
const tieredHost = 160_000

// tieredTrace is the trace replayed by engines offloading to a host tier
// of tieredHost blocks, so that device evictions move blocks to TierHost;
// the prompts are trace's.
func tieredTrace(b *testing.B) ([]Batch, [][]uint64) {
	_, prompts := trace(b)
	tieredOnce.Do(func() { tieredSteps, _ = mooncake(b, 0, tieredHost) })
	if tieredSteps == nil {
		b.Fatal("no trace")
	}
	return tieredSteps, prompts
}

func countOps(steps []Batch) (n int) {
	for _, s := range steps {
		n += len(s.Ops)
	}
	return n
}

func applyAll(t *Tree, steps []Batch) {
	for i := range steps {
		for _, op := range steps[i].Ops {
			if op.Kind == OpStore {
				t.Store(steps[i].Worker, op.Hash)
			} else {
				t.Remove(steps[i].Worker, op.Hash)
			}
		}
	}
}

// BenchmarkTreeApply: one op is one block stored or removed. Each iteration
// replays the whole trace and clears the workers, so from the second on the
// tree reuses what the first allocated.
func BenchmarkTreeApply(b *testing.B) {
	steps, _ := trace(b)
	ops := countOps(steps)
	t := NewTree()
	applyAll(t, steps)
	for w := range WorkerID(benchWorkers) {
		t.ClearWorker(w)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		applyAll(t, steps)
		for w := range WorkerID(benchWorkers) {
			t.ClearWorker(w)
		}
	}
	b.ReportMetric(float64(ops), "blocks/op")
	b.ReportMetric(float64(ops)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
}

// recent is how many of the trace's last requests the FindMatches benchmarks
// ask about: the ones whose blocks the engines still hold at the end.
const recent = 2000

// BenchmarkFindMatches: one recent request's prompt (on average 750 keys)
// against the tree the trace left behind.
func BenchmarkFindMatches(b *testing.B) {
	steps, prompts := trace(b)
	prompts = prompts[len(prompts)-recent:]
	t := NewTree()
	applyAll(t, steps)
	var dst []Score
	hits, matched := 0, 0 // matched: the best score of each request, summed
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		dst = t.FindMatches(dst[:0], prompts[i%len(prompts)])
		hits += len(dst)
		best := 0
		for _, s := range dst {
			best = max(best, s.Blocks)
		}
		matched += best
		i++
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "requests/s")
	b.ReportMetric(float64(matched)/float64(b.N), "best-match-blocks")
	if hits == 0 {
		b.Fatal("no request matched anything")
	}
}

// BenchmarkShardsFindMatches: the same through Shards, whose tables are read
// on the benchmark goroutine, for 1, 2 and 4 shards; dst is reused, so a
// lookup allocates nothing.
func BenchmarkShardsFindMatches(b *testing.B) {
	steps, prompts := trace(b)
	prompts = prompts[len(prompts)-recent:]
	for _, n := range []int{1, 2, 4} {
		b.Run(map[int]string{1: "shards=1", 2: "shards=2", 4: "shards=4"}[n], func(b *testing.B) {
			s := loadedShards(b, n, steps) // the trace applied: lookups alone are timed
			ctx := context.Background()
			timeLookups(b, ctx, s, prompts)
		})
	}
}

// BenchmarkShardsFindMatchesTiered: BenchmarkShardsFindMatches against the
// index a CPU-offloading trace left behind (every shard with a host table),
// scoring device and host tiers; best-match-blocks and best-tiered-blocks
// are the requests' best device and best any-tier prefixes.
func BenchmarkShardsFindMatchesTiered(b *testing.B) {
	steps, prompts := tieredTrace(b)
	prompts = prompts[len(prompts)-recent:]
	for _, n := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("shards=%d", n), func(b *testing.B) {
			s := loadedShards(b, n, steps) // the trace applied: lookups alone are timed
			ctx := context.Background()
			var hostNodes int64
			for i := range n {
				hostNodes += s.tierNodes(i, TierHost)
			}
			if hostNodes == 0 {
				b.Fatal("nothing offloaded")
			}
			var dst []Score
			matched, tiered := 0, 0
			b.ReportAllocs()
			b.ResetTimer()
			i := 0
			for b.Loop() {
				var err error
				if dst, err = s.FindMatches(ctx, dst[:0], prompts[i%len(prompts)]); err != nil {
					b.Fatal(err)
				}
				bd, bt := 0, 0
				for _, sc := range dst {
					bd, bt = max(bd, sc.Blocks), max(bt, sc.Tiers[NumTiers-1])
				}
				matched += bd
				tiered += bt
				i++
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "requests/s")
			b.ReportMetric(float64(matched)/float64(b.N), "best-match-blocks")
			b.ReportMetric(float64(tiered)/float64(b.N), "best-tiered-blocks")
		})
	}
}

// BenchmarkShardsIngest: the whole trace through the shard goroutines, then
// every worker cleared, per iteration; an iteration ends when the shards
// have applied it. A warm-up pass first, so the steady state is timed.
func BenchmarkShardsIngest(b *testing.B) { benchIngest(b, trace) }

// BenchmarkShardsIngestTiered: BenchmarkShardsIngest of the CPU-offloading
// trace, whose device evictions are stores to the host tier.
func BenchmarkShardsIngestTiered(b *testing.B) { benchIngest(b, tieredTrace) }

func benchIngest(b *testing.B, trace func(*testing.B) ([]Batch, [][]uint64)) {
	steps, _ := trace(b)
	ops := countOps(steps)
	for _, n := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("shards=%d", n), func(b *testing.B) {
			s := NewShards(n, 64)
			defer s.Close()
			clears := make([]Batch, benchWorkers)
			for w := range clears {
				clears[w] = Batch{Worker: WorkerID(w), Ops: []Op{{Kind: OpClearWorker}}}
			}
			ctx := context.Background()
			pass := func() {
				for i := range steps {
					s.Queue(steps[i].Worker) <- &steps[i]
				}
				for i := range clears {
					s.Queue(clears[i].Worker) <- &clears[i]
				}
				if err := s.Sync(ctx); err != nil {
					b.Fatal(err)
				}
			}
			pass()
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				pass()
			}
			b.ReportMetric(float64(ops)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// BenchmarkShardsFindMatchesUnderIngest: FindMatches of the recent
// prompts against the index the trace left behind (8 workers), idle and
// under full ingest: another goroutine replays the trace into the same
// shards as 8 more workers, flat out, each pass ending with their clears.
// By keys, and from tokens (FindMatchesRequest). It reports each
// lookup's latency percentiles, overall and per prompt length (up to 512
// keys, up to 2,048, longer), the lookups and the blocks applied per second,
// and from tokens the keys hashed per lookup; allocs/op counts the
// ingest's allocations too.
func BenchmarkShardsFindMatchesUnderIngest(b *testing.B) {
	steps, prompts := trace(b)
	prompts = prompts[len(prompts)-recent:]
	tokens := traceTokens
	churn := asWorkers(steps, benchWorkers)
	for _, n := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("shards=%d", n), func(b *testing.B) {
			s := loadedShards(b, n, steps)
			for _, ingest := range []string{"idle", "full"} {
				for _, from := range []string{"keys", "tokens"} {
					b.Run(ingest+"/"+from, func(b *testing.B) {
						var replay []Batch
						if ingest == "full" {
							replay = churn
						}
						var toks [][]uint32
						if from == "tokens" {
							toks = tokens
						}
						lookups(b, s, prompts, toks, replay)
					})
				}
			}
		})
	}
}

// asWorkers returns steps as the workers from first on, each pass followed
// by their clears. The ops are steps', shared: a Batch without Return is
// only read.
func asWorkers(steps []Batch, first WorkerID) []Batch {
	out := make([]Batch, 0, len(steps)+benchWorkers)
	for _, st := range steps {
		out = append(out, Batch{Worker: st.Worker + first, Ops: st.Ops})
	}
	for w := range WorkerID(benchWorkers) {
		out = append(out, Batch{Worker: w + first, Ops: []Op{{Kind: OpClearWorker}}})
	}
	return out
}

// lookups times FindMatches of prompts (from tokens, when given:
// FindMatchesRequest, hashing in the timed call) while replay, if any, is
// fed to s in a loop.
func lookups(b *testing.B, s *Shards, prompts [][]uint64, tokens [][]uint32, replay []Batch) {
	ctx := context.Background()
	var sent atomic.Int64 // blocks handed to the shards
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for len(replay) > 0 {
			for i := range replay {
				select {
				case s.Queue(replay[i].Worker) <- &replay[i]:
					sent.Add(int64(len(replay[i].Ops)))
				case <-stop:
					return
				}
			}
		}
	}()
	lat := newLatencies()
	var dst []Score
	var h Hasher
	var r Request
	matched, hashed := 0, 0
	b.ReportAllocs()
	b.ResetTimer()
	sent.Store(0)
	i := 0
	for b.Loop() {
		p := prompts[i%len(prompts)]
		start := time.Now()
		var err error
		if tokens != nil {
			r.Tokens = tokens[i%len(tokens)]
			dst, err = s.FindMatchesRequest(ctx, dst[:0], &h, &r, 16, false)
		} else {
			dst, err = s.FindMatches(ctx, dst[:0], p)
		}
		if err != nil {
			b.Fatal(err)
		}
		lat.add(len(p), time.Since(start))
		best := 0
		for _, sc := range dst {
			best = max(best, sc.Blocks)
		}
		matched += best
		if tokens != nil {
			hashed += lazyHashed(len(p), best)
		}
		i++
	}
	elapsed := b.Elapsed().Seconds()
	applied := sent.Load()
	close(stop)
	<-done
	lat.report(b)
	b.ReportMetric(float64(b.N)/elapsed, "lookups/s")
	b.ReportMetric(float64(applied)/elapsed, "ingest-blocks/s")
	b.ReportMetric(float64(matched)/float64(b.N), "best-match-blocks")
	if tokens != nil {
		b.ReportMetric(float64(hashed)/float64(b.N), "hashed-blocks")
	}
}

// lazyHashed is how many of a prompt's n keys FindMatchesRequest hashes
// when the best score is best (no tiers or predictions): the end of the
// first round that best does not reach, or all.
func lazyHashed(n, best int) int {
	for want := lazyFirst; ; want *= lazyGrowth {
		if want >= n || best < want {
			return min(want, n)
		}
	}
}

// latencies keeps lookup latencies overall and per prompt length bucket,
// without allocating while timed.
type latencies [4][]time.Duration

// latencyBuckets name latencies' slices: all, then prompts of up to 512
// keys, up to 2,048, and longer.
var latencyBuckets = [4]string{"", "le512-", "le2048-", "gt2048-"}

func newLatencies() *latencies {
	var l latencies
	for i := range l {
		l[i] = make([]time.Duration, 0, 1<<18)
	}
	return &l
}

func (l *latencies) add(keys int, d time.Duration) {
	bucket := 3
	switch {
	case keys <= 512:
		bucket = 1
	case keys <= 2048:
		bucket = 2
	}
	for _, i := range [2]int{0, bucket} {
		if len(l[i]) < cap(l[i]) {
			l[i] = append(l[i], d)
		}
	}
}

// report reports p50, p99 and max of each bucket with any lookup.
func (l *latencies) report(b *testing.B) {
	for i, ls := range l {
		if len(ls) == 0 {
			continue
		}
		slices.Sort(ls)
		name := latencyBuckets[i]
		b.ReportMetric(float64(ls[len(ls)/2]), name+"p50-ns")
		b.ReportMetric(float64(ls[len(ls)*99/100]), name+"p99-ns")
		b.ReportMetric(float64(ls[len(ls)-1]), name+"max-ns")
	}
}

// BenchmarkIndexMemory: the live heap the index of the trace takes (8
// engines of 40,000 blocks, 2 shards), after GC, per (block, worker)
// membership the engines' caches hold at the end. The trace's ops are in
// the heap before and after, so they do not count.
func BenchmarkIndexMemory(b *testing.B) {
	steps, _ := trace(b)
	var bytes uint64
	for b.Loop() {
		before := liveHeap()
		s := NewShards(2, 64)
		for i := range steps {
			s.Queue(steps[i].Worker) <- &steps[i]
		}
		if err := s.Sync(context.Background()); err != nil {
			b.Fatal(err)
		}
		bytes = liveHeap() - before
		s.Close()
	}
	b.ReportMetric(float64(bytes)/float64(traceLive), "bytes/block")
	b.ReportMetric(float64(traceLive), "memberships")
}

// liveHeap is the heap in use after a full GC.
func liveHeap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkTokenHash is why zeebo/xxh3: dynamo's router hashes blocks with
// xxh3-64, so only an xxh3 gives keys a Rust or Python router agrees with;
// the other hashes are here for the cost of that choice, on one 16-token block.
func BenchmarkTokenHash(b *testing.B) {
	tokens := make([]uint32, 16)
	for i := range tokens {
		tokens[i] = uint32(i * 7919)
	}
	buf := make([]byte, 0, 64)
	for _, tokens := range tokens {
		buf = binary.LittleEndian.AppendUint32(buf, tokens)
	}
	var sink uint64
	b.Run("zeebo-xxh3-with-encoding", func(b *testing.B) {
		var h Hasher
		b.SetBytes(64)
		for b.Loop() {
			sink += h.tokenHash(tokens)
		}
	})
	b.Run("zeebo-xxh3", func(b *testing.B) {
		b.SetBytes(64)
		for b.Loop() {
			sink += xxh3.HashSeed(buf, Seed)
		}
	})
	b.Run("cespare-xxhash64", func(b *testing.B) {
		b.SetBytes(64)
		for b.Loop() {
			sink += xxhash.Sum64(buf)
		}
	})
	b.Run("stdlib-maphash", func(b *testing.B) {
		seed := maphash.MakeSeed()
		b.SetBytes(64)
		for b.Loop() {
			sink += maphash.Bytes(seed, buf)
		}
	})
	b.Run("stdlib-fnv64a", func(b *testing.B) {
		b.SetBytes(64)
		for b.Loop() {
			h := fnv.New64a()
			h.Write(buf)
			sink += h.Sum64()
		}
	})
	if sink == 42 {
		b.Log(sink)
	}
}

// loadedShards starts n shards, stopped when the benchmark ends, holding
// what steps leave behind.
func loadedShards(b *testing.B, n int, steps []Batch) *Shards {
	s := NewShards(n, 64)
	b.Cleanup(s.Close)
	for i := range steps {
		s.Queue(steps[i].Worker) <- &steps[i]
	}
	if err := s.Sync(context.Background()); err != nil {
		b.Fatal(err)
	}
	return s
}

// timeLookups times FindMatches over prompts in turn, and reports requests/s.
func timeLookups(b *testing.B, ctx context.Context, s *Shards, prompts [][]uint64) {
	var dst []Score
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		var err error
		if dst, err = s.FindMatches(ctx, dst[:0], prompts[i%len(prompts)]); err != nil {
			b.Fatal(err)
		}
		i++
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "requests/s")
}
