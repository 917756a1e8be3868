package sim

import (
	"container/list"

	"github.com/kvpipe/kvpipe/codec"
)

// Engine models one inference engine's prefix cache of blocks of BlockSize
// tokens. Serving a request stores the blocks it lacks and evicts the least
// recently used beyond Capacity, and reports both as KV events, as vLLM does.
// An Engine is owned by one goroutine.
type Engine struct {
	BlockSize int
	Capacity  int // blocks

	blocks map[uint64]*list.Element // engine hash -> LRU entry
	lru    *list.List               // front: most recently used
}

// NewEngine returns an empty engine.
func NewEngine(blockSize, capacity int) *Engine {
	return &Engine{BlockSize: blockSize, Capacity: capacity, blocks: make(map[uint64]*list.Element), lru: list.New()}
}

// Len is the number of cached blocks.
func (e *Engine) Len() int { return len(e.blocks) }

// engineHash is the engine's own hash of a block: a chain over the block
// position and tokens, as vLLM's is (its value is opaque to the router).
func engineHash(parent uint64, hashID uint64, sub int) uint64 {
	x := parent ^ (hashID+1)*0xff51afd7ed558ccd ^ uint64(sub+1)*0xc4ceb9fe1a85ec53
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	return x
}

// BlockHashes appends the engine hashes of a request's blocks.
func (e *Engine) BlockHashes(dst []uint64, r *Request) []uint64 {
	var parent uint64
	for _, id := range r.HashIDs {
		for sub := range TraceBlockTokens / e.BlockSize {
			parent = engineHash(parent, id, sub)
			dst = append(dst, parent)
		}
	}
	return dst
}

// Holds reports whether the engine caches the block of engine hash h.
func (e *Engine) Holds(h uint64) bool { return e.blocks[h] != nil }

// Clear empties the cache, as an engine reset does, and returns its event.
func (e *Engine) Clear() codec.Event {
	clear(e.blocks)
	e.lru.Init()
	return codec.Event{Type: codec.AllBlocksCleared}
}

// Serve runs one request and appends its KV events to dst: at most one
// BlockStored (the blocks it lacked, chained to the cached prefix) and one
// BlockRemoved (what that evicted). It returns the events and how many of the
// request's blocks were already cached (its prefix hit).
func (e *Engine) Serve(dst []codec.Event, r *Request, tokens []uint32) ([]codec.Event, int) {
	hashes := e.BlockHashes(nil, r)
	n := len(hashes)
	hit := 0
	for hit < n && e.blocks[hashes[hit]] != nil {
		hit++
	}
	// Touch the request's blocks leaf first, so a parent is never evicted before its children.
	for i := n - 1; i >= 0; i-- {
		if el := e.blocks[hashes[i]]; el != nil {
			e.lru.MoveToFront(el)
		} else {
			e.blocks[hashes[i]] = e.lru.PushFront(hashes[i])
		}
	}
	if hit < n {
		st := codec.Event{Type: codec.BlockStored, BlockHashes: hashes[hit:], BlockSize: e.BlockSize, Medium: "GPU",
			TokenIDs: tokens[hit*e.BlockSize : n*e.BlockSize]}
		if hit > 0 {
			st.ParentHash, st.HasParent = hashes[hit-1], true
		}
		dst = append(dst, st)
	}
	var evicted []uint64
	for len(e.blocks) > e.Capacity {
		el := e.lru.Back()
		h := e.lru.Remove(el).(uint64)
		delete(e.blocks, h)
		evicted = append(evicted, h)
	}
	if len(evicted) > 0 {
		dst = append(dst, codec.Event{Type: codec.BlockRemoved, BlockHashes: evicted, Medium: "GPU"})
	}
	return dst, hit
}
