package actor

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/pace"
	"github.com/kvpipe/kvpipe/wire"
)

// Config configures the actor of one worker.
type Config struct {
	Worker    index.WorkerID
	Name      string // for logs
	BlockSize int    // the router's block size, e.g. 16
	// Sink takes the worker's batches of ops, in order (required): in a
	// pipeline, an index.Sender into the worker's shard queue, behind the
	// pipeline's Tap if it has one.
	Sink Sink
	// Drop says what the actor does when its shard is behind. False: it
	// waits for the shard, and so stops reading the socket; the loss, if
	// any, then shows upstream as a seq gap, which wire recovers. True: it
	// discards the batch's ops, counts them, and resyncs the worker in the
	// index (its entries cleared) with the next batch that gets through, or
	// alone once the shard has room (HandleIdle); Stale until then.
	Drop bool
	// Weights are the router's tier weights (index.Score.Weighted); a tier
	// weighted 0 is not indexed, its events filtered as LowerTier. The zero
	// value means index.DefaultWeights.
	Weights index.Weights
	// MaxBlocks bounds the engine blocks the worker's mapping holds (each
	// in any tiers, and k router blocks when an engine block spans k of
	// the router's), so that an engine that stores without removing cannot
	// grow the router without limit. Past it, a store's new blocks are
	// refused (the event counted as BlockCap) and the worker is partial
	// until a clear. 0 means 4 Mi (defaultMaxBlocks).
	MaxBlocks int
	Logger    *slog.Logger
	// Eagle: the engine runs EAGLE-family speculative decoding (SGLang's
	// bigram keys), known before its first event. Without it the mode is
	// learned from the events (Stats.Eagle); either way events decide.
	Eagle bool
	// EagleChanged, if set, is called on the actor's goroutine after
	// Stats().Eagle changes: a read path that caches which kinds of keys
	// its workers need learns that it must look again.
	EagleChanged func()
}

// Sink is where an actor's batches of ops go; *index.Sender is one.
type Sink interface {
	// Batch returns an empty batch of the worker's to fill.
	Batch() *index.Batch
	// Send hands b on if there is room, or else, with wait, once there is,
	// unless the worker stops meanwhile; it reports whether b was taken,
	// and one that was not is the actor's again.
	Send(b *index.Batch, wait bool) bool
	// Stopping reports that the worker is stopping: a batch not taken is
	// then no overload.
	Stopping() bool
	// Trim, called while the worker is idle, gives back to the heap the
	// spare batches of a flood, and reports whether some are left to give
	// back later (index.Sender.Trim).
	Trim(now time.Time) (more bool)
}

// defaultMaxBlocks is Config.MaxBlocks' default: 4 Mi engine blocks, 64 M
// tokens at 16 per block. A 141 GB accelerator holds about a million tokens
// of an 8B model's KV cache, a host tier of 2 TB some 16 M, so no real
// engine comes near it.
const defaultMaxBlocks = 1 << 22

// Actor normalises one worker's events into index ops: it decodes each
// batch, filters what a prefix index must not hold (each drop counted by
// reason), keys blocks as the router does, and hands the ops to its shard.
// It is the worker's wire.Handler; its state is owned by the goroutine
// that runs the worker's Subscriber, and needs no lock.
type Actor struct {
	cfg     Config
	stats   counters
	decoder *codec.Decoder
	batch   codec.Batch
	m       mapping // what the worker told of its blocks
	out     outbox  // the ops on their way to the shard
	groups  groups  // the filter's learned attention groups
	warn    *pace.Warner
	fresh   bool        // no batch since the start or the last reset
	stale   atomic.Bool // the outbox owes the index a clear (Stale)

	snapBlocks []codec.EngineSnapshotBlock // reused across chunks
	snapWhole  bool                        // the engine snapshot being applied mapped every block so far

	// pending: an imported snapshot waits for its position to be proven
	// before its blocks (block.restored) go into the index, with
	// pendingPartial as the worker's partial flag.
	pending, pendingPartial bool
}

// New returns the actor of one worker.
func New(cfg Config) *Actor {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxBlocks <= 0 {
		cfg.MaxBlocks = defaultMaxBlocks
	}
	if cfg.Weights == (index.Weights{}) {
		cfg.Weights = index.DefaultWeights
	}
	a := &Actor{cfg: cfg, decoder: codec.NewDecoder(), warn: pace.NewWarner(cfg.Logger, "kvpipe/actor: "), fresh: true}
	a.m = mapping{out: &a.out, stats: &a.stats, max: cfg.MaxBlocks}
	a.out = outbox{cfg: &a.cfg, stats: &a.stats, dropped: a.m.dropped, stale: &a.stale}
	a.groups = groups{main: make(map[int]bool), weights: &a.cfg.Weights}
	a.stats.Partial.Store(true)
	a.stats.Eagle.Store(cfg.Eagle)
	return a
}

// Stats returns the actor's counters; any goroutine may call it.
func (a *Actor) Stats() Stats { return a.stats.load() }

// Partial reports Stats().Partial without reading the other counters, for
// the read path.
func (a *Actor) Partial() bool { return a.stats.Partial.Load() }

// Stale reports that the index may hold blocks of this worker that its
// engine no longer holds: a batch was dropped (Drop backpressure), and the
// clear that makes up for it has not reached the shard's queue yet. A
// reader leaves the worker out of answers meanwhile.
func (a *Actor) Stale() bool { return a.stale.Load() }

// Eagle reports Stats().Eagle, for the read path: which keys to match the
// worker with.
func (a *Actor) Eagle() bool { return a.stats.Eagle.Load() }

var _ wire.Handler = (*Actor)(nil)

// HandleIdle sends what the actor owes its shard while no batch comes: the
// clear a dropped batch left owed (the shard had no room for it then); and
// lets the Sink give back the batches a flood left spare (Sink.Trim). It
// reports whether either is still to do, so that the caller asks again.
func (a *Actor) HandleIdle() bool {
	owed := a.out.settle()
	return a.cfg.Sink.Trim(time.Now()) || owed
}

// HandleBatch decodes one batch, filters and converts its events, and sends
// the resulting ops to the shard.
func (a *Actor) HandleBatch(seq uint64, payload []byte) {
	a.stats.Batches.Add(1)
	if a.pending { // a batch after a resume: its position was proven
		a.activate()
	}
	if a.fresh {
		a.fresh = false
		if seq == 0 { // an incarnation's first batch: its cache started empty
			a.stats.Partial.Store(false)
		}
	}
	if err := a.decoder.Decode(payload, &a.batch); err != nil {
		a.stats.DecodeErrors.Add(1)
		a.warn.Warn("batch dropped: bad payload", "seq", seq, "err", err, "worker", a.cfg.Name)
		return
	}
	if a.batch.Skipped > 0 {
		a.stats.Filtered[UnknownEvent].Add(uint64(a.batch.Skipped))
	}
	if n := len(a.batch.Invalid); n > 0 { // the batch's other events still count
		a.stats.Filtered[UnreadableEvent].Add(uint64(n))
		a.warn.Warn("unreadable events left out", "seq", seq, "count", n, "first", a.batch.Invalid[0], "worker", a.cfg.Name)
	}
	for i := range a.batch.Events {
		a.apply(&a.batch.Events[i])
	}
	a.out.flush()
}

// HandleReset: history is unknown, so the worker's entries may be stale and
// are cleared. Within one engine incarnation the block mapping is kept: a
// block stored later under a still-cached prefix gets its true key, and
// brings that prefix back into the index.
func (a *Actor) HandleReset(reason wire.ResetReason) {
	a.stats.Resyncs.Add(1)
	a.cfg.Logger.Info("kvpipe/actor: resync", "worker", a.cfg.Name, "reason", reason.String())
	a.pending = false // a reset before the proof: the snapshot is not the engine's
	if reason.SameIncarnation() {
		a.m.unindex()
	} else {
		a.m.clear()
	}
	a.fresh = true
	a.stats.Partial.Store(true)
	a.out.flush()
}

// Recover starts the worker afresh after a panic in its goroutine, whatever
// state the panic left: the partial batch is discarded and the worker's
// entries are cleared in its shard. Counters are kept.
func (a *Actor) Recover() {
	if a.out.out != nil {
		a.out.out.Ops = a.out.out.Ops[:0]
	}
	clear(a.groups.main)
	a.stats.Resyncs.Add(1)
	a.stats.Partial.Store(true)
	a.pending = false
	a.m.clear()
	a.out.flush()
}

// HandleEngineSnapshotBegin starts rebuilding the worker from its engine's
// snapshot: its entries go, what is known of its blocks stays.
func (a *Actor) HandleEngineSnapshotBegin() {
	a.pending = false
	a.m.unindex()
	a.snapWhole = true
	a.out.flush()
}

// HandleEngineSnapshot puts the blocks of one snapshot chunk back into the
// index, under the keys learned from their BlockStored events.
func (a *Actor) HandleEngineSnapshot(chunk []byte) {
	var err error
	if a.snapBlocks, err = a.decoder.DecodeEngineSnapshotChunk(chunk, a.snapBlocks); err != nil {
		a.stats.DecodeErrors.Add(1)
		a.snapWhole = false
		a.warn.Warn("snapshot chunk dropped: bad payload", "err", err, "worker", a.cfg.Name)
		return
	}
	for i := range a.snapBlocks {
		for _, ext := range a.snapBlocks[i].Hashes {
			b, ok := a.m.routerOf.get(ext)
			if !ok {
				a.stats.SnapshotUnmapped.Add(1)
				a.snapWhole = false
				continue
			}
			if a.m.hold(ext, b, index.TierDevice) {
				a.stats.SnapshotBlocks.Add(1)
			}
		}
	}
	a.out.flush()
}

// HandleEngineSnapshotEnd: a whole snapshot, every block mapped, makes the
// worker complete; a broken one leaves nothing of itself.
func (a *Actor) HandleEngineSnapshotEnd(ok bool) {
	if !ok {
		a.pending = false
		a.m.unindex()
	} else if a.snapWhole {
		a.stats.Partial.Store(false)
	}
	a.out.flush()
}

func (a *Actor) apply(e *codec.Event) {
	switch e.Type {
	case codec.BlockStored:
		a.stats.Stored.Add(1)
		a.store(e)
	case codec.BlockRemoved:
		a.stats.Removed.Add(1)
		if r, ok := a.groups.filter(e); !ok {
			a.stats.Filtered[r].Add(1)
			return
		}
		a.m.remove(e.BlockHashes, tierOf(e.Medium))
	case codec.AllBlocksCleared:
		a.stats.Cleared.Add(1)
		if r, ok := a.groups.mediumOK(e.Medium); !ok {
			a.stats.Filtered[r].Add(1)
			return
		}
		// No medium: the engine's whole cache. A device clear of a worker
		// that never told of other tiers: the same. Either way the cache is
		// empty, so nothing is missing now.
		if t := tierOf(e.Medium); e.Medium == "" || t == index.TierDevice && a.m.usedTiers&^bit(t) == 0 {
			a.pending = false
			a.m.clear()
			a.stats.Partial.Store(false)
		} else {
			a.m.clearTier(t) // the worker's other tiers keep their blocks
		}
	}
}

// setEagle sets the worker's mode, and tells the read path of a change.
func (a *Actor) setEagle(eagle bool) {
	if a.stats.Eagle.Load() != eagle {
		a.stats.Eagle.Store(eagle)
		if a.cfg.EagleChanged != nil {
			a.cfg.EagleChanged()
		}
	}
}

// store checks a BlockStored event against the filters and the router's
// block size, and hands its blocks to the mapping.
func (a *Actor) store(e *codec.Event) {
	size, bs := a.cfg.BlockSize, e.BlockSize
	if a.m.fullSeen && bs < size {
		a.stats.Filtered[PartialBlock].Add(1)
		if a.cfg.Logger.Enabled(context.Background(), slog.LevelDebug) { // normal with vLLM: skip the boxing otherwise
			a.cfg.Logger.Debug("kvpipe/actor: partial tail block dropped", "worker", a.cfg.Name, "block_size", bs)
		}
		return
	}
	if r, ok := a.groups.filter(e); !ok {
		a.stats.Filtered[r].Add(1)
		return
	}
	k, ok := a.split(bs)
	if !ok {
		return
	}
	t := tierOf(e.Medium)
	a.m.usedTiers |= bit(t)
	if len(e.TokenIDs) == 0 {
		a.m.retier(e, t)
		return
	}
	a.setEagle(e.Bigram) // the engine's mode, as its latest tokens show it
	if !a.m.store(e, t, k) {
		a.stats.Filtered[BlockCap].Add(1)
		a.stats.Partial.Store(true) // the engine holds what was refused
		a.warn.Warn("worker holds MaxBlocks blocks: new blocks refused", "worker", a.cfg.Name, "max", a.cfg.MaxBlocks)
	}
}

// split returns how many router blocks each engine block of size bs makes,
// and false for a size whose blocks are left out.
func (a *Actor) split(bs int) (int, bool) {
	size := a.cfg.BlockSize
	switch {
	case bs == size:
		a.m.fullSeen = true
		return 1, true
	case bs > size && bs%size == 0:
		k := bs / size
		if a.m.splitK == 0 {
			a.m.splitK = k
		} else if k != a.m.splitK { // the engine changed its block size without a clear
			a.badSize(bs)
			return 0, false
		}
		a.m.fullSeen = true
		return k, true
	case bs <= 0:
		a.stats.TokenMismatch.Add(1)
		return 0, false
	case bs < size:
		// Before any full block: a misconfiguration, converted at its own
		// size so that it shows (FORMAT.md §9.1).
		a.stats.SizeWarnings.Add(1)
		a.warn.Warn("block size differs from the router's", "configured", size, "received", bs, "worker", a.cfg.Name)
		return 1, true
	}
	a.badSize(bs)
	return 0, false
}

// badSize warns once per worker of a block size the router cannot split
// into its own, whose blocks are left out (FORMAT.md §9.1).
func (a *Actor) badSize(bs int) {
	a.stats.Filtered[BlockSizeMismatch].Add(1)
	if !a.m.sizeWarned {
		a.m.sizeWarned = true
		a.cfg.Logger.Warn("kvpipe/actor: block size cannot be split into the router's (not a multiple, or not the multiple split before); its blocks are not indexed",
			"worker", a.cfg.Name, "configured", a.cfg.BlockSize, "received", bs, "split", a.m.splitK)
	}
}
