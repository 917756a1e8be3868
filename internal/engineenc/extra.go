package engineenc

import "github.com/tinylib/msgp/msgp"

// ExtraKind is the kind of one extra-key entry AppendExtraKeys writes.
type ExtraKind uint8

const (
	// ExtraMultiModal is a multimodal input the block covers: Hash, and
	// Offset, its first placeholder relative to the block's first token
	// (Modality in the typed form only).
	ExtraMultiModal ExtraKind = iota + 1
	// ExtraLoRA names the request's adapter (Name).
	ExtraLoRA
	// ExtraCacheSalt is the request's salt (Name), on the block at token 0.
	ExtraCacheSalt
	// ExtraPromptEmbeds is the hash of the block's prompt embeddings (Bytes).
	ExtraPromptEmbeds
	// ExtraRaw is one msgpack value (Raw) written as it is: a shape this
	// version does not know (wrapped as a "legacy" key in the typed form).
	ExtraRaw
)

// ExtraKey is one entry of one block's extra keys.
type ExtraKey struct {
	Kind     ExtraKind
	Hash     string // ExtraMultiModal: the content identifier
	Modality string // ExtraMultiModal, typed form: "image", "audio", ...
	Offset   int64  // ExtraMultiModal: relative to the block's first token
	Name     string // ExtraLoRA, ExtraCacheSalt
	Bytes    []byte // ExtraPromptEmbeds
	Raw      []byte // ExtraRaw: one msgpack value
}

// ExtraForm is the encoding of extra_keys an engine version writes.
type ExtraForm uint8

const (
	// ExtraTuples is vLLM 0.19.1 and later: one tuple per block of bare
	// values, a multimodal input as an [identifier, offset] pair, the
	// adapter and the salt as strings, prompt embeddings as bytes.
	ExtraTuples ExtraForm = iota
	// ExtraBareIDs is vLLM from its first extra_keys to 0.19.0: as
	// ExtraTuples, but a multimodal input is its bare identifier, without
	// offset.
	ExtraBareIDs
	// ExtraTyped is vLLM's typed schema (event_version 1): each entry a map
	// tagged by "type": "mm", "lora", "cache_salt", "prompt_embeds" or
	// "legacy", its fields in declaration order.
	ExtraTyped
)

// AppendExtraKeys appends the msgpack of an extra_keys value, one array per
// block (nil for a block without extra keys), in form f; Event.ExtraKeys
// takes the result.
func AppendExtraKeys(dst []byte, blocks [][]ExtraKey, f ExtraForm) []byte {
	dst = msgp.AppendArrayHeader(dst, uint32(len(blocks)))
	for _, keys := range blocks {
		if keys == nil {
			dst = msgp.AppendNil(dst)
			continue
		}
		dst = msgp.AppendArrayHeader(dst, uint32(len(keys)))
		for i := range keys {
			if f == ExtraTyped {
				dst = appendTypedKey(dst, &keys[i])
			} else {
				dst = appendTupleKey(dst, &keys[i], f)
			}
		}
	}
	return dst
}

func appendTupleKey(dst []byte, k *ExtraKey, f ExtraForm) []byte {
	switch k.Kind {
	case ExtraMultiModal:
		if f == ExtraBareIDs {
			return msgp.AppendString(dst, k.Hash)
		}
		return AppendInt(msgp.AppendString(msgp.AppendArrayHeader(dst, 2), k.Hash), k.Offset)
	case ExtraLoRA, ExtraCacheSalt:
		return msgp.AppendString(dst, k.Name)
	case ExtraPromptEmbeds:
		return msgp.AppendBytes(dst, k.Bytes)
	}
	return appendRaw(dst, k.Raw)
}

func appendTypedKey(dst []byte, k *ExtraKey) []byte {
	switch k.Kind {
	case ExtraMultiModal:
		dst = AppendKey(msgp.AppendMapHeader(dst, 4), "type", "mm")
		dst = AppendKey(dst, "modality", k.Modality)
		dst = AppendKey(dst, "hash", k.Hash)
		return AppendInt(msgp.AppendString(dst, "block_offset"), k.Offset)
	case ExtraLoRA:
		return AppendKey(AppendKey(msgp.AppendMapHeader(dst, 2), "type", "lora"), "name", k.Name)
	case ExtraCacheSalt:
		return AppendKey(AppendKey(msgp.AppendMapHeader(dst, 2), "type", "cache_salt"), "salt", k.Name)
	case ExtraPromptEmbeds:
		dst = AppendKey(msgp.AppendMapHeader(dst, 2), "type", "prompt_embeds")
		return msgp.AppendBytes(msgp.AppendString(dst, "hash"), k.Bytes)
	}
	dst = AppendKey(msgp.AppendMapHeader(dst, 2), "type", "legacy")
	return appendRaw(msgp.AppendString(dst, "value"), k.Raw)
}

// appendRaw writes an already encoded value, nil when there is none.
func appendRaw(dst, raw []byte) []byte {
	if len(raw) == 0 {
		return msgp.AppendNil(dst)
	}
	return append(dst, raw...)
}
