package serve

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1/kvpipev1connect"
)

// batchRequests are a batch's edge cases: a whole chain, half of it, one
// refused (tokens and keys), one nothing matches, and an empty request.
func batchRequests() []*kvpipev1.MatchRequest {
	return []*kvpipev1.MatchRequest{
		{Tokens: chainTokens(7, 8)},
		{Tokens: append(chainTokens(7, 4), chainTokens(9, 4)...)},
		{Tokens: chainTokens(7, 1), Keys: []uint64{1}},
		{Tokens: chainTokens(9, 2)},
		{},
	}
}

// checkBatch checks the answers to batchRequests in order: the refused
// request's error is in its place and the others are answered.
func checkBatch(t *testing.T, via string, got []*kvpipev1.MatchResponse) {
	t.Helper()
	want := []struct {
		blocks uint32 // e0's
		code   string
	}{{8, ""}, {4, ""}, {0, "invalid_argument"}, {0, ""}, {0, ""}}
	if len(got) != len(want) {
		t.Fatalf("%s: %d answers to %d requests", via, len(got), len(want))
	}
	for i, w := range want {
		var blocks uint32
		for _, m := range got[i].Matches {
			if m.Worker == "e0" {
				blocks = m.Blocks
			}
		}
		if blocks != w.blocks || got[i].GetError().GetCode() != w.code {
			t.Errorf("%s: answer %d: e0 %d blocks, error %v; want %d blocks, error %q", via, i, blocks, got[i].GetError(), w.blocks, w.code)
		}
	}
}

// MatchBatch (gRPC and POST /v1/match/batch) and MatchStream answer each
// request in its place, a refused one with its error, the rest as Match.
func TestMatchBatchAndStream(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.0/8"}})
	e := newEngine(t, "")
	r.register("e0", e.pub)
	r.subscribed("e0", e)
	e.store(7, 8)
	eventually(t, "the chain indexed", func() bool { return r.matchGRPC(chainTokens(7, 8))["e0"] == 8 })
	ctx := context.Background()

	resp, err := r.grpc.MatchBatch(ctx, connect.NewRequest(&kvpipev1.MatchBatchRequest{Requests: batchRequests()}))
	if err != nil {
		t.Fatal(err)
	}
	checkBatch(t, "gRPC batch", resp.Msg.Responses)

	body, _ := json.Marshal(map[string]any{"requests": batchRequests()})
	code, text := r.call("POST", "/v1/match/batch", "", string(body))
	var out kvpipev1.MatchBatchResponse
	if code != http.StatusOK || protoJSON(text, &out) != nil {
		t.Fatalf("POST /v1/match/batch: %d %s", code, text)
	}
	checkBatch(t, "JSON batch", out.Responses)

	stream := r.grpc.MatchStream(ctx)
	var answers []*kvpipev1.MatchResponse
	for _, q := range batchRequests() { // one at a time: each answer before the next request
		if err := stream.Send(q); err != nil {
			t.Fatal(err)
		}
		a, err := stream.Receive()
		if err != nil {
			t.Fatal(err)
		}
		answers = append(answers, a)
	}
	if err := stream.CloseRequest(); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Receive(); !errors.Is(err, io.EOF) {
		t.Errorf("the stream after the client closed its side: %v, want EOF", err)
	}
	stream.CloseResponse()
	checkBatch(t, "stream", answers)
	checkBatch(t, "stream, all in flight", pipelined(t, r.grpc, 1))
	checkBatch(t, "stream, all in flight, closed after", pipelined(t, r.grpc, 0))
}

// pipelined sends batchRequests on a MatchStream, each once the answer to
// the one ahead-1 requests before it is in (ahead 0: all of them before
// any answer, and its side closed), and returns the answers.
func pipelined(t *testing.T, c kvpipev1connect.IndexServiceClient, ahead int) []*kvpipev1.MatchResponse {
	t.Helper()
	stream := c.MatchStream(context.Background())
	defer stream.CloseResponse()
	reqs := batchRequests()
	var answers []*kvpipev1.MatchResponse
	receive := func() {
		a, err := stream.Receive()
		if err != nil {
			t.Fatalf("answer %d: %v", len(answers), err)
		}
		answers = append(answers, a)
	}
	for i, q := range reqs {
		if err := stream.Send(q); err != nil {
			t.Fatal(err)
		}
		if ahead > 0 && i >= ahead {
			receive()
		}
	}
	if err := stream.CloseRequest(); err != nil {
		t.Fatal(err)
	}
	for len(answers) < len(reqs) {
		receive()
	}
	if _, err := stream.Receive(); !errors.Is(err, io.EOF) {
		t.Errorf("the stream after its last answer: %v, want EOF", err)
	}
	return answers
}

// A batch past maxBatch is refused whole, as invalid.
func TestMatchBatchTooLarge(t *testing.T) {
	r := start(t, Config{})
	reqs := make([]*kvpipev1.MatchRequest, maxBatch+1)
	for i := range reqs {
		reqs[i] = &kvpipev1.MatchRequest{}
	}
	_, err := r.grpc.MatchBatch(context.Background(), connect.NewRequest(&kvpipev1.MatchBatchRequest{Requests: reqs}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("a batch of %d: %v, want invalid_argument", len(reqs), err)
	}
	if _, err := r.grpc.MatchBatch(context.Background(), connect.NewRequest(&kvpipev1.MatchBatchRequest{Requests: reqs[:maxBatch]})); err != nil {
		t.Errorf("a batch of %d: %v", maxBatch, err)
	}
}

// A match with routed_to makes its keys predicted on that worker: the
// next match of a prefix no engine stored finds it there, predicted but
// not held. It needs the token; an unknown worker is not found.
func TestMatchRoutedPredicted(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.0/8"}})
	e := newEngine(t, "")
	r.register("e0", e.pub)
	r.subscribed("e0", e)
	ctx := context.Background()
	fresh := chainTokens(3, 5) // never stored
	for _, c := range []struct {
		name, token, worker string
		want                connect.Code
	}{
		{"no token", "", "e0", connect.CodeUnauthenticated},
		{"wrong token", "nope", "e0", connect.CodeUnauthenticated},
		{"unknown worker", testToken, "e9", connect.CodeNotFound},
		{"bad name", testToken, "e 0", connect.CodeInvalidArgument},
	} {
		_, err := r.grpc.Match(ctx, withToken(&kvpipev1.MatchRequest{Tokens: fresh, RoutedTo: c.worker}, c.token))
		if got := connect.CodeOf(err); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	if got := r.matchGRPC(fresh); len(got) != 0 {
		t.Fatalf("refused routings predicted %v", got)
	}
	resp, err := r.grpc.Match(ctx, withToken(&kvpipev1.MatchRequest{Tokens: fresh, RoutedTo: "e0"}, testToken))
	if err != nil || len(resp.Msg.Matches) != 0 {
		t.Fatalf("the routed match: %v, %v: want the index before the routing, empty", resp, err)
	}
	resp, err = r.grpc.Match(ctx, connect.NewRequest(&kvpipev1.MatchRequest{Tokens: fresh}))
	if err != nil || len(resp.Msg.Matches) != 1 {
		t.Fatalf("after routing: %v, %v", resp, err)
	}
	if m := resp.Msg.Matches[0]; m.Worker != "e0" || m.Blocks != 0 || m.Predicted != 5 {
		t.Errorf("after routing 5 blocks to e0: %v, want e0 with 0 held, 5 predicted", m)
	}
	body := fmt.Sprintf(`{"tokens": %s, "routedTo": "e0"}`, jsonList(chainTokens(4, 2)))
	if code, text := r.call("POST", "/v1/match", "", body); code != http.StatusUnauthorized {
		t.Errorf("POST /v1/match routed without the token: %d %s, want 401", code, text)
	}
	if code, text := r.call("POST", "/v1/match", testToken, body); code != http.StatusOK {
		t.Errorf("POST /v1/match routed with the token: %d %s", code, text)
	}
	if got := r.matchJSON(chainTokens(4, 2)); got["e0"] != 0 {
		t.Errorf("predicted blocks counted as held: %v", got)
	}
}

func jsonList(tokens []uint32) string {
	data, _ := json.Marshal(tokens)
	return string(data)
}

// The workers' endpoints (internal addresses) are shown only to a caller
// with the token, on every route that lists workers.
func TestWorkersEndpointsNeedToken(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.0/8"}})
	e := newEngine(t, "")
	r.register("e0", e.pub)
	r.subscribed("e0", e)
	for _, c := range []struct {
		name, token string
		full        bool
	}{{"no token", "", false}, {"wrong token", "nope", false}, {"token", testToken, true}} {
		for via, spec := range map[string]*kvpipev1.WorkerSpec{
			"GET /v1/workers": r.listedJSON(c.token),
			"ListWorkers":     r.listedGRPC(c.token),
			"GET /v1/watch":   r.watchedJSON(c.token),
			"WatchWorkers":    r.watchedGRPC(c.token),
		} {
			full := strings.HasPrefix(spec.GetEndpoint(), "tcp://127.0.0.1:") && spec.GetReplayEndpoint() != ""
			if full != c.full || spec.GetEndpointsRedacted() == c.full || spec.GetName() != "e0" {
				t.Errorf("%s, %s: spec %v; want endpoints shown %v", via, c.name, spec, c.full)
			}
		}
	}
	code, page := r.call("GET", "/", "", "")
	if code != http.StatusOK || strings.Contains(page, e.pub.Addr()) || !strings.Contains(page, "hidden") {
		t.Errorf("the status page without the token: %d, shows the endpoint or no note of it hidden", code)
	}
}

func (r *running) listedJSON(token string) *kvpipev1.WorkerSpec {
	code, body := r.call("GET", "/v1/workers", token, "")
	var list kvpipev1.ListWorkersResponse
	if code != http.StatusOK || protoJSON(body, &list) != nil || len(list.Workers) != 1 {
		r.t.Fatalf("GET /v1/workers: %d %s", code, body)
	}
	return list.Workers[0].Spec
}

func (r *running) listedGRPC(token string) *kvpipev1.WorkerSpec {
	resp, err := r.grpc.ListWorkers(context.Background(), withToken(&kvpipev1.ListWorkersRequest{}, token))
	if err != nil || len(resp.Msg.Workers) != 1 {
		r.t.Fatalf("ListWorkers: %v, %v", resp, err)
	}
	return resp.Msg.Workers[0].Spec
}

// watchedJSON reads GET /v1/watch's first line: the worker as it is.
func (r *running) watchedJSON(token string) *kvpipev1.WorkerSpec {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", r.url+"/v1/watch", nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := r.http.Do(req)
	if err != nil {
		r.t.Fatal(err)
	}
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	var ev kvpipev1.WorkerEvent
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/x-ndjson" || err != nil || protoJSON(line, &ev) != nil {
		r.t.Fatalf("GET /v1/watch: %s %q, %v", resp.Status, line, err)
	}
	return ev.Worker.GetSpec()
}

func (r *running) watchedGRPC(token string) *kvpipev1.WorkerSpec {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := r.grpc.WatchWorkers(ctx, withToken(&kvpipev1.WatchWorkersRequest{}, token))
	if err != nil {
		r.t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() {
		r.t.Fatalf("WatchWorkers: %v", stream.Err())
	}
	return stream.Msg().Worker.GetSpec()
}

// GET /v1/watch streams each change as a line as it comes: a worker
// registered, then removed.
func TestWatchJSONLines(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", r.url+"/v1/watch", nil)
	resp, err := r.http.Do(req) // answered at once, with no worker yet
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	lines := bufio.NewScanner(resp.Body)
	next := func() *kvpipev1.WorkerStatus {
		if !lines.Scan() {
			t.Fatalf("watch ended: %v", lines.Err())
		}
		var ev kvpipev1.WorkerEvent
		if err := protoJSON(lines.Text(), &ev); err != nil || ev.UnixMs == 0 {
			t.Fatalf("line %q: %v", lines.Text(), err)
		}
		return ev.Worker
	}
	e := newEngine(t, "")
	r.register("w1", e.pub)
	if w := next(); w.Name != "w1" {
		t.Fatalf("first event for %q, want w1", w.Name)
	}
	if code, body := r.call("DELETE", "/v1/workers/w1", testToken, ""); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d %s", code, body)
	}
	for w := next(); w.State != kvpipev1.WorkerState_WORKER_STATE_REMOVED; w = next() {
	}
}
