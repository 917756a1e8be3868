package codec

import (
	"bytes"
	"fmt"
	"math"

	"github.com/tinylib/msgp/msgp"

	"github.com/kvpipe/kvpipe/internal/extrakeys"
)

// Extra keys (docs/FORMAT.md §10.3). One entry of a block's extra_keys is,
// by its msgpack shape:
//
//   - a map with a string "type": a typed key (vLLM's published schema):
//     "mm" {modality, hash, block_offset}, "lora" {name}, "cache_salt"
//     {salt}, "prompt_embeds" {hash}, "legacy" {value}; another type is an
//     unknown kind, digested whole as raw content;
//   - a [str, int] pair: a multimodal input (identifier, block offset), as
//     vLLM 0.19.1 and later write it in raw tuples;
//   - a string: the LoRA name, the cache salt, or (vLLM before 0.19.1) a
//     multimodal identifier without offset;
//   - bytes: a prompt-embeddings hash;
//   - anything else: raw content.
//
// The digest covers the content entries; entries naming the event's LoRA
// adapter or its cache salt are left out, since the namespace carries them.

// Tags of extrakeys.Digest.Raw for content the digest has no structure
// for. Each msgpack value is fed as its canonical pieces, so its digest does
// not depend on the widths or the str/bin forms the encoder picked.
const (
	rawNil   = 1
	rawFalse = 2
	rawTrue  = 3
	rawNeg   = 4 // a negative int, v its two's-complement bits
	rawUint  = 5 // a non-negative int, v its value
	rawFloat = 6 // v the float64 bits (a float32 is widened)
	rawStr   = 7 // data its bytes
	rawBin   = 8 // data its bytes
	rawArray = 9 // v its length; the elements follow
	rawMap   = 10
	rawExt   = 11 // data its bytes, v its type
)

// maxExtraDepth bounds the nesting of one extra-key entry.
const maxExtraDepth = 16

// extraErr is a failure inside extra_keys, at entry [block][entry] (entry -1 for the block itself).
func extraErr(block, entry int, format string, args ...any) error {
	where := fmt.Sprintf("[%d]", block)
	if entry >= 0 {
		where += fmt.Sprintf("[%d]", entry)
	}
	return &Error{Field: "extra_keys", Msg: where + ": " + fmt.Sprintf(format, args...)}
}

// readMetadata reads SGLang's metadata map in the lora_name slot: its
// cache_salt (str or nil), other keys skipped.
func readMetadata(in *interner, p []byte, e *Event) ([]byte, error) {
	n, p, err := msgp.ReadMapHeaderBytes(p)
	if err != nil {
		return p, err
	}
	var key []byte
	for ; n > 0; n-- {
		if key, p, err = msgp.ReadStringZC(p); err != nil {
			return p, detail("metadata key: " + describe(err, p))
		}
		if string(key) != "cache_salt" {
			if p, err = msgp.Skip(p); err != nil {
				return p, err
			}
			continue
		}
		start := p
		if e.CacheSalt, p, err = in.readOptString(p); err != nil {
			return p, detail("cache_salt: " + describe(err, start))
		}
	}
	return p, nil
}

// digestExtraKeys fills e.BlockExtra from e.ExtraKeys, and e.CacheSalt from
// the first block of a root event when no field stated it.
func (d *Decoder) digestExtraKeys(e *Event) error {
	p := e.ExtraKeys
	if msgp.NextType(p) != msgp.ArrayType {
		return &Error{Field: "extra_keys", Msg: "expected array or nil, got " + typeName(p)}
	}
	n, p, err := readArrayHeader(p, d.limits().MaxBlocks)
	if err != nil {
		return &Error{Field: "extra_keys", Msg: describe(err, p), Err: err}
	}
	if int(n) != len(e.BlockHashes) {
		return &Error{Field: "extra_keys", Msg: fmt.Sprintf("%d entries for %d block hashes", n, len(e.BlockHashes))}
	}
	e.BlockExtra = e.BlockExtra[:0]
	for i := range int(n) {
		switch msgp.NextType(p) {
		case msgp.NilType:
			p = p[1:]
			e.BlockExtra = append(e.BlockExtra, 0)
			continue
		case msgp.ArrayType:
		default:
			return extraErr(i, -1, "expected array or nil, got %s", typeName(p))
		}
		if i == 0 && !e.HasParent && e.CacheSalt == "" {
			// vLLM states the salt on the block at token 0 only.
			e.CacheSalt = d.findSalt(p, e.LoraName)
		}
		var sum uint64
		if sum, p, err = digestBlock(p, e, i); err != nil {
			return err
		}
		e.BlockExtra = append(e.BlockExtra, sum)
	}
	return nil
}

// findSalt returns the cache salt the root block's entries p state: a typed
// cache_salt key, else the last string that is not the lora name (vLLM
// appends the salt after the adapter and the multimodal keys). A malformed
// block yields "", for digestBlock to report.
func (d *Decoder) findSalt(p []byte, lora string) string {
	n, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return ""
	}
	var bare []byte
	for ; n > 0; n-- {
		switch msgp.NextType(p) {
		case msgp.StrType:
			var s []byte
			if s, p, err = msgp.ReadStringZC(p); err != nil {
				return ""
			}
			if lora == "" || string(s) != lora {
				bare = s
			}
			continue
		case msgp.MapType:
			if kind, ok := typedKind(p); ok && string(kind) == "cache_salt" {
				if salt, ok := mapString(p, "salt"); ok {
					return d.strs.intern(salt)
				}
			}
		}
		if p, err = msgp.Skip(p); err != nil {
			return ""
		}
	}
	if bare == nil {
		return ""
	}
	return d.strs.intern(bare)
}

// typedKind returns the "type" of a map entry, ok false when it has none or
// it is not a string, or the map does not parse.
func typedKind(p []byte) ([]byte, bool) {
	v, found, err := mapValue(p, "type")
	if err != nil || !found || msgp.NextType(v) != msgp.StrType {
		return nil, false
	}
	kind, _, err := msgp.ReadStringZC(v)
	return kind, err == nil
}

// mapString returns the string under key in map p.
func mapString(p []byte, key string) ([]byte, bool) {
	v, found, err := mapValue(p, key)
	if err != nil || !found {
		return nil, false
	}
	s, _, err := msgp.ReadStringZC(v)
	return s, err == nil
}

// mapValue returns the bytes from the value under key in map p onwards.
func mapValue(p []byte, key string) ([]byte, bool, error) {
	n, p, err := msgp.ReadMapHeaderBytes(p)
	if err != nil {
		return nil, false, err
	}
	for ; n > 0; n-- {
		if msgp.NextType(p) != msgp.StrType {
			if p, err = msgp.Skip(p); err != nil { // a non-string key
				return nil, false, err
			}
		} else {
			var k []byte
			if k, p, err = msgp.ReadStringZC(p); err != nil {
				return nil, false, err
			}
			if string(k) == key {
				return p, true, nil
			}
		}
		if p, err = msgp.Skip(p); err != nil {
			return nil, false, err
		}
	}
	return nil, false, nil
}

// digestBlock digests the entries array at p of block i of e.
func digestBlock(p []byte, e *Event, i int) (uint64, []byte, error) {
	n, p, err := readArrayHeader(p, math.MaxInt32)
	if err != nil {
		return 0, p, extraErr(i, -1, "%s", describe(err, p))
	}
	var dg extrakeys.Digest
	for j := range int(n) {
		if p, err = digestEntry(&dg, p, e, i, j); err != nil {
			return 0, p, err
		}
	}
	return dg.Sum(), p, nil
}

// isNamespace reports whether s names e's adapter or salt, which the
// namespace carries and the digest leaves out.
func isNamespace(s []byte, e *Event) bool {
	return e.LoraName != "" && string(s) == e.LoraName || e.CacheSalt != "" && string(s) == e.CacheSalt
}

// digestEntry adds entry j of block i at p to dg.
func digestEntry(dg *extrakeys.Digest, p []byte, e *Event, i, j int) ([]byte, error) {
	switch msgp.NextType(p) {
	case msgp.StrType:
		s, rest, err := msgp.ReadStringZC(p)
		if err != nil {
			return p, extraErr(i, j, "%s", describe(err, p))
		}
		if !isNamespace(s, e) {
			dg.Raw(rawStr, s, 0)
		}
		return rest, nil
	case msgp.ArrayType:
		if hash, off, rest, ok := readMMPair(p); ok {
			dg.MultiModalBytes(unprefixed(hash, e.LoraName), off)
			return rest, nil
		}
	case msgp.MapType:
		// A map with a "type" is a typed key; one without is raw content.
		if v, found, err := mapValue(p, "type"); err == nil && found {
			kind, _, err := msgp.ReadStringZC(v)
			if err != nil {
				return p, extraErr(i, j, "type: %s", describe(err, v))
			}
			return digestTyped(dg, p, kind, e, i, j)
		}
	}
	rest, err := digestRaw(dg, p, 0)
	if err != nil {
		return rest, extraErr(i, j, "%s", describe(err, rest))
	}
	return rest, nil
}

// unprefixed strips "<lora>:" from a multimodal identifier: vLLM prefixes
// the identifiers of some LoRA requests with the adapter's name, and its
// typed keys carry the plain hash.
func unprefixed(id []byte, lora string) []byte {
	if lora != "" && len(id) > len(lora) && id[len(lora)] == ':' && bytes.HasPrefix(id, []byte(lora)) {
		return id[len(lora)+1:]
	}
	return id
}

// readMMPair reads a [str, int] pair, the int in the int64 range.
func readMMPair(p []byte) (hash []byte, off int64, rest []byte, ok bool) {
	n, q, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil || n != 2 || msgp.NextType(q) != msgp.StrType {
		return nil, 0, p, false
	}
	if hash, q, err = msgp.ReadStringZC(q); err != nil {
		return nil, 0, p, false
	}
	if off, q, err = readInt(q); err != nil {
		return nil, 0, p, false
	}
	return hash, off, q, true
}

// digestTyped adds a typed entry of the given kind at p.
func digestTyped(dg *extrakeys.Digest, p []byte, kind []byte, e *Event, i, j int) ([]byte, error) {
	t := typedEntry{kind: kind}
	switch string(kind) {
	case "mm", "prompt_embeds", "legacy":
	case "lora":
		t.nameKey = "name"
	case "cache_salt":
		t.nameKey = "salt"
	default: // an unknown kind: its whole map is raw content
		rest, err := digestRaw(dg, p, 0)
		if err != nil {
			return rest, extraErr(i, j, "%s", describe(err, rest))
		}
		return rest, nil
	}
	n, p, err := msgp.ReadMapHeaderBytes(p)
	if err != nil {
		return p, extraErr(i, j, "%s", describe(err, p))
	}
	var key []byte
	for ; n > 0; n-- {
		if key, p, err = msgp.ReadStringZC(p); err != nil {
			return p, extraErr(i, j, "%s: key: %s", kind, describe(err, p))
		}
		at := p
		if p, err = t.field(key, p); err != nil {
			return at, extraErr(i, j, "%s: %s: %s", kind, key, describe(err, at))
		}
	}
	return p, t.fold(dg, e, i, j)
}

// typedEntry is what digestTyped reads of one typed extra key (a map with a
// known "type").
type typedEntry struct {
	kind                      []byte
	nameKey                   string // the field holding a lora or salt key's string
	hash, name, embeds, value []byte
	off                       int64
	hasHash, hasOff, hasName  bool
	hasEmbeds, hasValue       bool
}

// field reads the value of key at p, skipping what the kind does not use.
func (t *typedEntry) field(key, p []byte) ([]byte, error) {
	var err error
	switch kind := string(t.kind); {
	case string(key) == "type":
		p, err = msgp.Skip(p)
	case kind == "mm" && string(key) == "hash":
		t.hash, p, err = msgp.ReadStringZC(p)
		t.hasHash = err == nil
	case kind == "mm" && string(key) == "block_offset":
		t.off, p, err = readInt(p)
		t.hasOff = err == nil
	case kind == "mm" && string(key) == "modality":
		if msgp.IsNil(p) {
			p = p[1:]
		} else {
			_, p, err = msgp.ReadStringZC(p)
		}
	case kind == "prompt_embeds" && string(key) == "hash":
		t.embeds, p, err = msgp.ReadBytesZC(p)
		t.hasEmbeds = err == nil
	case kind == "legacy" && string(key) == "value":
		t.value = p
		p, err = msgp.Skip(p)
		t.hasValue = err == nil
	case t.nameKey != "" && string(key) == t.nameKey:
		t.name, p, err = msgp.ReadStringZC(p)
		t.hasName = err == nil
	default:
		p, err = msgp.Skip(p)
	}
	return p, err
}

// fold adds the entry's contribution to dg, or says why it cannot.
func (t *typedEntry) fold(dg *extrakeys.Digest, e *Event, i, j int) error {
	missing := func(f string) error { return extraErr(i, j, "%s: %s: missing", t.kind, f) }
	switch string(t.kind) {
	case "mm":
		if !t.hasHash {
			return missing("hash")
		}
		if !t.hasOff {
			return missing("block_offset")
		}
		dg.MultiModalBytes(t.hash, t.off)
	case "prompt_embeds":
		if !t.hasEmbeds {
			return missing("hash")
		}
		dg.Raw(rawBin, t.embeds, 0)
	case "legacy":
		if !t.hasValue {
			return missing("value")
		}
		if _, err := digestRaw(dg, t.value, 0); err != nil {
			return extraErr(i, j, "legacy: value: %s", describe(err, t.value))
		}
	default: // lora, cache_salt
		if !t.hasName {
			return missing(t.nameKey)
		}
		if !isNamespace(t.name, e) {
			dg.Raw(rawStr, t.name, 0)
		}
	}
	return nil
}

// digestRaw feeds the msgpack value at p to dg as canonical pieces.
func digestRaw(dg *extrakeys.Digest, p []byte, depth int) ([]byte, error) {
	if depth > maxExtraDepth {
		return p, detail(fmt.Sprintf("nested deeper than %d levels", maxExtraDepth))
	}
	switch msgp.NextType(p) {
	case msgp.ArrayType:
		n, rest, err := readArrayHeader(p, math.MaxInt32)
		if err != nil {
			return p, err
		}
		dg.Raw(rawArray, nil, uint64(n))
		return digestRawN(dg, rest, int(n), depth)
	case msgp.MapType:
		n, rest, err := msgp.ReadMapHeaderBytes(p)
		if err != nil {
			return p, err
		}
		if int(n) > len(rest)/2 {
			return p, fmt.Errorf("map of %d pairs in %d remaining bytes", n, len(rest))
		}
		dg.Raw(rawMap, nil, uint64(n))
		return digestRawN(dg, rest, 2*int(n), depth)
	}
	return digestScalar(dg, p)
}

// digestRawN digests the n values at p, one level below depth.
func digestRawN(dg *extrakeys.Digest, p []byte, n, depth int) ([]byte, error) {
	var err error
	for ; n > 0; n-- {
		if p, err = digestRaw(dg, p, depth+1); err != nil {
			return p, err
		}
	}
	return p, nil
}

// digestScalar feeds the msgpack value at p, anything but an array or a
// map, to dg.
func digestScalar(dg *extrakeys.Digest, p []byte) ([]byte, error) {
	var err error
	switch msgp.NextType(p) {
	case msgp.NilType:
		dg.Raw(rawNil, nil, 0)
		return p[1:], nil
	case msgp.BoolType:
		var v bool
		if v, p, err = msgp.ReadBoolBytes(p); err == nil {
			tag := byte(rawFalse)
			if v {
				tag = rawTrue
			}
			dg.Raw(tag, nil, 0)
		}
		return p, err
	case msgp.IntType, msgp.UintType:
		v, neg, rest, err := readIntBits(p)
		if err != nil {
			return p, err
		}
		tag := byte(rawUint)
		if neg {
			tag = rawNeg
		}
		dg.Raw(tag, nil, v)
		return rest, nil
	case msgp.Float32Type, msgp.Float64Type:
		var f float64
		if f, p, err = msgp.ReadFloat64Bytes(p); err == nil {
			dg.Raw(rawFloat, nil, math.Float64bits(f))
		}
		return p, err
	case msgp.StrType, msgp.BinType:
		tag, read := byte(rawStr), msgp.ReadStringZC
		if msgp.NextType(p) == msgp.BinType {
			tag, read = rawBin, msgp.ReadBytesZC
		}
		var b []byte
		if b, p, err = read(p); err == nil {
			dg.Raw(tag, b, 0)
		}
		return p, err
	}
	if hdr := extHeader(p); hdr > 0 { // msgp names some ext types (time, complex) on their own
		rest, err := msgp.Skip(p)
		if err != nil {
			return p, err
		}
		raw := p[:len(p)-len(rest)]
		dg.Raw(rawExt, raw[hdr+1:], uint64(raw[hdr]))
		return rest, nil
	}
	return p, detail("expected a msgpack value, got " + typeName(p))
}

// extHeader is the offset of the type byte of the ext value at p, 0 when p
// holds no ext value.
func extHeader(p []byte) int {
	if len(p) == 0 {
		return 0
	}
	switch p[0] {
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16
		return 1
	case 0xc7: // ext 8
		return 2
	case 0xc8: // ext 16
		return 3
	case 0xc9: // ext 32
		return 5
	}
	return 0
}
