package kvpipe

import (
	"testing"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/internal/enginepeer"
)

// tokensFrom is the prompt of sglang_pub.py's "prompt BASE N".
func tokensFrom(base, n int) []uint32 {
	out := make([]uint32, n)
	for j := range out {
		out[j] = uint32((base + j) % 50000)
	}
	return out
}

// An SGLang publisher with EAGLE on the C libzmq (wire/testdata/sglang_pub.py
// --eagle), in both event forms: a prompt scores exactly the pages the
// engine caches of it (bigram pages, one token into the next), a shorter
// one a page less; a page published broken costs only itself and the
// pages chained to it, and the rest of its batch is applied.
func TestInteropSGLangEagle(t *testing.T) {
	for _, form := range []string{"array", "map"} {
		t.Run(form, func(t *testing.T) {
			args := []string{"--eagle"}
			if form == "map" {
				args = append(args, "--map-events")
			}
			engine, eps := enginepeer.StartBound(t, freeTCP, "wire/testdata/sglang_pub.py", []string{"--endpoint", "--replay"}, args...)
			ep, replay := eps[0], eps[1]
			p := startPipeline(t, Config{})
			subscribe(t, p, WorkerConfig{Endpoint: ep, ReplayEndpoint: replay})
			engine.Send("go")
			engine.Send("prompt 1000 70")
			pages := published(t, engine.Expect("published"))
			prompt := tokensFrom(1000, 70)
			if pages != 4 {
				t.Fatalf("the engine cached %d pages of 70 tokens, want (70-1)/16 = 4", pages)
			}
			eventually(t, "the prompt indexed", nil, func() bool { return scores(t, p, prompt)["w"] == pages })
			if got := scores(t, p, prompt[:64])["w"]; got != 3 {
				t.Errorf("64 tokens score %d, want 3: the fourth page's bigrams need token 64", got)
			}
			if st := workerStats(p, "w"); !st.Actor.Eagle {
				t.Error("the worker's stats do not show EAGLE")
			}

			engine.Send("prompt 2000 70 2") // page 2 published broken
			if got := published(t, engine.Expect("published")); got != 4 {
				t.Fatalf("engine cached %d pages", got)
			}
			broken := tokensFrom(2000, 70)
			eventually(t, "the broken prompt's pages before the broken one", nil, func() bool { return scores(t, p, broken)["w"] == 2 })
			st := workerStats(p, "w")
			if st.Actor.Filtered[actor.UnreadableEvent] != 1 || st.Actor.DecodeErrors != 0 || st.Actor.UnknownParent != 1 {
				t.Errorf("unreadable %d, decode errors %d, unknown parents %d; want 1, 0, 1",
					st.Actor.Filtered[actor.UnreadableEvent], st.Actor.DecodeErrors, st.Actor.UnknownParent)
			}
			engine.Send("quit")
		})
	}
}
