package serve

import (
	"encoding/binary"
	"fmt"

	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// matchCodec is connect-go's binary protobuf codec ("proto") with a fast
// path for a match request's keys: protobuf-go decodes a packed fixed64
// field one append a key (about 8 ns a key with its growth, 5 us of a
// 600-key request, the largest part of the server's own CPU a batched
// match), where the keys are a little-endian array on the wire. Every
// other field goes through protobuf-go, merged into the same message, so
// the result is proto.Unmarshal's; anything the fast path does not follow
// (a malformed field) is left to proto.Unmarshal whole, for its error.
type matchCodec struct{}

func (matchCodec) Name() string { return "proto" }

func (matchCodec) IsBinary() bool { return true }

func (matchCodec) Marshal(m any) ([]byte, error) {
	return matchCodec{}.MarshalAppend(nil, m)
}

func (matchCodec) MarshalAppend(dst []byte, m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("marshal: %T is not a protobuf message", m)
	}
	return proto.MarshalOptions{}.MarshalAppend(dst, pm)
}

func (matchCodec) Unmarshal(data []byte, m any) error {
	switch m := m.(type) {
	case *kvpipev1.MatchRequest:
		if unmarshalMatch(data, m) {
			return nil
		}
	case *kvpipev1.MatchBatchRequest:
		if unmarshalBatch(data, m) {
			return nil
		}
	}
	pm, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("unmarshal: %T is not a protobuf message", m)
	}
	if err := proto.Unmarshal(data, pm); err != nil {
		return fmt.Errorf("unmarshal into %T: %w", m, err)
	}
	return nil
}

// Field numbers of the messages unmarshalMatch and unmarshalBatch read.
const (
	fieldKeys      = 2 // MatchRequest.keys
	fieldEagleKeys = 3 // MatchRequest.eagle_keys
	fieldRequests  = 1 // MatchBatchRequest.requests
)

// unmarshalMatch decodes data into m (reset first), the keys itself and
// the other fields by protobuf-go; false: data is not well formed, and m
// is to be decoded again by proto.Unmarshal.
func unmarshalMatch(data []byte, m *kvpipev1.MatchRequest) bool {
	proto.Reset(m)
	var rest []byte // the other fields, in their order
	for b := data; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		size := protowire.ConsumeFieldValue(num, typ, b[n:])
		if size < 0 {
			return false
		}
		field, value := b[:n+size], b[n:n+size]
		b = b[n+size:]
		var keys *[]uint64
		switch num {
		case fieldKeys:
			keys = &m.Keys
		case fieldEagleKeys:
			keys = &m.EagleKeys
		}
		switch {
		case keys != nil && typ == protowire.BytesType:
			packed, _ := protowire.ConsumeBytes(value)
			if len(packed)%8 != 0 {
				return false
			}
			*keys = appendFixed64s(*keys, packed)
		case keys != nil && typ == protowire.Fixed64Type: // one key, unpacked
			*keys = append(*keys, binary.LittleEndian.Uint64(value))
		default:
			rest = append(rest, field...)
		}
	}
	return len(rest) == 0 || proto.UnmarshalOptions{Merge: true}.Unmarshal(rest, m) == nil
}

// unmarshalBatch decodes data into m (reset first), each request by
// unmarshalMatch; false as unmarshalMatch's.
func unmarshalBatch(data []byte, m *kvpipev1.MatchBatchRequest) bool {
	proto.Reset(m)
	var rest []byte
	for b := data; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		size := protowire.ConsumeFieldValue(num, typ, b[n:])
		if size < 0 {
			return false
		}
		field, value := b[:n+size], b[n:n+size]
		b = b[n+size:]
		if num != fieldRequests || typ != protowire.BytesType {
			rest = append(rest, field...)
			continue
		}
		msg, _ := protowire.ConsumeBytes(value)
		r := &kvpipev1.MatchRequest{}
		if !unmarshalMatch(msg, r) {
			return false
		}
		m.Requests = append(m.Requests, r)
	}
	return len(rest) == 0 || proto.UnmarshalOptions{Merge: true}.Unmarshal(rest, m) == nil
}

// appendFixed64s appends packed's little-endian uint64s to dst.
func appendFixed64s(dst []uint64, packed []byte) []uint64 {
	n, add := len(dst), len(packed)/8
	if cap(dst)-n < add {
		grown := make([]uint64, n, n+add)
		copy(grown, dst)
		dst = grown
	}
	dst = dst[:n+add]
	for i := range add {
		dst[n+i] = binary.LittleEndian.Uint64(packed[8*i:])
	}
	return dst
}
