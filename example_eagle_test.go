package kvpipe_test

import (
	"context"
	"fmt"
	"log"
	"slices"
	"strings"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
)

// A router with an SGLang engine running EAGLE speculative decoding beside
// a vLLM engine: both cache the same two blocks of a prompt, and
// FindMatches scores each with its own kind of keys. The EAGLE engine
// holds a block only with the token after it, so a prompt of exactly two
// blocks scores one block on it.
func Example_eagle() {
	vllm, sglang := startEngine(), startEngine()
	defer vllm.stop()
	defer sglang.stop()
	ctx := context.Background()
	p, err := kvpipe.New(kvpipe.Config{BlockSize: 16})
	if err != nil {
		log.Fatal(err)
	}
	p.AddWorker("vllm", kvpipe.WorkerConfig{Endpoint: vllm.pub, ReplayEndpoint: vllm.replay})
	// Eagle is optional: the mode is learned from the engine's bigram events.
	p.AddWorker("sglang-eagle", kvpipe.WorkerConfig{Endpoint: sglang.pub, ReplayEndpoint: sglang.replay, Eagle: true})
	stopped := make(chan error, 1)
	go func() { stopped <- p.Run(ctx) }()

	promptTokens := make([]uint32, 3*16)
	for i := range promptTokens {
		promptTokens[i] = uint32(i)
	}
	for range 500 { // until both engines' events are in
		vllm.caches(promptTokens[:2*16])
		sglang.cachesEagle(promptTokens[:2*16+1]) // two pages of bigrams: 33 tokens
		if matches, _ := p.FindMatches(ctx, promptTokens); len(matches) == 2 && matches[0].Blocks == 2 && matches[1].Blocks == 2 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, tokens := range [][]uint32{promptTokens, promptTokens[:2*16]} {
		matches, err := p.FindMatches(ctx, tokens)
		if err != nil {
			log.Fatal(err)
		}
		slices.SortFunc(matches, func(a, b kvpipe.Match) int { return strings.Compare(a.Worker, b.Worker) })
		for _, m := range matches {
			fmt.Printf("%d tokens: %s holds %d leading blocks (EAGLE keys: %v)\n", len(tokens), m.Worker, m.Blocks, m.Eagle)
		}
	}
	p.Shutdown(ctx)
	if err := <-stopped; err != nil {
		log.Fatal(err)
	}
	// Output:
	// 48 tokens: sglang-eagle holds 2 leading blocks (EAGLE keys: true)
	// 48 tokens: vllm holds 2 leading blocks (EAGLE keys: false)
	// 32 tokens: sglang-eagle holds 1 leading blocks (EAGLE keys: true)
	// 32 tokens: vllm holds 2 leading blocks (EAGLE keys: false)
}

// cachesEagle publishes a BlockStored of tokens as SGLang with EAGLE does:
// bigram token ids, two pages of 16 and the token after them.
func (e *engine) cachesEagle(tokens []uint32) {
	ev := codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{201, 202}, TokenIDs: tokens, Bigram: true, BlockSize: 16, Medium: "GPU"}
	e.publisher.Publish(engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{ev}}, engineenc.Layout{SignedHashes: true, SaltKey: true}))
}
