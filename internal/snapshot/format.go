package snapshot

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"slices"

	"github.com/tinylib/msgp/msgp"
	"github.com/zeebo/xxh3"

	"github.com/kvpipe/kvpipe/index"
)

// The frame around the msgp body; Append's doc gives its layout.
const (
	magicPrefix  = "KVPSNAP"
	frameVersion = 1
	magicLen     = len(magicPrefix) + 1
	checksumLen  = 8
	frameLen     = magicLen + checksumLen // a frame's bytes besides the body
)

var (
	// ErrCorrupt: the data is not a well-formed snapshot (bad magic,
	// truncated, checksum mismatch, undecodable body, inconsistent columns).
	ErrCorrupt = errors.New("snapshot: corrupt")
	// ErrVersion: the data is a snapshot of a format version this build does
	// not read.
	ErrVersion = errors.New("snapshot: unsupported version")
)

const (
	tierMask  = (1<<index.NumTiers - 1) << TierShift
	flagsMask = FlagParent | FlagSplit | tierMask
)

// Append appends s to dst, framed:
//
//	magic    8 bytes  "KVPSNAP" and the frame version, 0x01
//	body     s's msgp map (MarshalMsg, snapshot_gen.go)
//	checksum 8 bytes  xxh3-64 of body, little-endian
//
// The frame version changes only with this layout, the body's Version
// with its meaning; Decode refuses another frame version, or a body
// version it does not read, as ErrVersion. Append writes the oldest
// version that says what s holds (see Version), whatever s.Version says,
// and leaves s as it was; it refuses a snapshot that fails Check, so that
// what it writes decodes.
func Append(dst []byte, snap *Snapshot) ([]byte, error) {
	c := *snap // the workers shared, read only
	s := &c
	s.Version = s.minVersion()
	if err := s.Check(); err != nil {
		return dst, err
	}
	// One grow up front: MarshalMsg's own would leave no room for the
	// checksum, and a second one would copy the whole body again.
	dst = slices.Grow(dst, frameLen+s.Msgsize())
	start := len(dst)
	dst = append(dst, magicPrefix...)
	dst = append(dst, frameVersion)
	dst, err := s.MarshalMsg(dst)
	if err != nil {
		return dst[:start], err
	}
	sum := xxh3.Hash(dst[start+magicLen:])
	return binary.LittleEndian.AppendUint64(dst, sum), nil
}

// Decode decodes the frame Append wrote into s, then checks it (Check).
// It reuses s's slices where their capacity allows, so decoding into the
// same Snapshot again allocates nothing once it has grown to the data's
// shape; s does not keep data. A field the data lacks decodes as its zero
// value; a key s does not know is skipped (a newer writer of the same
// Version may add some). Errors wrap ErrCorrupt or ErrVersion; after one,
// s's contents are unspecified.
func Decode(data []byte, s *Snapshot) error {
	if len(data) < frameLen {
		return fmt.Errorf("%w: truncated: %d bytes, a snapshot has at least %d", ErrCorrupt, len(data), frameLen)
	}
	if string(data[:len(magicPrefix)]) != magicPrefix {
		return fmt.Errorf("%w: bad magic %q", ErrCorrupt, data[:magicLen])
	}
	if v := data[len(magicPrefix)]; v != frameVersion {
		return fmt.Errorf("%w: frame version %d, this build reads %d", ErrVersion, v, frameVersion)
	}
	body := data[magicLen : len(data)-checksumLen]
	if xxh3.Hash(body) != binary.LittleEndian.Uint64(data[len(data)-checksumLen:]) {
		return fmt.Errorf("%w: checksum mismatch (damaged or truncated)", ErrCorrupt)
	}
	if err := preflight(body); err != nil {
		return err
	}
	s.reset()
	rest, err := s.UnmarshalMsg(body)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	if len(rest) != 0 {
		return fmt.Errorf("%w: %d trailing bytes after the body", ErrCorrupt, len(rest))
	}
	return s.Check()
}

// minWorkerLen is the fewest bytes a worker that can pass Check encodes to:
// a map header, the key "name" and a bin of at least one byte.
const minWorkerLen = 1 + 5 + 3

// preflight walks body before the generated decoder does, because that
// decoder makes each slice as long as its array header says before reading
// an element: forged headers under a valid checksum could ask for
// terabytes. Skipping every value proves each array's elements are there,
// a byte or more each, so no column outgrows 8×len(body); a Worker, a few
// hundred bytes in memory, must take the bytes a valid one does. The
// version is read first, so that a newer format is refused as such even if
// its body no longer decodes as this one.
func preflight(body []byte) error {
	n, b, err := msgp.ReadMapHeaderBytes(body)
	if err != nil {
		return fmt.Errorf("%w: body: %w", ErrCorrupt, err)
	}
	for ; n > 0; n-- {
		var key []byte
		if key, b, err = msgp.ReadMapKeyZC(b); err != nil {
			return fmt.Errorf("%w: body: %w", ErrCorrupt, err)
		}
		switch string(key) {
		case "version":
			var v int64
			if v, b, err = msgp.ReadInt64Bytes(b); err != nil {
				return fmt.Errorf("%w: version: %w", ErrCorrupt, err)
			}
			if v < 1 || v > Version {
				return versionError(v)
			}
		case "workers":
			var workers uint32
			if workers, b, err = msgp.ReadArrayHeaderBytes(b); err != nil {
				return fmt.Errorf("%w: workers: %w", ErrCorrupt, err)
			}
			if uint64(workers)*minWorkerLen > uint64(len(b)) {
				return fmt.Errorf("%w: %d workers cannot fit in %d bytes", ErrCorrupt, workers, len(b))
			}
			for i := range workers {
				if b, err = msgp.Skip(b); err != nil {
					return fmt.Errorf("%w: worker %d: %w", ErrCorrupt, i, err)
				}
			}
		default:
			if b, err = msgp.Skip(b); err != nil {
				return fmt.Errorf("%w: %q: %w", ErrCorrupt, key, err)
			}
		}
	}
	if len(b) != 0 {
		return fmt.Errorf("%w: %d trailing bytes after the body", ErrCorrupt, len(b))
	}
	return nil
}

func versionError(v int64) error {
	return fmt.Errorf("%w: version %d, this build reads 1 to %d", ErrVersion, v, Version)
}

// reset zeroes s but keeps every slice's capacity, down to the workers past
// len(s.Workers): the generated decoder reslices into them and leaves a
// field the data lacks as it was.
func (s *Snapshot) reset() {
	ws := s.Workers[:cap(s.Workers)]
	for i := range ws {
		w := &ws[i]
		*w = Worker{
			Name:      w.Name[:0],
			GroupIdx:  w.GroupIdx[:0],
			GroupMain: w.GroupMain[:0],
			Hashes:    w.Hashes[:0],
			Keys:      w.Keys[:0],
			Parents:   w.Parents[:0],
			Flags:     w.Flags[:0],
			Split:     w.Split[:0],
		}
	}
	*s = Snapshot{Workers: ws[:0]}
}

// pairwiseWorkers is the most workers Check compares pairwise.
const pairwiseWorkers = 64

// Check reports whether s is consistent: what Append requires and Decode
// verifies. Its errors wrap ErrVersion for a Version this build does not
// read (below 1 or above Version), and ErrCorrupt otherwise. It allocates
// nothing unless it fails.
func (s *Snapshot) Check() error {
	if s.Version < 1 || s.Version > Version {
		return versionError(int64(s.Version))
	}
	if s.BlockSize <= 0 {
		return fmt.Errorf("%w: block size %d", ErrCorrupt, s.BlockSize)
	}
	// Few workers are compared pairwise, which allocates nothing; many, in a
	// map, so that a crafted snapshot of a million workers costs no more
	// than its size.
	var seen map[string]int
	if len(s.Workers) > pairwiseWorkers {
		seen = make(map[string]int, len(s.Workers))
	}
	for i := range s.Workers {
		w := &s.Workers[i]
		if len(w.Name) == 0 {
			return fmt.Errorf("%w: worker %d: empty name", ErrCorrupt, i)
		}
		if seen != nil {
			if j, dup := seen[string(w.Name)]; dup {
				return fmt.Errorf("%w: worker %d (%q): same name as worker %d", ErrCorrupt, i, w.Name, j)
			}
			seen[string(w.Name)] = i
		} else {
			for j := range i {
				if bytes.Equal(s.Workers[j].Name, w.Name) {
					return fmt.Errorf("%w: worker %d (%q): same name as worker %d", ErrCorrupt, i, w.Name, j)
				}
			}
		}
		if p := w.problem(); p != "" {
			return fmt.Errorf("%w: worker %d (%q): %s", ErrCorrupt, i, w.Name, p)
		}
	}
	return nil
}

// problem says what is inconsistent in w, or "" if nothing is.
func (w *Worker) problem() string {
	n := len(w.Hashes)
	if w.Absent && (n != 0 || w.HasSeq || w.StreamSeq != 0 || len(w.GroupIdx) != 0 || len(w.Split) != 0) {
		return "absent, but holds state"
	}
	if len(w.Keys) != n {
		return fmt.Sprintf("%d hashes but %d keys", n, len(w.Keys))
	}
	if len(w.Parents) != n {
		return fmt.Sprintf("%d hashes but %d parents", n, len(w.Parents))
	}
	if len(w.Flags) != n {
		return fmt.Sprintf("%d hashes but %d flags", n, len(w.Flags))
	}
	if len(w.GroupIdx) != len(w.GroupMain) {
		return fmt.Sprintf("%d group indices but %d group_main", len(w.GroupIdx), len(w.GroupMain))
	}
	if w.UsedTiers&^(1<<index.NumTiers-1) != 0 {
		return fmt.Sprintf("used tiers %#x beyond the %d tiers", w.UsedTiers, index.NumTiers)
	}
	if w.SplitK < 0 {
		return fmt.Sprintf("split_k %d", w.SplitK)
	}
	split := 0
	for i, f := range w.Flags {
		if f&^flagsMask != 0 {
			return fmt.Sprintf("block %d: unknown flags %#x", i, f&^flagsMask)
		}
		if f&FlagSplit != 0 {
			split++
		}
	}
	switch {
	case split == 0:
		if len(w.Split) != 0 {
			return fmt.Sprintf("no split blocks but %d split keys", len(w.Split))
		}
	case w.SplitK < 2:
		return fmt.Sprintf("%d split blocks but split_k %d", split, w.SplitK)
	// Divided, not multiplied: a forged SplitK could overflow the product.
	case len(w.Split)%(w.SplitK-1) != 0 || len(w.Split)/(w.SplitK-1) != split:
		return fmt.Sprintf("%d split blocks of split_k %d need %d×%d split keys, have %d",
			split, w.SplitK, split, w.SplitK-1, len(w.Split))
	}
	return ""
}

// SetAbsent makes w the entry of worker name whose state could not be
// taken: its name alone, partial, keeping its slices' capacity for reuse.
func (w *Worker) SetAbsent(name string) {
	*w = Worker{Name: append(w.Name[:0], name...), Absent: true, Partial: true,
		GroupIdx: w.GroupIdx[:0], GroupMain: w.GroupMain[:0],
		Hashes: w.Hashes[:0], Keys: w.Keys[:0], Parents: w.Parents[:0], Flags: w.Flags[:0], Split: w.Split[:0]}
}

// Blocks is the number of engine blocks w holds.
func (w *Worker) Blocks() int { return len(w.Hashes) }

// Blocks is the number of engine blocks all of s's workers hold.
func (s *Snapshot) Blocks() int {
	n := 0
	for i := range s.Workers {
		n += s.Workers[i].Blocks()
	}
	return n
}

// AppendOps appends the ops that rebuild w's index entries to dst: for each
// block in order, for each tier it is held in (ascending), an OpStore of
// each of its router keys, first to last (its split keys, then Keys[i]).
// Stores say their links as the actor's would (index.Op.Link), in every tier: a
// block without a parent is a root; one whose parent w holds is its
// parent's last key's child, unless w is Rekeyed; any other is of unknown
// link; a split block's keys after its first are each chained from the one
// before. A block held in no tier emits nothing. w is expected to pass
// Check; one that does not yields an unspecified subset of its ops, never
// a panic. Linking costs a map of w's blocks' keys.
func (w *Worker) AppendOps(dst []index.Op) []index.Op {
	n := min(len(w.Hashes), len(w.Keys), len(w.Flags), len(w.Parents))
	var keyOf map[uint64]uint64 // engine hash -> its last router key
	if !w.Rekeyed && slices.ContainsFunc(w.Flags[:n], func(f uint8) bool { return f&FlagParent != 0 && f>>TierShift != 0 }) {
		keyOf = make(map[uint64]uint64, n)
		for j, h := range w.Hashes[:n] {
			keyOf[h] = w.Keys[j] // a repeated hash: the last one wins, as in actor.Import
		}
	}
	split := w.Split
	for i, f := range w.Flags[:n] {
		var pre []uint64 // the block's split keys, before Keys[i]
		if f&FlagSplit != 0 && w.SplitK > 1 {
			k := min(w.SplitK-1, len(split))
			pre, split = split[:k], split[k:]
		}
		for t := range index.Tier(index.NumTiers) {
			if f&(1<<(TierShift+t)) == 0 {
				continue
			}
			link, parent := w.linkOf(i, keyOf) // in every tier, as the actor links them
			for _, h := range pre {
				dst = append(dst, index.Op{Kind: index.OpStore, Tier: t, Hash: h, Link: link, Parent: parent})
				link, parent = index.LinkChild, h
			}
			dst = append(dst, index.Op{Kind: index.OpStore, Tier: t, Hash: w.Keys[i], Link: link, Parent: parent})
		}
	}
	return dst
}

// linkOf is the link of block i's first router key, keyOf mapping w's
// engine hashes to their last router keys (nil for a Rekeyed w).
func (w *Worker) linkOf(i int, keyOf map[uint64]uint64) (index.Link, uint64) {
	if w.Flags[i]&FlagParent == 0 {
		return index.LinkRoot, 0
	}
	if k, ok := keyOf[w.Parents[i]]; ok {
		return index.LinkChild, k
	}
	return index.LinkNone, 0
}

// OpCount is the number of ops AppendOps appends for w (if it passes
// Check), for sizing dst.
func (w *Worker) OpCount() int {
	n := 0
	for _, f := range w.Flags {
		keys := 1
		if f&FlagSplit != 0 && w.SplitK > 1 {
			keys = w.SplitK
		}
		n += bits.OnesCount8(f&tierMask) * keys
	}
	return n
}

// Clone returns a copy of w that shares no memory with it.
func (w *Worker) Clone() Worker {
	c := *w
	c.Name = slices.Clone(w.Name)
	c.GroupIdx, c.GroupMain = slices.Clone(w.GroupIdx), slices.Clone(w.GroupMain)
	c.Hashes, c.Keys, c.Parents = slices.Clone(w.Hashes), slices.Clone(w.Keys), slices.Clone(w.Parents)
	c.Flags, c.Split = slices.Clone(w.Flags), slices.Clone(w.Split)
	return c
}
