package actor

import (
	"sync/atomic"

	"github.com/kvpipe/kvpipe/index"
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
	BlockCap                        // the worker holds Config.MaxBlocks blocks: its new blocks are refused
	NumReasons
)

var reasonNames = [NumReasons]string{"partial_block", "non_main_attention", "unlearned_group", "lower_tier", "unknown_medium", "unknown_event", "block_size",
	"unreadable_event", "block_cap"}

func (r Reason) String() string { return reasonNames[r] }

// Stats are what one actor did, as of one call of Stats.
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

// zeroHeld: the worker holds nothing in the index.
func (c *counters) zeroHeld() {
	for i := range c.TierBlocks {
		c.TierBlocks[i].Store(0)
	}
}
