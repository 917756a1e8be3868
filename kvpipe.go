// Package kvpipe is what a KV-cache-aware router imports: a Pipeline that
// subscribes to every inference engine's KV-cache events and answers which
// worker holds how much of a prompt.
//
// Events flow frames -> codec -> actor -> index: package wire receives an
// engine's ZMQ frames and recovers lost ones, codec decodes their msgpack,
// actor normalises one worker's events into index ops, and index keeps the
// sharded prefix index the read path (FindMatches) reads without a lock.
// supervisor runs each worker, and metrics exposes a Pipeline to Prometheus.
//
// Every config struct in kvpipe (Config, SubscriberOptions, the relay's)
// follows one defaulting rule: a zero field takes its documented default; a
// negative one means what its doc says (such as "negative disables") and is
// refused where the doc gives it no meaning; a maximum below its minimum
// takes its default, raised to the minimum.
package kvpipe

import (
	"errors"
	"log/slog"
	"time"

	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/kvpipe/kvpipe/wire"
)

// Config configures a Pipeline; zero fields take their defaults.
type Config struct {
	BlockSize int // the router's block size (required), e.g. 16
	Shards    int // index shards (default 2)
	// ShardQueue is how many batches each shard's queue holds, shared by the
	// shard's workers (default 256). A worker has at most ShardQueue+2
	// batches of at most 256 ops in flight (queued, being applied, being
	// filled), so a stalled shard holds at most 6 KiB per batch per worker
	// (24 B an op); a worker keeps them for reuse once applied, and gives
	// back all but 8 about a second after it falls idle while connected.
	ShardQueue   int
	Backpressure Backpressure // when a shard is behind: Block (default) or Drop
	// TierWeights weigh a match's blocks by the tier holding them
	// (Match.Score). A tier weighted 0 is not indexed at all: its events
	// are filtered as lower_tier. The zero value means DefaultWeights
	// (device 1, host 0.8, disk 0.5, remote 0.3).
	TierWeights Weights
	// MaxWorkerBlocks bounds the engine blocks one worker may have indexed
	// (default 4 Mi: 64 M tokens at 16 per block,
	// far above any engine's cache), so that an engine that stores and
	// never removes cannot grow the router without limit. Past it the
	// worker's new blocks are refused (filtered as block_cap) and it is
	// partial until its engine clears its cache.
	MaxWorkerBlocks int
	// PredictionTTL is how long the blocks of a request the router says it
	// sent to a worker with events (Pipeline.Routed) count as predicted
	// there, unless its events confirm or end them first (default 10s,
	// see defaultPredictionTTL; negative: such workers get no predictions).
	PredictionTTL time.Duration
	// ApproximateTTL is PredictionTTL for approximate workers, those with
	// no Endpoint, whose predictions nothing confirms (default 120s).
	ApproximateTTL time.Duration
	// MaxWorkerPredictions caps the predicted blocks of a worker with
	// events (default 131,072, some 8 MiB): past it the least recently
	// predicted end, counted as dropped.
	MaxWorkerPredictions int
	// Subscriber tunes every worker's subscriber (timeouts, backoff, replay
	// buffer, limits); the zero value holds the defaults.
	Subscriber SubscriberOptions
	// RestartMin and RestartMax bound the jittered exponential backoff before
	// a worker that panicked is restarted (defaults 100ms and 10s).
	RestartMin, RestartMax time.Duration
	// RemovalTimeout bounds how long a removed worker's last message (its
	// removal) may take to reach a Tap while the pipeline stops (default 5s).
	RemovalTimeout time.Duration
	Logger         *slog.Logger // nil discards
	// Observe, when set, sees every batch in the worker's goroutine before its
	// actor does (for tools such as kvpipe listen); payload is only valid
	// during the call. It must not block, nor call Shutdown or RemoveWorker:
	// both wait for the goroutine it runs on.
	Observe func(worker string, seq uint64, payload []byte)
	// Tap is kvpipe relay's, which publishes every worker's ops (a router
	// leaves it nil): it sees them before the worker's shard does. It needs
	// Backpressure Block.
	Tap seam.Tap
	// Source, when set, feeds the index with ops normalised elsewhere (a
	// relay's follower); Run runs it beside the workers.
	Source Source
}

// Backpressure says what a worker does when its shard is behind.
type Backpressure uint8

const (
	// Block waits for the shard, and so stops reading the engine's socket:
	// the loss, if any, shows as a seq gap, which replay recovers.
	Block Backpressure = iota
	// Drop discards the batch, counts it, and resyncs the worker: its
	// entries are cleared with the next batch its shard takes, and it is
	// left out of answers until then.
	Drop
)

// WorkerConfig is one engine's connection.
type WorkerConfig struct {
	// Endpoint is its KV-events PUB, e.g. tcp://10.0.0.5:5557. A worker
	// without one is approximate: an engine that publishes no events, of
	// which the pipeline knows only what Pipeline.Routed tells it.
	Endpoint       string
	ReplayEndpoint string // its replay ROUTER; "" when it has none
	// SnapshotEndpoint is its snapshot ROUTER (SGLang's snapshot_endpoint),
	// from which the worker is rebuilt after a loss; "" when it has none.
	SnapshotEndpoint string
	Topic            string // ZMQ topic prefix; the engines' default is ""
	// Eagle: the engine runs EAGLE-family speculative decoding (SGLang
	// with --speculative-algorithm EAGLE, EAGLE3, NEXTN), whose blocks are
	// keyed over windows of BlockSize+1 tokens. Optional: the worker's mode
	// is learned from its events (bigram token ids) in any case; this sets
	// it before the first one.
	Eagle bool
	// CacheBlocks is the engine's cache size in router blocks, which caps
	// the worker's predictions (Pipeline.Routed): no more of a prompt than
	// the engine can hold is claimed. An approximate worker's predictions
	// are an LRU of that many (default Config.MaxWorkerPredictions); a
	// worker with events keeps the smaller of it and MaxWorkerPredictions.
	CacheBlocks int
}

// SubscriberOptions tune every worker's subscriber (Config.Subscriber).
type SubscriberOptions = wire.Options

// Weights are what one block is worth to a request per tier it must be
// read from (Config.TierWeights), indexed by Tier.
type Weights [index.NumTiers]float64

// DefaultWeights are the tier weights a zero Config.TierWeights means: a
// device block counts 1, a host block 0.8, a disk block 0.5 and a remote
// one 0.3, as they must be loaded into device memory first.
var DefaultWeights = Weights(index.DefaultWeights)

// Tier is a storage tier: device, host, disk or remote. Match.Tiers and
// Weights are indexed by it. It is the index's own enum, named here so that
// a router needs no other import.
type Tier = index.Tier

const (
	TierDevice = index.TierDevice // accelerator memory
	TierHost   = index.TierHost   // host memory (CPU offload)
	TierDisk   = index.TierDisk   // local disk
	TierRemote = index.TierRemote // a shared or remote pool
)

var (
	// ErrClosed is returned once the pipeline has been shut down.
	ErrClosed = errors.New("kvpipe: pipeline closed")
	// ErrRunning is returned by a second call of Run.
	ErrRunning = errors.New("kvpipe: pipeline already running")
	// ErrNoWorker is returned by RemoveWorker for a name it does not know.
	ErrNoWorker = errors.New("kvpipe: no such worker")
	// ErrNotRunning is returned by Snapshot before Run.
	ErrNotRunning = errors.New("kvpipe: pipeline not running")
	// ErrNameTaken is returned by Feed.Apply for a name of an engine
	// worker (AddWorker's): a Source's ops never reach it.
	ErrNameTaken = errors.New("kvpipe: the name is an engine worker's")
)
