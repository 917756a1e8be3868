package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"syscall"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/metricsserve"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/relaypub"
	"github.com/kvpipe/kvpipe/metrics"
	"github.com/kvpipe/kvpipe/relay"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// relayFlags are kvpipe relay's flags.
type relayFlags struct {
	eps, replays                       endpoints
	natsURL, topic                     *string
	blockSize, shards                  *int
	prefix, stream, bucket, object     *string
	every, maxAge, leaseTTL            *time.Duration
	leaseKey, leaseBucket, metricsAddr *string
	verbose                            *bool
}

func parseRelayFlags(args []string, stderr io.Writer) (*relayFlags, bool) {
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	f := &relayFlags{}
	fs.Var(&f.eps, "endpoint", "an engine's PUB endpoint, URL or name=URL (repeat for several engines)")
	fs.Var(&f.eps, "workers", "same as --endpoint")
	fs.Var(&f.replays, "replay", "an engine's replay (ROUTER) endpoint, in --endpoint order or name=URL")
	f.natsURL = fs.String("nats", nats.DefaultURL, "NATS server URL(s), comma-separated")
	f.topic = fs.String("topic", "", "ZMQ topic prefix to subscribe to")
	f.blockSize = fs.Int("block-size", 16, "the router's block size")
	f.shards = fs.Int("shards", 2, "index shards")
	f.prefix = fs.String("prefix", opstream.DefaultPrefix, "subject prefix: one subject <prefix>.<worker> per worker")
	f.stream = fs.String("stream", opstream.DefaultStream, "JetStream stream name")
	f.bucket = fs.String("bucket", opstream.DefaultBucket, "object store bucket for snapshots")
	f.object = fs.String("object", opstream.DefaultObject, "snapshot object name")
	f.every = fs.Duration("snapshot-every", 15*time.Second, "how often to write the snapshot")
	f.maxAge = fs.Duration("max-age", opstream.DefaultMaxAge, "how long the stream keeps ops (keep several snapshot intervals)")
	f.leaseKey = fs.String("lease", "", "run as one of several relays for these engines: write only while holding this key of the lease bucket (empty: always write)")
	f.leaseBucket = fs.String("lease-bucket", relaypub.DefaultLeaseBucket, "KV bucket of the lease")
	f.leaseTTL = fs.Duration("lease-ttl", relaypub.DefaultLeaseTTL, "a holder silent this long loses the lease to a standby")
	f.metricsAddr = fs.String("metrics", "", "serve Prometheus metrics on this address at /metrics, e.g. :9090 (empty: none)")
	f.verbose = fs.Bool("v", false, "log to stderr")
	if err := fs.Parse(args); err != nil {
		return nil, false
	}
	if len(f.eps) == 0 {
		fmt.Fprintln(stderr, "kvpipe relay: at least one --endpoint is required")
		return nil, false
	}
	return f, true
}

// relayCmd runs a relay: the engines' ops to a JetStream stream, with
// snapshots in its object store, until SIGINT or SIGTERM.
func relayCmd(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	f, ok := parseRelayFlags(args, stderr)
	if !ok {
		return 2
	}
	logger := serviceLogger(stderr, *f.verbose)
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM) // main stops on SIGINT
	defer stop()
	nc, err := nats.Connect(*f.natsURL, nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true), nats.Name("kvpipe relay"),
		// No reconnect buffer: the relay keeps many messages in flight (Config.MaxInFlight).
		nats.ReconnectBufSize(-1))
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe relay:", err)
		return 1
	}
	defer nc.Close()
	r, code := newRelay(nc, f, logger, stderr)
	if r == nil {
		return code
	}
	if *f.metricsAddr != "" {
		current := func() kvpipe.Stats { // the pipeline the relay runs now
			if p := r.Pipeline(); p != nil {
				return p.Stats()
			}
			return kvpipe.Stats{}
		}
		stopMetrics, err := metricsserve.Serve(*f.metricsAddr, prometheus.NewRegistry(), relaypub.NewCollector(r), metrics.NewCollector(current))
		if err != nil {
			fmt.Fprintln(stderr, "kvpipe relay:", err)
			return 1
		}
		defer stopMetrics()
	}
	fmt.Fprintf(stderr, "kvpipe relay: %d workers to stream %s on %s\n", len(f.eps), *f.stream, *f.natsURL)
	if err := r.Run(ctx); err != nil && ctx.Err() == nil {
		fmt.Fprintln(stderr, "kvpipe relay:", err)
		return 1
	}
	st := r.Stats()
	fmt.Fprintf(stdout, "published=%d duplicates=%d retries=%d replayed=%d snapshots=%d snapshot_errors=%d resets=%d terms=%d lease_lost=%d\n",
		st.Published, st.Duplicates, st.Retries, st.Replayed, st.Snapshots, st.SnapshotErrors, st.Resets, st.Terms, st.LeaseLost)
	return 0
}

// newRelay builds the relay the flags describe, with its workers; on an
// error it returns nil and the exit code.
func newRelay(nc *nats.Conn, f *relayFlags, logger *slog.Logger, stderr io.Writer) (*relaypub.Relay, int) {
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe relay:", err)
		return nil, 1
	}
	cfg := relaypub.Config{
		Settings:      relay.Settings{Prefix: *f.prefix, Stream: *f.stream, Bucket: *f.bucket, Object: *f.object, MaxAge: *f.maxAge},
		Pipeline:      kvpipe.Config{BlockSize: *f.blockSize, Shards: *f.shards, Logger: logger},
		SnapshotEvery: *f.every,
		Logger:        logger,
	}
	if *f.leaseKey != "" {
		if cfg.Lease, err = relaypub.NewLease(js, relaypub.LeaseConfig{Bucket: *f.leaseBucket, Key: *f.leaseKey, TTL: *f.leaseTTL, Logger: logger}); err != nil {
			fmt.Fprintln(stderr, "kvpipe relay:", err)
			return nil, 2
		}
	}
	r, err := relaypub.New(js, cfg)
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe relay:", err)
		return nil, 2
	}
	for _, w := range workerConfigs(f.eps, f.replays, *f.topic) {
		if err := r.AddWorker(w.name, w.wc); err != nil {
			fmt.Fprintln(stderr, "kvpipe relay:", err)
			return nil, 2
		}
	}
	return r, 0
}

// serviceLogger is the logger of a long-running command (relay, serve):
// warnings, and with --verbose what it does.
func serviceLogger(stderr io.Writer, verbose bool) *slog.Logger {
	level := slog.LevelWarn
	if verbose {
		level = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
}
