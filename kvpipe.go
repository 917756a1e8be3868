// Package kvpipe is what a KV-cache-aware router imports: a Pipeline that
// subscribes to every inference engine's KV-cache events and answers which
// worker holds how much of a prompt. The parts live in wire, codec, actor,
// index and supervisor; this package names the few types a router touches.
package kvpipe

import (
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/supervisor"
	"github.com/kvpipe/kvpipe/wire"
)

type (
	// Pipeline runs the workers and the index; see supervisor.Pipeline.
	Pipeline = supervisor.Pipeline
	// Config configures a Pipeline.
	Config = supervisor.Config
	// WorkerConfig is one engine's endpoints, for AddWorker.
	WorkerConfig = supervisor.WorkerConfig
	// Match is one worker's overlap with a request.
	Match = supervisor.Match
	// Stats is a snapshot of every worker's counters and every shard's state.
	Stats = supervisor.Stats
	// WorkerStats is one worker's counters.
	WorkerStats = supervisor.WorkerStats
	// Backpressure says what a worker does when its shard is behind.
	Backpressure = supervisor.Backpressure
	// SubscriberOptions tune every worker's subscriber (Config.Subscriber).
	SubscriberOptions = wire.Options
	// Request is a request's tokens, adapter, salt and multimodal inputs,
	// for FindMatchesRequest.
	Request = supervisor.Request
	// MultiModal is one multimodal input of a Request.
	MultiModal = index.MultiModal
	// Weights are per-tier weights (Config.TierWeights).
	Weights = index.Weights
	// Tier is a storage tier: device, host, disk or remote.
	Tier = index.Tier
	// Hasher turns a prompt's tokens into router block keys, for
	// FindMatchesKeys and AppendMatches; its zero value is ready.
	Hasher = index.Hasher
	// Source feeds the index with ops normalised elsewhere (Config.Source;
	// relay.Follower consumes a relay's JetStream stream).
	Source = supervisor.Source
	// Feed is how a Source hands its ops to the pipeline.
	Feed = supervisor.Feed
)

const (
	TierDevice = index.TierDevice // accelerator memory
	TierHost   = index.TierHost   // host memory (CPU offload)
	TierDisk   = index.TierDisk   // local disk
	TierRemote = index.TierRemote // a shared or remote pool
)

const (
	Block = supervisor.Block // wait for the shard; replay recovers what the socket then drops
	Drop  = supervisor.Drop  // drop the batch, count it, resync the worker
)

var (
	// ErrClosed is returned once the pipeline has been shut down.
	ErrClosed = supervisor.ErrClosed
	// ErrRunning is returned by a second call of Run.
	ErrRunning = supervisor.ErrRunning
	// ErrNoWorker is returned by RemoveWorker for a name it does not know.
	ErrNoWorker = supervisor.ErrNoWorker
	// ErrNotRunning is returned by Snapshot before Run.
	ErrNotRunning = supervisor.ErrNotRunning
)

// New validates cfg and returns a Pipeline that starts nothing until Run.
func New(cfg Config) (*Pipeline, error) { return supervisor.New(cfg) }
