package serve

import (
	"encoding/binary"
	"encoding/json"
	"math/bits"

	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// maxMessageMultiModal bounds the multimodal inputs of a MatchBatch, in
// all (a MatchRequest's, maxMultiModal): each decodes to an object of
// about 80 bytes from 2 on the wire, so a message of them alone would
// cost 40 times its size.
const maxMessageMultiModal = 1 << 16

// Field numbers of the match messages' repeated fields, counted on the
// wire before decoding.
const (
	batchRequestsField   protowire.Number = 1 // MatchBatchRequest.requests
	matchTokensField     protowire.Number = 1 // MatchRequest.tokens
	matchEagleKeysField  protowire.Number = 3 // MatchRequest.eagle_keys
	matchMultiModalField protowire.Number = 7 // MatchRequest.multimodal
)

// decodeCount is what a match message would make of its bytes: a request
// or a multimodal input is an object each, and a few bytes on the wire
// (an empty one two) decode to hundreds in memory; a token or a key, two
// bytes of JSON, to 4 or 8 and more. MaxMessageBytes bounds only the
// bytes, so an 8 MiB batch of empty requests took 1 GiB to decode before
// its count was checked. Counted first, a message past the bounds is not
// decoded at all. A single request's tokens and keys are counted too (a
// batch's are bounded by their bytes, as many requests may each hold
// their limit).
type decodeCount struct {
	batch        bool // a MatchBatch, not a single MatchRequest
	requests     int  // a MatchBatch's
	multimodal   int  // in all
	tokens, keys int  // a single request's: keys or EAGLE keys, the more
}

// refusal is why a message of c is not decoded under l, nil if it may be:
// the bound it is past, as the handler's check would say it decoded.
func (c decodeCount) refusal(l limits) error {
	switch {
	case c.batch && c.requests > maxBatch:
		return invalid("match batch: %d requests, more than the limit of %d: split it", c.requests, maxBatch)
	case c.batch && c.multimodal > maxMessageMultiModal:
		return invalid("match batch: %d multimodal inputs in all, more than the limit of %d: split it", c.multimodal, maxMessageMultiModal)
	case c.batch:
		return nil
	case c.tokens > l.maxTokens:
		return invalid("match: %d tokens, more than the limit of %d (--max-tokens)", c.tokens, l.maxTokens)
	case c.keys > l.maxKeys():
		return invalid("match: %d keys, more than the limit of %d (--max-tokens / block size)", c.keys, l.maxKeys())
	case c.multimodal > maxMultiModal:
		return invalid("match: %d multimodal inputs, more than %d", c.multimodal, maxMultiModal)
	}
	return nil
}

// requestCount is the count of r, decoded.
func requestCount(r *kvpipev1.MatchRequest) decodeCount {
	return decodeCount{multimodal: len(r.Multimodal), tokens: len(r.Tokens), keys: max(len(r.Keys), len(r.EagleKeys))}
}

// countProto counts m's objects in b, its protobuf encoding, when m is a
// match message (ok false for the others). It stops at the first malformed
// field, which decoding then reports.
func countProto(b []byte, m proto.Message) (c decodeCount, ok bool) {
	switch m.(type) {
	case *kvpipev1.MatchRequest:
		return countRequest(b, true), true
	case *kvpipev1.MatchBatchRequest:
		c.batch = true
		eachField(b, func(num protowire.Number, typ protowire.Type, v []byte) {
			if num == batchRequestsField && typ == protowire.BytesType {
				c.requests++
				c.multimodal += countRequest(v, false).multimodal
			}
		})
		return c, true
	}
	return c, false
}

// countRequest counts the multimodal inputs of the MatchRequest b, and
// with scalars its tokens and keys, packed or not.
func countRequest(b []byte, scalars bool) decodeCount {
	var c decodeCount
	var keys, eagleKeys int
	eachField(b, func(num protowire.Number, typ protowire.Type, v []byte) {
		switch {
		case num == matchMultiModalField && typ == protowire.BytesType:
			c.multimodal++
		case !scalars:
		case num == matchTokensField && typ == protowire.VarintType:
			c.tokens++
		case num == matchTokensField && typ == protowire.BytesType:
			c.tokens += countVarints(v)
		case (num == matchKeysField || num == matchEagleKeysField) && (typ == protowire.Fixed64Type || typ == protowire.BytesType):
			n := 1
			if typ == protowire.BytesType {
				n = len(v) / 8
			}
			if num == matchKeysField {
				keys += n
			} else {
				eagleKeys += n
			}
		}
	})
	c.keys = max(keys, eagleKeys)
	return c
}

// countVarints counts the varints of packed: one ends at each byte below
// 0x80. Eight bytes at a time: the cost of counting a request's tokens is
// a tenth of decoding them.
func countVarints(packed []byte) int {
	n := 0
	for ; len(packed) >= 8; packed = packed[8:] {
		n += 8 - bits.OnesCount64(binary.LittleEndian.Uint64(packed)&0x8080808080808080)
	}
	for _, b := range packed {
		if b < 0x80 {
			n++
		}
	}
	return n
}

// eachField calls f with each field of the message b: its number, type,
// and bytes (a length-delimited field's contents). It stops at the first
// malformed field.
func eachField(b []byte, f func(protowire.Number, protowire.Type, []byte)) {
	eachRaw(b, func(num protowire.Number, typ protowire.Type, field []byte, tagLen int) {
		v := field[tagLen:]
		if typ == protowire.BytesType {
			v, _ = protowire.ConsumeBytes(v)
		}
		f(num, typ, v)
	})
}

// eachRaw calls f with each field of the message b: its number, type, and
// whole encoding, of which the tag takes tagLen bytes. It stops at the
// first malformed field.
func eachRaw(b []byte, f func(num protowire.Number, typ protowire.Type, field []byte, tagLen int)) {
	for len(b) > 0 {
		num, typ, tn := protowire.ConsumeTag(b)
		if tn < 0 {
			return
		}
		vn := protowire.ConsumeFieldValue(num, typ, b[tn:])
		if vn < 0 {
			return
		}
		f(num, typ, b[:tn+vn], tn)
		b = b[tn+vn:]
	}
}

// countJSON counts m's objects in b, its JSON form, when m is a match
// message: the objects opened at the depths where the mapping puts
// requests and multimodal inputs (any other object there is an error of
// decoding, or an unknown field's that connect's JSON skips, and counted
// all the same), and a single request's tokens and keys, the values of its
// arrays of those names. It reads the bytes once and allocates nothing,
// but for a field name written with escapes.
func countJSON(b []byte, m proto.Message) (c decodeCount, ok bool) {
	var j jsonCounter
	switch m.(type) {
	case *kvpipev1.MatchRequest:
		j.multimodalDepth, j.scalars = 2, true
	case *kvpipev1.MatchBatchRequest:
		j.requestDepth, j.multimodalDepth, c.batch = 2, 3, true
	default:
		return c, false
	}
	for i, ch := range b {
		j.step(i, ch, b, &c)
	}
	c.tokens, c.keys = j.tokens, max(j.keys, j.eagleKeys)
	return c, true
}

// jsonCounter is countJSON's state between bytes. Depths count objects
// only; level counts objects and arrays, for the arrays of a request.
type jsonCounter struct {
	requestDepth, multimodalDepth int
	scalars                       bool // count a single request's tokens and keys

	depth, level            int
	inString, escaped       bool
	keyStart, keyEnd        int  // the last string at the request's own level
	keyEscaped              bool // it held an escape
	array                   int  // what the request's array being read holds: one of the below
	expectValue             bool // in that array, after '[' or ','
	tokens, keys, eagleKeys int
}

// What a request's array holds, by its name.
const (
	arrayOther = iota
	arrayTokens
	arrayKeys
	arrayEagleKeys
	arrayEscaped // a name that does not unescape: tokens and keys, for all countJSON knows
)

func (j *jsonCounter) step(i int, ch byte, b []byte, c *decodeCount) {
	if j.inString {
		switch {
		case j.escaped:
			j.escaped = false
		case ch == '\\':
			j.escaped, j.keyEscaped = true, j.keyEscaped || j.level == 1
		case ch == '"':
			j.inString = false
			if j.level == 1 {
				j.keyEnd = i
			}
		}
		return
	}
	if j.expectValue && ch != ' ' && ch != '\t' && ch != '\n' && ch != '\r' {
		j.expectValue = false
		if ch != ']' {
			j.countValue()
		}
	}
	switch ch {
	case '"':
		j.inString = true
		if j.level == 1 {
			j.keyStart, j.keyEscaped = i+1, false
		}
	case ':':
		if j.level == 1 && j.keyStart > 0 { // a name read (else no JSON)
			j.array = arrayOf(b[j.keyStart-1:j.keyEnd+1], j.keyEscaped)
		}
	case '{', '[':
		j.level++
		if ch == '[' && j.level == 2 && j.scalars {
			j.expectValue = true
		}
		if ch == '{' {
			j.depth++
			switch j.depth {
			case j.requestDepth:
				c.requests++
			case j.multimodalDepth:
				c.multimodal++
			}
		}
	case '}', ']':
		j.level--
		if ch == '}' {
			j.depth--
		}
	case ',':
		if j.level == 2 && j.scalars {
			j.expectValue = true
		}
	}
}

func (j *jsonCounter) countValue() {
	switch j.array {
	case arrayTokens:
		j.tokens++
	case arrayKeys:
		j.keys++
	case arrayEagleKeys:
		j.eagleKeys++
	case arrayEscaped:
		j.tokens++
		j.keys++
	}
}

// arrayOf is what the array of a request's field of name holds; escaped,
// name (its JSON quotes around it) is unescaped first, which only such a
// name pays for.
func arrayOf(quoted []byte, escaped bool) int {
	name := quoted[1 : len(quoted)-1]
	if escaped {
		var s string
		if json.Unmarshal(quoted, &s) != nil {
			return arrayEscaped // not a name protojson takes either
		}
		name = []byte(s)
	}
	switch {
	case string(name) == "tokens":
		return arrayTokens
	case string(name) == "keys":
		return arrayKeys
	case string(name) == "eagleKeys" || string(name) == "eagle_keys":
		return arrayEagleKeys
	}
	return arrayOther
}

// refusedField is the field number (the highest protobuf allows) under
// which a codec that refused to decode a match message leaves why, in the
// message's unknown fields: grpc-go makes any codec error Internal, so the
// handler refuses it, with InvalidArgument, on every port. The proto
// reserves the number; one a client sends is dropped (dropRefusals).
const refusedField = protowire.MaxValidNumber

// decodeWithin decodes b into m, unless m is a match message that count
// finds past its bounds under l: then m is empty but for why it is
// refused (refusal reads it back).
func decodeWithin(b []byte, m proto.Message, l limits, count func([]byte, proto.Message) (decodeCount, bool), decode func([]byte, proto.Message) error) error {
	c, ok := count(b, m)
	if !ok {
		return decode(b, m)
	}
	why := c.refusal(l)
	if why == nil {
		if err := decode(b, m); err != nil {
			return err
		}
		dropRefusals(m)
		return nil
	}
	proto.Reset(m)
	m.ProtoReflect().SetUnknown(protowire.AppendString(protowire.AppendTag(nil, refusedField, protowire.BytesType), message(why)))
	return nil
}

// refusal is the error of why a codec refused to decode m, nil if it did
// not.
func refusal(m proto.Message) error {
	u := m.ProtoReflect().GetUnknown()
	if len(u) == 0 {
		return nil
	}
	var err error
	eachField(u, func(num protowire.Number, typ protowire.Type, v []byte) {
		if num == refusedField && typ == protowire.BytesType && err == nil {
			err = invalid("%s", v)
		}
	})
	return err
}

// dropRefusals drops the refusedField a client sent in m, a match message
// decoded: only a codec's refusal is one.
func dropRefusals(m proto.Message) {
	switch m := m.(type) {
	case *kvpipev1.MatchRequest:
		dropRefusal(m)
	case *kvpipev1.MatchBatchRequest:
		for _, r := range m.Requests {
			dropRefusal(r)
		}
	}
}

func dropRefusal(m proto.Message) {
	u := m.ProtoReflect().GetUnknown()
	if len(u) == 0 || refusal(m) == nil {
		return
	}
	var kept []byte
	eachRaw(u, func(num protowire.Number, _ protowire.Type, field []byte, _ int) {
		if num != refusedField {
			kept = append(kept, field...)
		}
	})
	m.ProtoReflect().SetUnknown(kept)
}
