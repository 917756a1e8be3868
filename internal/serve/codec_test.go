package serve

import (
	"runtime"
	"testing"

	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// codecCases are match requests on the wire as a client may send them,
// packed keys anywhere, in pieces, or not packed, and broken ones.
func codecCases(t testing.TB) map[string][]byte {
	marshal := func(r *kvpipev1.MatchRequest) []byte {
		b, err := proto.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	packed := func(keys ...uint64) []byte {
		var v []byte
		for _, k := range keys {
			v = protowire.AppendFixed64(v, k)
		}
		b := protowire.AppendTag(nil, matchKeysField, protowire.BytesType)
		return protowire.AppendBytes(b, v)
	}
	salt := marshal(&kvpipev1.MatchRequest{Salt: "tenant"})
	routed := marshal(&kvpipev1.MatchRequest{RoutedTo: "e0", EagleKeys: []uint64{7}})
	unpacked := protowire.AppendFixed64(protowire.AppendTag(nil, matchKeysField, protowire.Fixed64Type), 5)
	many := make([]uint64, maxPooledKeys+1)
	for i := range many {
		many[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	return map[string][]byte{
		"empty":                {},
		"keys only":            marshal(&kvpipev1.MatchRequest{Keys: []uint64{1, 2, 1 << 63}}),
		"every field":          marshal(&kvpipev1.MatchRequest{Tokens: []uint32{1, 2}, Keys: []uint64{3, 4}, EagleKeys: []uint64{5}, LoraName: "sql", LoraId: 3, HasLoraId: true, Salt: "s", Multimodal: []*kvpipev1.MultiModal{{Hash: "img", Offset: 1, Length: 2}}, RoutedTo: "e1"}),
		"keys last":            append(append([]byte{}, salt...), packed(1, 2)...),
		"keys in two pieces":   concat(packed(1, 2), salt, packed(3), routed),
		"no keys, packed":      concat(salt, packed()),
		"a key unpacked":       concat(packed(1), unpacked, packed(2)),
		"more than pooled":     marshal(&kvpipev1.MatchRequest{Keys: many}),
		"keys of 7 bytes":      concat(protowire.AppendTag(nil, matchKeysField, protowire.BytesType), []byte{7, 1, 2, 3, 4, 5, 6, 7}),
		"keys cut short":       packed(1, 2)[:10],
		"a tag cut short":      concat(salt, []byte{0x80}),
		"an unknown field":     concat(packed(1), protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 4), packed(2)),
		"a string not utf8":    concat(packed(1), protowire.AppendBytes(protowire.AppendTag(nil, 6, protowire.BytesType), []byte{0xff})),
		"a group never closed": concat(packed(1), protowire.AppendTag(nil, 10, protowire.StartGroupType)),
	}
}

func concat(parts ...[]byte) []byte {
	var b []byte
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}

// matchCodec reads every request as protobuf-go does: the same message,
// or an error where protobuf-go has one, also with its key buffers
// reused, and through grpc-go's buffers in one piece or several.
func TestMatchCodecUnmarshalsAsProtobuf(t *testing.T) {
	c := newMatchCodec(limits{maxTokens: 1 << 20, blockSize: testBlock})
	for name, b := range codecCases(t) {
		t.Run(name, func(t *testing.T) {
			for round := range 2 { // the second with the first's buffer
				var got kvpipev1.MatchRequest
				err := c.Unmarshal(splitIn(b, round+1), &got)
				checkAsProtobuf(t, b, &got, err)
				c.keys.put(got.Keys)
			}
		})
	}
}

// splitIn is b as grpc-go may hand it over: in n buffers.
func splitIn(b []byte, n int) mem.BufferSlice {
	var s mem.BufferSlice
	for i := range n {
		s = append(s, mem.SliceBuffer(b[len(b)*i/n:len(b)*(i+1)/n]))
	}
	return s
}

func checkAsProtobuf(t *testing.T, b []byte, got *kvpipev1.MatchRequest, err error) {
	t.Helper()
	var want kvpipev1.MatchRequest
	wantErr := proto.Unmarshal(b, &want)
	switch {
	case (err != nil) != (wantErr != nil):
		t.Fatalf("error %v, protobuf-go's %v", err, wantErr)
	case err == nil && !proto.Equal(got, &want):
		t.Fatalf("read %v, protobuf-go %v", got, &want)
	}
}

// The codec leaves every other message to protobuf's.
func TestMatchCodecOtherMessages(t *testing.T) {
	c := newMatchCodec(limits{maxTokens: 1 << 20, blockSize: testBlock})
	in := &kvpipev1.MatchBatchRequest{Requests: []*kvpipev1.MatchRequest{{Keys: []uint64{1, 2}}}}
	data, err := c.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	var out kvpipev1.MatchBatchRequest
	if err := c.Unmarshal(data, &out); err != nil || !proto.Equal(in, &out) {
		t.Fatalf("%v, %v, want %v", &out, err, in)
	}
}

// No input makes matchCodec read other than protobuf-go, or panic.
func FuzzMatchCodec(f *testing.F) {
	for _, b := range codecCases(f) {
		if len(b) < 4096 {
			f.Add(b)
		}
	}
	c := newMatchCodec(limits{maxTokens: 1 << 20, blockSize: testBlock})
	f.Fuzz(func(t *testing.T, b []byte) {
		var got kvpipev1.MatchRequest
		err := unmarshalMatchRequest(b, &got, &c.keys)
		checkAsProtobuf(t, b, &got, err)
		c.keys.put(got.Keys)
	})
}

// Keys sent one a field (valid protobuf, 10 bytes a key) are decoded in
// linear time and memory: the buffer grew by one key at a time, a copy of
// all keys a key (64 Ki keys, 640 KiB on the wire: 16 GiB allocated).
func TestMatchCodecKeysOneAField(t *testing.T) {
	const n = 64 << 10
	var wire []byte
	for i := range n {
		wire = protowire.AppendTag(wire, matchKeysField, protowire.BytesType)
		wire = protowire.AppendVarint(wire, 8)
		wire = protowire.AppendFixed64(wire, uint64(i))
	}
	c := newMatchCodec(limits{maxTokens: 1 << 20, blockSize: testBlock})
	var r kvpipev1.MatchRequest
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(wire)}, &r)
	runtime.ReadMemStats(&after)
	if err != nil || len(r.Keys) != n || r.Keys[n-1] != n-1 {
		t.Fatalf("decoded %d keys, %v", len(r.Keys), err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 8*uint64(len(wire)) {
		t.Errorf("decoding %d KiB allocated %d KiB", len(wire)>>10, got>>10)
	}
}

// routerRequests are a router's requests, encoded: 600 keys, or 8,192
// tokens.
func routerRequests(b *testing.B) map[string][]byte {
	keys := make([]uint64, 600)
	for i := range keys {
		keys[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	tokens := make([]uint32, 8192)
	for i := range tokens {
		tokens[i] = uint32(i * 7919 % 150000)
	}
	out := map[string][]byte{}
	for name, m := range map[string]*kvpipev1.MatchRequest{"keys=600": {Keys: keys}, "tokens=8192": {Tokens: tokens}} {
		wire, err := proto.Marshal(m)
		if err != nil {
			b.Fatal(err)
		}
		out[name] = wire
	}
	return out
}

// BenchmarkCountRequest is the count a codec takes of a request before it
// decodes it (countProto), alone.
func BenchmarkCountRequest(b *testing.B) {
	for name, wire := range routerRequests(b) {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(wire)))
			b.ReportAllocs()
			var r kvpipev1.MatchRequest
			for b.Loop() {
				if c, _ := countProto(wire, &r); c.tokens+c.keys == 0 {
					b.Fatal("counted nothing")
				}
			}
		})
	}
}

// BenchmarkMatchCodec decodes a router's requests as the grpc-go port
// does, counted first.
func BenchmarkMatchCodec(b *testing.B) {
	for name, wire := range routerRequests(b) {
		b.Run(name, func(b *testing.B) {
			c := newMatchCodec(limits{maxTokens: 1 << 20, blockSize: testBlock})
			data := mem.BufferSlice{mem.SliceBuffer(wire)}
			b.SetBytes(int64(len(wire)))
			b.ReportAllocs()
			for b.Loop() {
				var r kvpipev1.MatchRequest
				if err := c.Unmarshal(data, &r); err != nil {
					b.Fatal(err)
				}
				c.keys.put(r.Keys)
			}
		})
	}
}
