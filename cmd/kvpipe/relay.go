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

	"github.com/kvpipe/kvpipe/relay"
	"github.com/kvpipe/kvpipe/supervisor"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// relayCmd runs a relay: the engines' ops to a JetStream stream, with
// snapshots in its object store, until SIGINT or SIGTERM.
func relayCmd(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var eps, replays endpoints
	fs.Var(&eps, "endpoint", "an engine's PUB endpoint, URL or name=URL (repeat for several engines)")
	fs.Var(&eps, "workers", "same as --endpoint")
	fs.Var(&replays, "replay", "an engine's replay (ROUTER) endpoint, in --endpoint order or name=URL")
	natsURL := fs.String("nats", nats.DefaultURL, "NATS server URL(s), comma-separated")
	topic := fs.String("topic", "", "ZMQ topic prefix to subscribe to")
	blockSize := fs.Int("block-size", 16, "the router's block size")
	shards := fs.Int("shards", 2, "index shards")
	prefix := fs.String("prefix", relay.DefaultPrefix, "subject prefix: one subject <prefix>.<worker> per worker")
	stream := fs.String("stream", relay.DefaultStream, "JetStream stream name")
	bucket := fs.String("bucket", relay.DefaultBucket, "object store bucket for snapshots")
	object := fs.String("object", relay.DefaultObject, "snapshot object name")
	every := fs.Duration("snapshot-every", 15*time.Second, "how often to write the snapshot")
	maxAge := fs.Duration("max-age", relay.DefaultMaxAge, "how long the stream keeps ops (keep several snapshot intervals)")
	leaseKey := fs.String("lease", "", "run as one of several relays for these engines: write only while holding this key of the lease bucket (empty: always write)")
	leaseBucket := fs.String("lease-bucket", relay.DefaultLeaseBucket, "KV bucket of the lease")
	leaseTTL := fs.Duration("lease-ttl", relay.DefaultLeaseTTL, "a holder silent this long loses the lease to a standby")
	verbose := fs.Bool("v", false, "log to stderr")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if len(eps) == 0 {
		fmt.Fprintln(stderr, "kvpipe relay: at least one --endpoint is required")
		return 2
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM) // main stops on SIGINT
	defer stop()
	nc, err := nats.Connect(*natsURL, nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true), nats.Name("kvpipe relay"),
		// No reconnect buffer: the relay keeps many messages in flight (Config.MaxInFlight).
		nats.ReconnectBufSize(-1))
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe relay:", err)
		return 1
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe relay:", err)
		return 1
	}
	cfg := relay.Config{
		Settings:      relay.Settings{Prefix: *prefix, Stream: *stream, Bucket: *bucket, Object: *object, MaxAge: *maxAge},
		Pipeline:      supervisor.Config{BlockSize: *blockSize, Shards: *shards, Logger: logger},
		SnapshotEvery: *every,
		Logger:        logger,
	}
	if *leaseKey != "" {
		if cfg.Lease, err = relay.NewLease(js, relay.LeaseConfig{Bucket: *leaseBucket, Key: *leaseKey, TTL: *leaseTTL, Logger: logger}); err != nil {
			fmt.Fprintln(stderr, "kvpipe relay:", err)
			return 2
		}
	}
	r, err := relay.New(js, cfg)
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe relay:", err)
		return 2
	}
	for _, w := range workerConfigs(eps, replays, *topic) {
		if err := r.AddWorker(w.name, w.wc); err != nil {
			fmt.Fprintln(stderr, "kvpipe relay:", err)
			return 2
		}
	}
	fmt.Fprintf(stderr, "kvpipe relay: %d workers to stream %s on %s\n", len(eps), *stream, *natsURL)
	if err := r.Run(ctx); err != nil && ctx.Err() == nil {
		fmt.Fprintln(stderr, "kvpipe relay:", err)
		return 1
	}
	st := r.Stats()
	fmt.Fprintf(stdout, "published=%d duplicates=%d retries=%d replayed=%d snapshots=%d snapshot_errors=%d resets=%d terms=%d lease_lost=%d\n",
		st.Published, st.Duplicates, st.Retries, st.Replayed, st.Snapshots, st.SnapshotErrors, st.Resets, st.Terms, st.LeaseLost)
	return 0
}
