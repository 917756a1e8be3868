package sim

import (
	"container/list"

	"github.com/kvpipe/kvpipe/codec"
)

// Engine models one inference engine's prefix cache of blocks of BlockSize
// tokens. Serving a request stores the blocks it lacks and evicts the least
// recently used beyond Capacity, and reports both as KV events, as vLLM does.
// An Engine is owned by one goroutine.
//
// With no Option it is the polite engine kvpipe was first tested against:
// full blocks only, one attention group, no host tier, no adapters. Each
// Option switches on one behaviour of real engines (see Options).
type Engine struct {
	BlockSize int
	Capacity  int // blocks (device blocks when offloading)

	opts Options
	dev  lru // the device cache
	host lru // the host tier (WithCPUOffload only)
}

// Options are the behaviours of real engines a simulated one can show. The
// zero value is the default engine.
type Options struct {
	// PartialTails: the engine honours Request.InputLength (see PromptLen),
	// so its full blocks are the prompt's whole blocks, and it also publishes
	// the prompt's last, incomplete block, as vLLM does with a hash unit below
	// its block size: a BlockStored of one block whose BlockSize is the tail's
	// token count (< BlockSize), with those tokens, chained to the last full
	// block. A tail is a leaf: nothing is ever chained to it. When the
	// conversation continues, the block it started is stored again as a full
	// block (its own hash, chained to the previous full block), and the tail
	// entry ages out of the LRU on its own (a BlockRemoved of its hash).
	PartialTails bool
	// SlidingWindow > 0 models a hybrid model with a sliding-window group of
	// that many tokens: every BlockStored and BlockRemoved is published twice,
	// for group_idx 0 (BlockStored kind "full_attention") and right after it
	// for group_idx 1 (BlockStored kind "sliding_window" with the window),
	// the second with that group's own engine hashes (GroupHash) and parent.
	// BlockRemoved carries the group_idx only, as vLLM's does.
	SlidingWindow int
	// HostCapacity > 0 adds a host (CPU offload) tier of that many blocks:
	// blocks evicted from the device move to the host tier, as vLLM's
	// offloading connector reports (see WithCPUOffload).
	HostCapacity int
	// LoRA: the engine honours Request.Lora. An adapter's blocks are distinct
	// cache entries (their engine hashes are chained from a root per adapter,
	// as vLLM puts the adapter in its block hash extra keys), and its device
	// BlockStored events carry LoraName and LoraID (see LoraID).
	LoRA bool
	// Eagle: the engine runs EAGLE-family speculative decoding, as SGLang
	// with --speculative-algorithm EAGLE does: it keys its cache by bigrams,
	// so a block is cached only once the token after it is known (a prompt
	// of n tokens has (n-1)/BlockSize full blocks), and its BlockStored
	// events carry each block's tokens and the one after them, as bigrams
	// (codec.Event.Bigram). It publishes no partial tails.
	Eagle bool
}

// An Option switches on one behaviour of a real engine.
type Option func(*Options)

// WithPartialTails makes the engine publish prompts' partial last blocks
// (Options.PartialTails).
func WithPartialTails() Option { return func(o *Options) { o.PartialTails = true } }

// WithSlidingWindow makes the engine a hybrid model whose second KV cache
// group is a sliding window of window tokens (Options.SlidingWindow).
func WithSlidingWindow(window int) Option { return func(o *Options) { o.SlidingWindow = window } }

// WithCPUOffload adds a host tier of hostCapacity blocks
// (Options.HostCapacity). A block evicted from the device LRU is copied to
// the host first, unless the host already holds it: a BlockStored medium
// "CPU" of the same engine hashes, as vLLM's offloading connector publishes
// them (no parent, no tokens, no adapter), then the BlockRemoved medium
// "GPU" that frees it on the device. The host LRU evicts beyond its
// capacity with BlockRemoved medium "CPU". A request whose
// next blocks after its device hit are in the host tier loads them back:
// they are stored on the device again (in the request's BlockStored medium
// "GPU"), and the host keeps its copy (vLLM's CPU offload does: loading
// reads the host block, it does not move it), which counts as a use in the
// host LRU. Partial tails are never offloaded: vLLM offloads whole blocks.
func WithCPUOffload(hostCapacity int) Option {
	return func(o *Options) { o.HostCapacity = hostCapacity }
}

// WithLoRA makes the engine honour Request.Lora (Options.LoRA).
func WithLoRA() Option { return func(o *Options) { o.LoRA = true } }

// WithEagle makes the engine an SGLang one with EAGLE speculative decoding
// (Options.Eagle).
func WithEagle() Option { return func(o *Options) { o.Eagle = true } }

// Media and kinds the engine publishes.
const (
	MediumGPU         = "GPU"
	MediumCPU         = "CPU"
	KindFullAttention = "full_attention"
	KindSlidingWindow = "sliding_window"
)

// NewEngine returns an empty engine with the given options.
func NewEngine(blockSize, capacity int, opts ...Option) *Engine {
	e := &Engine{BlockSize: blockSize, Capacity: capacity, dev: newLRU(), host: newLRU()}
	for _, o := range opts {
		o(&e.opts)
	}
	return e
}

// Options returns the engine's options.
func (e *Engine) Options() Options { return e.opts }

// Len is the number of cached device blocks (partial tails included).
func (e *Engine) Len() int { return e.dev.len() }

// HostLen is the number of blocks in the host tier.
func (e *Engine) HostLen() int { return e.host.len() }

// engineHash is the engine's own hash of a block: a chain over the block
// position and tokens, as vLLM's is (its value is opaque to the router).
func engineHash(parent uint64, hashID uint64, sub int) uint64 {
	x := parent ^ (hashID+1)*0xff51afd7ed558ccd ^ uint64(sub+1)*0xc4ceb9fe1a85ec53
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	return x
}

// tailHash is the engine hash of a partial block of tokens tokens at the
// position of block (hashID, sub): never the full block's hash (engineHash is
// a bijection of its first argument's mix), and one per tail length.
func tailHash(parent uint64, hashID uint64, sub, tokens int) uint64 {
	return engineHash(parent^uint64(tokens)*0x9e3779b97f4a7c15, hashID, sub)
}

// fmix is a bijective 64-bit finaliser (murmur3's).
func fmix(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// GroupHash is the engine hash, in the sliding-window group (group_idx 1),
// of the block whose full-attention (group 0) hash is h. It is a bijection,
// so the groups' hashes are as distinct as the blocks.
func GroupHash(h uint64) uint64 { return fmix(h ^ 0x6a09e667f3bcc909) }

// loraRoot is the hash an adapter's chains start from (0 for the base model,
// so the base model's hashes are the default engine's).
func loraRoot(name string) uint64 {
	if name == "" {
		return 0
	}
	h := uint64(0xcbf29ce484222325) // FNV-1a
	for i := range len(name) {
		h = (h ^ uint64(name[i])) * 0x100000001b3
	}
	return fmix(h) | 1
}

// lora is the adapter the engine runs r on: "" unless it honours adapters.
func (e *Engine) lora(r *Request) string {
	if e.opts.LoRA {
		return r.Lora
	}
	return ""
}

// layout is how many full blocks of BlockSize the engine makes of r and how
// many tokens are left in its partial tail (0 unless PartialTails).
func (e *Engine) layout(r *Request) (full, tail int) {
	per := TraceBlockTokens / e.BlockSize
	if e.opts.Eagle { // bigrams: the last block waits for the token after it
		n := len(r.HashIDs) * TraceBlockTokens
		if e.opts.PartialTails {
			n = PromptLen(r)
		}
		return max(n-1, 0) / e.BlockSize, 0
	}
	if !e.opts.PartialTails {
		return len(r.HashIDs) * per, 0
	}
	n := PromptLen(r)
	return n / e.BlockSize, n % e.BlockSize
}

// BlockHashes appends the engine hashes (group 0) of a request's full blocks.
func (e *Engine) BlockHashes(dst []uint64, r *Request) []uint64 {
	full, _ := e.layout(r)
	per := TraceBlockTokens / e.BlockSize
	parent := loraRoot(e.lora(r))
	for j := range full {
		in := parent
		if e.opts.Eagle && j%per == per-1 {
			// The block's bigrams end with the next trace block's first
			// token: another next block is another cache entry.
			in ^= fmix(r.HashIDs[j/per+1] ^ 0x243f6a8885a308d3)
		}
		parent = engineHash(in, r.HashIDs[j/per], j%per)
		dst = append(dst, parent)
	}
	return dst
}

// TailHash is the engine hash (group 0) of a request's partial tail, and
// whether the engine makes one (PartialTails and a prompt length that is not
// a multiple of BlockSize).
func (e *Engine) TailHash(r *Request) (uint64, bool) {
	full, tail := e.layout(r)
	if tail == 0 {
		return 0, false
	}
	return e.tailHash(r, e.BlockHashes(make([]uint64, 0, full), r), tail), true
}

// tailHash is the hash of r's tail of tail tokens after its full blocks hashes.
func (e *Engine) tailHash(r *Request, hashes []uint64, tail int) uint64 {
	parent := loraRoot(e.lora(r))
	if len(hashes) > 0 {
		parent = hashes[len(hashes)-1]
	}
	per := TraceBlockTokens / e.BlockSize
	full := len(hashes)
	return tailHash(parent, r.HashIDs[full/per], full%per, tail)
}

// Holds reports whether the engine's device caches the block of engine hash
// h (a group 0 hash).
func (e *Engine) Holds(h uint64) bool { return e.dev.has(h) }

// Held reports how many of r's leading blocks the engine holds on device,
// and on device or host: what an exact index scores the worker.
func (e *Engine) Held(r *Request) (device, anyTier int) {
	hashes := e.BlockHashes(nil, r)
	for device < len(hashes) && e.Holds(hashes[device]) {
		device++
	}
	for anyTier < len(hashes) && (e.Holds(hashes[anyTier]) || e.HostHolds(hashes[anyTier])) {
		anyTier++
	}
	return device, anyTier
}

// HostHolds reports whether the host tier holds the block of engine hash h.
func (e *Engine) HostHolds(h uint64) bool { return e.host.has(h) }

// Clear empties the device cache, as an engine reset does, and returns its
// event. The host tier, if any, is kept: vLLM's prefix-cache reset does not
// reach the offloading connector's store.
func (e *Engine) Clear() codec.Event {
	e.dev.clear()
	return codec.Event{Type: codec.AllBlocksCleared}
}

// Result is what serving one request did, in blocks of BlockSize.
type Result struct {
	Blocks     int // full blocks of the prompt
	DeviceHits int // leading blocks already on the device (Serve's hit)
	HostHits   int // blocks right after those found in the host tier and loaded back
	Computed   int // Blocks - DeviceHits - HostHits: prefilled and stored
	TailTokens int // tokens of the partial last block (PartialTails), 0 if none
	Evicted    int // device entries evicted (partial tails included)
	Offloaded  int // evicted blocks newly stored in the host tier
	HostEvicts int // blocks the host tier evicted
}

// Serve runs one request and appends its KV events to dst: with default
// options at most one BlockStored (the blocks it lacked, chained to the
// cached prefix) and one BlockRemoved (what that evicted). It returns the
// events and how many of the request's blocks were already cached on the
// device (its prefix hit). ServeResult tells more.
func (e *Engine) Serve(dst []codec.Event, r *Request, tokens []uint32) ([]codec.Event, int) {
	dst, res := e.ServeResult(dst, r, tokens)
	return dst, res.DeviceHits
}

// ServeResult is Serve reporting the hits per tier. tokens are the prompt's
// (PromptTokens or InputTokens); only those of blocks the device lacks are
// read, and if tokens are too short for the prompt they are derived from the
// trace. In order, the events are: the device BlockStored of the blocks
// after the device hit (loaded from the host or computed), the tail's
// BlockStored, with offload the host BlockStored of the blocks the device
// evicts (copied before they are freed), the device BlockRemoved, and the
// host BlockRemoved; with a sliding window each is followed by its group 1
// twin. The events' slices are the caller's to keep.
func (e *Engine) ServeResult(dst []codec.Event, r *Request, tokens []uint32) ([]codec.Event, Result) {
	full, tail := e.layout(r)
	if len(tokens) < full*e.BlockSize+tail+e.over() {
		tokens = PromptTokens(nil, r)
	}
	hashes := e.BlockHashes(make([]uint64, 0, full), r)
	res := e.hits(hashes)
	res.TailTokens = tail
	var tailH uint64
	storeTail := false
	if tail > 0 {
		tailH = e.tailHash(r, hashes, tail)
		storeTail = !e.dev.has(tailH)
		// Touch the request's blocks leaf first (the tail before them all),
		// so a parent is never evicted before its children.
		e.dev.touch(tailH, true)
	}
	for i := full - 1; i >= 0; i-- {
		e.dev.touch(hashes[i], false)
	}
	lora := e.lora(r)
	if d := res.DeviceHits; d < full {
		st := codec.Event{Type: codec.BlockStored, BlockHashes: hashes[d:], BlockSize: e.BlockSize, Medium: MediumGPU,
			TokenIDs: tokens[d*e.BlockSize : full*e.BlockSize+e.over()], Bigram: e.opts.Eagle}
		if d > 0 {
			st.ParentHash, st.HasParent = hashes[d-1], true
		}
		dst = e.append(dst, withLora(st, lora))
	}
	if storeTail {
		st := codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{tailH}, BlockSize: tail, Medium: MediumGPU,
			TokenIDs: tokens[full*e.BlockSize : full*e.BlockSize+tail]}
		if full > 0 {
			st.ParentHash, st.HasParent = hashes[full-1], true
		}
		dst = e.append(dst, withLora(st, lora))
	}
	return e.evict(dst, &res), res
}

// over is how many tokens past its last block a BlockStored carries: the
// one that closes an EAGLE window.
func (e *Engine) over() int {
	if e.opts.Eagle {
		return 1
	}
	return 0
}

// withLora marks a device BlockStored with the request's adapter.
func withLora(ev codec.Event, lora string) codec.Event {
	if lora != "" {
		ev.LoraName, ev.LoraID, ev.HasLoraID = lora, LoraID(lora), true
	}
	return ev
}

// hits counts the request's leading blocks on the device, and the ones right
// after them in the host tier, which it loads back (a use of the host copy).
func (e *Engine) hits(hashes []uint64) Result {
	full := len(hashes)
	res := Result{Blocks: full}
	for res.DeviceHits < full && e.dev.has(hashes[res.DeviceHits]) {
		res.DeviceHits++
	}
	d := res.DeviceHits
	if e.opts.HostCapacity > 0 {
		for d+res.HostHits < full && e.host.has(hashes[d+res.HostHits]) {
			res.HostHits++
		}
		// A load is a use of the host copy: touch leaf first, as the device.
		for i := d + res.HostHits - 1; i >= d; i-- {
			e.host.touch(hashes[i], false)
		}
	}
	res.Computed = full - d - res.HostHits
	return res
}

// evict trims the device to Capacity (offloading to the host tier when it
// has one) and the host to its capacity, appending their events.
func (e *Engine) evict(dst []codec.Event, res *Result) []codec.Event {
	var evicted, offloaded, hostEvicted []uint64
	for e.dev.len() > e.Capacity {
		h, isTail := e.dev.pop()
		evicted = append(evicted, h)
		if e.opts.HostCapacity > 0 && !isTail {
			if !e.host.has(h) {
				offloaded = append(offloaded, h)
			}
			e.host.touch(h, false)
		}
	}
	for e.opts.HostCapacity > 0 && e.host.len() > e.opts.HostCapacity {
		h, _ := e.host.pop()
		hostEvicted = append(hostEvicted, h)
	}
	res.Evicted, res.Offloaded, res.HostEvicts = len(evicted), len(offloaded), len(hostEvicted)
	// The host copy is made before the device block is freed, so its event
	// comes first: a router still knows the blocks' keys when it reads it.
	if len(offloaded) > 0 {
		dst = e.append(dst, codec.Event{Type: codec.BlockStored, BlockHashes: offloaded, BlockSize: e.BlockSize,
			TokenIDs: []uint32{}, Medium: MediumCPU})
	}
	if len(evicted) > 0 {
		dst = e.append(dst, codec.Event{Type: codec.BlockRemoved, BlockHashes: evicted, Medium: MediumGPU})
	}
	if len(hostEvicted) > 0 {
		dst = e.append(dst, codec.Event{Type: codec.BlockRemoved, BlockHashes: hostEvicted, Medium: MediumCPU})
	}
	return dst
}

// append appends ev, and with a sliding window its group 1 twin after it.
func (e *Engine) append(dst []codec.Event, ev codec.Event) []codec.Event {
	if e.opts.SlidingWindow <= 0 {
		return append(dst, ev)
	}
	g0 := ev
	g0.HasGroupIdx = true
	g1 := ev
	g1.GroupIdx, g1.HasGroupIdx = 1, true
	g1.BlockHashes = make([]uint64, len(ev.BlockHashes))
	for i, h := range ev.BlockHashes {
		g1.BlockHashes[i] = GroupHash(h)
	}
	if ev.HasParent {
		g1.ParentHash = GroupHash(ev.ParentHash)
	}
	if ev.Type == codec.BlockStored {
		g0.SpecKind = KindFullAttention
		g1.SpecKind = KindSlidingWindow
		g1.SlidingWindow, g1.HasSlidingWindow = e.opts.SlidingWindow, true
	}
	return append(dst, g0, g1)
}

// lru is a set of engine hashes in least-recently-used order.
type lru struct {
	m map[uint64]*list.Element // hash -> entry
	l *list.List               // front: most recently used
}

type entry struct {
	hash uint64
	tail bool // a partial tail
}

func newLRU() lru { return lru{m: make(map[uint64]*list.Element), l: list.New()} }

func (c *lru) len() int          { return len(c.m) }
func (c *lru) has(h uint64) bool { return c.m[h] != nil }
func (c *lru) clear()            { clear(c.m); c.l.Init() }
func (c *lru) touch(h uint64, tail bool) {
	if el := c.m[h]; el != nil {
		c.l.MoveToFront(el)
	} else {
		c.m[h] = c.l.PushFront(entry{h, tail})
	}
}

// pop removes the least recently used entry.
func (c *lru) pop() (uint64, bool) {
	en := c.l.Remove(c.l.Back()).(entry)
	delete(c.m, en.hash)
	return en.hash, en.tail
}
