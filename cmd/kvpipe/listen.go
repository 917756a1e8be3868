package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/metricsserve"
	"github.com/kvpipe/kvpipe/metrics"
	"github.com/prometheus/client_golang/prometheus"
)

// endpoints collects repeated flag values, each "URL" or "name=URL".
type endpoints []string

func (e *endpoints) String() string     { return strings.Join(*e, ",") }
func (e *endpoints) Set(v string) error { *e = append(*e, v); return nil }

func splitNamed(v string, i int) (name, url string) {
	if n, u, ok := strings.Cut(v, "="); ok && !strings.Contains(n, "://") {
		return n, u
	}
	return fmt.Sprintf("w%d", i), v
}

// namedWorker is one --endpoint, with its name and the --replay of that name.
type namedWorker struct {
	name string
	wc   kvpipe.WorkerConfig
}

// workerConfigs pairs each --endpoint with the --replay of the same name.
func workerConfigs(eps, replays []string, topic string) []namedWorker {
	replayOf := map[string]string{}
	for i, r := range replays {
		name, url := splitNamed(r, i)
		replayOf[name] = url
	}
	out := make([]namedWorker, 0, len(eps))
	for i, e := range eps {
		name, url := splitNamed(e, i)
		out = append(out, namedWorker{name, kvpipe.WorkerConfig{Endpoint: url, ReplayEndpoint: replayOf[name], Topic: topic}})
	}
	return out
}

func listenCmd(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("listen", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var eps, replays endpoints
	fs.Var(&eps, "endpoint", "an engine's PUB endpoint, URL or name=URL (repeat for several engines)")
	fs.Var(&eps, "workers", "same as --endpoint")
	fs.Var(&replays, "replay", "an engine's replay (ROUTER) endpoint, in --endpoint order or name=URL")
	topic := fs.String("topic", "", "ZMQ topic prefix to subscribe to")
	blockSize := fs.Int("block-size", 16, "the router's block size")
	shards := fs.Int("shards", 2, "index shards")
	exitAfter := fs.Uint64("exit-after-batches", 0, "exit after this many batches (all engines together); 0: on SIGINT")
	jsonOut := fs.Bool("json", false, "print the summary (and events) as JSON")
	events := fs.Bool("events", false, "with --json, print every event as kvpipe decode does")
	verbose := fs.Bool("v", false, "log warnings to stderr")
	metricsAddr := fs.String("metrics", "", "serve Prometheus metrics on this address at /metrics, e.g. :9090 (empty: none)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if len(eps) == 0 {
		fmt.Fprintln(stderr, "kvpipe listen: at least one --endpoint is required")
		return 2
	}
	logger := slog.New(slog.DiscardHandler)
	if *verbose {
		logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	obs := &observer{out: bufio.NewWriter(stdout), stderr: stderr, printEvents: *events && *jsonOut,
		exitAfter: *exitAfter, stop: cancel, decoders: map[string]*codec.Decoder{}, seen: map[string]bool{}}
	p, err := kvpipe.New(kvpipe.Config{BlockSize: *blockSize, Shards: *shards, Logger: logger, Observe: obs.batch})
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe listen:", err)
		return 2
	}
	if *metricsAddr != "" {
		stopMetrics, err := metricsserve.Serve(*metricsAddr, prometheus.NewRegistry(), metrics.NewCollector(p.Stats))
		if err != nil {
			fmt.Fprintln(stderr, "kvpipe listen:", err)
			return 1
		}
		defer stopMetrics()
	}
	for _, w := range workerConfigs(eps, replays, *topic) {
		obs.decoders[w.name] = codec.NewDecoder()
		if err := p.AddWorker(w.name, w.wc); err != nil {
			fmt.Fprintln(stderr, "kvpipe listen:", err)
			return 2
		}
	}
	if err := p.Run(ctx); err != nil && ctx.Err() == nil {
		fmt.Fprintln(stderr, "kvpipe listen:", err)
		return 1
	}
	writeSummary(obs.out, summarise(p.Stats().Total()), *jsonOut) // the counters outlive the run
	return 0
}

// observer sees every batch in its worker's goroutine; the decoders map is
// only read there, each worker touching its own entry.
type observer struct {
	mu          sync.Mutex // serialises output from the workers' goroutines
	out         *bufio.Writer
	stderr      io.Writer
	printEvents bool
	exitAfter   uint64
	batches     atomic.Uint64
	stop        context.CancelFunc
	decoders    map[string]*codec.Decoder
	seen        map[string]bool
	decoded     codec.Batch
	line        []byte
}

func (o *observer) batch(worker string, seq uint64, payload []byte) {
	o.mu.Lock()
	if !o.seen[worker] {
		o.seen[worker] = true
		fmt.Fprintf(o.stderr, "kvpipe listen: worker %s: first batch, seq %d\n", worker, seq)
	}
	if o.printEvents && o.decoders[worker].Decode(payload, &o.decoded) == nil {
		for i := range o.decoded.Events {
			o.line = append(appendEventJSON(o.line[:0], &o.decoded.Events[i]), '\n')
			o.out.Write(o.line)
		}
		o.out.Flush()
		for _, err := range o.decoded.Invalid {
			fmt.Fprintf(o.stderr, "kvpipe listen: worker %s: seq %d: unreadable event left out: %v\n", worker, seq, err)
		}
	}
	o.mu.Unlock()
	if n := o.batches.Add(1); o.exitAfter > 0 && n >= o.exitAfter {
		o.stop() // the actor still applies this batch before the worker stops
	}
}

type summary struct {
	counts   []field
	filtered map[string]uint64
}

type field struct {
	key   string
	value uint64
}

func summarise(t kvpipe.WorkerStats) summary {
	w, a := t.Wire, t.Actor
	filtered := map[string]uint64{}
	for r := range actor.NumReasons {
		filtered[r.String()] = a.Filtered[r]
	}
	return summary{counts: []field{
		{"batches", w.Batches}, {"events", a.Stored + a.Removed + a.Cleared + a.Filtered[actor.UnknownEvent]},
		{"gaps", w.Gaps}, {"replayed", w.Replayed}, {"lost", w.Lost}, {"duplicates", w.Duplicates},
		{"malformed", w.Malformed}, {"decode_errors", a.DecodeErrors}, {"restarts", w.Restarts},
		{"reconnects", w.Reconnects}, {"resyncs", a.Resyncs}, {"indexed_blocks", uint64(max(a.IndexedBlocks, 0))},
	}, filtered: filtered}
}

func writeSummary(w *bufio.Writer, s summary, asJSON bool) {
	if asJSON {
		// Keys in the documented order, then the filter counts.
		var b strings.Builder
		b.WriteByte('{')
		for _, f := range s.counts {
			fmt.Fprintf(&b, "%q:%d,", f.key, f.value)
		}
		filtered, _ := json.Marshal(s.filtered)
		fmt.Fprintf(&b, "%q:%s}\n", "filtered", filtered)
		w.WriteString(b.String())
	} else {
		for _, f := range s.counts {
			fmt.Fprintf(w, "%s=%d ", f.key, f.value)
		}
		reasons := make([]string, 0, len(s.filtered))
		for r := range s.filtered {
			reasons = append(reasons, r)
		}
		sort.Strings(reasons)
		for _, r := range reasons {
			fmt.Fprintf(w, "filtered.%s=%d ", r, s.filtered[r])
		}
		w.WriteByte('\n')
	}
	w.Flush()
}
