package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/serve"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/relay"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/encoding/protojson"
)

// serveFlags are kvpipe serve's flags.
type serveFlags struct {
	eps, replays, allow                      endpoints
	listen, grpcListen, topic, config        *string
	tokenFile                                *string
	tlsCert, tlsKey, snapshot                *string
	natsURL, stream, prefix, bucket, object  *string
	blockSize, shards, maxTokens, maxBytes   *int
	drain, idle, snapshotEvery, readyTimeout *time.Duration
	verbose                                  *bool
}

func parseServeFlags(args []string, stderr io.Writer) (*serveFlags, bool) {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	f := &serveFlags{}
	fs.Var(&f.eps, "endpoint", "an engine's PUB endpoint, URL or name=URL (repeat for several engines)")
	fs.Var(&f.eps, "workers", "same as --endpoint")
	fs.Var(&f.replays, "replay", "an engine's replay (ROUTER) endpoint, in --endpoint order or name=URL")
	fs.Var(&f.allow, "allow", "a CIDR, address or host name that registrations may dial (repeat, or comma-separated); none: registration refused")
	f.listen = fs.String("listen", ":8080", "address of the gRPC, HTTP/JSON, metrics and status page server")
	f.grpcListen = fs.String("grpc-listen", "", "address of a second gRPC server, grpc-go's, for every call of the service (about half the CPU a match of --listen's gRPC); empty: none")
	f.topic = fs.String("topic", "", "ZMQ topic prefix of the --endpoint engines")
	f.config = fs.String("config", "", `JSON file of workers: {"workers": [{"name": "e0", "endpoint": "tcp://...", "replayEndpoint": "tcp://..."}]}`)
	f.tokenFile = fs.String("token-file", "", "file holding the bearer token of register, unregister and dump (else $KVPIPE_TOKEN; none: those calls are refused)")
	f.tlsCert = fs.String("tls-cert", "", "TLS certificate file (PEM); with --tls-key, serve over TLS")
	f.tlsKey = fs.String("tls-key", "", "TLS private key file (PEM)")
	f.snapshot = fs.String("snapshot", "", "file of the saved index and registrations: loaded at start, saved on SIGTERM")
	f.snapshotEvery = fs.Duration("snapshot-every", time.Minute, "with --snapshot, also save it this often (0: only on SIGTERM)")
	f.natsURL = fs.String("nats", "", "follow a kvpipe relay's JetStream stream on this NATS server (empty: none)")
	f.stream = fs.String("stream", opstream.DefaultStream, "with --nats, the relay's stream")
	f.prefix = fs.String("prefix", opstream.DefaultPrefix, "with --nats, the relay's subject prefix")
	f.bucket = fs.String("bucket", opstream.DefaultBucket, "with --nats, the relay's snapshot bucket")
	f.object = fs.String("object", opstream.DefaultObject, "with --nats, the relay's snapshot object")
	f.blockSize = fs.Int("block-size", 16, "the router's block size")
	f.shards = fs.Int("shards", 2, "index shards")
	f.maxTokens = fs.Int("max-tokens", 1<<20, "most tokens in one match request")
	f.maxBytes = fs.Int("max-message-bytes", 8<<20, "largest request body")
	f.drain = fs.Duration("drain-timeout", 10*time.Second, "on SIGTERM, how long in-flight calls may take")
	f.idle = fs.Duration("idle-timeout", 2*time.Minute, "close a connection with no call open for this long (0 or less: 2m)")
	f.readyTimeout = fs.Duration("ready-timeout", 30*time.Second, "how long /readyz waits for a registered worker to connect; past it the worker counts as partial (negative: for ever)")
	f.verbose = fs.Bool("v", false, "log to stderr")
	if err := fs.Parse(args); err != nil {
		return nil, false
	}
	if (*f.tlsCert == "") != (*f.tlsKey == "") {
		fmt.Fprintln(stderr, "kvpipe serve: --tls-cert and --tls-key go together")
		return nil, false
	}
	return f, true
}

// serveCmd runs kvpipe serve until SIGINT or SIGTERM, then drains.
func serveCmd(ctx context.Context, args []string, stderr io.Writer) int {
	f, ok := parseServeFlags(args, stderr)
	if !ok {
		return 2
	}
	logger := serviceLogger(stderr, *f.verbose)
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM) // main stops on SIGINT
	defer stop()
	cfg, closeSource, err := serveConfig(f, logger)
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe serve:", err)
		return 2
	}
	defer closeSource()
	l, err := listenServe(f, &cfg)
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe serve:", err)
		return 1
	}
	s, err := serve.New(ctx, cfg)
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe serve:", err)
		return 2 // the process exits: its listeners with it
	}
	fmt.Fprintf(stderr, "kvpipe serve: listening on %s (%d workers)\n", l.Addr(), len(cfg.Workers))
	if cfg.GRPCListener != nil {
		fmt.Fprintf(stderr, "kvpipe serve: gRPC (grpc-go) on %s\n", cfg.GRPCListener.Addr())
	}
	if err := s.Run(ctx, l); err != nil {
		fmt.Fprintln(stderr, "kvpipe serve:", err)
		return 1
	}
	fmt.Fprintln(stderr, "kvpipe serve: drained")
	return 0
}

// listenServe listens on --listen, and on --grpc-listen into
// cfg.GRPCListener.
func listenServe(f *serveFlags, cfg *serve.Config) (net.Listener, error) {
	l, err := net.Listen("tcp", *f.listen)
	if err != nil || *f.grpcListen == "" {
		return l, err
	}
	if cfg.GRPCListener, err = net.Listen("tcp", *f.grpcListen); err != nil {
		l.Close()
		return nil, fmt.Errorf("--grpc-listen: %w", err)
	}
	return l, nil
}

// serveConfig builds the server's config from the flags; closeSource
// closes the NATS connection of a followed relay.
func serveConfig(f *serveFlags, logger *slog.Logger) (serve.Config, func(), error) {
	cfg := serve.Config{BlockSize: *f.blockSize, MaxTokens: *f.maxTokens, MaxMessageBytes: *f.maxBytes, Snapshot: *f.snapshot, SnapshotEvery: *f.snapshotEvery,
		DrainTimeout: *f.drain, IdleTimeout: *f.idle, ReadyTimeout: *f.readyTimeout, Registry: prometheus.NewRegistry(), Logger: logger, Token: os.Getenv("KVPIPE_TOKEN")}
	for _, a := range f.allow {
		cfg.Allow = append(cfg.Allow, strings.Split(a, ",")...)
	}
	for _, w := range workerConfigs(f.eps, f.replays, *f.topic) {
		cfg.Workers = append(cfg.Workers, &kvpipev1.WorkerSpec{Name: w.name, Endpoint: w.wc.Endpoint, ReplayEndpoint: w.wc.ReplayEndpoint, Topic: w.wc.Topic})
	}
	var err error
	if *f.config != "" {
		if err = readWorkerFile(*f.config, &cfg.Workers); err != nil {
			return cfg, nil, err
		}
	}
	if *f.tokenFile != "" {
		data, err := os.ReadFile(*f.tokenFile)
		if err != nil {
			return cfg, nil, err
		}
		if cfg.Token = strings.TrimSpace(string(data)); cfg.Token == "" {
			return cfg, nil, fmt.Errorf("--token-file %s is empty", *f.tokenFile)
		}
	}
	if *f.tlsCert != "" {
		cert, err := tls.LoadX509KeyPair(*f.tlsCert, *f.tlsKey)
		if err != nil {
			return cfg, nil, err
		}
		cfg.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	pc := kvpipe.Config{BlockSize: *f.blockSize, Shards: *f.shards, Logger: logger}
	closeSource := func() {}
	if *f.natsURL != "" {
		if pc.Source, closeSource, err = follower(f, logger); err != nil {
			return cfg, nil, err
		}
	}
	if cfg.Pipeline, err = kvpipe.New(pc); err != nil {
		closeSource()
		return cfg, nil, err
	}
	return cfg, closeSource, nil
}

// readWorkerFile appends the workers of a --config file.
func readWorkerFile(path string, dst *[]*kvpipev1.WorkerSpec) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var file struct{ Workers []json.RawMessage }
	if err := json.Unmarshal(data, &file); err != nil {
		return fmt.Errorf("--config %s: %w", path, err)
	}
	if len(file.Workers) == 0 {
		return fmt.Errorf("--config %s: no workers", path)
	}
	for i, raw := range file.Workers {
		var w kvpipev1.WorkerSpec
		if err := protojson.Unmarshal(raw, &w); err != nil {
			return fmt.Errorf("--config %s: worker %d: %w", path, i, err)
		}
		*dst = append(*dst, &w)
	}
	return nil
}

// follower is the Source of a serve that follows a relay's stream.
func follower(f *serveFlags, logger *slog.Logger) (kvpipe.Source, func(), error) {
	nc, err := nats.Connect(*f.natsURL, nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true), nats.Name("kvpipe serve"))
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err == nil {
		var fl *relay.Follower
		settings := relay.Settings{Prefix: *f.prefix, Stream: *f.stream, Bucket: *f.bucket, Object: *f.object}
		if fl, err = relay.NewFollower(js, settings, logger); err == nil {
			return fl, nc.Close, nil
		}
	}
	nc.Close()
	return nil, nil, errors.Join(errors.New("--nats"), err)
}
