package serve

import (
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// maxMessageMultiModal bounds the multimodal inputs of a MatchBatch, in
// all (a MatchRequest is decoded with up to maxMultiModal): each decodes to an object of about 80 bytes from 2
// on the wire, so a message of them alone would cost 40 times its size.
const maxMessageMultiModal = 1 << 16

// Field numbers of the match messages' repeated messages, counted on the
// wire before decoding.
const (
	batchRequestsField   protowire.Number = 1 // MatchBatchRequest.requests
	matchMultiModalField protowire.Number = 7 // MatchRequest.multimodal
)

// decodeCount is what a match message would make of its bytes: a request
// or a multimodal input is an object each, and a few bytes on the wire
// (an empty one two) decode to hundreds in memory. MaxMessageBytes bounds
// only the bytes, so an 8 MiB batch of empty requests took 1 GiB to decode
// before its count was checked. Counted first, a message past the bounds
// is not decoded at all.
type decodeCount struct {
	batch      bool // a MatchBatch, not a single MatchRequest
	requests   int  // a MatchBatch's
	multimodal int  // in all
}

// within reports whether a message of c may be decoded: its requests and
// multimodal inputs within what any request the service answers holds.
func (c decodeCount) within() bool {
	if !c.batch {
		return c.multimodal <= maxMultiModal
	}
	return c.requests <= maxBatch && c.multimodal <= maxMessageMultiModal
}

// countProto counts m's objects in b, its protobuf encoding, when m is a
// match message (ok false for the others). It stops at the first malformed
// field, which decoding then reports.
func countProto(b []byte, m proto.Message) (c decodeCount, ok bool) {
	switch m.(type) {
	case *kvpipev1.MatchRequest:
		return decodeCount{multimodal: countFields(b, matchMultiModalField, nil)}, true
	case *kvpipev1.MatchBatchRequest:
		c.batch = true
		c.requests = countFields(b, batchRequestsField, func(v []byte) {
			c.multimodal += countFields(v, matchMultiModalField, nil)
		})
		return c, true
	}
	return c, false
}

// countFields counts the length-delimited fields num of the message b,
// calling each (if not nil) with the field's bytes.
func countFields(b []byte, num protowire.Number, each func([]byte)) int {
	n := 0
	for len(b) > 0 {
		f, typ, tn := protowire.ConsumeTag(b)
		if tn < 0 {
			return n
		}
		vn := protowire.ConsumeFieldValue(f, typ, b[tn:])
		if vn < 0 {
			return n
		}
		if f == num && typ == protowire.BytesType {
			n++
			if each != nil {
				v, _ := protowire.ConsumeBytes(b[tn:])
				each(v)
			}
		}
		b = b[tn+vn:]
	}
	return n
}

// countJSON counts m's objects in b, its JSON form, when m is a match
// message: the objects opened at the depths where the mapping puts
// requests and multimodal inputs (any other object there is an error of
// decoding, or an unknown field's, and counted all the same). It reads
// the bytes once and allocates nothing.
func countJSON(b []byte, m proto.Message) (c decodeCount, ok bool) {
	// Depths in objects: {"multimodal":[{...}]} and
	// {"requests":[{"multimodal":[{...}]}]}.
	var requestDepth, multimodalDepth int
	switch m.(type) {
	case *kvpipev1.MatchRequest:
		multimodalDepth = 2
	case *kvpipev1.MatchBatchRequest:
		requestDepth, multimodalDepth, c.batch = 2, 3, true
	default:
		return c, false
	}
	depth, inString, escaped := 0, false, false
	for _, ch := range b {
		switch {
		case inString:
			switch {
			case escaped:
				escaped = false
			case ch == '\\':
				escaped = true
			case ch == '"':
				inString = false
			}
		case ch == '"':
			inString = true
		case ch == '{':
			depth++
			switch depth {
			case requestDepth:
				c.requests++
			case multimodalDepth:
				c.multimodal++
			}
		case ch == '}':
			depth--
		}
	}
	return c, true
}

// refusedStandIn sets m, a match message of c not within its bounds, to a
// stand-in that the handler refuses with the bound it is past, as it would
// the message decoded. grpc-go makes any codec error Internal; a stand-in
// takes every port through the one check and its InvalidArgument. It costs
// one pointer an object past the bound, and points them all at one empty
// object.
func refusedStandIn(m proto.Message, c decodeCount) {
	mm := func(n int) []*kvpipev1.MultiModal {
		s, one := make([]*kvpipev1.MultiModal, n), &kvpipev1.MultiModal{}
		for i := range s {
			s[i] = one
		}
		return s
	}
	switch m := m.(type) {
	case *kvpipev1.MatchRequest:
		proto.Reset(m)
		m.Multimodal = mm(maxMultiModal + 1)
	case *kvpipev1.MatchBatchRequest:
		proto.Reset(m)
		if c.requests > maxBatch {
			m.Requests = make([]*kvpipev1.MatchRequest, maxBatch+1)
			one := &kvpipev1.MatchRequest{}
			for i := range m.Requests {
				m.Requests[i] = one
			}
			return
		}
		m.Requests = []*kvpipev1.MatchRequest{{Multimodal: mm(maxMessageMultiModal + 1)}}
	}
}

// decodeWithin decodes b into m, unless m is a match message that count
// finds past its bounds: then m is set to its refused stand-in.
func decodeWithin(b []byte, m proto.Message, count func([]byte, proto.Message) (decodeCount, bool), decode func([]byte, proto.Message) error) error {
	if c, ok := count(b, m); ok && !c.within() {
		refusedStandIn(m, c)
		return nil
	}
	return decode(b, m)
}
