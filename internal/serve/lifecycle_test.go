package serve

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1/kvpipev1connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// When Run's ctx ends (SIGTERM in kvpipe serve), a call in flight is still
// answered, the index and the registrations are saved, and a server started
// again from them has the worker back and answers with its blocks.
func TestDrainSavesAndRestarts(t *testing.T) {
	snap := filepath.Join(t.TempDir(), "index.snap")
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}, Snapshot: snap, SnapshotEvery: 20 * time.Millisecond})
	// The engine's replay buffer is too short to hold the chain by the
	// restart: only the snapshot can bring it back.
	e := newEngineBuffer(t, "", 40)
	r.register("e0", e.pub)
	r.subscribed("e0", e)
	e.store(3, 6)
	tokens := chainTokens(3, 6)
	eventually(t, "the chain indexed", func() bool { return r.matchGRPC(tokens)["e0"] == 6 })
	eventually(t, "a periodic snapshot", func() bool { _, err := os.Stat(snap); return err == nil })
	for range 50 {
		e.probe()
	}
	eventually(t, "the probes applied", func() bool { ws, _ := r.p.Stats().Worker("e0"); return ws.Wire.Batches >= 50 })

	// A match whose body is half sent when the drain begins.
	body, _ := json.Marshal(map[string]any{"tokens": tokens})
	pr, pw := io.Pipe()
	answered := make(chan *http.Response, 1)
	failed := make(chan error, 1)
	go func() {
		resp, err := r.http.Post(r.url+"/v1/match", "application/json", pr)
		if err != nil {
			failed <- err
			return
		}
		answered <- resp
	}()
	pw.Write(body[:10])
	eventually(t, "the match in flight", func() bool { return r.gauge("kvpipe_serve_in_flight_requests") >= 1 })
	stopped := make(chan error, 1)
	go func() { stopped <- r.stop() }()
	eventually(t, "the drain to begin", func() bool {
		select {
		case <-r.s.draining.Done():
			return true
		default:
			return false
		}
	})
	pw.Write(body[10:])
	pw.Close()
	select {
	case resp := <-answered:
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !json.Valid(data) {
			t.Errorf("the call in flight: %d %s", resp.StatusCode, data)
		}
	case err := <-failed:
		t.Fatalf("the call in flight failed: %v", err)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("Run: %v", err)
	}
	for _, f := range []string{snap, snap + ".workers"} {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("not saved: %v", err)
		}
	}

	again := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}, Snapshot: snap})
	eventually(t, "the registration loaded", func() bool { return again.s.svc.spec("e0") != nil })
	if specs := again.s.svc.registrations(); len(specs) != 1 {
		t.Fatalf("restarted with workers %v, want e0 alone", specs)
	}
	probes := 0
	eventually(t, "the restored chain answered", func() bool {
		if probes < 20 { // within the buffer: the restored seq stays provable
			e.probe()
			probes++
		}
		return again.matchJSON(tokens)["e0"] == 6
	})
}

// A drain ends an open MatchStream at once, idle or not: the requests the
// server read are answered, in order, and the stream then ends with
// Unavailable, saying why. (Before, an idle stream held the drain to its
// timeout, here longer than the test's.)
func TestDrainEndsMatchStreams(t *testing.T) {
	for _, inFlight := range []int{0, 1, 8} {
		t.Run(fmt.Sprintf("in-flight=%d", inFlight), func(t *testing.T) {
			r := start(t, Config{DrainTimeout: 10 * time.Minute})
			stream := r.grpc.MatchStream(context.Background())
			defer stream.CloseResponse()
			ask := func(i int) {
				if err := stream.Send(&kvpipev1.MatchRequest{Keys: make([]uint64, i+1)}); err != nil {
					t.Fatal(err)
				}
			}
			ask(0) // the stream open and answered once before the drain
			if a, err := stream.Receive(); err != nil || a.RequestBlocks != 1 {
				t.Fatalf("first answer: %v, %v", a, err)
			}
			for i := range inFlight {
				ask(i + 1)
			}
			stopped := make(chan error, 1)
			go func() { stopped <- r.stop() }()
			var err error
			for n := 1; err == nil; n++ {
				var a *kvpipev1.MatchResponse
				if a, err = stream.Receive(); err == nil && (n > inFlight || a.RequestBlocks != uint32(n+1)) {
					t.Fatalf("answer %d of %d in flight: %d blocks, want %d", n, inFlight, a.RequestBlocks, n+1)
				}
			}
			if connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "shutting down") {
				t.Errorf("the stream's end: %v, want unavailable: shutting down", err)
			}
			if err := <-stopped; err != nil {
				t.Fatalf("Run: %v", err)
			}
		})
	}
}

// Draining, a MatchStream answers every request it had read, in order,
// and then ends: none is skipped when a read one and the drain are both
// ready (select picks between them at random).
func TestDrainingStreamAnswersEveryRequestRead(t *testing.T) {
	closing := make(chan struct{})
	close(closing)
	for round := range 50 {
		reqs := make(chan *kvpipev1.MatchRequest, 8)
		for i := range cap(reqs) {
			reqs <- &kvpipev1.MatchRequest{Keys: make([]uint64, i+1)}
		}
		draining := false
		for i := range cap(reqs) {
			req, ok, err := nextRequest(context.Background(), reqs, closing, &draining)
			if err != nil || !ok || len(req.Keys) != i+1 {
				t.Fatalf("round %d, request %d: %d keys, ok %v, err %v; want %d keys", round, i, len(req.GetKeys()), ok, err, i+1)
			}
		}
		if _, _, err := nextRequest(context.Background(), reqs, closing, &draining); err != errDraining {
			t.Fatalf("round %d: after the requests read, %v; want errDraining", round, err)
		}
	}
}

// A MatchStream whose client sends and never reads its answers is cut
// streamGrace into the drain, on both ports: its handler waits in a send
// that only the client could let go on, or has returned with its answers
// queued. Before, it held the drain for all
// of DrainTimeout (10 s by default, a minute here).
func TestDrainCutsStreamsThatDoNotRead(t *testing.T) {
	// The answers past both clients' windows: 20,000 block the handler in
	// a send; 1,200 (about 70 KiB) let it return with the rest queued.
	for _, c := range []struct {
		port     string
		requests int
	}{{"main", 20000}, {"main", 1200}, {"grpc-go", 20000}, {"grpc-go", 1200}} {
		port, requests := c.port, c.requests
		t.Run(fmt.Sprintf("%s/requests=%d", port, requests), func(t *testing.T) {
			r := start(t, Config{DrainTimeout: time.Minute})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var send func(*kvpipev1.MatchRequest) error
			if port == "main" {
				tr := &http.Transport{Protocols: new(http.Protocols), HTTP2: &http.HTTP2Config{MaxReceiveBufferPerStream: 1 << 10}}
				tr.Protocols.SetUnencryptedHTTP2(true)
				defer tr.CloseIdleConnections()
				stream := kvpipev1connect.NewIndexServiceClient(&http.Client{Transport: tr}, r.url, connect.WithGRPC()).MatchStream(ctx)
				send = stream.Send
			} else {
				cc, err := grpc.NewClient(r.s.cfg.GRPCListener.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
					grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10))
				if err != nil {
					t.Fatal(err)
				}
				defer cc.Close()
				stream, err := kvpipev1.NewIndexServiceClient(cc).MatchStream(ctx)
				if err != nil {
					t.Fatal(err)
				}
				send = stream.Send
			}
			// Refused in place, each answered with its error.
			bad := &kvpipev1.MatchRequest{Tokens: []uint32{1}, Keys: []uint64{1}}
			for i := range requests {
				if err := send(bad); err != nil {
					t.Fatalf("request %d: %v", i, err)
				}
			}
			// Its answers block once the client's window is full; drained
			// before that, it still owes more than the window.
			eventually(t, "the stream open", func() bool { return r.gauge("kvpipe_serve_in_flight_requests") >= 1 })
			begun := time.Now()
			if err := r.stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			if took := time.Since(begun); took > r.s.cfg.DrainTimeout/2 {
				t.Errorf("the drain took %v with a stream that does not read, DrainTimeout %v; streams are cut %v into it",
					took, r.s.cfg.DrainTimeout, streamGrace)
			}
		})
	}
}

// A connection with no call open is closed after IdleTimeout, on both
// ports. Before, an idle HTTP/2 connection stayed open for ever, a few
// goroutines each.
func TestIdleConnectionsClosed(t *testing.T) {
	r := start(t, Config{IdleTimeout: 200 * time.Millisecond})
	for port, addr := range map[string]string{
		"main":    strings.TrimPrefix(r.url, "http://"),
		"grpc-go": r.s.cfg.GRPCListener.Addr().String(),
	} {
		t.Run(port, func(t *testing.T) {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			// HTTP/2 with prior knowledge: the preface and empty settings.
			if _, err := io.WriteString(c, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"); err != nil {
				t.Fatal(err)
			}
			c.SetReadDeadline(time.Now().Add(time.Minute))
			if _, err := io.Copy(io.Discard, c); err != nil { // the server's settings, a GOAWAY, then EOF
				t.Fatalf("the idle connection was not closed: %v", err)
			}
		})
	}
}

// A Dump in flight to a client that reads it slowly is answered whole
// through a drain on the grpc-go port, its status included: a call is
// answered up to DrainTimeout. (Stopping the port once no handler ran
// threw away the chunks still queued.)
func TestDrainAnswersASlowDump(t *testing.T) {
	const chains, blocks = 40, 1000
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.0/8"}, DrainTimeout: time.Minute})
	e := newEngine(t, "")
	r.register("e0", e.pub)
	r.subscribed("e0", e)
	for c := range chains {
		e.store(10+c, blocks)
	}
	eventually(t, "the chains indexed", func() bool { return r.matchGRPC(chainTokens(10+chains-1, blocks))["e0"] == blocks })
	cc, err := grpc.NewClient(r.s.cfg.GRPCListener.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	stream, err := kvpipev1.NewIndexServiceClient(cc).Dump(tokenCtx(testToken), &kvpipev1.DumpRequest{Worker: "e0"})
	if err != nil {
		t.Fatal(err)
	}
	first, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	got := len(first.Blocks)
	stopped := make(chan error, 1)
	go func() { stopped <- r.stop() }()
	for {
		time.Sleep(200 * time.Millisecond) // the server's window fills meanwhile
		chunk, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("after %d of %d blocks: %v", got, chains*blocks, err)
		}
		got += len(chunk.Blocks)
	}
	if got != chains*blocks {
		t.Errorf("dumped %d blocks, want %d", got, chains*blocks)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// A drain ends every watch with Unavailable, on both ports and over
// HTTP/JSON (a last line in the error shape): a client tells it from an
// end of its own and watches another server.
func TestDrainEndsWatchesUnavailable(t *testing.T) {
	r := start(t, Config{})
	connectWatch, err := r.grpc.WatchWorkers(context.Background(), connect.NewRequest(&kvpipev1.WatchWorkersRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	grpcWatch, err := r.grpcgo.WatchWorkers(context.Background(), &kvpipev1.WatchWorkersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := r.http.Get(r.url + "/v1/watch")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	eventually(t, "the watches open", func() bool { return r.gauge("kvpipe_serve_in_flight_requests") >= 3 })
	stopped := make(chan error, 1)
	go func() { stopped <- r.stop() }()
	for connectWatch.Receive() {
	}
	wantCode(t, "connect's watch", connectWatch.Err(), connect.CodeUnavailable)
	var grpcErr error
	for grpcErr == nil {
		_, grpcErr = grpcWatch.Recv()
	}
	wantCode(t, "grpc-go's watch", grpcErr, connect.CodeUnavailable)
	lines, _ := io.ReadAll(resp.Body)
	if !strings.HasSuffix(string(lines), "\n") || !strings.Contains(string(lines), `"code":"unavailable"`) {
		t.Errorf("/v1/watch ended with %q, want a last line of code unavailable", lines)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("Run: %v", err)
	}
}
