package serve

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1/kvpipev1connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// oversize is a match message that holds more objects than any request
// answered, in both encodings, with the words its refusal says.
type oversize struct {
	what, says string
	msg        proto.Message
	json       string // written here: protojson's encoding costs the client more than the server
}

// oversizeMatches are oversize messages of about size bytes, each object
// two bytes on the wire (three in JSON), each token one (two).
func oversizeMatches(size int) []oversize {
	emptyMM := func(n int) []*kvpipev1.MultiModal {
		s := make([]*kvpipev1.MultiModal, n)
		for i := range s {
			s[i] = &kvpipev1.MultiModal{}
		}
		return s
	}
	objects := func(n int) string { return "[" + strings.Repeat("{},", n-1) + "{}]" }
	n := size / 2
	batch := &kvpipev1.MatchBatchRequest{Requests: make([]*kvpipev1.MatchRequest, n)}
	for i := range batch.Requests {
		batch.Requests[i] = &kvpipev1.MatchRequest{}
	}
	perRequest := n / maxBatch
	wide := &kvpipev1.MatchBatchRequest{Requests: make([]*kvpipev1.MatchRequest, maxBatch)}
	for i := range wide.Requests {
		wide.Requests[i] = &kvpipev1.MatchRequest{Multimodal: emptyMM(perRequest)}
	}
	wideRequest := `{"multimodal":` + objects(perRequest) + "}"
	return []oversize{
		{"a batch of empty requests", "requests, more than the limit of 4096", batch, `{"requests":` + objects(n) + "}"},
		{"a batch of requests with empty multimodal inputs", "multimodal inputs in all, more than the limit of 65536", wide,
			`{"requests":[` + strings.Repeat(wideRequest+",", maxBatch-1) + wideRequest + "]}"},
		{"a match of empty multimodal inputs", "524288 multimodal inputs, more than 1024",
			&kvpipev1.MatchRequest{Multimodal: emptyMM(n)}, `{"multimodal":` + objects(n) + "}"},
		// Past a server's MaxTokens of size/16 and its keys (block size 16).
		{"a match of tokens past the limit", "tokens, more than the limit",
			&kvpipev1.MatchRequest{Tokens: make([]uint32, n)}, `{"tokens":[` + strings.Repeat("0,", n-1) + "0]}"},
		{"a match of keys past the limit", "keys, more than the limit",
			&kvpipev1.MatchRequest{Keys: make([]uint64, size/8)}, `{"keys":[` + strings.Repeat("0,", size/8-1) + "0]}"},
	}
}

// A match message that holds more requests or multimodal inputs than any
// answered is refused as invalid on every port and in every encoding, and
// before it is decoded: the call allocates a small multiple of its size.
// Decoded first, 2 bytes on the wire became 250 in memory (an 8 MiB batch
// of empty requests, 1 GiB).
func TestOversizeMatchesRefusedUndecoded(t *testing.T) {
	const size = 1 << 20
	r := start(t, Config{MaxMessageBytes: 4 * size, MaxTokens: size / 16})
	call := map[string]func(oversize) error{
		"grpc-go": func(c oversize) error {
			var err error
			switch m := c.msg.(type) {
			case *kvpipev1.MatchRequest:
				_, err = r.grpcgo.Match(context.Background(), m)
			case *kvpipev1.MatchBatchRequest:
				_, err = r.grpcgo.MatchBatch(context.Background(), m)
			}
			return err
		},
		"connect gRPC": func(c oversize) error {
			var err error
			switch m := c.msg.(type) {
			case *kvpipev1.MatchRequest:
				_, err = r.grpc.Match(context.Background(), connect.NewRequest(m))
			case *kvpipev1.MatchBatchRequest:
				_, err = r.grpc.MatchBatch(context.Background(), connect.NewRequest(m))
			}
			return err
		},
		"connect JSON": func(c oversize) error {
			return r.postJSON(kvpipev1connect.IndexServiceMatchProcedure+batchSuffix(c.msg, "Batch"), c.json)
		},
		"HTTP/JSON": func(c oversize) error { return r.postJSON("/v1/match"+batchSuffix(c.msg, "/batch"), c.json) },
	}
	for _, c := range oversizeMatches(size) {
		for _, port := range []string{"grpc-go", "connect gRPC", "connect JSON", "HTTP/JSON"} {
			t.Run(port+"/"+c.what, func(t *testing.T) {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				err := call[port](c)
				runtime.ReadMemStats(&after)
				if codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), c.says) {
					t.Fatalf("got %v, want InvalidArgument saying %q", err, c.says)
				}
				// The client's encoding, HTTP's buffers and the server's
				// read of the body: a few copies of the message.
				alloc := after.TotalAlloc - before.TotalAlloc
				t.Logf("allocated %.1f MiB", float64(alloc)/(1<<20))
				if alloc > 16*size {
					t.Errorf("the call allocated %d MiB for a message of %d MiB", alloc>>20, size>>20)
				}
			})
		}
	}
	// Within the bounds, both are answered.
	if _, err := r.grpcgo.MatchBatch(context.Background(), &kvpipev1.MatchBatchRequest{Requests: make([]*kvpipev1.MatchRequest, maxBatch)}); err != nil {
		t.Errorf("a batch of %d: %v", maxBatch, err)
	}
	if err := r.postJSON("/v1/match/batch", `{"requests":[{"keys":["1"]},{}]}`); err != nil {
		t.Errorf("a batch of two: %v", err)
	}
	if err := r.postJSON(kvpipev1connect.IndexServiceMatchProcedure, `{"keys":["1"]}`); err != nil {
		t.Errorf("a match: %v", err)
	}
}

// batchSuffix is suffix for a MatchBatchRequest, "" for a MatchRequest.
func batchSuffix(m proto.Message, suffix string) string {
	if _, ok := m.(*kvpipev1.MatchBatchRequest); ok {
		return suffix
	}
	return ""
}

// postJSON posts body to path: nil if answered 200, else an error of the
// answer's code (InvalidArgument for a 400) that holds its body.
func (r *running) postJSON(path, body string) error {
	resp, err := r.http.Post(r.url+path, "application/json", strings.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	switch resp.StatusCode {
	case http.StatusOK:
		return nil
	case http.StatusBadRequest:
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s", answer))
	}
	return connect.NewError(connect.CodeUnknown, fmt.Errorf("%s: %s", resp.Status, answer))
}

// The counts on the wire and in JSON are the decoded message's, strings
// that hold braces and quotes included.
func TestDecodeCounts(t *testing.T) {
	mm := []*kvpipev1.MultiModal{{Hash: "a{b}", Offset: 1, Length: 2}, {Hash: `"}{\"`}, {}}
	for i, m := range []proto.Message{
		&kvpipev1.MatchRequest{},
		&kvpipev1.MatchRequest{Tokens: []uint32{1, 2}, Multimodal: mm, Salt: `{{"`},
		&kvpipev1.MatchRequest{Tokens: []uint32{0, 127, 128, 1 << 31}, LoraName: `[", "`},
		&kvpipev1.MatchRequest{Keys: []uint64{1, 2, 3}, EagleKeys: []uint64{4}, RoutedTo: "a"},
		&kvpipev1.MatchRequest{EagleKeys: []uint64{4, 5}},
		&kvpipev1.MatchBatchRequest{},
		&kvpipev1.MatchBatchRequest{Requests: []*kvpipev1.MatchRequest{{}, {Multimodal: mm}, {LoraName: "{\\"}, {Multimodal: mm[:1]}}},
	} {
		want := decodedCount(m)
		wire, _ := proto.Marshal(m)
		text, _ := protojson.Marshal(m)
		if got, ok := countProto(wire, m); !ok || got != want {
			t.Errorf("%d: protobuf: counted %+v, want %+v", i, got, want)
		}
		if got, ok := countJSON(text, m); !ok || got != want {
			t.Errorf("%d: JSON %s: counted %+v, want %+v", i, text, got, want)
		}
	}
	if _, ok := countProto(nil, &kvpipev1.RegisterWorkerRequest{}); ok {
		t.Error("counted a message that is not a match")
	}
}

// A JSON name written with escapes is the field protojson decodes it as,
// and counted as that field: its values neither let through nor counted
// as what they are not (as keys, tokens past maxKeys refused a request
// within its limits). A client's own refusedField is dropped.
func TestDecodeCountsEscapedNamesAndRefusals(t *testing.T) {
	for _, body := range []string{`{"\u0074okens":[1,2,3]}`, `{"k\u0065ys":["1","2"],"eagle\u005fkeys":["3"]}`} {
		var m kvpipev1.MatchRequest
		if err := protojson.Unmarshal([]byte(body), &m); err != nil {
			t.Fatalf("protojson: %v", err)
		}
		if c, _ := countJSON([]byte(body), &m); c != requestCount(&m) {
			t.Errorf("%s: counted %+v, decoded %+v", body, c, requestCount(&m))
		}
	}
	sent := protowire.AppendString(protowire.AppendTag(nil, refusedField, protowire.BytesType), "my own words")
	sent = protowire.AppendTag(sent, matchKeysField, protowire.BytesType)
	sent = protowire.AppendBytes(sent, make([]byte, 8))
	var m kvpipev1.MatchRequest
	if err := decodeWithin(sent, &m, limits{maxTokens: 64, blockSize: testBlock}, countProto, proto.Unmarshal); err != nil || len(m.Keys) != 1 {
		t.Fatalf("decoded %v, %v", &m, err)
	}
	if err := refusal(&m); err != nil {
		t.Errorf("a client's refusedField refused its request: %v", err)
	}
}

// decodedCount is what countProto and countJSON should find in m, the
// message decoded.
func decodedCount(m proto.Message) decodeCount {
	switch m := m.(type) {
	case *kvpipev1.MatchRequest:
		return requestCount(m)
	case *kvpipev1.MatchBatchRequest:
		return decodeCount{batch: true, requests: len(m.Requests), multimodal: multimodalIn(m)}
	}
	return decodeCount{}
}
