package kvpipe_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/prometheus/client_golang/prometheus"
)

// A router builds one Pipeline, adds a worker per engine, runs it, and asks
// FindMatches for each request's prompt.
func Example() {
	engine := startEngine() // a simulated vLLM engine: its events PUB and replay ROUTER
	defer engine.stop()

	p, err := kvpipe.New(kvpipe.Config{BlockSize: 16, Registry: prometheus.NewRegistry()})
	if err != nil {
		log.Fatal(err)
	}
	// One worker per engine: its KV-events PUB and its replay ROUTER ("" if none).
	err = p.AddWorker("engine-0", kvpipe.WorkerConfig{Endpoint: engine.pub, ReplayEndpoint: engine.replay})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	stopped := make(chan error, 1)
	go func() { stopped <- p.Run(ctx) }() // owns every goroutine until it returns
	defer func() {
		shutdownCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		p.Shutdown(shutdownCtx) // drain, then stop: Run returns nil
		if err := <-stopped; err != nil {
			log.Print(err)
		}
	}()

	prompt := make([]uint32, 3*16) // a request of three blocks of tokens
	for i := range prompt {
		prompt[i] = uint32(i)
	}
	for range 500 {
		engine.caches(prompt[:2*16]) // the engine caches the first two blocks (and says so until we see it)
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
