package supervisor_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/supervisor"
	"github.com/kvpipe/kvpipe/wire/wiretest"
	"github.com/prometheus/client_golang/prometheus"
)

// A router embeds one Pipeline, adds a worker per engine, and asks
// FindMatches for each request's prompt.
func Example() {
	pub, sub, replay, stop := exampleEngine() // plays vLLM: PUB on sub, ROUTER on replay
	defer stop()

	p, err := supervisor.New(supervisor.Config{BlockSize: 16, Registry: prometheus.NewRegistry()})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go p.Run(ctx) // until cancel, then drains and stops
	defer p.Close()

	if err := p.AddWorker("engine-0", sub, replay); err != nil {
		log.Fatal(err)
	}

	prompt := make([]uint32, 3*16) // a request of three blocks of tokens
	for i := range prompt {
		prompt[i] = uint32(i)
	}
	for range 500 { // the engine caches the first two blocks (and says so until we see it)
		pub.Publish(storedEvent(prompt[:2*16]))
		matches, err := p.FindMatches(ctx, prompt)
		if err != nil {
			log.Fatal(err)
		}
		if len(matches) > 0 {
			fmt.Printf("%s holds %d leading blocks\n", matches[0].Worker, matches[0].Blocks)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Output: engine-0 holds 2 leading blocks
}

func exampleEngine() (pub *wiretest.Publisher, sub, replay string, stop func()) {
	dir, err := os.MkdirTemp("", "kvpipe-example") // ipc:// sockets need no free port
	if err != nil {
		log.Fatal(err)
	}
	sub, replay = "ipc://"+filepath.Join(dir, "pub"), "ipc://"+filepath.Join(dir, "replay")
	pub, err = wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: sub, ReplayEndpoint: replay})
	if err != nil {
		log.Fatal(err)
	}
	return pub, sub, replay, func() { pub.Close(); os.RemoveAll(dir) }
}

func storedEvent(tokens []uint32) []byte {
	e := codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{101, 102}, TokenIDs: tokens, BlockSize: 16, Medium: "GPU"}
	return codec.AppendBatch(nil, &codec.Batch{Events: []codec.Event{e}}, codec.CurrentVLLM)
}
