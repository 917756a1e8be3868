package actor

import (
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/snapshot"
)

// Export writes the actor's state into w (all but its name and stream
// position, which are the caller's), reusing w's slices: the block mapping
// with the tiers each block is indexed in, the learned groups and the
// full-block history. Call it in the actor's goroutine.
func (a *Actor) Export(w *snapshot.Worker) {
	w.Partial = a.stats.Partial.Load()
	w.FullSeen = a.fullSeen
	w.SplitK = a.splitK
	w.UsedTiers = a.usedTiers
	w.StreamSeq = a.streamSeq
	w.GroupIdx, w.GroupMain = w.GroupIdx[:0], w.GroupMain[:0]
	for g, main := range a.mainGroup {
		w.GroupIdx = append(w.GroupIdx, int64(g))
		w.GroupMain = append(w.GroupMain, main)
	}
	w.Hashes, w.Keys, w.Parents, w.Flags, w.Split = w.Hashes[:0], w.Keys[:0], w.Parents[:0], w.Flags[:0], w.Split[:0]
	for h, b := range a.routerOf {
		flags := b.held(a.gen) << snapshot.TierShift
		if b.hasParent {
			flags |= snapshot.FlagParent
		}
		if b.split >= 0 {
			flags |= snapshot.FlagSplit
			n := a.splitK - 1
			w.Split = append(w.Split, a.splitKeys[int(b.split)*n:int(b.split+1)*n]...)
		}
		w.Hashes = append(w.Hashes, h)
		w.Keys = append(w.Keys, b.key)
		w.Parents = append(w.Parents, b.parent)
		w.Flags = append(w.Flags, flags)
	}
}

// Import replaces the actor's state with w's, as Export wrote it and
// snapshot.Check passed it, and rebuilds the worker's index entries from
// it: the worker is cleared, then each block goes back into the tiers it
// was indexed in. Call it in the actor's goroutine, before its first batch.
func (a *Actor) Import(w *snapshot.Worker) {
	// The entries rebuilt here are the snapshot's, already in the stream a
	// Publish feeds: they go to the shard only.
	a.restoring = true
	defer func() { a.restoring = false }()
	a.clear()
	a.fresh = false // the stream goes on from the snapshot's seq
	a.fullSeen = w.FullSeen
	a.usedTiers = w.UsedTiers & (1<<index.NumTiers - 1)
	a.streamSeq = w.StreamSeq
	clear(a.mainGroup)
	for i, g := range w.GroupIdx {
		a.mainGroup[int(g)] = w.GroupMain[i]
	}
	a.splitK = w.SplitK
	next := 0 // the next block's keys in w.Split
	for i, h := range w.Hashes {
		f := w.Flags[i]
		b := block{key: w.Keys[i], parent: w.Parents[i], hasParent: f&snapshot.FlagParent != 0, split: -1,
			gen: a.gen - 1} // known, not indexed until hold
		if f&snapshot.FlagSplit != 0 {
			n := a.splitK - 1
			if n < 1 || next+n > len(w.Split) {
				continue // snapshot.Check refuses this
			}
			b.split = a.slot(w.Split[next : next+n])
			next += n
		}
		if old, dup := a.routerOf[h]; dup { // not from Export; keep the mapping a function
			a.forget(h, old)
		}
		a.routerOf[h] = b
		for t := range index.Tier(index.NumTiers) {
			if f&(bit(t)<<snapshot.TierShift) != 0 {
				a.hold(h, a.routerOf[h], t)
			}
		}
	}
	a.stats.Partial.Store(w.Partial)
	a.flush()
}
