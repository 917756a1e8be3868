package kvpipe

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
)

// The engine is the C libzmq (pyzmq) publisher of wire/testdata; its cache is
// the chains it published, so the index can be checked against it exactly.

func startPyEngine(t *testing.T, args ...string) (engine *enginepeer.Peer, ep, replay string) {
	t.Helper()
	engine, eps := enginepeer.StartBound(t, freeTCP, "wire/testdata/engine_pub.py", []string{"--endpoint", "--replay"}, args...)
	return engine, eps[0], eps[1]
}

// subscribe adds worker "w" for the engine and waits until its probes arrive.
func subscribe(t *testing.T, p *Pipeline, wc WorkerConfig) {
	t.Helper()
	if err := p.AddWorker("w", wc); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the subscription", nil, func() bool { return workerStats(p, "w").Wire.Batches > 0 })
}

// published reads the seq count from the engine's "published N" or "restarted N".
func published(t *testing.T, line string) int {
	t.Helper()
	n, err := strconv.Atoi(line[strings.LastIndexByte(line, ' ')+1:])
	if err != nil {
		t.Fatalf("engine said %q", line)
	}
	return n
}

// An engine restarts and its new incarnation has sent more batches than the
// old one before the SUB is back: the same seqs, other payloads. It must be
// taken for a restart, once, and the index must hold the new engine's blocks
// only, the ones it sent while the SUB was away included.
func TestInteropRestartFasterThanTheReconnect(t *testing.T) {
	engine, ep, replay := startPyEngine(t)
	p := startPipeline(t, Config{})
	subscribe(t, p, WorkerConfig{Endpoint: ep, ReplayEndpoint: replay})
	engine.Send("go")
	engine.Send("chain 20 1000")
	engine.Expect("published")
	old := enginepeer.ChainTokens(1000, 20)
	eventually(t, "the old chain indexed", nil, func() bool { return scores(t, p, old)["w"] == 20 })

	engine.Send("restart-ahead 30 5000")
	n := published(t, engine.Expect("restarted"))
	fresh := enginepeer.ChainTokens(5000, n)
	eventually(t, "the new incarnation indexed", nil, func() bool { return scores(t, p, fresh)["w"] == n })
	st := workerStats(p, "w")
	if got := scores(t, p, old)["w"]; got != 0 {
		t.Errorf("the old incarnation's chain still matches %d blocks", got)
	}
	if st.Wire.Restarts != 1 || st.Actor.Resyncs != 1 || st.Wire.Lost != 0 {
		t.Errorf("restarts %d, resyncs %d, lost %d; want 1, 1, 0", st.Wire.Restarts, st.Actor.Resyncs, st.Wire.Lost)
	}
	if got := st.Actor.IndexedBlocks; got != int64(n) {
		t.Errorf("indexed blocks %d, want the new engine's %d", got, n)
	}
	engine.Send("quit")
}

// A libzmq PUB at hwm=1 drops most of a burst; every batch stays in the
// engine's replay buffer (whose ROUTER also drops replies past its own
// high-water mark), so nothing may be lost and the index must end equal to
// the engine's blocks, every run.
func TestInteropFloodAtHWM1LosesNothing(t *testing.T) {
	const runs, batches = 10, 4000
	start := time.Now()
	for run := range runs {
		t.Run(strconv.Itoa(run), func(t *testing.T) {
			engine, ep, replay := startPyEngine(t, "--hwm", "1", "--buffer", "20000")
			cfg := Config{}
			cfg.Subscriber.TailCheck = 100 * time.Millisecond
			p := startPipeline(t, cfg)
			subscribe(t, p, WorkerConfig{Endpoint: ep, ReplayEndpoint: replay})
			engine.Send("go")
			engine.Send("chain " + strconv.Itoa(batches) + " 1000")
			engine.Expect("published")
			want := enginepeer.ChainTokens(1000, batches)
			eventually(t, "every block indexed", nil, func() bool { return scores(t, p, want)["w"] == batches })
			st := workerStats(p, "w")
			if st.Wire.Lost != 0 || st.Actor.Resyncs != 0 || st.Actor.IndexedBlocks != batches {
				t.Errorf("lost %d, resyncs %d, indexed %d; want 0, 0, %d",
					st.Wire.Lost, st.Actor.Resyncs, st.Actor.IndexedBlocks, batches)
			}
			t.Logf("gaps %d, replay requests %d, replayed %d, live overflow %d",
				st.Wire.Gaps, st.Wire.Replays, st.Wire.Replayed, st.Wire.LiveOverflow)
			engine.Send("quit")
		})
	}
	t.Logf("%d runs in %v", runs, time.Since(start).Round(time.Millisecond))
}

// An SGLang publisher with snapshots (wire/testdata/sglang_pub.py, the C
// libzmq underneath): after a loss past its replay buffer the worker is
// rebuilt from the engine's snapshot, so a cached prefix that is never
// stored again matches again; blocks the snapshot names but kvpipe never saw
// are counted and leave the worker partial. A restart shows as a new epoch.
func TestInteropSGLangSnapshotAfterALoss(t *testing.T) {
	engine, eps := enginepeer.StartBound(t, freeTCP, "wire/testdata/sglang_pub.py", []string{"--endpoint", "--replay", "--snapshot"}, "--buffer", "20")
	ep, replay, snap := eps[0], eps[1], eps[2]
	cfg := Config{}
	cfg.Subscriber.TailCheck = 100 * time.Millisecond
	p := startPipeline(t, cfg)
	subscribe(t, p, WorkerConfig{Endpoint: ep, ReplayEndpoint: replay, SnapshotEndpoint: snap})
	engine.Send("go")
	engine.Send("batches 30 1000")
	engine.Expect("published")
	system := enginepeer.ChainTokens(1000, 30)
	eventually(t, "the first chain indexed", nil, func() bool { return scores(t, p, system)["w"] == 30 })

	// 50 batches the PUB drops, 30 more than the replay buffer holds.
	drop := make([]string, 50)
	for i := range drop {
		drop[i] = strconv.Itoa(i)
	}
	engine.Send("batches 50 5000 " + strings.Join(drop, ","))
	engine.Expect("published")
	eventually(t, "the snapshot applied", nil, func() bool { return workerStats(p, "w").Wire.Snapshots == 1 })
	// Counted once the actor has it; its ops may still be queued at the shard.
	if err := p.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := scores(t, p, system)["w"]; got != 30 {
		t.Errorf("after the snapshot the cached chain matches %d blocks, want 30", got)
	}
	st := workerStats(p, "w")
	if st.Actor.SnapshotBlocks != 30 || st.Actor.SnapshotUnmapped != 50 || st.Wire.HistoryMissing != 1 {
		t.Errorf("snapshot blocks %d, unmapped %d, history missing %d; want 30, 50, 1",
			st.Actor.SnapshotBlocks, st.Actor.SnapshotUnmapped, st.Wire.HistoryMissing)
	}
	ms, _ := p.FindMatches(context.Background(), system)
	if len(ms) != 1 || !ms[0].Partial {
		t.Errorf("matches %+v: want the worker partial, 50 of its blocks unknown", ms)
	}
	// The stream goes on after the barrier.
	engine.Send("batches 5 9000")
	engine.Expect("published")
	eventually(t, "batches after the barrier", nil, func() bool { return scores(t, p, enginepeer.ChainTokens(9000, 5))["w"] == 5 })

	engine.Send("restart")
	engine.Expect("restarted")
	engine.Send("go")
	engine.Send("batches 10 7000")
	engine.Expect("published")
	eventually(t, "the new incarnation indexed", nil, func() bool { return scores(t, p, enginepeer.ChainTokens(7000, 10))["w"] == 10 })
	if got := scores(t, p, system)["w"]; got != 0 {
		t.Errorf("after a restart the old chain still matches %d blocks", got)
	}
	if got := workerStats(p, "w").Wire.Restarts; got != 1 {
		t.Errorf("restarts %d, want 1", got)
	}
	if ms, _ := p.FindMatches(context.Background(), enginepeer.ChainTokens(7000, 10)); len(ms) != 1 || ms[0].Partial {
		t.Errorf("matches %+v: the new incarnation, replayed from seq 0, is complete", ms)
	}
	engine.Send("quit")
}

// A snapshot the engine refuses costs nothing but the snapshot: counted, the
// worker stays partial and goes on.
func TestInteropSGLangSnapshotRefused(t *testing.T) {
	engine, eps := enginepeer.StartBound(t, freeTCP, "wire/testdata/sglang_pub.py", []string{"--endpoint", "--replay", "--snapshot"}, "--buffer", "5")
	ep, replay, snap := eps[0], eps[1], eps[2]
	p := startPipeline(t, Config{})
	subscribe(t, p, WorkerConfig{Endpoint: ep, ReplayEndpoint: replay, SnapshotEndpoint: snap})
	engine.Send("go")
	engine.Send("snapshot-busy")
	engine.Expect("armed")
	engine.Send("batches 20 1000 0,1,2,3,4,5,6,7,8,9")
	engine.Expect("published")
	eventually(t, "the refusal counted", nil, func() bool { return workerStats(p, "w").Wire.SnapshotFailures == 1 })
	engine.Send("batches 3 8000")
	engine.Expect("published")
	eventually(t, "later batches indexed", nil, func() bool { return scores(t, p, enginepeer.ChainTokens(8000, 3))["w"] == 3 })
	if st := workerStats(p, "w"); st.Wire.Snapshots != 0 || !st.Actor.Partial {
		t.Errorf("snapshots %d, partial %v; want 0 and true", st.Wire.Snapshots, st.Actor.Partial)
	}
	engine.Send("quit")
}
