package codec_test

import (
	. "github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"strings"
	"testing"

	gocmp "github.com/google/go-cmp/cmp"
	"github.com/tinylib/msgp/msgp"
)

// eagleBatch is an SGLang EAGLE engine's step: bigram BlockStored events of
// one and of three blocks of 4, a plain one, and a BlockRemoved.
func eagleBatch() Batch {
	return Batch{TS: 3, HasDPRank: true, Events: []Event{
		{Type: BlockStored, BlockHashes: []uint64{0xfedcba9876543211}, TokenIDs: []uint32{1, 2, 3, 4, 5}, Bigram: true, BlockSize: 4, Medium: "GPU"},
		{Type: BlockStored, BlockHashes: []uint64{7, 8, 9}, ParentHash: 0xfedcba9876543211, HasParent: true,
			TokenIDs: []uint32{5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 100000}, Bigram: true, BlockSize: 4, Medium: "GPU"},
		{Type: BlockStored, BlockHashes: []uint64{10}, TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 4},
		{Type: BlockRemoved, BlockHashes: []uint64{7}},
	}}
}

// Bigram token ids decode flattened, the event marked, in every layout an
// engine with them uses: SGLang's array events (7 slots, 8 with a salt
// map), its map events, and the longer vLLM-shaped arrays and batch maps.
func TestBigramsDecodeInEveryLayout(t *testing.T) {
	layouts := []engineenc.Layout{
		{ArrayEvents: true, StoredSlots: 7, SignedHashes: true},
		{ArrayEvents: true, StoredSlots: 8, SignedHashes: true, SaltKey: true},
		{SignedHashes: true, SaltKey: true},
		{ArrayEvents: true},
		engineenc.CurrentVLLM,
		{MapBatch: true, BinHashes: true},
	}
	d := NewDecoder()
	for _, l := range layouts {
		want := eagleBatch()
		want.Events[0].CacheSalt = "tenant-1"
		p := engineenc.AppendBatch(nil, &want, l)
		for i := range want.Events {
			want.Events[i] = keepSlots(want.Events[i], max(l.StoredSlots, 12*boolInt(l.StoredSlots == 0)), l)
		}
		if !l.SaltKey {
			want.Events[0].CacheSalt = ""
		}
		var got Batch
		if err := d.Decode(p, &got); err != nil {
			t.Fatalf("%+v: %v", l, err)
		}
		if diff := gocmp.Diff(want, got, batchCmp); diff != "" {
			t.Errorf("%+v (-want +got):\n%s", l, diff)
		}
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// What is not a chain of bigrams is an error of its event alone.
func TestBigramErrors(t *testing.T) {
	stored := func(tokens []byte) []byte {
		p := msgp.AppendArrayHeader(nil, 3)
		p = msgp.AppendFloat64(p, 0)
		p = msgp.AppendArrayHeader(p, 2)
		p = msgp.AppendArrayHeader(p, 5)
		p = msgp.AppendString(p, "BlockStored")
		p = engineenc.AppendHashes(p, []uint64{1}, engineenc.Layout{})
		p = msgp.AppendNil(p)
		p = append(p, tokens...)
		p = engineenc.AppendInt(p, 2)
		p = engineenc.AppendEvent(p, &Event{Type: AllBlocksCleared}, engineenc.Layout{})
		return msgp.AppendNil(p)
	}
	cases := []struct {
		name   string
		tokens []byte
		want   string
	}{
		{"three in a pair", []byte{0x91, 0x93, 1, 2, 3}, "event 0: token_ids: [0]: bigram of 3 elements, want 2"},
		{"not a chain", []byte{0x92, 0x92, 1, 2, 0x92, 3, 4}, "event 0: token_ids: [1]: bigram starts with 3, not 2"},
		{"a string in a pair", []byte{0x91, 0x92, 1, 0xa1, 'x'}, "event 0: token_ids: [0]: expected int, got str"},
		{"negative in a pair", []byte{0x91, 0x92, 0xff, 2}, "event 0: token_ids: [0]: token id -1 out of range"},
		{"a pair after a token", []byte{0x92, 1, 0x92, 1, 2}, "event 0: token_ids: [1]: expected int, got array"},
		{"a token after a pair", []byte{0x92, 0x92, 1, 2, 3}, "event 0: token_ids: [1]: expected array, got int"},
	}
	d := NewDecoder()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var b Batch
			err, whole := firstErr(d, stored(tc.tokens), &b)
			if err == nil || whole || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v (batch rejected: %v), want %q for the event alone", err, whole, tc.want)
			}
			if len(b.Events) != 1 || b.Events[0].Type != AllBlocksCleared {
				t.Errorf("kept %+v, want the AllBlocksCleared after the bad event", b.Events)
			}
		})
	}
}

// A string in the group_idx slot is the spec kind; a kind in its own slot
// after it wins, a nil there keeps it.
func TestKindInGroupSlot(t *testing.T) {
	stored := func(slot9, slot10 any) []byte {
		p := msgp.AppendArrayHeader(nil, 2)
		p = msgp.AppendFloat64(p, 0)
		p = msgp.AppendArrayHeader(p, 1)
		p = msgp.AppendArrayHeader(p, 11)
		p = msgp.AppendString(p, "BlockStored")
		p = engineenc.AppendHashes(p, []uint64{1}, engineenc.Layout{})
		p = msgp.AppendNil(p)
		p = engineenc.AppendTokens(p, []uint32{1, 2}, false)
		p = engineenc.AppendInt(p, 2)
		for range 4 {
			p = msgp.AppendNil(p)
		}
		p, _ = msgp.AppendIntf(p, slot9)
		p, _ = msgp.AppendIntf(p, slot10)
		return p
	}
	cases := []struct {
		slot9, slot10 any
		kind          string
		group         int
		hasGroup      bool
	}{
		{"full_attention", nil, "full_attention", 0, false},
		{"mamba", "sliding_window", "sliding_window", 0, false},
		{3, "mamba", "mamba", 3, true},
		{nil, nil, "", 0, false},
	}
	d := NewDecoder()
	for _, tc := range cases {
		var b Batch
		if err, _ := firstErr(d, stored(tc.slot9, tc.slot10), &b); err != nil {
			t.Fatalf("%v, %v: %v", tc.slot9, tc.slot10, err)
		}
		if e := b.Events[0]; e.SpecKind != tc.kind || e.GroupIdx != tc.group || e.HasGroupIdx != tc.hasGroup {
			t.Errorf("slots %v, %v: kind %q, group %d (%v); want %q, %d (%v)", tc.slot9, tc.slot10,
				e.SpecKind, e.GroupIdx, e.HasGroupIdx, tc.kind, tc.group, tc.hasGroup)
		}
	}
}

// One unreadable event costs only itself, in either form, wherever it is;
// a truncated one still rejects its batch, as nothing after it can be read.
func TestUnreadableEventCostsOnlyItself(t *testing.T) {
	for _, l := range []engineenc.Layout{engineenc.CurrentVLLM, {ArrayEvents: true, StoredSlots: 7}} {
		good := eagleBatch()
		for bad := range good.Events {
			in := eagleBatch()
			in.Events[bad].BlockSize = -1 // out of range: written, never decoded
			var b Batch
			if err := NewDecoder().Decode(engineenc.AppendBatch(nil, &in, l), &b); err != nil {
				t.Fatalf("%+v: the batch was rejected: %v", l, err)
			}
			if in.Events[bad].Type != BlockStored { // BlockRemoved carries no block size
				continue
			}
			if len(b.Invalid) != 1 || b.Invalid[0].Event != bad || b.Invalid[0].Field != "block_size" {
				t.Fatalf("%+v, event %d bad: errors %v", l, bad, b.Invalid)
			}
			if len(b.Events) != len(good.Events)-1 {
				t.Errorf("%+v, event %d bad: kept %d events, want %d", l, bad, len(b.Events), len(good.Events)-1)
			}
		}
	}
	in := eagleBatch()
	p := engineenc.AppendBatch(nil, &in, engineenc.CurrentVLLM)
	var b Batch
	if err := NewDecoder().Decode(p[:len(p)/2], &b); err == nil || len(b.Events) != 0 || len(b.Invalid) != 0 {
		t.Errorf("truncated: %v, %d events, %d errors; want the batch rejected", err, len(b.Events), len(b.Invalid))
	}
}

// Bigram events decode without allocating once the batch has grown, as
// plain ones do.
func TestSteadyStateBigramDecodeAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	for _, l := range []engineenc.Layout{{ArrayEvents: true, StoredSlots: 7, SignedHashes: true}, {SignedHashes: true, SaltKey: true}} {
		in := eagleBatch()
		p := engineenc.AppendBatch(nil, &in, l)
		d := NewDecoder()
		var b Batch
		if err := d.Decode(p, &b); err != nil {
			t.Fatal(err)
		}
		allocs := testing.AllocsPerRun(100, func() {
			if err := d.Decode(p, &b); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("%+v: steady-state bigram Decode allocates %.1f times per batch, want 0", l, allocs)
		}
	}
}
