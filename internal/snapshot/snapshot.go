package snapshot

//go:generate go run github.com/tinylib/msgp@v1.6.5 -file=snapshot.go -o=snapshot_gen.go -tests=false -io=false

// Version is the newest format version this package reads and writes.
// Append writes the oldest version that says what a snapshot holds
// (minVersion), so that older builds load what they can understand, and
// Decode refuses any version newer than Version: a newer kvpipe's
// snapshot is not loaded half-understood.
//
//   - 1: the first format.
//   - 2: a worker may be Absent. A build that reads version 1 alone would
//     take an absent worker for one holding no blocks, so a snapshot with
//     an absent worker is version 2 (a version-1 file with an absent
//     worker, as builds of 2026-12-05 and 06 wrote, still loads).
//   - 3: a worker may be Eagle (its keys are EAGLE windows'). A build that
//     reads up to version 2 would match it with plain keys, so a snapshot
//     with an EAGLE worker is version 3.
//   - 4: a worker may be Rekeyed. A build that reads up to version 3 would
//     link its blocks to their parents' keys, which some of them were not
//     hashed from, so a snapshot with a rekeyed worker is version 4.
const Version = 4

// minVersion is the oldest version whose readers understand s.
func (s *Snapshot) minVersion() int {
	v := 1
	for i := range s.Workers {
		w := &s.Workers[i]
		switch {
		case w.Rekeyed:
			return 4
		case w.Eagle:
			v = 3
		case w.Absent:
			v = max(v, 2)
		}
	}
	return v
}

// Snapshot is a Pipeline's index and, per worker, what it needs to go on
// from it: the last engine batch applied with its fingerprint, and the
// worker's block mapping, from which its index entries are rebuilt.
type Snapshot struct {
	Version   int `msg:"version"`
	BlockSize int `msg:"block_size"` // the router's: a snapshot of another size is refused
	// KeySeed is the seed of the router keys it holds (index.Seed): keys
	// hashed otherwise would never match, so a snapshot of another seed is
	// refused.
	KeySeed uint64   `msg:"key_seed"`
	Created int64    `msg:"created"` // unix nanoseconds
	Workers []Worker `msg:"workers"`
}

// Flags of one block (Worker.Flags).
const (
	FlagParent uint8 = 1 << 0 // Parents holds its parent's engine hash
	FlagSplit  uint8 = 1 << 1 // an engine block of SplitK router blocks: its first SplitK-1 keys are in Split
	// TierShift: bits 2-5 are the index tiers holding the block (bit 2+t for
	// tier t); none means known but not indexed (kept through a resync).
	TierShift = 2
)

// Worker is one worker's state. Its blocks are columns: block i is the
// engine hash Hashes[i], with router key Keys[i], parent Parents[i] (when
// Flags[i]&FlagParent) and Flags[i].
type Worker struct {
	// Name is bytes, not a string, so that a reused Snapshot decodes
	// without allocating.
	Name []byte `msg:"name"`
	// Absent: the worker's state could not be taken in time (it was in a
	// replay, a restart, or too slow); the entry holds its name alone, and
	// a restore starts it afresh. Without the entry, a reader could not
	// tell a worker left out from one that did not exist.
	Absent bool `msg:"absent"`
	// HasSeq: Seq is the last engine batch applied and Fingerprint its
	// fingerprint (the xxh3 of its payload); a restored worker proves continuity from them.
	HasSeq      bool   `msg:"has_seq"`
	Seq         uint64 `msg:"seq"`
	Fingerprint uint64 `msg:"fingerprint"`
	// StreamSeq is the last JetStream message of this worker's ops the
	// snapshot covers (a relay's); 0 when none.
	StreamSeq uint64 `msg:"stream_seq"`
	Partial   bool   `msg:"partial"`   // the entries may lack blocks the engine holds
	FullSeen  bool   `msg:"full_seen"` // a full-size block was seen: smaller ones are partial tails
	SplitK    int    `msg:"split_k"`   // router blocks per engine block once split; 0 before
	// Eagle: the engine's blocks are keyed over EAGLE windows (bigram
	// tokens), as its latest stores showed; the reader matches the worker
	// with EAGLE keys.
	Eagle bool `msg:"eagle"`
	// UsedTiers: bit t is set if the worker stored blocks in tier t since
	// its entries were last cleared whole.
	UsedTiers uint8 `msg:"used_tiers"`
	// Rekeyed: a block took another router key since the worker's last
	// clear, so that its children's keys may not be hashed from their
	// parents' keys here: their stores link to none (index.Op.Link).
	Rekeyed bool `msg:"rekeyed"`
	// GroupIdx[i] was learned to be a main attention group iff GroupMain[i].
	GroupIdx  []int64 `msg:"group_idx"`
	GroupMain []bool  `msg:"group_main"`

	Hashes  []uint64 `msg:"hashes"`
	Keys    []uint64 `msg:"keys"`
	Parents []uint64 `msg:"parents"`
	Flags   []byte   `msg:"flags"` // bytes: msgp writes them as one bin, not an array
	// Split holds, for each block flagged FlagSplit in order, its first
	// SplitK-1 router keys.
	Split []uint64 `msg:"split"`
}
