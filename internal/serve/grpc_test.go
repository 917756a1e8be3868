package serve

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// receiveAll receives a server stream's messages until it ends; err is
// its end, nil for a clean one.
func receiveAll[T any](stream grpc.ServerStreamingClient[T], err error) ([]*T, error) {
	if err != nil {
		return nil, err
	}
	var out []*T
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, m)
	}
}

// The grpc-go port answers every call as the main port does: a worker
// registered there is matched (alone, in a batch and on a stream), listed,
// watched, dumped and unregistered there.
func TestGRPCGoServesEveryCall(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.0/8"}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	watch, err := r.grpcgo.WatchWorkers(ctx, &kvpipev1.WatchWorkersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, "")
	spec := &kvpipev1.WorkerSpec{Name: "e0", Endpoint: "tcp://" + e.pub.Addr()}
	if _, err := r.grpcgo.RegisterWorker(tokenCtx(testToken), &kvpipev1.RegisterWorkerRequest{Worker: spec}); err != nil {
		t.Fatal(err)
	}
	if ev, err := watch.Recv(); err != nil || ev.Worker.GetName() != "e0" || !ev.Worker.Spec.GetEndpointsRedacted() {
		t.Fatalf("watched %v, %v: want e0, its endpoints hidden", ev, err)
	}
	r.subscribed("e0", e)
	e.store(7, 8)
	eventually(t, "the chain indexed over grpc-go", func() bool {
		resp, err := r.grpcgo.Match(ctx, &kvpipev1.MatchRequest{Tokens: chainTokens(7, 8)})
		return err == nil && len(resp.Matches) == 1 && resp.Matches[0].Worker == "e0" && resp.Matches[0].Blocks == 8
	})
	batch, err := r.grpcgo.MatchBatch(ctx, &kvpipev1.MatchBatchRequest{Requests: batchRequests()})
	if err != nil {
		t.Fatal(err)
	}
	checkBatch(t, "grpc-go batch", batch.Responses)
	checkBatch(t, "grpc-go stream", grpcgoPipelined(t, r.grpcgo))
	checkGRPCGoList(t, r)
	checkGRPCGoRouted(t, r)
	blocks, err := receiveAll(r.grpcgo.Dump(tokenCtx(testToken), &kvpipev1.DumpRequest{Worker: "e0"}))
	if err != nil || len(blocks) != 1 || len(blocks[0].Blocks) != 8 {
		t.Fatalf("dump: %v, %v: want one chunk of 8 blocks", blocks, err)
	}
	if _, err := r.grpcgo.UnregisterWorker(tokenCtx(testToken), &kvpipev1.UnregisterWorkerRequest{Name: "e0"}); err != nil {
		t.Fatal(err)
	}
	if specs := r.s.svc.registrations(); len(specs) != 0 {
		t.Errorf("after unregister: %v", specs)
	}
}

// checkGRPCGoList lists e0 over grpc-go: its endpoints with the token only.
func checkGRPCGoList(t *testing.T, r *running) {
	t.Helper()
	for _, token := range []string{"", testToken} {
		list, err := r.grpcgo.ListWorkers(tokenCtx(token), &kvpipev1.ListWorkersRequest{})
		if err != nil || len(list.Workers) != 1 || list.Workers[0].IndexedBlocks != 8 {
			t.Fatalf("list with token %q: %v, %v", token, list, err)
		}
		if spec := list.Workers[0].Spec; (token == "") != spec.EndpointsRedacted || (token == "") != (spec.Endpoint == "") {
			t.Errorf("list with token %q: spec %v", token, spec)
		}
	}
}

// checkGRPCGoRouted records a routing to e0 over grpc-go, with the token:
// unary, in a batch and on a stream; each refused without it.
func checkGRPCGoRouted(t *testing.T, r *running) {
	t.Helper()
	for _, token := range []string{testToken, ""} {
		what, want := fmt.Sprintf("routed_to with token %q", token), ""
		if token == "" {
			want = connect.CodeUnauthenticated.String()
		}
		routed := &kvpipev1.MatchRequest{Tokens: chainTokens(7, 8), RoutedTo: "e0"}
		_, err := r.grpcgo.Match(tokenCtx(token), routed)
		if (err != nil) != (want != "") || (err != nil && codeOf(err).String() != want) {
			t.Errorf("%s: Match: %v, want %q", what, err, want)
		}
		batch, err := r.grpcgo.MatchBatch(tokenCtx(token), &kvpipev1.MatchBatchRequest{Requests: []*kvpipev1.MatchRequest{routed}})
		if err != nil || batch.Responses[0].GetError().GetCode() != want {
			t.Errorf("%s: MatchBatch: %v, %v, want %q", what, batch, err, want)
		}
		stream, err := r.grpcgo.MatchStream(tokenCtx(token))
		if err == nil {
			err = stream.Send(routed)
		}
		a, err := receiveOne(stream, err)
		if err != nil || a.GetError().GetCode() != want {
			t.Errorf("%s: MatchStream: %v, %v, want %q", what, a, err, want)
		}
	}
}

// receiveOne is a MatchStream's next answer, its side then closed.
func receiveOne(stream grpc.BidiStreamingClient[kvpipev1.MatchRequest, kvpipev1.MatchResponse], err error) (*kvpipev1.MatchResponse, error) {
	if err != nil {
		return nil, err
	}
	a, err := stream.Recv()
	stream.CloseSend()
	if _, end := stream.Recv(); !errors.Is(end, io.EOF) && err == nil {
		err = end
	}
	return a, err
}

// grpcgoPipelined sends batchRequests on one grpc-go MatchStream, all
// before any answer, and returns the answers.
func grpcgoPipelined(t *testing.T, c kvpipev1.IndexServiceClient) []*kvpipev1.MatchResponse {
	t.Helper()
	stream, err := c.MatchStream(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range batchRequests() {
		if err := stream.Send(q); err != nil {
			t.Fatal(err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	var answers []*kvpipev1.MatchResponse
	for {
		a, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return answers
		}
		if err != nil {
			t.Fatalf("answer %d: %v", len(answers), err)
		}
		answers = append(answers, a)
	}
}

// On the grpc-go port, every guarded call is refused without the token,
// with a wrong one, and by a server that has none: Unauthenticated. So is
// a match that records its routing.
func TestGRPCGoRefusedWithoutToken(t *testing.T) {
	for _, server := range []string{"", testToken} {
		r := start(t, Config{Token: server, Allow: []string{"127.0.0.1"}})
		for _, token := range []string{"", "wrong", testToken} {
			if server == testToken && token == testToken {
				continue
			}
			what := fmt.Sprintf("server token %q, call token %q", server, token)
			ctx := tokenCtx(token)
			reg := &kvpipev1.RegisterWorkerRequest{Worker: &kvpipev1.WorkerSpec{Name: "x", Endpoint: "tcp://127.0.0.1:9"}}
			_, err := r.grpcgo.RegisterWorker(ctx, reg)
			wantCode(t, what+": RegisterWorker", err, connect.CodeUnauthenticated)
			_, err = r.grpcgo.UnregisterWorker(ctx, &kvpipev1.UnregisterWorkerRequest{Name: "x"})
			wantCode(t, what+": UnregisterWorker", err, connect.CodeUnauthenticated)
			dumped, err := receiveAll(r.grpcgo.Dump(ctx, &kvpipev1.DumpRequest{Worker: "x"}))
			wantCode(t, fmt.Sprintf("%s: Dump (%d messages)", what, len(dumped)), err, connect.CodeUnauthenticated)
			_, err = r.grpcgo.Match(ctx, &kvpipev1.MatchRequest{Keys: []uint64{1}, RoutedTo: "x"})
			wantCode(t, what+": Match routed_to", err, connect.CodeUnauthenticated)
		}
		if list := r.s.svc.registrations(); len(list) != 0 {
			t.Errorf("server token %q: registered %v", server, list)
		}
		if !strings.Contains(r.metricsText(), `kvpipe_serve_refused_total{reason="unauthenticated"}`) {
			t.Errorf("server token %q: refusals not counted", server)
		}
	}
}

// On the grpc-go port, a registration may only dial what the allow-list
// holds: PermissionDenied.
func TestGRPCGoRefusedOffTheAllowList(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.0/8", "::1"}})
	for _, w := range offTheAllowList() {
		_, err := r.grpcgo.RegisterWorker(tokenCtx(testToken), &kvpipev1.RegisterWorkerRequest{Worker: w})
		wantCode(t, "register "+w.Name, err, connect.CodePermissionDenied)
	}
	if list := r.s.svc.registrations(); len(list) != 0 {
		t.Errorf("registered %v", list)
	}
}

// On the grpc-go port, requests past a limit or malformed are refused
// with what is wrong (InvalidArgument; a message past the size limit,
// ResourceExhausted), and the port goes on answering.
func TestGRPCGoRefusedInvalid(t *testing.T) {
	// The size limit lets a batch past maxBatch through (8 KiB).
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}, MaxTokens: 64, MaxMessageBytes: 16 << 10})
	ctx := tokenCtx(testToken)
	for _, c := range invalidMatches() {
		_, err := r.grpcgo.Match(ctx, c.req)
		wantCode(t, c.what, err, connect.CodeInvalidArgument)
	}
	for _, c := range []struct {
		what string
		w    *kvpipev1.WorkerSpec
	}{
		{"a bad worker name", &kvpipev1.WorkerSpec{Name: "a/b", Endpoint: "tcp://127.0.0.1:1"}},
		{"an ipc endpoint", &kvpipev1.WorkerSpec{Name: "a", Endpoint: "ipc:///tmp/x"}},
		{"a port out of range", &kvpipev1.WorkerSpec{Name: "a", Endpoint: "tcp://127.0.0.1:70000"}},
		{"a block size not the router's multiple", &kvpipev1.WorkerSpec{Name: "a", Endpoint: "tcp://127.0.0.1:1", BlockSize: 24}},
		{"no worker", nil},
	} {
		_, err := r.grpcgo.RegisterWorker(ctx, &kvpipev1.RegisterWorkerRequest{Worker: c.w})
		wantCode(t, c.what, err, connect.CodeInvalidArgument)
	}
	_, err := r.grpcgo.MatchBatch(ctx, &kvpipev1.MatchBatchRequest{Requests: make([]*kvpipev1.MatchRequest, maxBatch+1)})
	wantCode(t, "a batch past the limit", err, connect.CodeInvalidArgument)
	_, err = r.grpcgo.Match(ctx, &kvpipev1.MatchRequest{Salt: strings.Repeat("x", 20<<10)})
	wantCode(t, "a message past the limit", err, connect.CodeResourceExhausted)
	if _, err := r.grpcgo.Match(ctx, &kvpipev1.MatchRequest{Keys: []uint64{1}}); err != nil {
		t.Errorf("a match after the refusals: %v", err)
	}
}

// The grpc-go port serves TLS from the same config: a TLS client is
// answered, a plain one is not.
func TestGRPCGoTLS(t *testing.T) {
	r := start(t, Config{TLS: selfSigned(t)})
	if _, err := r.grpcgo.Match(context.Background(), &kvpipev1.MatchRequest{Tokens: chainTokens(1, 2)}); err != nil {
		t.Fatalf("grpc-go over TLS: %v", err)
	}
	cc, err := grpc.NewClient(r.s.cfg.GRPCListener.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = kvpipev1.NewIndexServiceClient(cc).Match(ctx, &kvpipev1.MatchRequest{Tokens: chainTokens(1, 2)})
	if err == nil {
		t.Error("plain HTTP/2 answered by a TLS server")
	}
}

// A drain ends the grpc-go port's streams at once, as the main port's: a
// MatchStream answers the requests read and ends with Unavailable, so
// does a WatchWorkers, and Run returns long before the drain timeout.
func TestGRPCGoDrainEndsStreams(t *testing.T) {
	r := start(t, Config{DrainTimeout: 10 * time.Minute})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	watch, err := r.grpcgo.WatchWorkers(ctx, &kvpipev1.WatchWorkersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	stream, err := r.grpcgo.MatchStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&kvpipev1.MatchRequest{Keys: make([]uint64, 3)}); err != nil {
		t.Fatal(err)
	}
	if a, err := stream.Recv(); err != nil || a.RequestBlocks != 3 {
		t.Fatalf("first answer: %v, %v", a, err)
	}
	eventually(t, "both streams in flight", func() bool { return r.gauge("kvpipe_serve_in_flight_requests") == 2 })
	stopped := make(chan error, 1)
	go func() { stopped <- r.stop() }()
	_, err = stream.Recv()
	if codeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "shutting down") {
		t.Errorf("the match stream's end: %v, want unavailable: shutting down", err)
	}
	if events, err := receiveAll(watch, nil); codeOf(err) != connect.CodeUnavailable {
		t.Errorf("the watch's end after %d events: %v, want unavailable", len(events), err)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := r.gauge("kvpipe_serve_in_flight_requests"); n != 0 {
		t.Errorf("in flight after the drain: %v", n)
	}
}
