package serve

import (
	"testing"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// No match request, in binary or JSON, panics the validation or the
// hashing of a request it lets through; one it lets through is within the
// limits.
func FuzzCheckMatch(f *testing.F) {
	seeds := []*kvpipev1.MatchRequest{
		{Tokens: chainTokens(1, 3)},
		{Keys: []uint64{1, 2, 3}, EagleKeys: []uint64{4}},
		{Tokens: chainTokens(2, 2), LoraName: "sql", Salt: "tenant", Multimodal: []*kvpipev1.MultiModal{{Hash: "img", Offset: 3, Length: 20}}},
		{Tokens: chainTokens(3, 1), RoutedTo: "e0"},
		{Keys: []uint64{9}, RoutedTo: "bad name/"},
		{Tokens: make([]uint32, 40), LoraId: -7, HasLoraId: true, Multimodal: []*kvpipev1.MultiModal{{Hash: "b", Offset: 30, Length: 10}, {Hash: "a", Offset: 0, Length: 1}}},
	}
	for _, s := range seeds {
		bin, _ := proto.Marshal(s)
		f.Add(bin, false)
		js, _ := protojson.Marshal(s)
		f.Add(js, true)
	}
	l := limits{maxTokens: 256, blockSize: testBlock}
	f.Fuzz(func(t *testing.T, data []byte, asJSON bool) {
		var r kvpipev1.MatchRequest
		var err error
		if asJSON {
			err = protojson.Unmarshal(data, &r)
		} else {
			err = proto.Unmarshal(data, &r)
		}
		if err != nil || l.checkMatch(&r) != nil {
			return
		}
		if len(r.Tokens) > l.maxTokens || len(r.Keys) > l.maxKeys() || len(r.EagleKeys) > l.maxKeys() {
			t.Fatalf("let through past the limits: %d tokens, %d keys, %d eagle keys", len(r.Tokens), len(r.Keys), len(r.EagleKeys))
		}
		if r.RoutedTo != "" && checkName(r.RoutedTo) != nil {
			t.Fatalf("let through routed_to %q", r.RoutedTo)
		}
		var h kvpipe.Hasher
		q := request(&r)
		keys := h.RequestKeys(nil, q, testBlock)
		if len(keys) > len(r.Tokens)/testBlock {
			t.Fatalf("%d keys for %d tokens", len(keys), len(r.Tokens))
		}
		h.EagleKeys(nil, q, testBlock)
	})
}

// No worker spec panics the validation; one let through has a tcp
// endpoint and a name safe in a URL.
func FuzzCheckSpec(f *testing.F) {
	for _, s := range []string{
		`{"name":"e0","endpoint":"tcp://127.0.0.1:5557","replayEndpoint":"tcp://[::1]:5558"}`,
		`{"name":"a:b.c-d_e","endpoint":"tcp://engine-3.local:1","blockSize":32,"topic":"kv"}`,
		`{"name":"x","endpoint":"tcp://:1"}`,
	} {
		f.Add([]byte(s))
	}
	l := limits{maxTokens: 256, blockSize: testBlock}
	f.Fuzz(func(t *testing.T, data []byte) {
		var w kvpipev1.WorkerSpec
		if protojson.Unmarshal(data, &w) != nil || l.checkSpec(&w) != nil {
			return
		}
		if _, _, err := splitEndpoint(w.Endpoint); err != nil || checkName(w.Name) != nil {
			t.Fatalf("let through: %v", &w)
		}
	})
}
