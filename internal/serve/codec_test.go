package serve

import (
	"testing"

	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/google/go-cmp/cmp"
)

// matchCodecCases are encodings of match requests, each as a MatchRequest
// and inside a MatchBatchRequest: what protobuf-go makes, and what other
// encoders may (keys split or unpacked, fields in any order, unknown
// fields), and malformed ones.
func matchCodecCases() map[string][]byte {
	keys := func(num protowire.Number, ks ...uint64) []byte {
		var packed []byte
		for _, k := range ks {
			packed = protowire.AppendFixed64(packed, k)
		}
		return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), packed)
	}
	full, _ := proto.Marshal(&kvpipev1.MatchRequest{Tokens: []uint32{1, 2, 3}, Keys: []uint64{7, 1 << 63, 9}, EagleKeys: []uint64{4},
		LoraName: "sql", LoraId: -3, HasLoraId: true, Salt: "t", RoutedTo: "e0",
		Multimodal: []*kvpipev1.MultiModal{{Hash: "img", Offset: 3, Length: 20}}})
	unpacked := protowire.AppendFixed64(protowire.AppendTag(nil, fieldKeys, protowire.Fixed64Type), 5)
	salt := protowire.AppendString(protowire.AppendTag(nil, 6, protowire.BytesType), "s")
	unknown := protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 1)
	wrongType := protowire.AppendVarint(protowire.AppendTag(nil, fieldKeys, protowire.VarintType), 1)
	cat := func(parts ...[]byte) (b []byte) {
		for _, p := range parts {
			b = append(b, p...)
		}
		return b
	}
	return map[string][]byte{
		"empty":                     nil,
		"keys only":                 keys(fieldKeys, 1, 2, 3),
		"every field":               full,
		"keys split and unpacked":   cat(keys(fieldKeys, 1, 2), unpacked, salt, keys(fieldKeys, 3), keys(fieldEagleKeys, 8)),
		"empty packed keys":         keys(fieldKeys),
		"unknown fields kept":       cat(unknown, keys(fieldKeys, 1), unknown),
		"keys of another wire type": cat(wrongType, keys(fieldKeys, 2)),
		"keys not whole":            protowire.AppendBytes(protowire.AppendTag(nil, fieldKeys, protowire.BytesType), []byte{1, 2, 3}),
		"truncated":                 keys(fieldKeys, 1, 2)[:10],
		"field number 0":            {0x02, 0x00},
		"bad utf-8 salt":            protowire.AppendBytes(protowire.AppendTag(nil, 6, protowire.BytesType), []byte{0xff}),
	}
}

// The codec decodes every match request, well formed or not, exactly as
// proto.Unmarshal does: the same message, or an error for the same input.
func TestMatchCodecAsProto(t *testing.T) {
	for name, data := range matchCodecCases() {
		t.Run(name, func(t *testing.T) {
			checkMatchCodec(t, data)
			batch := protowire.AppendBytes(protowire.AppendTag(nil, fieldRequests, protowire.BytesType), data)
			checkMatchCodec(t, append(batch, batch...))
		})
	}
}

func FuzzMatchCodec(f *testing.F) {
	for _, data := range matchCodecCases() {
		f.Add(data)
	}
	f.Fuzz(checkMatchCodec)
}

// checkMatchCodec decodes data as a MatchRequest and a MatchBatchRequest
// with matchCodec and with proto.Unmarshal, and fails where they differ.
func checkMatchCodec(t *testing.T, data []byte) {
	for _, newMsg := range []func() proto.Message{
		func() proto.Message { return &kvpipev1.MatchRequest{} },
		func() proto.Message { return &kvpipev1.MatchBatchRequest{} },
	} {
		got, want := newMsg(), newMsg()
		gotErr, wantErr := matchCodec{}.Unmarshal(data, got), proto.Unmarshal(data, want)
		if (gotErr != nil) != (wantErr != nil) {
			t.Fatalf("%T from %x: error %v, proto.Unmarshal's %v", got, data, gotErr, wantErr)
		}
		if wantErr == nil {
			if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
				t.Fatalf("%T from %x, -proto.Unmarshal +codec:\n%s", got, data, diff)
			}
		}
	}
}
