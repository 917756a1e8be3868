package engineenc

import "github.com/kvpipe/kvpipe/codec"

// field names a slot of an event's positional array.
type field uint8

const (
	fieldType field = iota + 1
	fieldBlockHashes
	fieldParent
	fieldTokenIDs
	fieldBlockSize
	fieldLoraID
	fieldMedium
	fieldLoraName
	fieldExtraKeys
	fieldGroupIdx
	fieldSpecKind
	fieldSlidingWindow
)

var fieldNames = [...]string{fieldType: "type", fieldBlockHashes: "block_hashes", fieldParent: "parent_block_hash",
	fieldTokenIDs: "token_ids", fieldBlockSize: "block_size", fieldLoraID: "lora_id", fieldMedium: "medium",
	fieldLoraName: "lora_name", fieldExtraKeys: "extra_keys", fieldGroupIdx: "group_idx",
	fieldSpecKind: "kv_cache_spec_kind", fieldSlidingWindow: "kv_cache_spec_sliding_window"}

func (f field) String() string { return fieldNames[f] }

// Array slots per tag (docs/FORMAT.md §8.2); slot 0 is the tag. The
// decoder keeps the same tables (TestSlotTablesAgree in package codec).
var (
	storedSlots = [...]field{fieldType, fieldBlockHashes, fieldParent, fieldTokenIDs, fieldBlockSize, fieldLoraID,
		fieldMedium, fieldLoraName, fieldExtraKeys, fieldGroupIdx, fieldSpecKind, fieldSlidingWindow}
	removedSlots = [...]field{fieldType, fieldBlockHashes, fieldMedium, fieldGroupIdx, fieldSpecKind, fieldSlidingWindow}
	clearedSlots = [...]field{fieldType, fieldMedium}
)

// minStoredSlots is the shortest BlockStored array any engine sent, tag
// included.
const minStoredSlots = 5

// slotsOf is the array slot table of t, nil for a tag without one.
func slotsOf(t codec.EventType) []field {
	switch t {
	case codec.BlockStored:
		return storedSlots[:]
	case codec.BlockRemoved:
		return removedSlots[:]
	case codec.AllBlocksCleared:
		return clearedSlots[:]
	}
	return nil
}

// SlotNames names the slots of t's positional array, in order (nil for a
// tag without one), for the test that checks the decoder reads them where
// the encoder writes them.
func SlotNames(t codec.EventType) []string {
	var names []string
	for _, f := range slotsOf(t) {
		names = append(names, f.String())
	}
	return names
}
