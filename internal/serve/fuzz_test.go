package serve

import (
	"bytes"
	"context"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
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

// handlerRoutes are the HTTP/JSON and Connect calls FuzzHandler sends a
// body to; a route's path may take the body as a worker name.
var handlerRoutes = []struct {
	method, path, contentType string
	nameInPath, nameInQuery   bool
}{
	{method: "POST", path: "/v1/match", contentType: "application/json"},
	{method: "POST", path: "/v1/match/batch", contentType: "application/json"},
	{method: "POST", path: "/v1/workers", contentType: "application/json"},
	{method: "DELETE", path: "/v1/workers/", nameInPath: true},
	{method: "GET", path: "/v1/dump?worker=", nameInQuery: true},
	{method: "GET", path: "/v1/workers"},
	{method: "POST", path: "/kvpipe.v1.IndexService/Match", contentType: "application/proto"},
	{method: "POST", path: "/kvpipe.v1.IndexService/Match", contentType: "application/json"},
	{method: "POST", path: "/kvpipe.v1.IndexService/MatchBatch", contentType: "application/proto"},
	{method: "POST", path: "/kvpipe.v1.IndexService/RegisterWorker", contentType: "application/json"},
	{method: "POST", path: "/kvpipe.v1.IndexService/UnregisterWorker", contentType: "application/proto"},
}

// No request through the server's handler, HTTP/JSON or Connect, with the
// token or without, panics it or fails it as an internal error: whatever
// the body, the answer is a success or a client error (4xx). Each input
// starts from a server with one worker, e0, registered (so that a dump or
// an unregister reaches the pipeline) and nothing else.
func FuzzHandler(f *testing.F) {
	match, _ := proto.Marshal(&kvpipev1.MatchRequest{Tokens: chainTokens(1, 3), LoraName: "sql"})
	matchJSON, _ := protojson.Marshal(&kvpipev1.MatchRequest{Keys: []uint64{1, 2}, RoutedTo: "e0"})
	batch, _ := proto.Marshal(&kvpipev1.MatchBatchRequest{Requests: []*kvpipev1.MatchRequest{{Tokens: chainTokens(2, 2)}, {Keys: []uint64{7}}}})
	seeds := [][]byte{match, matchJSON, batch,
		[]byte(`{"worker":{"name":"e0","endpoint":"tcp://127.0.0.1:1"}}`),
		[]byte(`{"name":"e0","endpoint":"tcp://127.0.0.1:1","blockSize":32}`),
		[]byte(`{"requests":[{"tokens":[1,2,3]},{"keys":["18446744073709551615"]}]}`),
		[]byte("e0"), []byte("../x"), {}}
	for _, s := range seeds {
		for r := range handlerRoutes {
			f.Add(s, uint8(r), false)
			f.Add(s, uint8(r), true)
		}
	}
	p, err := kvpipe.New(kvpipe.Config{BlockSize: testBlock})
	if err != nil {
		f.Fatal(err)
	}
	s, err := New(context.Background(), Config{Pipeline: p, BlockSize: testBlock, Token: testToken,
		Allow: []string{"127.0.0.1/32"}, MaxTokens: 256, MaxMessageBytes: 1 << 16, Registry: prometheus.NewRegistry()})
	if err != nil {
		f.Fatal(err)
	}
	// Running, as in production: a dump, say, needs the pipeline's loop.
	ctx, cancel := context.WithCancel(context.Background())
	done, l := make(chan error, 1), listen(f)
	go func() { done <- s.Run(ctx, l) }()
	f.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			f.Errorf("Run: %v", err)
		}
	})
	silent := listen(f) // accepts, never speaks
	f.Cleanup(func() { silent.Close() })
	e0 := &kvpipev1.WorkerSpec{Name: "e0", Endpoint: "tcp://" + silent.Addr().String()}
	// reset leaves e0 alone registered.
	reset := func() error {
		for _, r := range s.svc.registrations() {
			if r.spec.Name != e0.Name {
				if err := s.svc.unregister(ctx, r.spec.Name); err != nil {
					return err
				}
			}
		}
		if s.svc.spec(e0.Name) == nil {
			_, err := s.svc.register(ctx, e0, true)
			return err
		}
		return nil
	}
	if err := reset(); err != nil {
		f.Fatal(err)
	}
	for start := time.Now(); ; time.Sleep(10 * time.Millisecond) { // until the pipeline runs
		if err := s.svc.dump(ctx, e0.Name, func(*kvpipev1.DumpResponse) error { return nil }); err == nil {
			break
		} else if time.Since(start) > time.Minute {
			f.Fatalf("dump of e0 a minute after the start: %v", err)
		}
	}
	h := s.Handler()
	f.Fuzz(func(t *testing.T, body []byte, route uint8, token bool) {
		if err := reset(); err != nil {
			t.Fatal(err)
		}
		rt := handlerRoutes[int(route)%len(handlerRoutes)]
		target := rt.path
		switch {
		case rt.nameInPath:
			target += url.PathEscape(string(body))
		case rt.nameInQuery:
			target += url.QueryEscape(string(body))
		}
		req := httptest.NewRequest(rt.method, "http://kvpipe"+target, bytes.NewReader(body))
		if rt.contentType != "" {
			req.Header.Set("Content-Type", rt.contentType)
		}
		if token {
			req.Header.Set("Authorization", "Bearer "+testToken)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code >= 500 {
			t.Fatalf("%s %s (%d bytes, token %v): %d %s", rt.method, rt.path, len(body), token, rec.Code, rec.Body)
		}
	})
}

// The counts taken before decoding are the decoded message's, for every
// match message that decodes, in binary and in JSON; with unknown fields
// skipped (connect's JSON), at least theirs. None panics.
func FuzzDecodeCounts(f *testing.F) {
	mm := []*kvpipev1.MultiModal{{Hash: "a{", Offset: 1, Length: 2}, {}}
	for _, m := range []proto.Message{
		&kvpipev1.MatchRequest{Tokens: chainTokens(1, 2), Multimodal: mm, Salt: `"{`},
		&kvpipev1.MatchRequest{Keys: []uint64{1, 1 << 60}, EagleKeys: []uint64{7}},
		&kvpipev1.MatchBatchRequest{Requests: []*kvpipev1.MatchRequest{{}, {Multimodal: mm}, {LoraName: `\"}`}}},
	} {
		_, batch := m.(*kvpipev1.MatchBatchRequest)
		bin, _ := proto.Marshal(m)
		f.Add(bin, false, batch, false)
		js, _ := protojson.Marshal(m)
		f.Add(js, true, batch, false)
	}
	f.Add([]byte(`{"\u0074okens":[1,2],"x":{"y":[{}]}}`), true, false, true)
	// Tokens and keys unpacked, one a field: valid, and counted too.
	var unpacked []byte
	for i := range 3 {
		unpacked = protowire.AppendTag(unpacked, matchTokensField, protowire.VarintType)
		unpacked = protowire.AppendVarint(unpacked, uint64(i)<<20)
		unpacked = protowire.AppendTag(unpacked, matchEagleKeysField, protowire.Fixed64Type)
		unpacked = protowire.AppendFixed64(unpacked, uint64(i))
	}
	f.Add(unpacked, false, false, false)
	f.Fuzz(func(t *testing.T, data []byte, asJSON, batch, discardUnknown bool) {
		var m proto.Message = &kvpipev1.MatchRequest{}
		if batch {
			m = &kvpipev1.MatchBatchRequest{}
		}
		count, decode := countProto, proto.Unmarshal
		if asJSON {
			count, decode = countJSON, protojson.UnmarshalOptions{DiscardUnknown: discardUnknown}.Unmarshal
		}
		got, _ := count(data, m)
		if decode(data, m) != nil {
			return
		}
		want := decodedCount(m)
		if asJSON && discardUnknown {
			if got.requests < want.requests || got.multimodal < want.multimodal || got.tokens < want.tokens || got.keys < want.keys {
				t.Fatalf("counted %+v, decoded %+v", got, want)
			}
		} else if got != want {
			t.Fatalf("counted %+v, decoded %+v", got, want)
		}
	})
}
