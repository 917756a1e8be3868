package engineenc

import (
	"fmt"
	"github.com/kvpipe/kvpipe/codec"
	"testing"

	gocmp "github.com/google/go-cmp/cmp"
	"github.com/tinylib/msgp/msgp"
)

// rawMsg is a slot whose msgpack bytes are compared as they are (extra_keys).
type rawMsg []byte

// readSlot reads one array element with msgp's primitives, in the form want
// has: a string, nil, an int (as its 64-bit pattern, whatever its width and
// sign), an array of ints, or raw msgpack. It never calls the decoder, so a
// mistake in the slot tables cannot hide behind a matching one in it.
func readSlot(p []byte, want any) (any, []byte, error) {
	switch want.(type) {
	case string:
		return msgp.ReadStringBytes(p)
	case nil:
		rest, err := msgp.ReadNilBytes(p)
		return nil, rest, err
	case uint64:
		return readIntPattern(p)
	case []uint64:
		n, p, err := msgp.ReadArrayHeaderBytes(p)
		if err != nil {
			return nil, p, err
		}
		got := []uint64{}
		for range n {
			var v uint64
			if v, p, err = readIntPattern(p); err != nil {
				return nil, p, err
			}
			got = append(got, v)
		}
		return got, p, nil
	case rawMsg:
		rest, err := msgp.Skip(p)
		return rawMsg(p[:len(p)-len(rest)]), rest, err
	}
	return nil, p, fmt.Errorf("no reader for %T", want)
}

func readIntPattern(p []byte) (uint64, []byte, error) {
	if msgp.NextType(p) == msgp.UintType {
		return msgp.ReadUint64Bytes(p)
	}
	v, rest, err := msgp.ReadInt64Bytes(p)
	return uint64(v), rest, err
}

// slotMismatches walks a one-event batch and says where its event array
// differs from want, position by position.
func slotMismatches(payload []byte, want []any) []string {
	var bad []string
	_, p, err := msgp.ReadArrayHeaderBytes(payload)
	if err == nil {
		_, p, err = msgp.ReadFloat64Bytes(p)
	}
	if err == nil {
		_, p, err = msgp.ReadArrayHeaderBytes(p)
	}
	var n uint32
	if err == nil {
		n, p, err = msgp.ReadArrayHeaderBytes(p)
	}
	if err != nil {
		return []string{"batch: " + err.Error()}
	}
	if int(n) != len(want) {
		bad = append(bad, fmt.Sprintf("array of %d, want %d", n, len(want)))
	}
	for i := 0; i < int(n) && i < len(want); i++ {
		got, rest, err := readSlot(p, want[i])
		if err != nil {
			bad = append(bad, fmt.Sprintf("slot %d: %v (a %s), want %v", i, err, msgp.NextType(p), want[i]))
			if rest, err = msgp.Skip(p); err != nil {
				return append(bad, err.Error())
			}
		} else if diff := gocmp.Diff(want[i], got); diff != "" {
			bad = append(bad, fmt.Sprintf("slot %d (-want +got): %s", i, diff))
		}
		p = rest
	}
	return bad
}

var (
	// Every field set, each to a value no other slot holds; the ints are
	// the numbers of their slots in the format's table.
	slotStored = codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{0x1111, 0x2222}, ParentHash: 2, HasParent: true,
		TokenIDs: []uint32{31, 32, 33, 34, 35, 36, 37, 38}, BlockSize: 4, LoraID: 5, HasLoraID: true, Medium: "CPU",
		LoraName: "adapter-7", ExtraKeys: []byte{0x92, 0x91, 0xa2, 'x', '8', 0xc0}, GroupIdx: 9, HasGroupIdx: true,
		SpecKind: "sliding_window", SlidingWindow: 11, HasSlidingWindow: true}
	slotRemoved = codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{0x3333}, Medium: "DISK", GroupIdx: 3, HasGroupIdx: true,
		SpecKind: "mamba", SlidingWindow: 5, HasSlidingWindow: true}
)

// specStored is slotStored as the BlockStored column of docs/FORMAT.md §8.2
// lays it out, written from that table, not from storedSlots: tag,
// block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
// lora_name, extra_keys, group_idx, kv_cache_spec_kind, sliding_window.
var specStored = []any{"BlockStored", []uint64{0x1111, 0x2222}, uint64(2), []uint64{31, 32, 33, 34, 35, 36, 37, 38},
	uint64(4), uint64(5), "CPU", "adapter-7", rawMsg{0x92, 0x91, 0xa2, 'x', '8', 0xc0}, uint64(9), "sliding_window", uint64(11)}

// slotCases are events whose every array position the format's table gives.
func slotCases() []struct {
	name string
	l    Layout
	e    codec.Event
	want []any
} {
	type tc = struct {
		name string
		l    Layout
		e    codec.Event
		want []any
	}
	cases := []tc{
		{"stored, 0 slots means all 12", Layout{ArrayEvents: true}, slotStored, specStored},
		{"stored, past the table", Layout{ArrayEvents: true, StoredSlots: 13}, slotStored, specStored},
		{"stored, below the minimum", Layout{ArrayEvents: true, StoredSlots: 3}, slotStored, specStored[:5]},
		{"stored, only fields without a nil", Layout{ArrayEvents: true},
			codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{0x5555}, TokenIDs: []uint32{1, 2}, BlockSize: 2},
			[]any{"BlockStored", []uint64{0x5555}, nil, []uint64{1, 2}, uint64(2), nil, nil, nil, nil, nil, nil, nil}},
		// The BlockRemoved column: tag, block_hashes, medium, group_idx,
		// kv_cache_spec_kind, sliding_window.
		{"removed, group fields", Layout{ArrayEvents: true}, slotRemoved,
			[]any{"BlockRemoved", []uint64{0x3333}, "DISK", uint64(3), "mamba", uint64(5)}},
		{"removed, none past medium", Layout{ArrayEvents: true}, codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{0x4444}},
			[]any{"BlockRemoved", []uint64{0x4444}, nil}},
		// The AllBlocksCleared column: tag, then the optional medium.
		{"cleared, medium", Layout{ArrayEvents: true}, codec.Event{Type: codec.AllBlocksCleared, Medium: "CPU"}, []any{"AllBlocksCleared", "CPU"}},
		{"cleared", Layout{ArrayEvents: true}, codec.Event{Type: codec.AllBlocksCleared}, []any{"AllBlocksCleared"}},
	}
	// Each older BlockStored length is a prefix of the full column.
	for n := 5; n < 12; n++ {
		cases = append(cases, tc{fmt.Sprintf("stored, %d slots", n), Layout{ArrayEvents: true, StoredSlots: n}, slotStored, specStored[:n]})
	}
	return cases
}

// The encoder puts every field where docs/FORMAT.md §8.2 says, checked
// without the decoder and without the slot tables both take positions from.
func TestArraySlotsFollowSpec(t *testing.T) {
	for _, tc := range slotCases() {
		t.Run(tc.name, func(t *testing.T) {
			p := AppendBatch(nil, &codec.Batch{Events: []codec.Event{tc.e}}, tc.l)
			for _, m := range slotMismatches(p, tc.want) {
				t.Error(m)
			}
		})
	}
}

// A slot table with any two entries swapped must fail the check of
// TestArraySlotsFollowSpec: the encoder can no longer agree with a wrong
// table behind the format's back. Each swap is undone before the next (the
// tests of this package do not run in parallel).
func TestSwappedSlotTableIsCaught(t *testing.T) {
	for _, typ := range []codec.EventType{codec.BlockStored, codec.BlockRemoved, codec.AllBlocksCleared} {
		slots := slotsOf(typ)
		for i := range slots {
			for j := i + 1; j < len(slots); j++ {
				name := fmt.Sprintf("%s %s<->%s", typ, slots[i], slots[j])
				if slots[i] == fieldType || slots[j] == fieldType {
					name = fmt.Sprintf("%s slot %d<->%d", typ, i, j)
				}
				t.Run(name, func(t *testing.T) {
					slots[i], slots[j] = slots[j], slots[i]
					defer func() { slots[i], slots[j] = slots[j], slots[i] }()
					caught := false
					for _, tc := range slotCases() {
						if tc.e.Type == typ && len(tc.want) > j {
							p := AppendBatch(nil, &codec.Batch{Events: []codec.Event{tc.e}}, tc.l)
							caught = caught || len(slotMismatches(p, tc.want)) > 0
						}
					}
					if !caught {
						t.Error("no case notices the swap")
					}
				})
			}
		}
	}
}

// The position check itself must see a wrong value, a wrong type and a wrong
// length, or the tests above could pass for nothing.
func TestSlotMismatchesNotices(t *testing.T) {
	good := AppendBatch(nil, &codec.Batch{Events: []codec.Event{slotRemoved}}, Layout{ArrayEvents: true})
	spec := []any{"BlockRemoved", []uint64{0x3333}, "DISK", uint64(3), "mamba", uint64(5)}
	if bad := slotMismatches(good, spec); len(bad) != 0 {
		t.Fatalf("the right event reported: %v", bad)
	}
	for name, want := range map[string][]any{
		"value":  {"BlockRemoved", []uint64{0x3333}, "DISK", uint64(4), "mamba", uint64(5)},
		"type":   {"BlockRemoved", []uint64{0x3333}, "DISK", "3", "mamba", uint64(5)},
		"nil":    {"BlockRemoved", []uint64{0x3333}, nil, uint64(3), "mamba", uint64(5)},
		"length": {"BlockRemoved", []uint64{0x3333}, "DISK"},
		"raw":    {"BlockRemoved", rawMsg{0x91, 0x01}, "DISK", uint64(3), "mamba", uint64(5)},
	} {
		if bad := slotMismatches(good, want); len(bad) == 0 {
			t.Errorf("a wrong %s went unnoticed", name)
		}
	}
}
