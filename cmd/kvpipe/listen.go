package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/wire"
)

// endpoints collects repeated --endpoint/--replay values, each "URL" or "name=URL".
type endpoints []string

func (e *endpoints) String() string     { return strings.Join(*e, ",") }
func (e *endpoints) Set(v string) error { *e = append(*e, v); return nil }

func splitNamed(v string, i int) (name, url string) {
	if n, u, ok := strings.Cut(v, "="); ok && !strings.Contains(n, "://") {
		return n, u
	}
	return fmt.Sprintf("w%d", i), v
}

func listenCmd(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("listen", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var eps, replays endpoints
	fs.Var(&eps, "endpoint", "an engine's PUB endpoint, URL or name=URL (repeat for several engines)")
	fs.Var(&replays, "replay", "the matching engine's replay (ROUTER) endpoint, in --endpoint order or name=URL")
	topic := fs.String("topic", "", "ZMQ topic prefix to subscribe to")
	blockSize := fs.Int("block-size", 16, "the router's block size")
	exitAfter := fs.Uint64("exit-after-batches", 0, "exit after this many batches (all engines together); 0: on SIGINT")
	jsonOut := fs.Bool("json", false, "print the summary (and events) as JSON")
	events := fs.Bool("events", false, "with --json, print every event as kvpipe decode does")
	verbose := fs.Bool("v", false, "log wire warnings to stderr")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if len(eps) == 0 {
		fmt.Fprintln(stderr, "kvpipe listen: at least one --endpoint is required")
		return 2
	}
	if *blockSize <= 0 {
		fmt.Fprintln(stderr, "kvpipe listen: --block-size must be positive")
		return 2
	}
	logger := slog.New(slog.DiscardHandler)
	if *verbose {
		logger = slog.New(slog.NewTextHandler(stderr, nil))
	}
	replayOf := map[string]string{}
	for i, r := range replays {
		name, url := splitNamed(r, i)
		replayOf[name] = url
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := &printer{w: bufio.NewWriter(stdout), printEvents: *events && *jsonOut}
	total := &summary{}
	var workers []*listener
	for i, e := range eps {
		name, url := splitNamed(e, i)
		sub, err := wire.NewSubscriber(wire.Config{Endpoint: url, ReplayEndpoint: replayOf[name], Topic: *topic, Logger: logger.With("worker", name)})
		if err != nil {
			fmt.Fprintf(stderr, "kvpipe listen: worker %s: %v\n", name, err)
			return 2
		}
		workers = append(workers, &listener{name: name, sub: sub, decoder: codec.NewDecoder(), out: out, total: total,
			exitAfter: *exitAfter, stop: cancel, stderr: stderr})
	}
	var wg sync.WaitGroup
	for _, l := range workers {
		wg.Go(func() { l.sub.Run(ctx, l) })
	}
	wg.Wait()
	for _, l := range workers {
		total.add(l.sub.Stats())
	}
	out.summary(total, *jsonOut)
	return 0
}

// listener is one engine's handler; it runs in that engine's Subscriber goroutine.
type listener struct {
	name      string
	sub       *wire.Subscriber
	decoder   *codec.Decoder
	batch     codec.Batch
	out       *printer
	total     *summary
	exitAfter uint64
	stop      context.CancelFunc
	stderr    io.Writer
	announced bool
}

func (l *listener) HandleBatch(seq uint64, payload []byte) {
	if !l.announced {
		l.announced = true
		fmt.Fprintf(l.stderr, "kvpipe listen: worker %s: first batch, seq %d\n", l.name, seq)
	}
	if err := l.decoder.Decode(payload, &l.batch); err != nil {
		l.total.decodeErrors.Add(1)
		fmt.Fprintf(l.stderr, "kvpipe listen: worker %s: seq %d: %v\n", l.name, seq, err)
	} else {
		l.total.events.Add(uint64(len(l.batch.Events)))
		l.total.unknown.Add(uint64(l.batch.Skipped))
		l.out.events(l.batch.Events)
	}
	if n := l.total.batches.Add(1); l.exitAfter > 0 && n >= l.exitAfter {
		l.stop()
	}
}

func (l *listener) HandleReset(why wire.ResetReason) {
	fmt.Fprintf(l.stderr, "kvpipe listen: worker %s: history unknown (%v)\n", l.name, why)
}

// summary adds up every worker's counts.
type summary struct {
	batches, events, unknown, decodeErrors atomic.Uint64
	gaps, replayed, lost, duplicates       uint64
	malformed, restarts, reconnects        uint64
}

func (s *summary) add(st *wire.Stats) {
	s.gaps += st.Gaps.Load()
	s.replayed += st.Replayed.Load()
	s.lost += st.Lost.Load()
	s.duplicates += st.Duplicates.Load()
	s.malformed += st.Malformed.Load()
	s.restarts += st.Restarts.Load()
	s.reconnects += st.Reconnects.Load()
}

// printer serialises output from every worker's goroutine.
type printer struct {
	mu          sync.Mutex
	w           *bufio.Writer
	printEvents bool
	line        []byte
}

func (p *printer) events(evs []codec.Event) {
	if !p.printEvents {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := range evs {
		p.line = append(appendEventJSON(p.line[:0], &evs[i]), '\n')
		p.w.Write(p.line)
	}
	p.w.Flush()
}

func (p *printer) summary(s *summary, asJSON bool) {
	fields := []struct {
		k string
		v uint64
	}{
		{"batches", s.batches.Load()}, {"events", s.events.Load()}, {"gaps", s.gaps}, {"replayed", s.replayed},
		{"lost", s.lost}, {"duplicates", s.duplicates}, {"malformed", s.malformed},
		{"decode_errors", s.decodeErrors.Load()}, {"unknown_events", s.unknown.Load()},
		{"restarts", s.restarts}, {"reconnects", s.reconnects},
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if asJSON {
		m := make(map[string]uint64, len(fields))
		for _, f := range fields {
			m[f.k] = f.v
		}
		b, _ := json.Marshal(m)
		p.w.Write(append(b, '\n'))
	} else {
		for i, f := range fields {
			if i > 0 {
				p.w.WriteByte(' ')
			}
			fmt.Fprintf(p.w, "%s=%d", f.k, f.v)
		}
		p.w.WriteByte('\n')
	}
	p.w.Flush()
}
