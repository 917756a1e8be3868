package kvpipe

import (
	"context"
	"math"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
)

// Through the whole pipeline: a worker holding a prompt partly on device and
// partly on the host scores by tier, and an adapter's blocks answer only
// requests on that adapter.
func TestMatchesByTierAndAdapter(t *testing.T) {
	e := newEngine(t)
	p := startPipeline(t, Config{Shards: 2, TierWeights: Weights{1, 0.5, 0.25, 0.125}})
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	toks := prompt(3, 4)
	onHost := func(ev *codec.Event) { ev.Medium = "CPU" }
	// Blocks 0-1 on device, 2-3 on the host (chained to block 1).
	eventually(t, "the base prompt indexed", func() {
		e.parent, e.next = 0, 0
		e.store(toks[:32], 16)
		e.store(toks[32:], 16, onHost)
	}, func() bool {
		ms, err := p.FindMatches(context.Background(), toks)
		return err == nil && len(ms) == 1 && ms[0].Tiers[index.TierHost] == 4
	})
	ms, err := p.FindMatches(context.Background(), toks)
	if err != nil || len(ms) != 1 {
		t.Fatalf("FindMatches = %v, %v", ms, err)
	}
	m := ms[0]
	if m.Blocks != 2 || m.Tiers != [index.NumTiers]int{2, 4, 4, 4} || m.Score != 2+2*0.5 {
		t.Errorf("match %+v, want 2 device blocks, 4 with the host, score 3", m)
	}

	adapter := &Request{Tokens: prompt(4, 2), Lora: "sql-lora"}
	eventually(t, "the adapter's prompt indexed", func() {
		e.parent = 0
		e.store(adapter.Tokens, 16, func(ev *codec.Event) { ev.LoraName = "sql-lora" })
	}, func() bool {
		ms, err := p.FindMatchesRequest(context.Background(), adapter)
		return err == nil && len(ms) == 1 && ms[0].Blocks == 2
	})
	if got := scores(t, p, adapter.Tokens); len(got) != 0 {
		t.Errorf("a base-model request matches the adapter's blocks: %v", got)
	}
	other := &Request{Tokens: adapter.Tokens, Lora: "chat-lora"}
	if ms, err := p.FindMatchesRequest(context.Background(), other); err != nil || len(ms) != 0 {
		t.Errorf("another adapter's request matches: %v, %v", ms, err)
	}
}

func TestTierWeightsAreChecked(t *testing.T) {
	for _, w := range []Weights{{0, 1, 1, 1}, {1, -0.5, 0, 0}, {1, math.Inf(1), 0, 0}, {1, 0, math.NaN(), 0}} {
		if _, err := New(Config{BlockSize: 16, TierWeights: w}); err == nil {
			t.Errorf("New accepted TierWeights %v", w)
		}
	}
}
