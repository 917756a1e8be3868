package index

// WorkerID names a worker inside the index.
type WorkerID uint32

// Tree is the prefix index as a plain structure owned by one goroutine: the
// reference the shards' concurrent tables are tested against. Router hashes
// are chained, so a hash names its whole prefix: the tree is kept flat, a
// map from hash to node, and a walk down it is a lookup per block. A node
// lives while a worker holds it.
type Tree struct {
	nodes map[uint64]*node
	free  []*node                       // freed nodes, reused so that a warm tree allocates nothing
	held  map[WorkerID]map[uint64]int32 // per worker: hash -> how many engine blocks map to it
	// UnknownRemoves counts removes of blocks the worker did not hold.
	UnknownRemoves uint64
}

type node struct{ workers []WorkerID }

// maxFree bounds the free list (about 50 MB of nodes), so a tree that shrank
// far gives memory back, while an engine clearing and refilling its cache does
// not make the tree allocate again.
const maxFree = 1 << 20

// NewTree returns an empty tree.
func NewTree() *Tree {
	return &Tree{nodes: make(map[uint64]*node), held: make(map[WorkerID]map[uint64]int32)}
}

// Nodes is the number of live nodes.
func (t *Tree) Nodes() int { return len(t.nodes) }

// Blocks is the number of distinct blocks worker w holds.
func (t *Tree) Blocks(w WorkerID) int { return len(t.held[w]) }

// Store records that w holds block h.
func (t *Tree) Store(w WorkerID, h uint64) {
	held := t.held[w]
	if held == nil {
		held = make(map[uint64]int32)
		t.held[w] = held
	}
	held[h]++
	if held[h] > 1 {
		return
	}
	n := t.nodes[h]
	if n == nil {
		if k := len(t.free); k > 0 {
			n, t.free = t.free[k-1], t.free[:k-1]
		} else {
			n = &node{}
		}
		t.nodes[h] = n
	}
	n.workers = append(n.workers, w)
}

// Remove records that w no longer holds block h.
func (t *Tree) Remove(w WorkerID, h uint64) {
	held := t.held[w]
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
	t.drop(w, h)
}

// ClearWorker removes every block w holds. It keeps w's table, since an
// engine that cleared its cache fills it again.
func (t *Tree) ClearWorker(w WorkerID) {
	for h := range t.held[w] {
		t.drop(w, h)
	}
	clear(t.held[w])
}

// RemoveWorker removes every block w holds and frees all of its entries.
func (t *Tree) RemoveWorker(w WorkerID) {
	t.ClearWorker(w)
	delete(t.held, w)
}

// drop takes w off h's node and frees the node when nobody holds it.
func (t *Tree) drop(w WorkerID, h uint64) {
	n := t.nodes[h]
	for i, x := range n.workers {
		if x == w {
			last := len(n.workers) - 1
			n.workers[i] = n.workers[last]
			n.workers = n.workers[:last]
			break
		}
	}
	if len(n.workers) == 0 {
		delete(t.nodes, h)
		if len(t.free) < maxFree {
			t.free = append(t.free, n)
		}
	}
}

// Score is how many leading blocks of a request one worker holds.
type Score struct {
	Worker WorkerID
	Blocks int
}

// FindMatches appends to dst the score of every worker holding at least the
// first block of hashes. The walk stops when no worker holds the next block.
func (t *Tree) FindMatches(dst []Score, hashes []uint64) []Score {
	if len(hashes) == 0 {
		return dst
	}
	n := t.nodes[hashes[0]]
	if n == nil {
		return dst
	}
	start := len(dst)
	for _, w := range n.workers {
		dst = append(dst, Score{Worker: w, Blocks: 1})
	}
	active := dst[start:] // the workers still matching sit at the front
	for _, h := range hashes[1:] {
		n = t.nodes[h]
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
	return dst
}

func holds(n *node, w WorkerID) bool {
	for _, x := range n.workers {
		if x == w {
			return true
		}
	}
	return false
}
