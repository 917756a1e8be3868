package sim

import (
	"container/list"
	"fmt"
	"reflect"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvpipe/kvpipe/codec"
)

// legacyEngine is the engine as it was before options, kept verbatim as the
// reference the default options must reproduce event for event.
type legacyEngine struct {
	BlockSize, Capacity int
	blocks              map[uint64]*list.Element
	lru                 *list.List
}

func newLegacy(blockSize, capacity int) *legacyEngine {
	return &legacyEngine{BlockSize: blockSize, Capacity: capacity, blocks: make(map[uint64]*list.Element), lru: list.New()}
}

func (e *legacyEngine) BlockHashes(dst []uint64, r *Request) []uint64 {
	var parent uint64
	for _, id := range r.HashIDs {
		for sub := range TraceBlockTokens / e.BlockSize {
			parent = engineHash(parent, id, sub)
			dst = append(dst, parent)
		}
	}
	return dst
}

func (e *legacyEngine) Serve(dst []codec.Event, r *Request, tokens []uint32) ([]codec.Event, int) {
	hashes := e.BlockHashes(nil, r)
	n := len(hashes)
	hit := 0
	for hit < n && e.blocks[hashes[hit]] != nil {
		hit++
	}
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

// The default options (and options that switch nothing on) are the engine
// of before: the same events, hits and hashes for every request of the
// synthetic trace and of the Mooncake one, even though the traces now
// assign adapters and partial last blocks.
func TestDefaultOptionsAreTheLegacyEngine(t *testing.T) {
	mooncake, source, err := Trace(1000)
	if err != nil {
		t.Fatal(err)
	}
	traces := map[string][]Request{"synthetic": SyntheticTrace(1000, 3), source: mooncake}
	for name, reqs := range traces {
		for _, tc := range []struct {
			blockSize, capacity int
			opts                []Option
		}{
			{16, 3000, nil},
			{64, 200, nil},
			{32, 700, []Option{WithCPUOffload(0), WithSlidingWindow(0)}},
		} {
			t.Run(fmt.Sprintf("%s/%d/%d/%d", name, tc.blockSize, tc.capacity, len(tc.opts)), func(t *testing.T) {
				want, got := newLegacy(tc.blockSize, tc.capacity), NewEngine(tc.blockSize, tc.capacity, tc.opts...)
				evictions := 0
				for i := range reqs {
					r := &reqs[i]
					tokens := PromptTokens(nil, r)
					wantEvs, wantHit := want.Serve(nil, r, tokens)
					gotEvs, gotHit := got.Serve(nil, r, tokens)
					if !reflect.DeepEqual(wantEvs, gotEvs) || wantHit != gotHit {
						t.Fatalf("request %d: hit %d, want %d; events\n%+v\nwant\n%+v", i, gotHit, wantHit, gotEvs, wantEvs)
					}
					if !slices.Equal(want.BlockHashes(nil, r), got.BlockHashes(nil, r)) {
						t.Fatalf("request %d: block hashes differ", i)
					}
					if len(wantEvs) > 0 && wantEvs[len(wantEvs)-1].Type == codec.BlockRemoved {
						evictions++
					}
				}
				if evictions == 0 {
					t.Error("the run never evicted: a weak comparison")
				}
			})
		}
	}
}

// serveIDs serves a request of the given ids and input length.
func serveIDs(e *Engine, inputLength int, lora string, ids ...uint64) ([]codec.Event, Result) {
	r := &Request{HashIDs: ids, InputLength: inputLength, Lora: lora}
	return e.ServeResult(nil, r, PromptTokens(nil, r))
}

func TestPartialTails(t *testing.T) {
	const bs = 16
	for _, tc := range []struct {
		name        string
		ids         []uint64
		inputLength int
		full, tail  int
	}{
		{"whole blocks", []uint64{1, 2}, 1024, 64, 0},
		{"input length unknown", []uint64{1, 2}, 0, 64, 0},
		{"tail in the last trace block", []uint64{1, 2}, 512 + 100, 32 + 6, 4},
		{"a whole last trace block", []uint64{1, 2}, 512 + 96, 32 + 6, 0},
		{"prompt shorter than a block", []uint64{5}, 5, 0, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := NewEngine(bs, 1000, WithPartialTails())
			evs, res := serveIDs(e, tc.inputLength, "", tc.ids...)
			if res.Blocks != tc.full || res.TailTokens != tc.tail || res.DeviceHits != 0 || res.Computed != tc.full {
				t.Fatalf("result %+v, want %d full blocks and a tail of %d", res, tc.full, tc.tail)
			}
			wantEvents := 0
			if tc.full > 0 {
				wantEvents++
			}
			if tc.tail > 0 {
				wantEvents++
			}
			if len(evs) != wantEvents {
				t.Fatalf("%d events, want %d: %+v", len(evs), wantEvents, evs)
			}
			hashes := e.BlockHashes(nil, &Request{HashIDs: tc.ids, InputLength: tc.inputLength})
			if len(hashes) != tc.full {
				t.Fatalf("%d block hashes, want %d", len(hashes), tc.full)
			}
			if tc.full > 0 {
				if st := evs[0]; st.BlockSize != bs || len(st.BlockHashes) != tc.full || len(st.TokenIDs) != tc.full*bs || st.HasParent {
					t.Errorf("full blocks' event: size %d, %d hashes, %d tokens", st.BlockSize, len(st.BlockHashes), len(st.TokenIDs))
				}
			}
			if tc.tail == 0 {
				if _, ok := e.TailHash(&Request{HashIDs: tc.ids, InputLength: tc.inputLength}); ok {
					t.Error("TailHash reports a tail")
				}
				return
			}
			st := evs[len(evs)-1]
			last := tc.ids[len(tc.ids)-1]
			within := tc.full*bs - (len(tc.ids)-1)*TraceBlockTokens // the tail's offset in its trace block
			if st.Type != codec.BlockStored || st.BlockSize != tc.tail || len(st.BlockHashes) != 1 || st.Medium != "GPU" ||
				!slices.Equal(st.TokenIDs, Tokens(nil, last)[within:within+tc.tail]) {
				t.Fatalf("tail event %+v", st)
			}
			if tc.full > 0 && (!st.HasParent || st.ParentHash != hashes[tc.full-1]) {
				t.Errorf("the tail chains to %x (%v), want the last full block %x", st.ParentHash, st.HasParent, hashes[tc.full-1])
			}
			if tc.full == 0 && st.HasParent {
				t.Error("a tail with no full block before it has a parent")
			}
			if h, ok := e.TailHash(&Request{HashIDs: tc.ids, InputLength: tc.inputLength}); !ok || h != st.BlockHashes[0] || slices.Contains(hashes, h) {
				t.Errorf("TailHash %x %v, event's %x", h, ok, st.BlockHashes[0])
			}
			if !e.Holds(st.BlockHashes[0]) || e.Len() != tc.full+1 {
				t.Errorf("the tail is not cached beside the %d full blocks (%d entries)", tc.full, e.Len())
			}
			// The same prompt again: everything is cached, nothing is published.
			if evs, res := serveIDs(e, tc.inputLength, "", tc.ids...); len(evs) != 0 || res.DeviceHits != tc.full {
				t.Errorf("repeat: %d events, hit %d", len(evs), res.DeviceHits)
			}
		})
	}
}

// When the conversation continues, the block the tail began is stored as a
// full block chained to the last full block, never to the tail, and the tail
// ages out of the LRU by itself.
func TestPartialTailIsRestoredFullWhenTheConversationContinues(t *testing.T) {
	const bs = 16
	e := NewEngine(bs, 32+7+1, WithPartialTails()) // room for the first turn exactly
	evs, _ := serveIDs(e, 512+100, "", 1, 2)
	tail := evs[1].BlockHashes[0]
	first := e.BlockHashes(nil, &Request{HashIDs: []uint64{1, 2}, InputLength: 512 + 100})
	evs, res := serveIDs(e, 2*512+7, "", 1, 2, 3)
	if res.DeviceHits != 38 || res.Blocks != 64 || res.TailTokens != 7 {
		t.Fatalf("second turn: %+v", res)
	}
	if len(evs) != 3 || evs[0].Type != codec.BlockStored || evs[1].Type != codec.BlockStored || evs[2].Type != codec.BlockRemoved {
		t.Fatalf("second turn events: %+v", evs)
	}
	st := evs[0]
	if !st.HasParent || st.ParentHash != first[37] || slices.Contains(st.BlockHashes, tail) || len(st.BlockHashes) != 26 {
		t.Errorf("the continued block chains to %x, want the last full block %x (tail %x)", st.ParentHash, first[37], tail)
	}
	if !slices.Equal(st.TokenIDs[:bs], Tokens(nil, 2)[6*bs:7*bs]) {
		t.Error("the continued block's tokens are not the trace block's")
	}
	if !slices.Contains(evs[2].BlockHashes, tail) || e.Holds(tail) {
		t.Error("the old tail was not the first to go")
	}
	if evs[2].BlockHashes[0] != tail {
		t.Errorf("evicted %x first, want the old tail %x", evs[2].BlockHashes[0], tail)
	}
}

func TestSlidingWindowGroupTwinsEveryEvent(t *testing.T) {
	const bs, window = 16, 4096
	plain := NewEngine(bs, 40, WithPartialTails())
	hybrid := NewEngine(bs, 40, WithPartialTails(), WithSlidingWindow(window))
	for step, ids := range [][]uint64{{1}, {1, 2}, {3}} {
		r := &Request{HashIDs: ids, InputLength: len(ids)*512 - 3}
		tokens := PromptTokens(nil, r)
		want, wantHit := plain.Serve(nil, r, tokens)
		got, gotHit := hybrid.Serve(nil, r, tokens)
		if gotHit != wantHit || len(got) != 2*len(want) {
			t.Fatalf("step %d: %d events, want twice %d", step, len(got), len(want))
		}
		for i, w := range want {
			g0, g1 := got[2*i], got[2*i+1]
			if g0.Type != w.Type || !slices.Equal(g0.BlockHashes, w.BlockHashes) || g0.ParentHash != w.ParentHash || g0.HasParent != w.HasParent ||
				!slices.Equal(g0.TokenIDs, w.TokenIDs) || g0.BlockSize != w.BlockSize || !g0.HasGroupIdx || g0.GroupIdx != 0 || g0.HasSlidingWindow {
				t.Errorf("step %d event %d: group 0 is not the plain event: %+v", step, i, g0)
			}
			if g1.Type != w.Type || !g1.HasGroupIdx || g1.GroupIdx != 1 || !slices.Equal(g1.TokenIDs, w.TokenIDs) || g1.BlockSize != w.BlockSize ||
				g1.HasParent != w.HasParent || (w.HasParent && g1.ParentHash != GroupHash(w.ParentHash)) {
				t.Errorf("step %d event %d: group 1 %+v", step, i, g1)
			}
			for j, h := range g1.BlockHashes {
				if h != GroupHash(w.BlockHashes[j]) || h == w.BlockHashes[j] {
					t.Errorf("step %d event %d: group 1 hash %x of %x", step, i, h, w.BlockHashes[j])
				}
			}
			switch w.Type {
			case codec.BlockStored:
				if g0.SpecKind != "full_attention" || g1.SpecKind != "sliding_window" || !g1.HasSlidingWindow || g1.SlidingWindow != window {
					t.Errorf("step %d event %d: kinds %q %q, window %d", step, i, g0.SpecKind, g1.SpecKind, g1.SlidingWindow)
				}
			case codec.BlockRemoved:
				if g0.SpecKind != "" || g1.SpecKind != "" || g1.HasSlidingWindow {
					t.Errorf("step %d event %d: a BlockRemoved with a kind", step, i)
				}
			}
		}
	}
}

func TestCPUOffload(t *testing.T) {
	const bs = 64 // 8 engine blocks per trace block
	e := NewEngine(bs, 16, WithCPUOffload(24))
	type want struct {
		device, host, computed int
		events                 []string // type/medium/blocks
	}
	describe := func(evs []codec.Event) []string {
		var out []string
		for _, ev := range evs {
			out = append(out, fmt.Sprintf("%v/%s/%d", ev.Type, ev.Medium, len(ev.BlockHashes)))
		}
		return out
	}
	stored, removed := codec.BlockStored, codec.BlockRemoved
	steps := []struct {
		ids []uint64
		want
	}{
		{[]uint64{1, 2}, want{0, 0, 16, []string{fmt.Sprintf("%v/GPU/16", stored)}}},
		// 3 and 4 push 1 and 2 out to the host.
		{[]uint64{3, 4}, want{0, 0, 16, []string{fmt.Sprintf("%v/GPU/16", stored), fmt.Sprintf("%v/CPU/16", stored), fmt.Sprintf("%v/GPU/16", removed)}}},
		// 1 is loaded back (and stays on the host, used last), 5 computed; 3 and 4
		// go to the host, which evicts its least recently used: 2.
		{[]uint64{1, 5}, want{0, 8, 8, []string{fmt.Sprintf("%v/GPU/16", stored), fmt.Sprintf("%v/CPU/16", stored), fmt.Sprintf("%v/GPU/16", removed), fmt.Sprintf("%v/CPU/8", removed)}}},
		// 1 is on the device now.
		{[]uint64{1}, want{8, 0, 0, nil}},
	}
	for i, s := range steps {
		r := &Request{HashIDs: s.ids}
		evs, res := e.ServeResult(nil, r, PromptTokens(nil, r))
		if res.DeviceHits != s.device || res.HostHits != s.host || res.Computed != s.computed {
			t.Errorf("step %d: %+v, want device %d host %d computed %d", i, res, s.device, s.host, s.computed)
		}
		if d := cmp.Diff(s.events, describe(evs)); d != "" {
			t.Errorf("step %d events (-want +got):\n%s", i, d)
		}
		if e.Len() > 16 || e.HostLen() > 24 {
			t.Errorf("step %d: %d device and %d host blocks", i, e.Len(), e.HostLen())
		}
		for _, ev := range evs {
			if ev.Medium == "CPU" && (ev.HasParent || len(ev.TokenIDs) != 0 || ev.HasLoraID) {
				t.Errorf("step %d: a host event as vLLM's connector does not publish it: %+v", i, ev)
			}
			if ev.Type == stored && ev.Medium == "CPU" && ev.BlockSize != bs {
				t.Errorf("step %d: host BlockStored of size %d", i, ev.BlockSize)
			}
		}
		if i == 1 {
			// The host holds exactly the blocks the device removed.
			for _, h := range evs[2].BlockHashes {
				if !e.HostHolds(h) || e.Holds(h) {
					t.Errorf("block %x: host %v device %v", h, e.HostHolds(h), e.Holds(h))
				}
			}
			if !slices.Equal(evs[1].BlockHashes, evs[2].BlockHashes) {
				t.Error("the host stored other hashes than the device removed")
			}
		}
		if i == 2 {
			loaded := e.BlockHashes(nil, &Request{HashIDs: []uint64{1}})
			if !slices.Equal(evs[0].BlockHashes[:8], loaded) || evs[0].HasParent {
				t.Error("the loaded blocks are not stored on the device as a root chain")
			}
			for _, h := range loaded {
				if !e.HostHolds(h) || !e.Holds(h) {
					t.Errorf("loaded block %x: host %v device %v, want both", h, e.HostHolds(h), e.Holds(h))
				}
			}
			two := e.BlockHashes(nil, &Request{HashIDs: []uint64{1, 2}})[8:]
			slices.Reverse(two) // leaves go first
			if !slices.Equal(evs[3].BlockHashes, two) {
				t.Error("the host did not evict block 2's engine blocks")
			}
		}
	}
}

// Partial tails evicted from the device are removed, never offloaded.
func TestCPUOffloadSkipsPartialTails(t *testing.T) {
	e := NewEngine(64, 8, WithCPUOffload(100), WithPartialTails())
	_, first := serveIDs(e, 512-10, "", 1) // 7 full blocks and a tail of 54
	evs, res := serveIDs(e, 512, "", 2)
	if first.TailTokens != 54 || res.Evicted != 8 || res.Offloaded != 7 || e.HostLen() != 7 {
		t.Fatalf("first %+v, second %+v, host %d: %+v", first, res, e.HostLen(), evs)
	}
}

func TestLoRA(t *testing.T) {
	const bs = 16
	e := NewEngine(bs, 10_000, WithLoRA(), WithPartialTails())
	base := map[uint64]bool{}
	evs, _ := serveIDs(e, 1000, "", 1, 2)
	for _, ev := range evs {
		if ev.LoraName != "" || ev.HasLoraID {
			t.Errorf("base model event with an adapter: %+v", ev)
		}
		for _, h := range ev.BlockHashes {
			base[h] = true
		}
	}
	seen := map[uint64]string{}
	for id, name := range Adapters {
		evs, res := serveIDs(e, 1000, name, 1, 2)
		if res.DeviceHits != 0 || len(evs) != 2 {
			t.Fatalf("%s: the base model's blocks were hits (%d), %d events", name, res.DeviceHits, len(evs))
		}
		for _, ev := range evs {
			if ev.LoraName != name || !ev.HasLoraID || ev.LoraID != int64(id+1) || ev.LoraID != LoraID(name) {
				t.Errorf("%s: event lora %q id %d (%v)", name, ev.LoraName, ev.LoraID, ev.HasLoraID)
			}
			for _, h := range ev.BlockHashes {
				if base[h] || seen[h] != "" {
					t.Errorf("%s: hash %x shared with %q", name, h, seen[h])
				}
				seen[h] = name
			}
		}
		if _, res := serveIDs(e, 1000, name, 1, 2, 3); res.DeviceHits != 1000/bs {
			t.Errorf("%s: its own prefix hit %d", name, res.DeviceHits)
		}
	}
	// An engine without WithLoRA runs every request on the base model.
	plain := NewEngine(bs, 10_000)
	r := &Request{HashIDs: []uint64{1, 2}, Lora: Adapters[0]}
	if !slices.Equal(plain.BlockHashes(nil, r), NewEngine(bs, 1).BlockHashes(nil, &Request{HashIDs: r.HashIDs})) {
		t.Error("an engine without WithLoRA honours Lora")
	}
}

func TestTracesAssignAdapters(t *testing.T) {
	reqs, source, err := Trace(0)
	if err != nil {
		t.Fatal(err)
	}
	for name, reqs := range map[string][]Request{source: reqs, "synthetic": SyntheticTrace(TraceRequests, 1)} {
		count := map[string]int{}
		byConversation := map[uint64]string{}
		for i, r := range reqs {
			count[r.Lora]++
			if r.Lora != "" && LoraID(r.Lora) == 0 {
				t.Fatalf("%s: request %d: adapter %q", name, i, r.Lora)
			}
			if name != "synthetic" {
				if r.Lora != Adapter(r.HashIDs) {
					t.Fatalf("%s: request %d: adapter %q, Adapter says %q", name, i, r.Lora, Adapter(r.HashIDs))
				}
				continue
			}
			key := r.HashIDs[len(r.HashIDs)-1] // a synthetic id is fresh in one conversation, system ids excepted
			if key >= 1012 {
				if prev, ok := byConversation[key]; ok && prev != r.Lora {
					t.Fatalf("%s: request %d changes adapter mid-conversation", name, i)
				}
				byConversation[key] = r.Lora
			}
		}
		adapted := len(reqs) - count[""]
		if adapted < len(reqs)/8 || adapted > len(reqs)*3/8 || count[Adapters[0]] == 0 || count[Adapters[1]] == 0 {
			t.Errorf("%s: adapters %v of %d requests, want about 1 in 4", name, count, len(reqs))
		}
	}
}

func TestSyntheticTraceIsUnchangedButForTailsAndAdapters(t *testing.T) {
	a, b := SyntheticTrace(500, 9), SyntheticTrace(500, 9)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("not deterministic")
	}
	tails := 0
	for i, r := range a {
		n := len(r.HashIDs)
		if r.InputLength <= (n-1)*TraceBlockTokens || r.InputLength > n*TraceBlockTokens || PromptLen(&r) != r.InputLength {
			t.Fatalf("request %d: %d tokens in %d blocks", i, r.InputLength, n)
		}
		if got := InputTokens(nil, &r); len(got) != r.InputLength || !slices.Equal(got, PromptTokens(nil, &r)[:r.InputLength]) {
			t.Fatalf("request %d: InputTokens", i)
		}
		if r.InputLength%16 != 0 {
			tails++
		}
	}
	if tails < len(a)/2 {
		t.Errorf("only %d of %d prompts end in a partial block of 16", tails, len(a))
	}
}
