package serve

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/ztest"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// A worker registered over gRPC is matched, listed and dumped the same
// over gRPC, Connect JSON and the HTTP/JSON routes, and its answers are
// the engine's blocks.
func TestMatchListDump(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.0/8"}})
	e := newEngine(t, "")
	r.register("e0", e.pub)
	r.subscribed("e0", e)
	e.store(7, 8)
	full := chainTokens(7, 8)
	eventually(t, "the chain indexed", func() bool { return r.matchGRPC(full)["e0"] == 8 })
	half := append(chainTokens(7, 4), chainTokens(9, 4)...)
	if got := r.matchJSON(half)["e0"]; got != 4 {
		t.Errorf("JSON match of 4 blocks then another chain: %d blocks, want 4", got)
	}
	if got := r.matchGRPC(chainTokens(9, 4)); len(got) != 0 {
		t.Errorf("a chain the engine never stored matched %v", got)
	}
	resp, err := r.grpc.Match(context.Background(), connect.NewRequest(&kvpipev1.MatchRequest{Tokens: full}))
	if err != nil {
		t.Fatal(err)
	}
	m := resp.Msg.Matches[0]
	if resp.Msg.RequestBlocks != 8 || m.Score != 8 || !slices.Equal(m.Tiers, []uint32{8, 8, 8, 8}) || m.LastEventAgeMs < 0 {
		t.Errorf("match %v: want 8 request blocks, score 8, tiers [8 8 8 8], an age", resp.Msg)
	}
	checkList(t, r)
	checkDump(t, r, 7, 8)
}

func checkList(t *testing.T, r *running) {
	t.Helper()
	code, body := r.call("GET", "/v1/workers", "", "")
	var list kvpipev1.ListWorkersResponse
	if code != http.StatusOK || protoJSON(body, &list) != nil || len(list.Workers) != 1 {
		t.Fatalf("GET /v1/workers: %d %s", code, body)
	}
	w := list.Workers[0]
	if w.Name != "e0" || w.IndexedBlocks != 8 || w.Events != 8 || !w.Spec.GetEndpointsRedacted() {
		t.Errorf("listed %v: want e0 with 8 blocks and 8 events, its endpoints hidden", w)
	}
	if w.State != kvpipev1.WorkerState_WORKER_STATE_CONNECTED && w.State != kvpipev1.WorkerState_WORKER_STATE_PARTIAL {
		t.Errorf("state %v, want connected or partial", w.State)
	}
	resp, err := r.grpc.ListWorkers(context.Background(), connect.NewRequest(&kvpipev1.ListWorkersRequest{}))
	if err != nil || len(resp.Msg.Workers) != 1 || resp.Msg.IndexNodes == 0 {
		t.Errorf("ListWorkers over gRPC: %v, %v", resp, err)
	}
}

// checkDump dumps e0 over gRPC and HTTP: the engine hashes of chain base.
func checkDump(t *testing.T, r *running, base, n int) {
	t.Helper()
	stream, err := r.grpc.Dump(context.Background(), withToken(&kvpipev1.DumpRequest{Worker: "e0"}, testToken))
	if err != nil {
		t.Fatal(err)
	}
	var hashes []uint64
	for stream.Receive() {
		for _, b := range stream.Msg().Blocks {
			hashes = append(hashes, b.Hash)
			if b.Tiers != 1 {
				t.Errorf("block %d in tiers %b, want device only", b.Hash, b.Tiers)
			}
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	stream.Close()
	want := make([]uint64, n)
	for i := range want {
		want[i] = uint64(base*1000 + i)
	}
	slices.Sort(hashes)
	if !slices.Equal(hashes, want) {
		t.Errorf("dumped %v, want %v", hashes, want)
	}
	code, body := r.call("GET", "/v1/dump?worker=e0", testToken, "")
	var chunk kvpipev1.DumpResponse
	if code != http.StatusOK || protoJSON(strings.SplitN(body, "\n", 2)[0], &chunk) != nil || len(chunk.Blocks) != n {
		t.Errorf("GET /v1/dump: %d %.200s", code, body)
	}
}

// A watcher sees each worker's state, then its removal.
func TestWatchWorkers(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := r.grpc.WatchWorkers(ctx, connect.NewRequest(&kvpipev1.WatchWorkersRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	e := newEngine(t, "")
	r.register("w1", e.pub)
	next := func() *kvpipev1.WorkerStatus {
		if !stream.Receive() {
			t.Fatalf("watch ended: %v", stream.Err())
		}
		return stream.Msg().Worker
	}
	for w := next(); w.State != kvpipev1.WorkerState_WORKER_STATE_CONNECTED && w.State != kvpipev1.WorkerState_WORKER_STATE_PARTIAL; w = next() {
		if w.Name != "w1" {
			t.Fatalf("event for %q", w.Name)
		}
		e.probe()
	}
	if _, err := r.grpc.UnregisterWorker(ctx, withToken(&kvpipev1.UnregisterWorkerRequest{Name: "w1"}, testToken)); err != nil {
		t.Fatal(err)
	}
	for w := next(); w.State != kvpipev1.WorkerState_WORKER_STATE_REMOVED; w = next() {
	}
}

// /readyz answers 503 until every worker has connected (within the ready
// timeout, 30s); the page and /healthz answer all along.
func TestReadyz(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}})
	if code, _ := r.call("GET", "/readyz", "", ""); code != http.StatusOK {
		t.Errorf("readyz with no workers: %d, want 200", code)
	}
	ep := freeTCP(t)
	spec := &kvpipev1.WorkerSpec{Name: "late", Endpoint: ep}
	if _, err := r.grpc.RegisterWorker(context.Background(), withToken(&kvpipev1.RegisterWorkerRequest{Worker: spec}, testToken)); err != nil {
		t.Fatal(err)
	}
	if code, body := r.call("GET", "/readyz", "", ""); code != http.StatusServiceUnavailable || !strings.Contains(body, "late") {
		t.Errorf("readyz before the engine runs: %d %q, want 503 naming the worker", code, body)
	}
	if code, _ := r.call("GET", "/healthz", "", ""); code != http.StatusOK {
		t.Errorf("healthz: %d", code)
	}
	e := newEngine(t, ep)
	r.subscribed("late", e)
	if code, body := r.call("GET", "/readyz", "", ""); code != http.StatusOK {
		t.Errorf("readyz once connected: %d %q", code, body)
	}
	code, body := r.call("GET", "/metrics", "", "")
	if code != http.StatusOK || !strings.Contains(body, "kvpipe_serve_in_flight_requests") || !strings.Contains(body, `worker="late"`) {
		t.Errorf("metrics: %d, %.300s", code, body)
	}
}

// A worker whose engine never comes up holds /readyz back for
// ReadyTimeout, then counts as partial: the server is ready without it
// and names it, on /readyz and the page; one registered later is waited
// for again. With no worker connected at all it is not ready.
func TestReadyzGivesUpOnAWorkerThatNeverConnects(t *testing.T) {
	const wait = 2 * time.Second
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}, ReadyTimeout: wait})
	// register returns a time at or before the server's own (it stamps the
	// worker inside the call), so that what it waited is at most since it.
	register := func(name, ep string) time.Time {
		at := time.Now()
		spec := &kvpipev1.WorkerSpec{Name: name, Endpoint: ep}
		if _, err := r.grpc.RegisterWorker(context.Background(), withToken(&kvpipev1.RegisterWorkerRequest{Worker: spec}, testToken)); err != nil {
			t.Fatal(err)
		}
		return at
	}
	readyz := func() (int, string) { return r.call("GET", "/readyz", "", "") }
	waiting := func(at time.Time, name string) {
		t.Helper()
		code, body := readyz()
		if time.Since(at) >= wait {
			t.Skipf("the machine took %v to register and ask, past the ready timeout %v", time.Since(at), wait)
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body, name) {
			t.Errorf("readyz within the ready timeout: %d %q, want 503 naming %s", code, body, name)
		}
	}

	at := register("down", freeTCP(t)) // no engine there
	waiting(at, "down")
	eventually(t, "the ready timeout past", func() bool { return time.Since(at) > wait+100*time.Millisecond })
	if code, body := readyz(); code != http.StatusServiceUnavailable || !strings.Contains(body, "no worker has connected") {
		t.Errorf("readyz with its only worker never connected: %d %q, want 503", code, body)
	}

	ep := freeTCP(t)
	register("up", ep)
	r.subscribed("up", newEngine(t, ep))
	if code, body := readyz(); code != http.StatusOK || !strings.Contains(body, "partial") || !strings.Contains(body, "down") {
		t.Errorf("readyz with up connected and down given up on: %d %q, want 200 naming down", code, body)
	}
	if _, page := r.call("GET", "/", "", ""); !strings.Contains(page, "never connected: down") {
		t.Errorf("the page does not name the worker given up on:\n%.2000s", page)
	}
	waiting(register("later", freeTCP(t)), "later")
}

func protoJSON(s string, m proto.Message) error { return protojson.Unmarshal([]byte(s), m) }

var freeTCP = ztest.FreeTCP
