package codec_test

import (
	"errors"
	"fmt"
	. "github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"strings"
	"testing"

	"cmp"

	gocmp "github.com/google/go-cmp/cmp"
	"github.com/tinylib/msgp/msgp"

	"github.com/kvpipe/kvpipe/internal/extrakeys"
)

// fullBatch sets every field the format has, each to a value that tells it apart.
func fullBatch() Batch {
	return Batch{TS: 1712.25, DPRank: 2, HasDPRank: true, Events: []Event{
		{Type: BlockStored, BlockHashes: []uint64{1 << 63, 42, 0}, ParentHash: 99, HasParent: true,
			TokenIDs: []uint32{0, 1, 1<<32 - 1, 7, 8, 9}, BlockSize: 2, LoraID: 3, HasLoraID: true,
			Medium: "CPU_PINNED", LoraName: "adapter-a", ExtraKeys: []byte{0x93, 0xc0, 0xc0, 0x92, 0xa1, 'x', 0x05},
			BlockExtra: []uint64{0, 0, digestOf(func(d *extrakeys.Digest) { d.Raw(RawStr, []byte("x"), 0); d.Raw(RawUint, nil, 5) })},
			GroupIdx:   1, HasGroupIdx: true, SpecKind: "sliding_window", SlidingWindow: 4096, HasSlidingWindow: true},
		{Type: BlockStored, BlockHashes: []uint64{5}, TokenIDs: []uint32{1, 2}, BlockSize: 2, CacheSalt: "tenant-7"},
		{Type: BlockRemoved, BlockHashes: []uint64{42, 1 << 63}, Medium: "GPU", GroupIdx: 2, HasGroupIdx: true},
		{Type: AllBlocksCleared},
	}}
}

// keepSlots is what an array layout of n BlockStored slots can carry of e.
func keepSlots(e Event, n int, l engineenc.Layout) Event {
	if e.Type != BlockStored {
		return e
	}
	if !l.SaltKey || e.LoraName != "" || n <= 7 {
		e.CacheSalt = ""
	}
	if n <= 5 {
		e.LoraID, e.HasLoraID = 0, false
	}
	if n <= 6 {
		e.Medium = ""
	}
	if n <= 7 {
		e.LoraName = ""
	}
	if n <= 8 {
		e.ExtraKeys, e.BlockExtra = nil, nil
	}
	if n <= 9 {
		e.GroupIdx, e.HasGroupIdx = 0, false
	}
	if n <= 10 {
		e.SpecKind = ""
	}
	if n <= 11 {
		e.SlidingWindow, e.HasSlidingWindow = 0, false
	}
	return e
}

func TestRoundTripEveryLayout(t *testing.T) {
	layouts := []struct {
		name string
		l    engineenc.Layout
	}{
		{"vllm-map", engineenc.CurrentVLLM},
		{"vllm-map-bin-hashes", engineenc.Layout{BinHashes: true}},
		{"map-batch", engineenc.Layout{MapBatch: true}},
		{"sglang-signed", engineenc.Layout{ArrayEvents: true, StoredSlots: 8, SignedHashes: true}},
		{"sglang-salt-metadata", engineenc.Layout{ArrayEvents: true, StoredSlots: 8, SignedHashes: true, SaltKey: true}},
		{"sglang-salt-map", engineenc.Layout{SignedHashes: true, SaltKey: true}},
		{"array-12-salt", engineenc.Layout{ArrayEvents: true, SaltKey: true}},
		{"array-5", engineenc.Layout{ArrayEvents: true, StoredSlots: 5}},
		{"array-6-lora-id", engineenc.Layout{ArrayEvents: true, StoredSlots: 6}},
		{"array-7-medium", engineenc.Layout{ArrayEvents: true, StoredSlots: 7}},
		{"array-8-lora-name", engineenc.Layout{ArrayEvents: true, StoredSlots: 8}},
		{"array-9-extra-keys", engineenc.Layout{ArrayEvents: true, StoredSlots: 9}},
		{"array-10-group", engineenc.Layout{ArrayEvents: true, StoredSlots: 10}},
		{"array-12-full", engineenc.Layout{ArrayEvents: true}},
		{"array-two-element-batch", engineenc.Layout{ArrayEvents: true, NoDPRank: true}},
	}
	d := NewDecoder()
	for _, tc := range layouts {
		t.Run(tc.name, func(t *testing.T) {
			in := fullBatch()
			want := fullBatch()
			if tc.l.NoDPRank {
				want.DPRank, want.HasDPRank = 0, false
			}
			for i := range want.Events {
				e := &want.Events[i]
				if tc.l.ArrayEvents {
					*e = keepSlots(*e, cmp.Or(tc.l.StoredSlots, 12), tc.l)
				} else if !tc.l.SaltKey {
					e.CacheSalt = "" // vLLM's map form states a salt in extra_keys only
				}
			}
			var got Batch
			if err := d.Decode(engineenc.AppendBatch(nil, &in, tc.l), &got); err != nil {
				t.Fatal(err)
			}
			if diff := gocmp.Diff(want, got, batchCmp); diff != "" {
				t.Errorf("round trip (-want +got):\n%s", diff)
			}
		})
	}
}

// A reused Batch must not show anything of the batch decoded into it before.
func TestReuseLeavesNoStaleFields(t *testing.T) {
	d := NewDecoder()
	var b Batch
	full := fullBatch()
	if err := d.Decode(engineenc.AppendBatch(nil, &full, engineenc.Layout{ArrayEvents: true}), &b); err != nil {
		t.Fatal(err)
	}
	short := Batch{Events: []Event{{Type: BlockStored, BlockHashes: []uint64{8}, TokenIDs: []uint32{3, 4}, BlockSize: 2}}}
	if err := d.Decode(engineenc.AppendBatch(nil, &short, engineenc.Layout{ArrayEvents: true, StoredSlots: 5, NoDPRank: true}), &b); err != nil {
		t.Fatal(err)
	}
	if diff := gocmp.Diff(short, b, batchCmp); diff != "" {
		t.Errorf("stale fields after reuse (-want +got):\n%s", diff)
	}
	// A failed decode leaves no events behind either.
	if err := d.Decode([]byte{0x93, 0xc0}, &b); err == nil || len(b.Events) != 0 {
		t.Errorf("after a bad payload: err=%v, %d events", err, len(b.Events))
	}
}

// Events of a newer engine: longer arrays, unknown keys, keys in any order.
func TestToleratesNewerAndOlderEngines(t *testing.T) {
	stored := func(extraSlots ...func([]byte) []byte) []byte {
		p := msgp.AppendArrayHeader(nil, uint32(12+len(extraSlots)))
		p = msgp.AppendString(p, "BlockStored")
		p = engineenc.AppendHashes(p, []uint64{11}, engineenc.Layout{})
		p = msgp.AppendNil(p)
		p = engineenc.AppendTokens(p, []uint32{1, 2}, false)
		p = msgp.AppendInt(p, 2)
		for range 7 {
			p = msgp.AppendNil(p)
		}
		for _, f := range extraSlots {
			p = f(p)
		}
		return p
	}
	batchOf := func(events ...[]byte) []byte {
		p := msgp.AppendArrayHeader(nil, 3)
		p = msgp.AppendFloat64(p, 0)
		p = msgp.AppendArrayHeader(p, uint32(len(events)))
		for _, e := range events {
			p = append(p, e...)
		}
		return msgp.AppendNil(p)
	}
	mapEvent := func(kv ...any) []byte {
		p := msgp.AppendMapHeader(nil, uint32(len(kv)/2))
		for i := 0; i < len(kv); i += 2 {
			p = msgp.AppendString(p, kv[i].(string))
			p, _ = msgp.AppendIntf(p, kv[i+1])
		}
		return p
	}
	base := Event{Type: BlockStored, BlockHashes: []uint64{11}, TokenIDs: []uint32{1, 2}, BlockSize: 2}
	cases := []struct {
		name    string
		payload []byte
		want    []Event
		skipped int
	}{
		{"array with two future slots", batchOf(stored(
			func(p []byte) []byte { return msgp.AppendString(p, "future") },
			func(p []byte) []byte { return msgp.AppendMapHeader(p, 0) })), []Event{base}, 0},
		{"map with type last and unknown keys", batchOf(mapEvent(
			"block_hashes", []any{11}, "remaining_copy_counts", []any{1, 2}, "token_ids", []any{1, 2},
			"block_size", 2, "parent_block_hash", nil, "type", "BlockStored")), []Event{base}, 0},
		{"unknown tag between two events, array and map", batchOf(stored(),
			mapEvent("type", "BlockMoved", "block_hashes", "not an array"),
			stored()), []Event{base, base}, 1},
		{"array-form unknown tag with odd slots", batchOf(
			append(msgp.AppendString(msgp.AppendArrayHeader(nil, 3), "Future"), 0xc0, 0x81, 0xa1, 'k', 0x01), stored()),
			[]Event{base}, 1},
		{"hash widths and signs", batchOf(mapEvent("type", "BlockRemoved", "medium", nil,
			"block_hashes", []any{int8(-1), uint8(200), int16(-300), uint16(60000), int32(-70000), uint32(4e9), int64(-5e12), uint64(1 << 63)})),
			[]Event{{Type: BlockRemoved, BlockHashes: []uint64{1<<64 - 1, 200, 1<<64 - 300, 60000, 1<<64 - 70000, 4e9, 1<<64 - 5e12, 1 << 63}}}, 0},
		{"short bin hash", batchOf(mapEvent("type", "BlockRemoved", "block_hashes", []any{[]byte{1, 2}})),
			[]Event{{Type: BlockRemoved, BlockHashes: []uint64{0x0102}}}, 0},
		{"AllBlocksCleared with medium", batchOf(
			msgp.AppendString(msgp.AppendString(msgp.AppendArrayHeader(nil, 2), "AllBlocksCleared"), "CPU")),
			[]Event{{Type: AllBlocksCleared, Medium: "CPU"}}, 0},
	}
	d := NewDecoder()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var b Batch
			if err := d.Decode(tc.payload, &b); err != nil {
				t.Fatal(err)
			}
			if diff := gocmp.Diff(tc.want, b.Events, batchCmp); diff != "" {
				t.Errorf("events (-want +got):\n%s", diff)
			}
			if b.Skipped != tc.skipped {
				t.Errorf("skipped = %d, want %d", b.Skipped, tc.skipped)
			}
		})
	}
}

func TestDecodeErrors(t *testing.T) {
	good := fullBatch()
	valid := engineenc.AppendBatch(nil, &good, engineenc.CurrentVLLM)
	// ev builds a batch of a valid BlockStored followed by a map event of the given fields.
	ev := func(fields ...any) []byte {
		p := msgp.AppendArrayHeader(nil, 3)
		p = msgp.AppendFloat64(p, 0)
		p = msgp.AppendArrayHeader(p, 2)
		p = engineenc.AppendEvent(p, &good.Events[1], engineenc.CurrentVLLM)
		p = msgp.AppendMapHeader(p, uint32(len(fields)/2))
		for i := 0; i < len(fields); i += 2 {
			p = msgp.AppendString(p, fields[i].(string))
			p, _ = msgp.AppendIntf(p, fields[i+1])
		}
		return msgp.AppendNil(p)
	}
	cases := []struct {
		name    string
		payload []byte
		want    string
		kept    int // events decoded beside the bad one; -1: the batch is rejected
	}{
		{"empty", nil, "batch: expected array or map, got end of payload", -1},
		{"not a batch", msgp.AppendString(nil, "hello"), "batch: expected array or map, got str", -1},
		{"one-element batch", msgp.AppendFloat64(msgp.AppendArrayHeader(nil, 1), 0), "batch: array of 1 elements, want at least 2 (ts, events)", -1},
		{"ts as string", msgp.AppendString(msgp.AppendArrayHeader(nil, 2), "x"), "batch: ts: expected float64, got str", -1},
		{"truncated in the middle", valid[:len(valid)/2], "truncated payload", -1},
		{"truncated by one byte", valid[:len(valid)-1], "batch: data_parallel_rank: truncated payload", -1},
		{"trailing garbage", append(append([]byte{}, valid...), 0x01), "batch: 1 trailing bytes after the batch", -1},
		{"token_ids as string", ev("type", "BlockStored", "block_hashes", []any{1}, "token_ids", "abc", "block_size", 2),
			"event 1: token_ids: expected array, got str", 1},
		{"token id as float", ev("type", "BlockStored", "block_hashes", []any{1}, "token_ids", []any{1, 2.5}, "block_size", 2),
			"event 1: token_ids: [1]: expected int, got float64", 1},
		{"negative token id", ev("type", "BlockStored", "block_hashes", []any{1}, "token_ids", []any{-4}, "block_size", 2),
			"event 1: token_ids: [0]: token id -4 out of range", 1},
		{"hash as string", ev("type", "BlockRemoved", "block_hashes", []any{"h"}),
			"event 1: block_hashes: [0]: expected int, got str", 1},
		{"block_size as string", ev("type", "BlockStored", "block_hashes", []any{1}, "token_ids", []any{1}, "block_size", "16"),
			"event 1: block_size: expected int, got str", 1},
		{"negative block size", ev("type", "BlockStored", "block_hashes", []any{1}, "token_ids", []any{1}, "block_size", -16),
			"event 1: block_size: -16 out of range", 1},
		{"medium as int", ev("type", "BlockRemoved", "block_hashes", []any{1}, "medium", 3),
			"event 1: medium: expected str, got int", 1},
		{"missing block_hashes", ev("type", "BlockRemoved", "medium", nil), "event 1: block_hashes: missing", 1},
		{"missing type", ev("block_hashes", []any{1}), "event 1: type: missing", 1},
		{"type as int", ev("type", 7), "event 1: type: expected str, got int", 1},
		{"event as int", append(msgp.AppendArrayHeader(msgp.AppendFloat64(msgp.AppendArrayHeader(nil, 2), 0), 1), 0x05),
			"event 0: expected array or map, got int", 0},
		{"short stored array", append(msgp.AppendString(msgp.AppendArrayHeader(msgp.AppendArrayHeader(msgp.AppendFloat64(msgp.AppendArrayHeader(nil, 2), 0), 1), 2), "BlockStored"), 0x90),
			"event 0: BlockStored array of 2 elements, want at least 5", 0},
		{"oversize events array", append(msgp.AppendFloat64(msgp.AppendArrayHeader(nil, 2), 0), 0xdd, 0xff, 0xff, 0xff, 0xff),
			"batch: events: array of 4294967295 elements exceeds the limit of 65536", -1},
		{"events array longer than the payload", append(msgp.AppendFloat64(msgp.AppendArrayHeader(nil, 2), 0), 0xdc, 0x01, 0x00, 0xc0),
			"batch: events: array of 256 elements in 1 remaining bytes", -1},
		{"invalid prefix byte", append(msgp.AppendFloat64(msgp.AppendArrayHeader(nil, 2), 0), 0x91, 0xc1),
			"event 0: expected array or map, got <invalid>", -1},
	}
	d := NewDecoder()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var b Batch
			err, whole := firstErr(d, tc.payload, &b)
			if err == nil {
				t.Fatalf("no error; decoded %d events", len(b.Events))
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q, want it to contain %q", err, tc.want)
			}
			if whole != (tc.kept < 0) {
				t.Errorf("batch rejected: %v, want %v", whole, tc.kept < 0)
			}
			if !whole && (len(b.Events) != tc.kept || len(b.Invalid) != 1) {
				t.Errorf("kept %d events and %d errors, want %d and 1", len(b.Events), len(b.Invalid), tc.kept)
			}
		})
	}
}

// firstErr decodes p into b and returns the batch's error, else the first
// event's; whole says it is the batch's. Either is a *Error.
func firstErr(d *Decoder, p []byte, b *Batch) (err error, whole bool) {
	if err := d.Decode(p, b); err != nil {
		if _, ok := err.(*Error); !ok {
			return fmt.Errorf("error %T is not a *codec.Error: %w", err, err), true
		}
		return err, true
	}
	if len(b.Invalid) > 0 {
		return b.Invalid[0], false
	}
	return nil, false
}

func TestSteadyStateDecodeAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	payload := realisticPayload(engineenc.CurrentVLLM)
	d := NewDecoder()
	var b Batch
	if err := d.Decode(payload, &b); err != nil {
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(100, func() {
		if err := d.Decode(payload, &b); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("steady-state Decode allocates %.1f times per batch, want 0", allocs)
	}
}

// AppendBatch into a buffer with room allocates nothing, in every event form.
func TestAppendBatchAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	for _, tc := range encodeLayouts {
		b := realisticBatch()
		dst := engineenc.AppendBatch(nil, &b, tc.l)
		if allocs := testing.AllocsPerRun(100, func() { dst = engineenc.AppendBatch(dst[:0], &b, tc.l) }); allocs != 0 {
			t.Errorf("%s: engineenc.AppendBatch allocates %.1f times per batch, want 0", tc.name, allocs)
		}
	}
}

// A Decoder needs no constructor: the zero value and a literal with only
// limits decode as NewDecoder's does (they panicked on the intern table, or
// rejected everything with zero limits).
func TestDecoderZeroValue(t *testing.T) {
	e := Event{Type: BlockStored, BlockHashes: []uint64{7}, TokenIDs: make([]uint32, 16), BlockSize: 16, Medium: "a-new-medium"}
	p := engineenc.AppendBatch(nil, &Batch{TS: 1, Events: []Event{e}}, engineenc.CurrentVLLM)
	for name, d := range map[string]*Decoder{"zero": {}, "limits only": LimitedDecoder(DefaultLimits), "one limit": LimitedDecoder(DecodeLimits{MaxTokens: 8})} {
		var b Batch
		err := d.Decode(p, &b)
		if name == "one limit" {
			if err != nil || len(b.Invalid) != 1 || len(b.Events) != 0 {
				t.Errorf("%s: 16 tokens past a limit of 8 decoded", name)
			}
			continue
		}
		if err != nil || len(b.Events) != 1 || b.Events[0].Medium != "a-new-medium" || len(b.Events[0].TokenIDs) != 16 {
			t.Errorf("%s: %v, %+v", name, err, b.Events)
		}
	}
}

// A *Error wraps the msgpack reader's error, for errors.Is.
func TestErrorUnwraps(t *testing.T) {
	p := engineenc.AppendBatch(nil, &Batch{TS: 1, Events: []Event{{Type: AllBlocksCleared}}}, engineenc.CurrentVLLM)
	var b Batch
	err := NewDecoder().Decode(p[:len(p)-3], &b)
	var ce *Error
	if !errors.As(err, &ce) || !errors.Is(err, msgp.ErrShortBytes) {
		t.Errorf("truncated batch: %v (%T); want a *codec.Error wrapping msgp.ErrShortBytes", err, err)
	}
}
