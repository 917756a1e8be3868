package supervisor

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
)

// The engine is the C libzmq (pyzmq) publisher of wire/testdata; its cache is
// the chains it published, so the index can be checked against it exactly.

// chain returns the prompt whose blocks the engine's "chain n base" stored.
func chain(base, n int) []uint32 {
	out := make([]uint32, 0, n*16)
	for i := range n {
		for t := range 16 {
			out = append(out, uint32(((base-1000+i)*16+t)%50000))
		}
	}
	return out
}

func startPyEngine(t *testing.T, args ...string) (engine *enginepeer.Peer, ep, replay string) {
	t.Helper()
	ep, replay = freeTCP(t), freeTCP(t)
	engine = enginepeer.Start(t, "../wire/testdata/engine_pub.py", append([]string{"--endpoint", ep, "--replay", replay}, args...)...)
	engine.Expect("ready")
	return engine, ep, replay
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
	if err := p.AddWorker("w", ep, replay); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the subscription", nil, func() bool { return p.WorkerStats()["w"].Wire.Batches.Load() > 0 })
	engine.Send("go")
	engine.Send("chain 20 1000")
	engine.Expect("published")
	old := chain(1000, 20)
	eventually(t, "the old chain indexed", nil, func() bool { return scores(t, p, old)["w"] == 20 })

	engine.Send("restart-ahead 30 5000")
	n := published(t, engine.Expect("restarted"))
	fresh := chain(5000, n)
	eventually(t, "the new incarnation indexed", nil, func() bool { return scores(t, p, fresh)["w"] == n })
	st := p.WorkerStats()["w"]
	if got := scores(t, p, old)["w"]; got != 0 {
		t.Errorf("the old incarnation's chain still matches %d blocks", got)
	}
	if st.Wire.Restarts.Load() != 1 || st.Actor.Resyncs.Load() != 1 || st.Wire.Lost.Load() != 0 {
		t.Errorf("restarts %d, resyncs %d, lost %d; want 1, 1, 0", st.Wire.Restarts.Load(), st.Actor.Resyncs.Load(), st.Wire.Lost.Load())
	}
	if got := st.Actor.IndexedBlocks.Load(); got != int64(n) {
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
			cfg.Wire.TailCheck = 100 * time.Millisecond
			p := startPipeline(t, cfg)
			if err := p.AddWorker("w", ep, replay); err != nil {
				t.Fatal(err)
			}
			eventually(t, "the subscription", nil, func() bool { return p.WorkerStats()["w"].Wire.Batches.Load() > 0 })
			engine.Send("go")
			engine.Send("chain " + strconv.Itoa(batches) + " 1000")
			engine.Expect("published")
			want := chain(1000, batches)
			eventually(t, "every block indexed", nil, func() bool { return scores(t, p, want)["w"] == batches })
			st := p.WorkerStats()["w"]
			if st.Wire.Lost.Load() != 0 || st.Actor.Resyncs.Load() != 0 || st.Actor.IndexedBlocks.Load() != batches {
				t.Errorf("lost %d, resyncs %d, indexed %d; want 0, 0, %d",
					st.Wire.Lost.Load(), st.Actor.Resyncs.Load(), st.Actor.IndexedBlocks.Load(), batches)
			}
			t.Logf("gaps %d, replay requests %d, replayed %d, live overflow %d",
				st.Wire.Gaps.Load(), st.Wire.Replays.Load(), st.Wire.Replayed.Load(), st.Wire.LiveOverflow.Load())
			engine.Send("quit")
		})
	}
	t.Logf("%d runs in %v", runs, time.Since(start).Round(time.Millisecond))
}
