package index

// Tree is the prefix index as a plain structure owned by one goroutine: the
// reference the shards' concurrent tables are tested against. Router hashes
// are chained, so a hash names its whole prefix: the tree is kept flat, a
// map from hash to node per tier, and a walk down it is a lookup per block.
// A node lives while a worker holds it in that tier.
type Tree struct {
	tiers [NumTiers]treeTier
	free  []*node // freed nodes, reused so that a warm tree allocates nothing
	// UnknownRemoves counts removes of blocks the worker did not hold in
	// the op's tier.
	UnknownRemoves uint64
}

// treeTier is one tier's nodes and holdings; a lower tier's maps are nil
// until its first store.
type treeTier struct {
	nodes map[uint64]*node
	held  map[WorkerID]map[uint64]int32 // per worker: hash -> how many engine blocks map to it
}

type node struct{ workers []WorkerID }

// maxFree bounds the free list (about 50 MB of nodes), so a tree that shrank
// far gives memory back, while an engine clearing and refilling its cache does
// not make the tree allocate again.
const maxFree = 1 << 20

// NewTree returns an empty tree.
func NewTree() *Tree {
	t := &Tree{}
	t.tiers[TierDevice] = treeTier{nodes: make(map[uint64]*node), held: make(map[WorkerID]map[uint64]int32)}
	return t
}

// Nodes is the number of live device nodes.
func (t *Tree) Nodes() int { return len(t.tiers[TierDevice].nodes) }

// TierNodes is the number of live nodes of tier tier: distinct blocks some
// worker holds there.
func (t *Tree) TierNodes(tier Tier) int {
	if tier >= NumTiers {
		return 0
	}
	return len(t.tiers[tier].nodes)
}

// Blocks is the number of distinct blocks worker w holds on device.
func (t *Tree) Blocks(w WorkerID) int { return len(t.tiers[TierDevice].held[w]) }

// Apply applies one op of worker w, as a shard does.
func (t *Tree) Apply(w WorkerID, op Op) {
	switch op.Kind {
	case OpStore:
		t.StoreTier(w, op.Tier, op.Hash)
	case OpRemove:
		t.RemoveTier(w, op.Tier, op.Hash)
	case OpClearWorker:
		t.ClearWorker(w)
	case OpClearTier:
		t.ClearTier(w, op.Tier)
	case OpRemoveWorker:
		t.RemoveWorker(w)
	}
}

// Store records that w holds block h on device.
func (t *Tree) Store(w WorkerID, h uint64) { t.StoreTier(w, TierDevice, h) }

// StoreTier records that w holds block h in tier tier (as well as in any
// other tier it holds it in).
func (t *Tree) StoreTier(w WorkerID, tier Tier, h uint64) {
	if tier >= NumTiers {
		return
	}
	tt := &t.tiers[tier]
	if tt.nodes == nil {
		tt.nodes, tt.held = make(map[uint64]*node), make(map[WorkerID]map[uint64]int32)
	}
	held := tt.held[w]
	if held == nil {
		held = make(map[uint64]int32)
		tt.held[w] = held
	}
	held[h]++
	if held[h] > 1 {
		return
	}
	n := tt.nodes[h]
	if n == nil {
		if k := len(t.free); k > 0 {
			n, t.free = t.free[k-1], t.free[:k-1]
		} else {
			n = &node{}
		}
		tt.nodes[h] = n
	}
	n.workers = append(n.workers, w)
}

// Remove records that w no longer holds block h on device.
func (t *Tree) Remove(w WorkerID, h uint64) { t.RemoveTier(w, TierDevice, h) }

// RemoveTier records that w no longer holds block h in tier tier.
func (t *Tree) RemoveTier(w WorkerID, tier Tier, h uint64) {
	if tier >= NumTiers {
		return
	}
	held := t.tiers[tier].held[w]
	refs, ok := held[h]
	if !ok {
		t.UnknownRemoves++
		return
	}
	if refs > 1 {
		held[h] = refs - 1
		return
	}
	delete(held, h)
	t.drop(tier, w, h)
}

// ClearWorker removes every block w holds, in every tier. It keeps w's
// tables, since an engine that cleared its cache fills it again.
func (t *Tree) ClearWorker(w WorkerID) {
	for tier := range Tier(NumTiers) {
		t.ClearTier(w, tier)
	}
}

// ClearTier removes every block w holds in tier tier.
func (t *Tree) ClearTier(w WorkerID, tier Tier) {
	if tier >= NumTiers {
		return
	}
	for h := range t.tiers[tier].held[w] {
		t.drop(tier, w, h)
	}
	clear(t.tiers[tier].held[w])
}

// RemoveWorker removes every block w holds and frees all of its entries.
func (t *Tree) RemoveWorker(w WorkerID) {
	t.ClearWorker(w)
	for tier := range t.tiers {
		delete(t.tiers[tier].held, w)
	}
}

// drop takes w off h's node of tier and frees the node when nobody holds it.
func (t *Tree) drop(tier Tier, w WorkerID, h uint64) {
	nodes := t.tiers[tier].nodes
	n := nodes[h]
	for i, x := range n.workers {
		if x == w {
			last := len(n.workers) - 1
			n.workers[i] = n.workers[last]
			n.workers = n.workers[:last]
			break
		}
	}
	if len(n.workers) == 0 {
		delete(nodes, h)
		if len(t.free) < maxFree {
			t.free = append(t.free, n)
		}
	}
}

// FindMatches appends to dst the score of every worker holding at least the
// first block of hashes, in any tier. The walk stops when no worker holds
// the next block.
func (t *Tree) FindMatches(dst []Score, hashes []uint64) []Score {
	if len(hashes) == 0 {
		return dst
	}
	for _, tt := range t.tiers[1:] {
		if tt.nodes != nil {
			return t.findTiered(dst, hashes)
		}
	}
	n := t.tiers[TierDevice].nodes[hashes[0]]
	if n == nil {
		return dst
	}
	start := len(dst)
	for _, w := range n.workers {
		dst = append(dst, Score{Worker: w, Blocks: 1})
	}
	active := dst[start:] // the workers still matching sit at the front
	for _, h := range hashes[1:] {
		n = t.tiers[TierDevice].nodes[h]
		if n == nil {
			break
		}
		k := 0
		for i := range active {
			if holds(n, active[i].Worker) {
				active[i].Blocks++
				active[i], active[k] = active[k], active[i]
				k++
			}
		}
		if k == 0 {
			break
		}
		active = active[:k]
	}
	for i := start; i < len(dst); i++ {
		for tier := range dst[i].Tiers {
			dst[i].Tiers[tier] = dst[i].Blocks
		}
	}
	return dst
}

// findTiered is FindMatches once a lower tier is in use, by the definition
// of the counts (it is the reference, so plain rather than fast): every
// worker holding hashes[0] in some tier, and for each tier t the leading
// blocks held in a tier <= t, counted on from the count of tier t-1.
func (t *Tree) findTiered(dst []Score, hashes []uint64) []Score {
	start := len(dst)
	for _, tt := range t.tiers {
		if n := tt.nodes[hashes[0]]; n != nil {
			for _, w := range n.workers {
				if !scored(dst[start:], w) {
					dst = append(dst, Score{Worker: w})
				}
			}
		}
	}
	for i := start; i < len(dst); i++ {
		s := &dst[i]
		n := 0
		for tier := range Tier(NumTiers) {
			for n < len(hashes) && t.holdsUpTo(s.Worker, tier, hashes[n]) {
				n++
			}
			s.Tiers[tier] = n
		}
		s.Blocks = s.Tiers[TierDevice]
	}
	return dst
}

// holdsUpTo reports whether w holds h in tier or a faster one.
func (t *Tree) holdsUpTo(w WorkerID, tier Tier, h uint64) bool {
	for x := range tier + 1 {
		if t.tiers[x].held[w][h] > 0 {
			return true
		}
	}
	return false
}

func scored(s []Score, w WorkerID) bool {
	for _, x := range s {
		if x.Worker == w {
			return true
		}
	}
	return false
}

func holds(n *node, w WorkerID) bool {
	for _, x := range n.workers {
		if x == w {
			return true
		}
	}
	return false
}
