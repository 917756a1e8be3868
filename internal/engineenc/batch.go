package engineenc

import (
	"encoding/binary"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/tinylib/msgp/msgp"
)

// Layout selects which engine version's encoding AppendBatch writes.
type Layout struct {
	// ArrayEvents writes events as positional arrays (vLLM 0.25 and older,
	// older SGLang); otherwise as maps tagged by "type" (current vLLM).
	ArrayEvents bool
	// StoredSlots is the BlockStored array length, tag included (5..12), as
	// each engine version wrote it; 0 means all 12. Fields past it are lost.
	StoredSlots int
	// MapBatch writes the batch as a map (one intermediate vLLM build).
	MapBatch bool
	// NoDPRank writes the two-element batch of old versions.
	NoDPRank bool
	// BinHashes writes block hashes as 32-byte digests (vLLM with
	// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) whose last 8 bytes are the hash.
	BinHashes bool
	// SignedHashes writes block hashes as signed int64, as SGLang does.
	SignedHashes bool
	// SaltKey writes Event.CacheSalt the way SGLang does: in map events as a
	// cache_salt key (and lora_name only when set, SGLang's map form having
	// none), in array events as the metadata map {"cache_salt": salt} in the
	// lora_name slot when LoraName is empty. Without it the salt is written
	// nowhere but in ExtraKeys, where vLLM states it.
	SaltKey bool
}

// CurrentVLLM is the layout of current vLLM releases.
var CurrentVLLM = Layout{}

// AppendBatch appends the msgpack encoding of b to dst.
func AppendBatch(dst []byte, b *codec.Batch, l Layout) []byte {
	switch {
	case l.MapBatch:
		n := uint32(2)
		if b.HasDPRank {
			n = 3
		}
		dst = msgp.AppendMapHeader(dst, n)
		dst = msgp.AppendString(dst, "ts")
		dst = msgp.AppendFloat64(dst, b.TS)
		dst = msgp.AppendString(dst, "events")
	case l.NoDPRank:
		dst = msgp.AppendArrayHeader(dst, 2)
		dst = msgp.AppendFloat64(dst, b.TS)
	default:
		dst = msgp.AppendArrayHeader(dst, 3)
		dst = msgp.AppendFloat64(dst, b.TS)
	}
	dst = msgp.AppendArrayHeader(dst, uint32(len(b.Events)))
	for i := range b.Events {
		dst = AppendEvent(dst, &b.Events[i], l)
	}
	switch {
	case l.MapBatch && b.HasDPRank:
		dst = msgp.AppendString(dst, "data_parallel_rank")
		dst = AppendInt(dst, b.DPRank)
	case l.MapBatch || l.NoDPRank:
	case b.HasDPRank:
		dst = AppendInt(dst, b.DPRank)
	default:
		dst = msgp.AppendNil(dst)
	}
	return dst
}

// AppendEvent appends one event as l writes it: a positional array or a
// map. Tests build batches around it that AppendBatch would not write.
func AppendEvent(dst []byte, e *codec.Event, l Layout) []byte {
	if l.ArrayEvents {
		return appendArrayEvent(dst, e, l)
	}
	return appendMapEvent(dst, e, l)
}

func appendMapEvent(dst []byte, e *codec.Event, l Layout) []byte {
	switch e.Type {
	case codec.BlockStored:
		return appendMapStored(dst, e, l)
	case codec.BlockRemoved:
		// vLLM's map form has no spec kind or window on BlockRemoved; they
		// are written when set all the same, so that this form carries
		// every field the decoder keeps.
		dst = msgp.AppendMapHeader(dst, 3+count(e.HasGroupIdx)+count(e.SpecKind != "")+count(e.HasSlidingWindow))
		dst = AppendKey(dst, "type", "BlockRemoved")
		dst = msgp.AppendString(dst, "block_hashes")
		dst = AppendHashes(dst, e.BlockHashes, l)
		dst = msgp.AppendString(dst, "medium")
		dst = appendOptString(dst, e.Medium)
		return appendMapGroup(dst, e)
	}
	if e.Medium == "" {
		return AppendKey(msgp.AppendMapHeader(dst, 1), "type", "AllBlocksCleared")
	}
	dst = AppendKey(msgp.AppendMapHeader(dst, 2), "type", "AllBlocksCleared")
	return AppendKey(dst, "medium", e.Medium)
}

// appendMapStored writes a BlockStored map: fields without a default always,
// defaulted ones only when set.
func appendMapStored(dst []byte, e *codec.Event, l Layout) []byte {
	n := uint32(7)
	withLoraName := !l.SaltKey || e.LoraName != ""
	withSalt := l.SaltKey && e.CacheSalt != ""
	n += count(withLoraName) + count(withSalt)
	n += count(e.ExtraKeys != nil) + count(e.HasGroupIdx) + count(e.SpecKind != "") + count(e.HasSlidingWindow)
	dst = msgp.AppendMapHeader(dst, n)
	dst = AppendKey(dst, "type", "BlockStored")
	dst = msgp.AppendString(dst, "block_hashes")
	dst = AppendHashes(dst, e.BlockHashes, l)
	dst = msgp.AppendString(dst, "parent_block_hash")
	dst = appendOptHash(dst, e.ParentHash, e.HasParent, l)
	dst = msgp.AppendString(dst, "token_ids")
	dst = AppendTokens(dst, e.TokenIDs, e.Bigram)
	dst = msgp.AppendString(dst, "block_size")
	dst = AppendInt(dst, int64(e.BlockSize))
	dst = msgp.AppendString(dst, "lora_id")
	dst = appendOptInt(dst, e.LoraID, e.HasLoraID)
	dst = msgp.AppendString(dst, "medium")
	dst = appendOptString(dst, e.Medium)
	if withLoraName {
		dst = msgp.AppendString(dst, "lora_name")
		dst = appendOptString(dst, e.LoraName)
	}
	if withSalt {
		dst = AppendKey(dst, "cache_salt", e.CacheSalt)
	}
	if e.ExtraKeys != nil {
		dst = msgp.AppendString(dst, "extra_keys")
		dst = append(dst, e.ExtraKeys...)
	}
	return appendMapGroup(dst, e)
}

// appendMapGroup writes the group fields of a map event that are set.
func appendMapGroup(dst []byte, e *codec.Event) []byte {
	if e.HasGroupIdx {
		dst = msgp.AppendString(dst, "group_idx")
		dst = AppendInt(dst, int64(e.GroupIdx))
	}
	if e.SpecKind != "" {
		dst = AppendKey(dst, "kv_cache_spec_kind", e.SpecKind)
	}
	if e.HasSlidingWindow {
		dst = msgp.AppendString(dst, "kv_cache_spec_sliding_window")
		dst = AppendInt(dst, int64(e.SlidingWindow))
	}
	return dst
}

// appendArrayEvent writes e as a positional array. Positions come only from
// the slot tables (slots.go), values from the switch on field id below
// (unset fields are nil): a table out of order cannot be cancelled out by a
// second mistake here, and slots_test.go checks the tables' order against
// docs/FORMAT.md §8.2. The switch stays in the loop: a function per field
// cost a call per slot.
func appendArrayEvent(dst []byte, e *codec.Event, l Layout) []byte {
	t := e.Type
	slots := slotsOf(t)
	if slots == nil { // an unknown event type has no encoding; appendMapEvent does the same
		t = codec.AllBlocksCleared
		slots = slotsOf(t)
	}
	slots = slots[:arrayLen(t, slots, e, l)]
	dst = msgp.AppendArrayHeader(dst, uint32(len(slots)))
	for _, f := range slots {
		switch f {
		case fieldType:
			dst = msgp.AppendString(dst, t.String())
		case fieldBlockHashes:
			dst = AppendHashes(dst, e.BlockHashes, l)
		case fieldParent:
			dst = appendOptHash(dst, e.ParentHash, e.HasParent, l)
		case fieldTokenIDs:
			dst = AppendTokens(dst, e.TokenIDs, e.Bigram)
		case fieldBlockSize:
			dst = AppendInt(dst, int64(e.BlockSize))
		case fieldLoraID:
			dst = appendOptInt(dst, e.LoraID, e.HasLoraID)
		case fieldMedium:
			dst = appendOptString(dst, e.Medium)
		case fieldLoraName:
			if e.LoraName == "" && l.SaltKey && e.CacheSalt != "" {
				dst = AppendKey(msgp.AppendMapHeader(dst, 1), "cache_salt", e.CacheSalt)
			} else {
				dst = appendOptString(dst, e.LoraName)
			}
		case fieldExtraKeys:
			if e.ExtraKeys == nil {
				dst = msgp.AppendNil(dst)
			} else {
				dst = append(dst, e.ExtraKeys...) // already msgpack
			}
		case fieldGroupIdx:
			dst = appendOptInt(dst, int64(e.GroupIdx), e.HasGroupIdx)
		case fieldSpecKind:
			dst = appendOptString(dst, e.SpecKind)
		case fieldSlidingWindow:
			dst = appendOptInt(dst, int64(e.SlidingWindow), e.HasSlidingWindow)
		default: // a field the tables do not hold: keep the slot
			dst = msgp.AppendNil(dst)
		}
	}
	return dst
}

// shortSlots is the length, tag included, older engines sent BlockRemoved
// (through medium) and AllBlocksCleared (the tag alone) with.
var shortSlots = [...]int{codec.BlockRemoved: 3, codec.AllBlocksCleared: 1}

// arrayLen is how many of t's slots e's array holds. BlockStored takes the
// layout's length; the other tags the short form, or the whole table as soon
// as a field past it is set, so that no set field is ever dropped.
func arrayLen(t codec.EventType, slots []field, e *codec.Event, l Layout) int {
	if t == codec.BlockStored {
		n := l.StoredSlots
		if n == 0 || n > len(slots) {
			n = len(slots)
		}
		return max(n, minStoredSlots)
	}
	for _, f := range slots[shortSlots[t]:] {
		if isSet(f, e, l) {
			return len(slots)
		}
	}
	return shortSlots[t]
}

// isSet reports whether e holds a value for f other than nil. A field with
// no nil form (hashes, tokens, block size) is always set.
func isSet(f field, e *codec.Event, l Layout) bool {
	switch f {
	case fieldParent:
		return e.HasParent
	case fieldLoraID:
		return e.HasLoraID
	case fieldMedium:
		return e.Medium != ""
	case fieldLoraName:
		return e.LoraName != "" || l.SaltKey && e.CacheSalt != ""
	case fieldExtraKeys:
		return e.ExtraKeys != nil
	case fieldGroupIdx:
		return e.HasGroupIdx
	case fieldSpecKind:
		return e.SpecKind != ""
	case fieldSlidingWindow:
		return e.HasSlidingWindow
	}
	return true
}

func count(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}

// AppendKey writes a map entry of string key and string value.
func AppendKey(dst []byte, key, value string) []byte {
	return msgp.AppendString(msgp.AppendString(dst, key), value)
}

// binFiller stands in for the 24 leading digest bytes the decoder ignores.
var binFiller = [24]byte{0: 0xde, 1: 0xad, 23: 0xbe}

func appendHash(dst []byte, h uint64, l Layout) []byte {
	switch {
	case l.SignedHashes:
		return msgp.AppendInt64(dst, int64(h))
	case !l.BinHashes:
		return msgp.AppendUint64(dst, h)
	}
	var digest [32]byte
	copy(digest[:], binFiller[:])
	binary.BigEndian.PutUint64(digest[24:], h)
	return msgp.AppendBytes(dst, digest[:])
}

// AppendHashes writes an array of block hashes in l's form.
func AppendHashes(dst []byte, hashes []uint64, l Layout) []byte {
	dst = msgp.AppendArrayHeader(dst, uint32(len(hashes)))
	for _, h := range hashes {
		dst = appendHash(dst, h, l)
	}
	return dst
}

func appendOptHash(dst []byte, h uint64, ok bool, l Layout) []byte {
	if !ok {
		return msgp.AppendNil(dst)
	}
	return appendHash(dst, h, l)
}

// AppendTokens writes tokens, as bigrams [[t0,t1],[t1,t2],...] when bigram
// is set (SGLang with EAGLE) and there are two or more.
func AppendTokens(dst []byte, tokens []uint32, bigram bool) []byte {
	if bigram && len(tokens) > 1 {
		dst = msgp.AppendArrayHeader(dst, uint32(len(tokens)-1))
		for i := 1; i < len(tokens); i++ {
			dst = msgp.AppendArrayHeader(dst, 2)
			dst = msgp.AppendUint32(msgp.AppendUint32(dst, tokens[i-1]), tokens[i])
		}
		return dst
	}
	dst = msgp.AppendArrayHeader(dst, uint32(len(tokens)))
	for _, t := range tokens {
		dst = msgp.AppendUint32(dst, t)
	}
	return dst
}

func appendOptInt(dst []byte, v int64, ok bool) []byte {
	if !ok {
		return msgp.AppendNil(dst)
	}
	return AppendInt(dst, v)
}

// AppendInt writes v in the shortest form, unsigned when v >= 0, as msgspec
// (every engine) does; msgp.AppendInt64 would write 128 as an int16.
func AppendInt(dst []byte, v int64) []byte {
	if v >= 0 {
		return msgp.AppendUint64(dst, uint64(v))
	}
	return msgp.AppendInt64(dst, v)
}

func appendOptString(dst []byte, s string) []byte {
	if s == "" {
		return msgp.AppendNil(dst)
	}
	return msgp.AppendString(dst, s)
}
