package serve

import (
	"encoding/binary"
	"fmt"
	"sync"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	protobuf "google.golang.org/protobuf/proto"
)

// matchKeysField is MatchRequest.keys' field number.
const matchKeysField protowire.Number = 2

// maxPooledKeys bounds the key buffers keyPool keeps: a rare huge request's
// is left to the collector rather than held.
const maxPooledKeys = 1 << 16

// matchCodec is the grpc-go port's codec: protobuf's, but a MatchRequest's
// keys, the bulk of a router's request, are copied from the wire (the
// little-endian words they are there) into a buffer of keys, which the
// handler gives back once answered. A new array per request, zeroed and
// then filled, was most of what decoding a request cost the server.
type matchCodec struct {
	proto  encoding.CodecV2
	keys   keyPool
	limits limits // of a request, counted before it is decoded
}

func newMatchCodec(l limits) *matchCodec {
	return &matchCodec{proto: encoding.GetCodecV2(proto.Name), limits: l}
}

// Name is protobuf's: the codec reads and writes the same bytes.
func (c *matchCodec) Name() string { return proto.Name }

func (c *matchCodec) Marshal(v any) (mem.BufferSlice, error) { return c.proto.Marshal(v) }

func (c *matchCodec) Unmarshal(data mem.BufferSlice, v any) error {
	switch v.(type) {
	case *kvpipev1.MatchRequest, *kvpipev1.MatchBatchRequest:
	default:
		return c.proto.Unmarshal(data, v)
	}
	// A request comes in pieces (a piece a frame read): joined in a buffer
	// of grpc-go's pool, not a new one.
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	return decodeWithin(buf.ReadOnlyData(), v.(protobuf.Message), c.limits, countProto, c.unmarshal)
}

func (c *matchCodec) unmarshal(b []byte, m protobuf.Message) error {
	if r, ok := m.(*kvpipev1.MatchRequest); ok {
		return unmarshalMatchRequest(b, r, &c.keys)
	}
	return protobuf.Unmarshal(b, m)
}

// connectCodec is one of connect's codecs, protobuf or JSON (under name,
// one of the content types connect knows it by), but a match message is
// counted (count) before it is decoded, against limits (decodeCount).
type connectCodec struct {
	name      string
	limits    limits
	count     func([]byte, protobuf.Message) (decodeCount, bool)
	marshal   func([]byte, protobuf.Message) ([]byte, error)
	unmarshal func([]byte, protobuf.Message) error
}

func (c connectCodec) Name() string { return c.name }

func (c connectCodec) Marshal(v any) ([]byte, error) { return c.MarshalAppend(nil, v) }

// MarshalAppend lets connect marshal into a buffer of its own pool.
func (c connectCodec) MarshalAppend(dst []byte, v any) ([]byte, error) {
	m, err := asProto(v)
	if err != nil {
		return nil, err
	}
	return c.marshal(dst, m)
}

func (c connectCodec) Unmarshal(b []byte, v any) error {
	m, err := asProto(v)
	if err != nil {
		return err
	}
	return decodeWithin(b, m, c.limits, c.count, c.unmarshal)
}

// connectCodecs are the codecs of the main port's Connect handler, for
// requests of limits l. JSON leaves unknown fields out, as connect's own
// does: a client of a newer schema is still answered.
func connectCodecs(l limits) []connect.HandlerOption {
	jsonCodec := func(name string) connect.HandlerOption {
		return connect.WithCodec(connectCodec{name, l, countJSON, protojson.MarshalOptions{}.MarshalAppend,
			protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal})
	}
	return []connect.HandlerOption{
		connect.WithCodec(connectCodec{proto.Name, l, countProto, protobuf.MarshalOptions{}.MarshalAppend, protobuf.Unmarshal}),
		jsonCodec("json"), jsonCodec("json; charset=utf-8")}
}

func asProto(v any) (protobuf.Message, error) {
	m, ok := v.(protobuf.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a protobuf message", v)
	}
	return m, nil
}

// unmarshalMatchRequest is protobuf's unmarshal of b into r, but with the
// packed keys read into a buffer of pool; the other fields go to protobuf-go.
// A request that sends a key unpacked (valid, and rare) is protobuf-go's
// alone.
func unmarshalMatchRequest(b []byte, r *kvpipev1.MatchRequest, pool *keyPool) error {
	var keys []uint64
	rest := b // b without its keys fields: b itself while none is seen
	copied := false
	for i := 0; i < len(b); {
		num, typ, n := protowire.ConsumeTag(b[i:])
		m := 0
		if n > 0 {
			m = protowire.ConsumeFieldValue(num, typ, b[i+n:])
		}
		end := i + n + m
		switch {
		case n < 0 || m < 0 || (num == matchKeysField && typ != protowire.BytesType):
			// Malformed (protobuf-go says how), or a key unpacked.
			pool.put(keys)
			return protobuf.Unmarshal(b, r)
		case num != matchKeysField:
			if copied {
				rest = append(rest, b[i:end]...)
			}
		default:
			v, _ := protowire.ConsumeBytes(b[i+n:])
			if len(v)%8 != 0 {
				pool.put(keys)
				return fmt.Errorf("match request: keys: %d bytes, not a whole number of 8-byte keys", len(v))
			}
			keys = appendKeys(keys, v, pool)
			if !copied { // the fields before this one
				rest, copied = append([]byte(nil), b[:i]...), true
			}
		}
		i = end
	}
	if err := protobuf.Unmarshal(rest, r); err != nil {
		pool.put(keys)
		return err
	}
	if keys != nil {
		r.Keys = keys
	}
	return nil
}

// appendKeys appends the little-endian words of v to keys, taking a buffer
// from pool when keys has none.
func appendKeys(keys []uint64, v []byte, pool *keyPool) []uint64 {
	n := len(v) / 8
	if keys == nil {
		keys = pool.get(n)
	}
	keys = growKeys(keys, n)
	for j := range n {
		keys = append(keys, binary.LittleEndian.Uint64(v[8*j:]))
	}
	return keys
}

// growKeys makes room for n more keys, doubling at least: a request that
// sends its keys one a field (valid, if odd) must not cost a copy of all
// keys a key.
func growKeys(keys []uint64, n int) []uint64 {
	if cap(keys)-len(keys) >= n {
		return keys
	}
	grown := make([]uint64, len(keys), max(len(keys)+n, 2*cap(keys)))
	copy(grown, keys)
	return grown
}

// keyPool holds key buffers for matchCodec: one a request in flight.
type keyPool struct{ p sync.Pool }

// get is an empty buffer with room for n keys.
func (p *keyPool) get(n int) []uint64 {
	if k, _ := p.p.Get().(*[]uint64); k != nil && cap(*k) >= n {
		return (*k)[:0]
	}
	return make([]uint64, 0, max(n, 64))
}

// put gives keys back, once nothing refers to them.
func (p *keyPool) put(keys []uint64) {
	if keys != nil && cap(keys) <= maxPooledKeys {
		p.p.Put(&keys)
	}
}
