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

// Reason is why an event was filtered out rather than indexed.
type Reason uint8

const (
	PartialBlock      Reason = iota // a block smaller than the router's, after this worker sent full ones
	NonMainAttention                // a sliding-window, Mamba, ... group
	UnlearnedGroup                  // a nonzero group_idx whose kind was never published
	LowerTier                       // a tier the router does not index (weighted 0)
	UnknownMedium                   // a medium this version does not know
	UnknownEvent                    // a tag this version does not know
	BlockSizeMismatch               // a block size the router cannot split into its own
	UnreadableEvent                 // an event the decoder could not read (a field of the wrong type, ...)
	NumReasons
)

var reasonNames = [NumReasons]string{"partial_block", "non_main_attention", "unlearned_group", "lower_tier", "unknown_medium", "unknown_event", "block_size",
	"unreadable_event"}

func (r Reason) String() string { return reasonNames[r] }

// Backpressure says what the actor does when its shard is behind.
type Backpressure uint8

const (
	// Block waits for the shard, and so stops reading the socket: the loss,
	// if any, then shows upstream as a seq gap, which wire recovers.
	Block Backpressure = iota
	// Drop discards the batch's ops, counts them, and resyncs the worker in
	// the index (its entries cleared) with the next batch that gets through.
	Drop
)

// Config configures the actor of one worker.
type Config struct {
	Worker    index.WorkerID
	Name      string // for logs
	BlockSize int    // the router's block size, e.g. 16
	// Shard is the worker's shard queue (shared with the shard's other
	// workers). Its capacity bounds the actor's batches in flight: the actor
	// makes batches as needed, up to that many and two more (one being
	// applied, one being filled), and reuses them once applied.
	Shard        chan<- *index.Batch
	Backpressure Backpressure
	// Weights are the router's tier weights (index.Score.Weighted); a tier
	// weighted 0 is not indexed, its events filtered as LowerTier. The zero
	// value means index.DefaultWeights.
	Weights index.Weights
	// Done, when closed, abandons a send the shard is not taking: the worker
	// is stopping, and its entries go with it.
	Done   <-chan struct{}
	Logger *slog.Logger
	// Publish, when set, sees every batch of ops before the shard does, in
	// the actor's goroutine, and returns the position it reached (a relay's
	// stream sequence), which the actor keeps for its snapshot. The ops are
	// only valid during the call.
	Publish func(ops []index.Op, o Origin) uint64
	// Eagle: the engine runs EAGLE-family speculative decoding (SGLang's
	// bigram keys), known before its first event. Without it the mode is
	// learned from the events (Stats.Eagle); either way events decide.
	Eagle bool
}

// Origin says where a batch of ops came from, for Config.Publish.
type Origin struct {
	// Batch: the ops come from the engine batch Seq, whose payload has
	// Fingerprint; Part counts the batches of ops it made (0 first). Else
	// they come from a reset, a recovery, an engine's snapshot or a start
	// afresh. (What an imported snapshot puts back is not published: the
	// stream has it.)
	Batch       bool
	Seq         uint64
	Fingerprint uint64
	Part        int
	Partial     bool // the worker's Stats().Partial once the ops are applied
	// Whole: the ops are a part of the worker's whole state, a clear first,
	// as Republish makes it.
	Whole bool
}

// Stats is a snapshot of what one actor did.
type Stats struct {
	Batches, DecodeErrors        uint64
	Stored, Removed, Cleared     uint64 // events by type, as received
	Filtered                     [NumReasons]uint64
	BlocksStored, BlocksRemoved  uint64 // router blocks sent to the index
	TokenMismatch, UnknownParent uint64
	UnknownRemove, SizeWarnings  uint64
	Resyncs, DroppedBatches      uint64
	IndexedBlocks                int64                 // router blocks this worker holds on device in the index
	TierBlocks                   [index.NumTiers]int64 // router blocks held per tier; [TierDevice] is IndexedBlocks
	// Partial: the index may lack blocks the engine holds, because the
	// stream since the start or the last reset did not begin from an empty
	// cache (seq 0 of an incarnation, or an AllBlocksCleared). Add ORs it.
	Partial bool
	// SnapshotBlocks are blocks an engine snapshot put back into the index;
	// SnapshotUnmapped the ones it named that this worker never told of
	// (no tokens in a snapshot: their keys cannot be computed).
	SnapshotBlocks, SnapshotUnmapped uint64
	// Eagle: the worker's blocks are keyed over EAGLE windows (its last
	// BlockStored with tokens sent bigrams, or Config.Eagle before any), so
	// a request is matched against it with index.Hasher.EagleKeys.
	Eagle bool
}

// Add adds o's counts to s, as when summing workers.
func (s *Stats) Add(o Stats) {
	s.Batches += o.Batches
	s.DecodeErrors += o.DecodeErrors
	s.Stored += o.Stored
	s.Removed += o.Removed
	s.Cleared += o.Cleared
	for i := range s.Filtered {
		s.Filtered[i] += o.Filtered[i]
	}
	s.BlocksStored += o.BlocksStored
	s.BlocksRemoved += o.BlocksRemoved
	s.TokenMismatch += o.TokenMismatch
	s.UnknownParent += o.UnknownParent
	s.UnknownRemove += o.UnknownRemove
	s.SizeWarnings += o.SizeWarnings
	s.Resyncs += o.Resyncs
	s.DroppedBatches += o.DroppedBatches
	s.IndexedBlocks += o.IndexedBlocks
	for i := range s.TierBlocks {
		s.TierBlocks[i] += o.TierBlocks[i]
	}
	s.Partial = s.Partial || o.Partial
	s.SnapshotBlocks += o.SnapshotBlocks
	s.SnapshotUnmapped += o.SnapshotUnmapped
	s.Eagle = s.Eagle || o.Eagle
}

// counters are the live Stats: written by the actor's goroutine, read by
// Stats from any goroutine.
type counters struct {
	Batches, DecodeErrors            atomic.Uint64
	Stored, Removed, Cleared         atomic.Uint64
	Filtered                         [NumReasons]atomic.Uint64
	BlocksStored, BlocksRemoved      atomic.Uint64
	TokenMismatch, UnknownParent     atomic.Uint64
	UnknownRemove, SizeWarnings      atomic.Uint64
	Resyncs, DroppedBatches          atomic.Uint64
	TierBlocks                       [index.NumTiers]atomic.Int64
	Partial                          atomic.Bool
	SnapshotBlocks, SnapshotUnmapped atomic.Uint64
	Eagle                            atomic.Bool
}

func (c *counters) load() Stats {
	st := Stats{
		Batches: c.Batches.Load(), DecodeErrors: c.DecodeErrors.Load(),
		Stored: c.Stored.Load(), Removed: c.Removed.Load(), Cleared: c.Cleared.Load(),
		BlocksStored: c.BlocksStored.Load(), BlocksRemoved: c.BlocksRemoved.Load(),
		TokenMismatch: c.TokenMismatch.Load(), UnknownParent: c.UnknownParent.Load(),
		UnknownRemove: c.UnknownRemove.Load(), SizeWarnings: c.SizeWarnings.Load(),
		Resyncs: c.Resyncs.Load(), DroppedBatches: c.DroppedBatches.Load(),
		Partial:        c.Partial.Load(),
		SnapshotBlocks: c.SnapshotBlocks.Load(), SnapshotUnmapped: c.SnapshotUnmapped.Load(),
		Eagle: c.Eagle.Load(),
	}
	for i := range c.Filtered {
		st.Filtered[i] = c.Filtered[i].Load()
	}
	for i := range c.TierBlocks {
		st.TierBlocks[i] = c.TierBlocks[i].Load()
	}
	st.IndexedBlocks = st.TierBlocks[index.TierDevice]
	return st
}

// block is what the actor knows of one engine block.
type block struct {
	key    uint64 // the router's key (of its last router block, when split)
	parent uint64 // the engine's hash of its parent
	gen    uint32 // the generation tiers was set in
	// split >= 0: the slot of its first router keys in splitKeys, for an
	// engine block of several router blocks.
	split     int32
	hasParent bool
	tiers     uint8 // the tiers the index holds it in, as of gen
	// restored: the tiers a snapshot says it is in, indexed once the
	// snapshot's position is proven (Actor.pending).
	restored uint8
}

// held returns the tiers the index holds b in now.
func (b block) held(gen uint32) uint8 {
	if b.gen != gen {
		return 0
	}
	return b.tiers
}

func bit(t index.Tier) uint8 { return 1 << t }

// maxKept bounds the blocks a resync keeps mapped: a mapping this large
// after losses holds many blocks the engine evicted unseen, so it is dropped.
const maxKept = 1 << 21

// Actor normalises one worker's events and sends them to its shard. It is a
// wire.Handler: its state is owned by the goroutine running the worker's
// Subscriber, and needs no lock.
type Actor struct {
	cfg     Config
	stats   counters
	decoder *codec.Decoder
	batch   codec.Batch
	hasher  index.Hasher
	free    chan *index.Batch // batches the shard handed back
	out     *index.Batch      // being filled; nil until the first op
	resync  bool              // a dropped batch left the index behind: clear first
	fresh   bool              // no batch since the start or the last reset

	// routerOf maps the engine's block hash to the router's, for chaining
	// parents and for removes. It survives a resync within one engine
	// incarnation (engine hashes are content hashes), so that blocks under a
	// prefix the engine still holds keep their true keys.
	routerOf map[uint64]block
	// gen counts the worker's index clears; a block is in the index only if
	// it was stored in the current generation.
	gen uint32
	// fullSeen: this worker published a block of the router's size that
	// passed group filtering.
	fullSeen bool
	// mainGroup: what each group_idx was learned to be.
	mainGroup map[int]bool
	// usedTiers: the tiers this worker stored blocks in since its entries
	// were last cleared whole.
	usedTiers uint8
	// sizeWarned: a block size the router cannot split was warned about.
	sizeWarned bool
	// An engine block of splitK router blocks (splitK > 1) keeps its last
	// router key; its first splitK-1 live in a slot of splitKeys, reused
	// through freeSlots.
	splitK    int
	splitKeys []uint64
	freeSlots []int32
	keys      []uint64 // scratch: one engine block's router keys
	warn      pace.Limiter

	snapBlocks []codec.SnapshotBlock // reused across chunks
	snapWhole  bool                  // the snapshot being applied mapped every block so far

	origin    Origin // of the ops being made, for Config.Publish
	streamSeq uint64 // what Config.Publish last returned
	restoring bool   // Import: its ops are not published
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
	if cfg.Done == nil {
		cfg.Done = make(chan struct{}) // never closed
	}
	if cfg.Weights == (index.Weights{}) {
		cfg.Weights = index.DefaultWeights
	}
	a := &Actor{cfg: cfg, decoder: codec.NewDecoder(), free: make(chan *index.Batch, cap(cfg.Shard)+2), warn: pace.Limiter{Every: time.Second},
		routerOf: make(map[uint64]block), mainGroup: make(map[int]bool)}
	a.fresh = true
	a.stats.Partial.Store(true)
	a.stats.Eagle.Store(cfg.Eagle)
	return a
}

// Stats returns a snapshot of the actor's counters; any goroutine may call it.
func (a *Actor) Stats() Stats { return a.stats.load() }

// Partial reports Stats().Partial without reading the other counters, for
// the read path.
func (a *Actor) Partial() bool { return a.stats.Partial.Load() }

// Eagle reports Stats().Eagle, for the read path: which keys to match the
// worker with.
func (a *Actor) Eagle() bool { return a.stats.Eagle.Load() }

var (
	_ wire.SnapshotHandler = (*Actor)(nil)
	_ wire.ResumeHandler   = (*Actor)(nil)
)

// HandleBatch decodes one batch, filters and converts its events, and sends
// the resulting ops to the shard.
func (a *Actor) HandleBatch(seq uint64, payload []byte) {
	a.stats.Batches.Add(1)
	a.origin = Origin{Batch: true, Seq: seq}
	if a.cfg.Publish != nil {
		a.origin.Fingerprint = wire.Fingerprint(payload)
	}
	defer a.unsourced()
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
		a.warnf("batch dropped: bad payload", "seq", seq, "err", err)
		return
	}
	if a.batch.Skipped > 0 {
		a.stats.Filtered[UnknownEvent].Add(uint64(a.batch.Skipped))
	}
	if n := len(a.batch.Invalid); n > 0 { // the batch's other events still count
		a.stats.Filtered[UnreadableEvent].Add(uint64(n))
		a.warnf("unreadable events left out", "seq", seq, "count", n, "first", a.batch.Invalid[0])
	}
	for i := range a.batch.Events {
		a.apply(&a.batch.Events[i])
	}
	a.flush()
}

// HandleReset: history is unknown, so the worker's entries may be stale and
// are cleared. Within one engine incarnation the block mapping is kept: a
// block stored later under a still-cached prefix gets its true key, and
// brings that prefix back into the index.
func (a *Actor) HandleReset(reason wire.ResetReason) {
	a.stats.Resyncs.Add(1)
	a.cfg.Logger.Info("kvpipe/actor: resync", "worker", a.cfg.Name, "reason", reason.String())
	if reason.SameIncarnation() {
		a.unindex()
	} else {
		a.clear()
	}
	a.fresh = true
	a.stats.Partial.Store(true)
	a.flush()
}

// Recover starts the worker afresh after a panic in its goroutine, whatever
// state the panic left: the partial batch is discarded and the worker's
// entries are cleared in its shard. Counters are kept.
func (a *Actor) Recover() {
	if a.out != nil {
		a.out.Ops = a.out.Ops[:0]
	}
	clear(a.mainGroup)
	a.stats.Resyncs.Add(1)
	a.stats.Partial.Store(true)
	a.clear()
	a.flush()
}

// HandleSnapshotBegin starts rebuilding the worker from its engine's
// snapshot: its entries go, what is known of its blocks stays.
func (a *Actor) HandleSnapshotBegin() {
	a.unindex()
	a.snapWhole = true
	a.flush()
}

// HandleSnapshot puts the blocks of one snapshot chunk back into the index,
// under the keys learned from their BlockStored events.
func (a *Actor) HandleSnapshot(chunk []byte) {
	var err error
	if a.snapBlocks, err = a.decoder.DecodeSnapshotChunk(chunk, a.snapBlocks); err != nil {
		a.stats.DecodeErrors.Add(1)
		a.snapWhole = false
		a.warnf("snapshot chunk dropped: bad payload", "err", err)
		return
	}
	for i := range a.snapBlocks {
		for _, ext := range a.snapBlocks[i].Hashes {
			b, ok := a.routerOf[ext]
			if !ok {
				a.stats.SnapshotUnmapped.Add(1)
				a.snapWhole = false
				continue
			}
			if a.hold(ext, b, index.TierDevice) {
				a.stats.SnapshotBlocks.Add(1)
			}
		}
	}
	a.flush()
}

// HandleSnapshotEnd: a whole snapshot, every block mapped, makes the worker
// complete; a broken one leaves nothing of itself.
func (a *Actor) HandleSnapshotEnd(ok bool) {
	if !ok {
		a.unindex()
	} else if a.snapWhole {
		a.stats.Partial.Store(false)
	}
	a.flush()
}

func (a *Actor) apply(e *codec.Event) {
	switch e.Type {
	case codec.BlockStored:
		a.stats.Stored.Add(1)
		a.store(e)
	case codec.BlockRemoved:
		a.stats.Removed.Add(1)
		if r, ok := a.filter(e); !ok {
			a.stats.Filtered[r].Add(1)
			return
		}
		t := tierOf(e.Medium)
		for _, ext := range e.BlockHashes {
			b, ok := a.routerOf[ext]
			if !ok {
				a.stats.UnknownRemove.Add(1)
				continue
			}
			a.room(a.keysOf(b))
			if b.gen != a.gen {
				// Kept through a resync, its tiers unknown: gone from the
				// device, it is forgotten as before tiers; gone from another
				// tier, the device may still hold it.
				if t == index.TierDevice {
					a.forget(ext, b)
				}
				continue
			}
			if b.tiers&bit(t) != 0 {
				a.emitKeys(index.OpRemove, t, b, index.LinkNone, 0)
			}
			if b.tiers &^= bit(t); b.tiers == 0 {
				a.forget(ext, b)
			} else {
				a.routerOf[ext] = b // still held in another tier
			}
		}
	case codec.AllBlocksCleared:
		a.stats.Cleared.Add(1)
		if r, ok := a.mediumOK(e.Medium); !ok {
			a.stats.Filtered[r].Add(1)
			return
		}
		// No medium: the engine's whole cache. A device clear of a worker
		// that never told of other tiers: the same. Either way the cache is
		// empty, so nothing is missing now.
		if t := tierOf(e.Medium); e.Medium == "" || t == index.TierDevice && a.usedTiers&^bit(t) == 0 {
			a.clear()
			a.stats.Partial.Store(false)
		} else {
			a.clearTier(t) // the worker's other tiers keep their blocks
		}
	}
}

// clear forgets every block of the worker and its full-block history: an
// engine that comes back with another block size must warn again.
func (a *Actor) clear() {
	clear(a.routerOf)
	a.usedTiers = 0
	a.splitK, a.splitKeys, a.freeSlots = 0, a.splitKeys[:0], a.freeSlots[:0]
	a.sizeWarned = false
	a.unindex()
}

// clearTier empties one tier of the worker, in the index and in the
// mapping, and keeps what its other tiers hold. It walks the mapping, but
// only for an engine that clears one tier of several.
func (a *Actor) clearTier(t index.Tier) {
	a.room(1)
	for ext, b := range a.routerOf {
		if b.gen != a.gen || b.tiers&bit(t) == 0 {
			continue // not in the tier (or kept through a resync, tiers unknown)
		}
		if b.tiers &^= bit(t); b.tiers == 0 {
			a.forget(ext, b)
		} else {
			a.routerOf[ext] = b
		}
	}
	a.usedTiers &^= bit(t)
	if t == index.TierDevice {
		a.fullSeen = false
	}
	a.emit(index.Op{Kind: index.OpClearTier, Tier: t})
}

// forget drops ext from the mapping, and its split keys' slot.
func (a *Actor) forget(ext uint64, b block) {
	delete(a.routerOf, ext)
	if b.split >= 0 {
		a.freeSlots = append(a.freeSlots, b.split)
	}
}

// unindex clears the worker in the index but keeps the block mapping: its
// entries become known but not indexed. The tiers it used are kept: the
// engine may still hold blocks in them.
func (a *Actor) unindex() {
	a.pending = false // a reset before the proof: the snapshot is not the engine's
	a.room(1)
	if len(a.routerOf) > maxKept {
		a.routerOf = make(map[uint64]block) // not clear: give its peak memory back
		a.splitK, a.splitKeys, a.freeSlots = 0, nil, nil
	}
	a.gen++
	a.fullSeen = false
	a.emit(index.Op{Kind: index.OpClearWorker})
}

func (a *Actor) store(e *codec.Event) {
	k, ok := a.admit(e)
	if !ok {
		return
	}
	t := tierOf(e.Medium)
	a.usedTiers |= bit(t)
	if len(e.TokenIDs) == 0 {
		a.retier(e, t)
		return
	}
	a.stats.Eagle.Store(e.Bigram) // the engine's mode, as its latest tokens show it
	n := len(e.BlockHashes)
	if whole := wholeBlocks(e); whole < n {
		a.stats.TokenMismatch.Add(1)
		n = whole
	}
	parent, hasParent := uint64(0), false
	if e.HasParent {
		p, ok := a.routerOf[e.ParentHash]
		if !ok {
			// Its key chains through blocks this worker never told us of
			// (history lost, or the router joined late): no prompt could
			// hash to a key made up here, so the blocks stay out.
			a.stats.UnknownParent.Add(1)
			return
		}
		if t == index.TierDevice {
			// The engine built on the parent on device, so it holds the
			// parent's prefix there.
			a.reindex(e.ParentHash)
		}
		parent, hasParent = p.key, true
	}
	a.storeBlocks(e, n, k, t, parent, hasParent)
}

// wholeBlocks is how many blocks e's tokens cover: block i is tokens
// [i·size, (i+1)·size), and one more token for a bigram event, whose key
// is hashed over an EAGLE window (index.Hasher.EagleKeys).
func wholeBlocks(e *codec.Event) int {
	if e.Bigram {
		return (len(e.TokenIDs) - 1) / e.BlockSize
	}
	return len(e.TokenIDs) / e.BlockSize
}

// admit applies the partial-tail, group, medium and size rules to a
// BlockStored (docs/FORMAT.md §9.1) and returns the router blocks per
// engine block, or false when the event is left out.
func (a *Actor) admit(e *codec.Event) (int, bool) {
	size, bs := a.cfg.BlockSize, e.BlockSize
	if a.fullSeen && bs < size {
		a.stats.Filtered[PartialBlock].Add(1)
		if a.cfg.Logger.Enabled(context.Background(), slog.LevelDebug) { // normal with vLLM: skip the boxing otherwise
			a.cfg.Logger.Debug("kvpipe/actor: partial tail block dropped", "worker", a.cfg.Name, "block_size", bs)
		}
		return 0, false
	}
	if r, ok := a.filter(e); !ok {
		a.stats.Filtered[r].Add(1)
		return 0, false
	}
	switch {
	case bs == size:
		a.fullSeen = true
		return 1, true
	case bs > size && bs%size == 0:
		k := bs / size
		if a.splitK == 0 {
			a.splitK = k
		} else if k != a.splitK { // the engine changed its block size without a clear
			a.badSize(bs)
			return 0, false
		}
		a.fullSeen = true
		return k, true
	case bs <= 0:
		a.stats.TokenMismatch.Add(1)
		return 0, false
	case bs < size:
		// Before any full block: a misconfiguration, converted at its own
		// size so that it shows (FORMAT.md §9.1).
		a.stats.SizeWarnings.Add(1)
		a.warnf("block size differs from the router's", "configured", size, "received", bs)
		return 1, true
	}
	a.badSize(bs)
	return 0, false
}

// storeBlocks keys e's first n engine blocks, k router blocks each, under
// parent, and stores them in tier t. A root's key takes the event's
// namespace (adapter and salt), each block its extra-key digest.
func (a *Actor) storeBlocks(e *codec.Event, n, k int, t index.Tier, parent uint64, hasParent bool) {
	var ns uint64
	if !hasParent {
		ns = index.Namespace(e.LoraName, e.LoraID, e.HasLoraID, e.CacheSalt)
	}
	bs, over := e.BlockSize, 0
	if e.Bigram {
		over = 1 // an EAGLE window runs one token past its block
	}
	unit := bs / k
	ext, extParent := e.ParentHash, e.HasParent
	for i := range n {
		link, linkParent := chainLink(hasParent), parent // of the block's first router key
		var extra uint64
		if i < len(e.BlockExtra) {
			extra = e.BlockExtra[i]
		}
		toks := e.TokenIDs[i*bs : (i+1)*bs+over]
		a.keys = a.keys[:0]
		for j := range k {
			parent = a.hasher.Key(parent, hasParent, ns, extra, toks[j*unit:(j+1)*unit+over])
			hasParent = true
			a.keys = append(a.keys, parent)
		}
		h := e.BlockHashes[i]
		a.place(h, block{key: parent, parent: ext, hasParent: extParent, gen: a.gen, tiers: bit(t), split: -1}, k, t, link, linkParent)
		ext, extParent = h, true
	}
}

// place maps engine block h to b, whose router keys are a.keys, and stores
// it in tier t, its first key with link and parent (index.Op.Link): held
// already under the same key, it is only added to t; under another key
// (other tokens or another parent), its old keys leave every tier first.
func (a *Actor) place(h uint64, b block, k int, t index.Tier, link index.Link, parent uint64) {
	old, known := a.routerOf[h]
	if known && old.key == b.key {
		a.hold(h, old, t) // stored again: in the index already, unless in another tier
		return
	}
	if known {
		a.room(a.keysOf(old)*index.NumTiers + k)
		for ot := range index.Tier(index.NumTiers) {
			if old.held(a.gen)&bit(ot) != 0 {
				a.emitKeys(index.OpRemove, ot, old, index.LinkNone, 0)
			}
		}
		a.forget(h, old)
	} else {
		a.room(k)
	}
	b.gen = a.gen // room may have flushed, and a dropped flush starts a generation
	if k > 1 {
		b.split = a.slot(a.keys[:k-1])
	}
	a.routerOf[h] = b
	a.emitKeys(index.OpStore, t, b, link, parent)
}

// retier handles a BlockStored without tokens (vLLM's offloading connector
// names the blocks it copied to another tier by hash alone): blocks this
// worker told of go into the tier under their keys; others cannot be keyed.
func (a *Actor) retier(e *codec.Event, t index.Tier) {
	for _, h := range e.BlockHashes {
		b, ok := a.routerOf[h]
		if !ok {
			a.stats.TokenMismatch.Add(1)
			continue
		}
		a.hold(h, b, t)
	}
}

// badSize warns once per worker of a block size the router cannot split
// into its own, whose blocks are left out (FORMAT.md §9.1).
func (a *Actor) badSize(bs int) {
	a.stats.Filtered[BlockSizeMismatch].Add(1)
	if !a.sizeWarned {
		a.sizeWarned = true
		a.cfg.Logger.Warn("kvpipe/actor: block size cannot be split into the router's (not a multiple, or not the multiple split before); its blocks are not indexed",
			"worker", a.cfg.Name, "configured", a.cfg.BlockSize, "received", bs, "split", a.splitK)
	}
}

// slot stores the first router keys of a split engine block and returns
// their slot.
func (a *Actor) slot(keys []uint64) int32 {
	if n := len(a.freeSlots); n > 0 {
		s := a.freeSlots[n-1]
		a.freeSlots = a.freeSlots[:n-1]
		copy(a.splitKeys[int(s)*len(keys):], keys)
		return s
	}
	a.splitKeys = append(a.splitKeys, keys...)
	return int32(len(a.splitKeys)/len(keys) - 1)
}

// hold puts the known block h in tier t of the index, unless it is there,
// and reports whether it did.
func (a *Actor) hold(h uint64, b block, t index.Tier) bool {
	a.room(a.keysOf(b))
	held := b.held(a.gen)
	if held&bit(t) != 0 {
		return false
	}
	b.gen, b.tiers = a.gen, held|bit(t)
	a.routerOf[h] = b
	a.usedTiers |= bit(t)
	link, parent := index.LinkNone, uint64(0)
	if t == index.TierDevice {
		link, parent = linkOf(a.routerOf, b)
	}
	a.emitKeys(index.OpStore, t, b, link, parent)
	return true
}

// keysOf is the number of router keys of b.
func (a *Actor) keysOf(b block) int {
	if b.split >= 0 {
		return a.splitK
	}
	return 1
}

// emitKeys sends one op for each router key of b, first to last, the first
// with link and parent (index.Op.Link), each after it chained from the one
// before.
func (a *Actor) emitKeys(kind index.OpKind, t index.Tier, b block, link index.Link, parent uint64) {
	if b.split >= 0 {
		n := a.splitK - 1
		for _, k := range a.splitKeys[int(b.split)*n : int(b.split+1)*n] {
			a.emit(index.Op{Kind: kind, Tier: t, Hash: k, Link: link, Parent: parent})
			link, parent = index.LinkChild, k
		}
	}
	a.emit(index.Op{Kind: kind, Tier: t, Hash: b.key, Link: link, Parent: parent})
}

// chainLink is the link of a key chained from a parent, or a root.
func chainLink(hasParent bool) index.Link {
	if hasParent {
		return index.LinkChild
	}
	return index.LinkRoot
}

// linkOf is the link of b's first router key: its engine parent's last
// router key, as far as the mapping knows it.
func linkOf(routerOf map[uint64]block, b block) (index.Link, uint64) {
	if !b.hasParent {
		return index.LinkRoot, 0
	}
	if p, ok := routerOf[b.parent]; ok { // else forgotten: unknown
		return index.LinkChild, p.key
	}
	return index.LinkNone, 0
}

// reindex puts the block ext and its ancestors back on device where an
// earlier clear or eviction took them out.
func (a *Actor) reindex(ext uint64) {
	for {
		b, ok := a.routerOf[ext]
		if !ok || !a.hold(ext, b, index.TierDevice) {
			return
		}
		if !b.hasParent {
			return
		}
		ext = b.parent
	}
}

// filter applies the group and medium rules (docs/FORMAT.md §9.2 and §9.3), learning
// each group's kind from events that carry both.
func (a *Actor) filter(e *codec.Event) (Reason, bool) {
	if e.SpecKind != "" {
		main := codec.IsMainAttention(e.SpecKind)
		if e.HasGroupIdx && e.Type == codec.BlockStored {
			a.mainGroup[e.GroupIdx] = main
		}
		if !main {
			return NonMainAttention, false
		}
	} else if e.HasGroupIdx {
		main, learned := a.mainGroup[e.GroupIdx]
		switch {
		case learned && !main:
			return NonMainAttention, false
		case !learned && e.GroupIdx != 0:
			return UnlearnedGroup, false
		}
	}
	return a.mediumOK(e.Medium)
}

func (a *Actor) mediumOK(medium string) (Reason, bool) {
	t := codec.MediumTier(medium)
	if t == codec.TierUnknown {
		return UnknownMedium, false
	}
	if a.cfg.Weights[tierOf(medium)] == 0 {
		return LowerTier, false
	}
	return 0, true
}

// tierOf maps a medium that mediumOK passed to its index tier.
func tierOf(medium string) index.Tier {
	switch codec.MediumTier(medium) {
	case codec.TierHost:
		return index.TierHost
	case codec.TierDisk:
		return index.TierDisk
	case codec.TierRemote:
		return index.TierRemote
	}
	return index.TierDevice
}

// maxOps caps the ops of one index batch, so that a batch's memory is
// bounded (the bound Config.ShardQueue documents) and a huge event (a whole
// long prompt) is applied in parts rather than holding its shard at once.
const maxOps = 256

// room flushes the batch being filled unless it has room for n more ops.
// Every change of the mapping asks for its ops' room before it reads the
// generation, and only room flushes: a flush that drops the batch starts a
// new generation, which must not fall between a block's ops and its
// mapping, or the index would keep keys the mapping says are out.
func (a *Actor) room(n int) {
	if a.out != nil && len(a.out.Ops)+n > maxOps {
		a.flush()
	}
}

func (a *Actor) emit(op index.Op) {
	kind, t := op.Kind, op.Tier
	if a.out == nil {
		a.out = a.take()
	}
	switch kind {
	case index.OpStore:
		a.stats.BlocksStored.Add(1)
		a.stats.TierBlocks[t].Add(1)
	case index.OpRemove:
		a.stats.BlocksRemoved.Add(1)
		a.stats.TierBlocks[t].Add(-1)
	case index.OpClearWorker:
		a.zeroHeld()
	case index.OpClearTier:
		a.stats.TierBlocks[t].Store(0)
	}
	a.out.Ops = append(a.out.Ops, op)
}

func (a *Actor) zeroHeld() {
	for i := range a.stats.TierBlocks {
		a.stats.TierBlocks[i].Store(0)
	}
}

// take returns a batch to fill: a free one, or else a new one. At most
// cap(free) ever exist: when take runs, none is being filled, at most
// cap(Shard) are queued and one is being applied, and every other one is
// in free (flush and drop put back what they do not send, and the shard
// returns what it applied), so a new one is made only while fewer exist,
// and the shard's hand-back into free never blocks.
func (a *Actor) take() *index.Batch {
	select {
	case b := <-a.free:
		return b
	default:
		return &index.Batch{Worker: a.cfg.Worker, Return: a.free}
	}
}

func (a *Actor) flush() {
	b := a.out
	if b == nil {
		return
	}
	a.out = nil
	if a.resync {
		// Entries were lost with a dropped batch: start the worker afresh.
		b.Ops = append(b.Ops, index.Op{})
		copy(b.Ops[1:], b.Ops)
		b.Ops[0] = index.Op{Kind: index.OpClearWorker}
		a.resync = false
	}
	if a.cfg.Publish != nil && !a.restoring {
		a.origin.Partial = a.stats.Partial.Load()
		a.streamSeq = a.cfg.Publish(b.Ops, a.origin)
		a.origin.Part++
	}
	select { // a shard with room takes the batch, even from a stopping worker
	case a.cfg.Shard <- b:
		return
	default:
	}
	if a.cfg.Backpressure == Block {
		select {
		case a.cfg.Shard <- b:
			return
		case <-a.cfg.Done:
		}
	}
	a.drop(b)
}

// drop discards b's ops: the index has lost them, so the worker is resynced
// (its entries cleared) with the next batch that gets through.
func (a *Actor) drop(b *index.Batch) {
	select {
	case <-a.cfg.Done: // stopping: not an overload
	default:
		a.stats.DroppedBatches.Add(1)
	}
	a.resync = true
	a.gen++ // the mapping stays true: the engine is the same
	a.fullSeen = false
	a.zeroHeld()
	a.stats.Partial.Store(true)
	b.Ops = b.Ops[:0]
	a.free <- b
}

// unsourced marks the ops that follow as not from an engine batch, until
// the next one.
func (a *Actor) unsourced() { a.origin = Origin{} }

func (a *Actor) warnf(msg string, args ...any) {
	if n, ok := a.warn.Allow(time.Now()); ok {
		if n > 0 {
			args = append(args, "suppressed", n)
		}
		a.cfg.Logger.Warn("kvpipe/actor: "+msg, append(args, "worker", a.cfg.Name)...)
	}
}
