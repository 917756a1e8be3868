package main

import (
	"bytes"
	"strconv"
	"unicode/utf8"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/tinylib/msgp/msgp"
)

// appendEventJSON writes one event as a JSON object with the engine's field
// names; hashes are unsigned decimal, absent optional fields are null.
func appendEventJSON(dst []byte, e *codec.Event) []byte {
	dst = append(dst, `{"type":`...)
	dst = appendJSONString(dst, e.Type.String())
	if e.Type == codec.AllBlocksCleared {
		if e.Medium != "" {
			dst = append(dst, `,"medium":`...)
			dst = appendJSONString(dst, e.Medium)
		}
		return append(dst, '}')
	}
	dst = append(dst, `,"block_hashes":[`...)
	for i, h := range e.BlockHashes {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = strconv.AppendUint(dst, h, 10)
	}
	dst = append(dst, ']')
	if e.Type == codec.BlockStored {
		dst = append(dst, `,"parent_block_hash":`...)
		if e.HasParent {
			dst = strconv.AppendUint(dst, e.ParentHash, 10)
		} else {
			dst = append(dst, "null"...)
		}
		dst = appendTokensJSON(dst, e)
		dst = append(dst, `,"block_size":`...)
		dst = strconv.AppendInt(dst, int64(e.BlockSize), 10)
		dst = appendOptInt(dst, "lora_id", e.LoraID, e.HasLoraID)
	}
	dst = appendOptString(dst, "medium", e.Medium)
	if e.Type == codec.BlockStored {
		dst = appendOptString(dst, "lora_name", e.LoraName)
		dst = appendOptString(dst, "cache_salt", e.CacheSalt)
		dst = append(dst, `,"extra_keys":`...)
		if e.ExtraKeys == nil {
			dst = append(dst, "null"...)
		} else {
			var buf bytes.Buffer
			if _, err := msgp.UnmarshalAsJSON(&buf, e.ExtraKeys); err != nil {
				dst = append(dst, "null"...)
			} else {
				dst = append(dst, bytes.TrimSpace(buf.Bytes())...)
			}
		}
	}
	dst = appendOptInt(dst, "group_idx", int64(e.GroupIdx), e.HasGroupIdx)
	dst = appendOptString(dst, "kv_cache_spec_kind", e.SpecKind)
	dst = appendOptInt(dst, "kv_cache_spec_sliding_window", int64(e.SlidingWindow), e.HasSlidingWindow)
	return append(dst, '}')
}

// appendTokensJSON writes token_ids, flattened as decoded, and "bigram"
// when the engine sent them as bigrams.
func appendTokensJSON(dst []byte, e *codec.Event) []byte {
	dst = append(dst, `,"token_ids":[`...)
	for i, t := range e.TokenIDs {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = strconv.AppendUint(dst, uint64(t), 10)
	}
	dst = append(dst, ']')
	if e.Bigram {
		dst = append(dst, `,"bigram":true`...)
	}
	return dst
}

func appendOptInt(dst []byte, key string, v int64, ok bool) []byte {
	dst = append(dst, `,"`...)
	dst = append(dst, key...)
	dst = append(dst, `":`...)
	if !ok {
		return append(dst, "null"...)
	}
	return strconv.AppendInt(dst, v, 10)
}

func appendOptString(dst []byte, key, v string) []byte {
	dst = append(dst, `,"`...)
	dst = append(dst, key...)
	dst = append(dst, `":`...)
	if v == "" {
		return append(dst, "null"...)
	}
	return appendJSONString(dst, v)
}

// appendJSONString writes s as a JSON string. Engines send arbitrary bytes
// in string fields: control bytes become \u00XX and invalid UTF-8 becomes
// U+FFFD, as encoding/json does (strconv.AppendQuote would write \x01,
// which is not JSON).
func appendJSONString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				dst = append(dst, '\\', c)
			case c < 0x20:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			default:
				dst = append(dst, c)
			}
			i++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			dst = append(dst, "\\ufffd"...)
		} else {
			dst = append(dst, s[i:i+n]...)
		}
		i += n
	}
	return append(dst, '"')
}
