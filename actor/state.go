package actor

import (
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/snapshot"
)

// Export writes the actor's state into w (all but its name and stream
// positions, which are the caller's), reusing w's slices: the block mapping
// with the tiers each block is indexed in, the learned groups and the
// full-block history. An imported snapshot not yet proven is exported as it
// was imported. Call it in the actor's goroutine.
func (a *Actor) Export(w *snapshot.Worker) {
	w.Partial = a.stats.Partial.Load()
	if a.pending {
		w.Partial = a.pendingPartial
	}
	w.FullSeen = a.m.fullSeen
	w.SplitK = a.m.splitK
	w.Eagle = a.stats.Eagle.Load()
	w.UsedTiers = a.m.usedTiers
	w.Rekeyed = a.m.rekeyed
	w.GroupIdx, w.GroupMain = w.GroupIdx[:0], w.GroupMain[:0]
	for g, main := range a.groups.main {
		w.GroupIdx = append(w.GroupIdx, int64(g))
		w.GroupMain = append(w.GroupMain, main)
	}
	w.Hashes, w.Keys, w.Parents, w.Flags, w.Split = w.Hashes[:0], w.Keys[:0], w.Parents[:0], w.Flags[:0], w.Split[:0]
	for h, b := range a.m.routerOf.all() {
		tiers := b.held(a.m.gen)
		if a.pending {
			tiers |= b.restored()
		}
		flags := tiers << snapshot.TierShift
		if b.hasParent() {
			flags |= snapshot.FlagParent
		}
		if b.split >= 0 {
			flags |= snapshot.FlagSplit
			n := a.m.splitK - 1
			w.Split = append(w.Split, a.m.splitKeys[int(b.split)*n:int(b.split+1)*n]...)
		}
		w.Hashes = append(w.Hashes, h)
		w.Keys = append(w.Keys, b.key)
		w.Parents = append(w.Parents, b.parent)
		w.Flags = append(w.Flags, flags)
	}
}

// Import replaces the actor's state with w's, as Export wrote it and
// snapshot.Check passed it, and clears the worker in the index. The blocks
// go back into the index once the snapshot's position is proven: at
// HandleResumed, or at the first batch (the Subscriber delivers one after
// a Resume only once proven); a reset first drops them, leaving the mapping
// as a reset does. Until then the worker is partial. Call it in the actor's
// goroutine; what it held before goes.
func (a *Actor) Import(w *snapshot.Worker) {
	// The entries rebuilt from it are the snapshot's: their batches say
	// so (Batch.IndexOnly), as a history of the worker's ops has them.
	a.out.restoring = true
	defer func() { a.out.restoring = false }()
	a.m.clear()
	a.fresh = false // the stream goes on from the snapshot's seq
	a.m.fullSeen = w.FullSeen
	a.m.usedTiers = w.UsedTiers & (1<<index.NumTiers - 1)
	a.m.rekeyed = w.Rekeyed
	clear(a.groups.main)
	for i, g := range w.GroupIdx {
		a.groups.main[int(g)] = w.GroupMain[i]
	}
	a.m.splitK = w.SplitK
	a.setEagle(w.Eagle || a.cfg.Eagle)
	next := 0 // the next block's keys in w.Split
	for i, h := range w.Hashes {
		f := w.Flags[i]
		b := newBlock(w.Keys[i], w.Parents[i], f&snapshot.FlagParent != 0, 0)
		b.flags |= f >> snapshot.TierShift & restoredMask
		if f&snapshot.FlagSplit != 0 {
			n := a.m.splitK - 1
			if n < 1 || next+n > len(w.Split) {
				continue // snapshot.Check refuses this
			}
			b.split = a.m.slot(w.Split[next : next+n])
			next += n
		}
		if old, dup := a.m.routerOf.get(h); dup { // snapshot.Check does not look for these: the last one wins
			a.m.forget(h, old)
		}
		a.m.routerOf.set(h, b)
	}
	a.pending, a.pendingPartial = true, w.Partial
	a.stats.Partial.Store(true)
	a.out.flush()
}

// HandleResumed puts an imported snapshot's blocks into the index: the
// Subscriber has proven its position.
func (a *Actor) HandleResumed() {
	if a.pending {
		a.activate()
		a.out.flush()
	}
}

// activate indexes the blocks of a proven snapshot. The partial flag comes
// first, so that a batch dropped meanwhile (Drop) leaves the worker partial.
func (a *Actor) activate() {
	a.pending = false
	a.stats.Partial.Store(a.pendingPartial)
	a.out.restoring = true // Batch.Restored: a history of the worker's ops has them
	defer func() { a.out.restoring = false }()
	for h, b := range a.m.routerOf.all() {
		tiers := b.restored()
		if tiers == 0 {
			continue
		}
		b.flags &^= restoredMask
		a.m.routerOf.set(h, b)
		for t := range index.Tier(index.NumTiers) {
			if tiers&bit(t) != 0 {
				b, _ = a.m.routerOf.get(h)
				a.m.hold(h, b, t)
			}
		}
	}
	a.out.flush()
}
