package actor

import (
	"slices"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
)

// sendSGLang sends events as current SGLang publishes them (map events, a
// cache_salt key, signed hashes).
func (h *harness) sendSGLang(events ...codec.Event) {
	h.a.HandleBatch(0, engineenc.AppendBatch(nil, &codec.Batch{Events: events}, engineenc.Layout{SignedHashes: true, SaltKey: true}))
	h.collect()
}

// storedKeys are the router keys of h's device stores, in order.
func (h *harness) storedKeys() []uint64 {
	var out []uint64
	for _, op := range h.ops {
		if op.Kind == index.OpStore && op.Tier == index.TierDevice {
			out = append(out, op.Hash)
		}
	}
	return out
}

// A bigram event is keyed over EAGLE windows, the keys a router computes
// with EagleKeys for the same request, in every case a plain event has:
// several blocks, a split engine block, a salt and adapter, a short tail.
func TestBigramEventsKeyedAsEagleRequests(t *testing.T) {
	prompt := tokens(3, 4, 16)
	prompt = append(prompt, 77, 78) // the window of block 3 needs token 64
	var hs index.Hasher
	cases := []struct {
		name string
		ev   codec.Event
		req  index.Request
		want int // blocks keyed
	}{
		{"four blocks", codec.Event{BlockHashes: []uint64{1, 2, 3, 4}, TokenIDs: prompt[:65], BlockSize: 16}, index.Request{Tokens: prompt}, 4},
		{"tokens short of the last window", codec.Event{BlockHashes: []uint64{1, 2, 3, 4}, TokenIDs: prompt[:64], BlockSize: 16}, index.Request{Tokens: prompt}, 3},
		{"split engine blocks", codec.Event{BlockHashes: []uint64{1, 2}, TokenIDs: prompt[:65], BlockSize: 32}, index.Request{Tokens: prompt}, 4},
		{"salt and adapter id", codec.Event{BlockHashes: []uint64{1, 2}, TokenIDs: prompt[:33], BlockSize: 16, CacheSalt: "t", LoraID: 4, HasLoraID: true},
			index.Request{Tokens: prompt, Salt: "t", LoraID: 4, HasLoraID: true}, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			tc.ev.Type, tc.ev.Bigram = codec.BlockStored, true
			h.sendSGLang(tc.ev)
			want := hs.EagleKeys(nil, &tc.req, 16)[:tc.want]
			if got := h.storedKeys(); !slices.Equal(got, want) {
				t.Errorf("keys %x, want EagleKeys' %x", got, want)
			}
			if !h.a.Stats().Eagle || !h.a.Eagle() {
				t.Error("a worker sending bigrams is not marked EAGLE")
			}
		})
	}
}

// The mode follows the events: set by the config until the first event
// with tokens, then whatever the latest one sends.
func TestEagleModeLearnedFromEvents(t *testing.T) {
	ch := make(chan *index.Batch, 16)
	h := &harness{t: t, a: New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, nil), Eagle: true}), shard: ch}
	if !h.a.Eagle() {
		t.Fatal("Config.Eagle not shown before any event")
	}
	h.send(stored(1, 16))
	if h.a.Eagle() {
		t.Error("still EAGLE after a plain event")
	}
	h.send(stored(2, 16, func(e *codec.Event) { e.TokenIDs, e.Bigram = append(e.TokenIDs, 9), true }))
	if !h.a.Eagle() {
		t.Error("not EAGLE after a bigram event")
	}
	h.send(codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{2}}, cleared())
	if !h.a.Eagle() {
		t.Error("events without tokens changed the mode")
	}
}

// A batch with one unreadable event applies the others, and counts the one.
func TestUnreadableEventAppliesTheRest(t *testing.T) {
	h := newHarness(t)
	bigram := stored(1, 16, func(e *codec.Event) { e.TokenIDs, e.Bigram = append(e.TokenIDs, 9), true })
	bad := stored(2, 16, func(e *codec.Event) { e.BlockSize = -16 }) // written, never read back
	plain := stored(3, 16)
	h.send(bigram, bad, plain)
	st := h.a.Stats()
	if st.Filtered[UnreadableEvent] != 1 || st.DecodeErrors != 0 {
		t.Errorf("unreadable %d, decode errors %d; want 1 and 0", st.Filtered[UnreadableEvent], st.DecodeErrors)
	}
	if st.Stored != 2 || h.stores() != 2 {
		t.Errorf("stored %d events, %d blocks; want the two readable ones", st.Stored, h.stores())
	}
}
