package kvpipe_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/metrics"
	"github.com/prometheus/client_golang/prometheus"
)

// A router builds one Pipeline, adds a worker per engine, runs it, and asks
// FindMatches for each request's prompt.
func Example() {
	engine := startEngine() // a simulated vLLM engine: its events PUB and replay ROUTER
	defer engine.stop()
	if err := route(context.Background(), prometheus.NewRegistry(), engine); err != nil {
		log.Fatal(err)
	}
	// Output: engine-0 holds 2 leading blocks
}

// route holds the README's embedding example line for line
// (TestReadmeEmbeddingIsTheExample), and what the simulated engine needs
// around it.
func route(ctx context.Context, registry *prometheus.Registry, engine *engine) error {
	pub, replay := engine.pub, engine.replay
	p, err := kvpipe.New(kvpipe.Config{BlockSize: 16})
	if err != nil {
		return err
	}
	// Prometheus: the collector reads the pipeline's counters at each scrape.
	if err := registry.Register(metrics.NewCollector(p.Stats)); err != nil {
		return err
	}
	// One worker per engine: its KV-events PUB (e.g. "tcp://10.0.0.5:5557") and its replay ROUTER ("" if none).
	err = p.AddWorker("engine-0", kvpipe.WorkerConfig{Endpoint: pub, ReplayEndpoint: replay})
	if err != nil {
		return err
	}
	stopped := make(chan error, 1)
	go func() { stopped <- p.Run(ctx) }() // owns every goroutine until it returns

	promptTokens := make([]uint32, 3*16) // a request of three blocks of tokens
	for i := range promptTokens {
		promptTokens[i] = uint32(i)
	}
	for range 500 {
		engine.caches(promptTokens[:2*16]) // the engine caches the first two blocks (and says so until we see it)
		// Per request: which workers hold how many leading blocks of its prompt.
		matches, err := p.FindMatches(ctx, promptTokens)
		if err != nil {
			return err
		}
		if len(matches) == 0 || matches[0].Blocks < 2 { // not yet, or a batch seen in part
			time.Sleep(10 * time.Millisecond)
			continue
		}
		for _, m := range matches {
			fmt.Printf("%s holds %d leading blocks\n", m.Worker, m.Blocks)
		}
		break
	}

	// On the way out: drain, then stop, within a deadline; Run then returns nil.
	shutdownCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := p.Shutdown(shutdownCtx); err != nil {
		return err
	}
	return <-stopped
}
