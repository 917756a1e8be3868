package serve

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1/kvpipev1connect"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
)

const (
	testBlock = 16
	testToken = "s3cret-token"
)

// running is a Server on loopback, run until the test ends.
type running struct {
	t      *testing.T
	s      *Server
	p      *kvpipe.Pipeline
	reg    *prometheus.Registry
	url    string
	http   *http.Client
	grpc   kvpipev1connect.IndexServiceClient
	grpcgo kvpipev1.IndexServiceClient // the grpc-go port's, by grpc-go
	cancel context.CancelFunc
	done   chan error
}

// start runs a server with cfg (Pipeline, BlockSize, Token, Allow and Poll
// defaulted for tests) on 127.0.0.1, with its grpc-go port.
func start(t *testing.T, cfg Config) *running {
	t.Helper()
	if cfg.Pipeline == nil {
		p, err := kvpipe.New(kvpipe.Config{BlockSize: testBlock})
		if err != nil {
			t.Fatal(err)
		}
		cfg.Pipeline = p
	}
	cfg.BlockSize = testBlock
	cfg.Poll = orInt(cfg.Poll, 20*time.Millisecond)
	cfg.Registry = prometheus.NewRegistry()
	l, gl := listen(t), listen(t)
	cfg.GRPCListener = gl
	s, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{t: t, s: s, p: cfg.Pipeline, reg: cfg.Registry, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- s.Run(ctx, l) }()
	scheme := "http"
	tr := &http.Transport{Protocols: new(http.Protocols)}
	if cfg.TLS != nil {
		scheme = "https"
		tr.Protocols.SetHTTP2(true)
		tr.TLSClientConfig = &tls.Config{RootCAs: testCA(t, cfg.TLS)}
	} else {
		tr.Protocols.SetUnencryptedHTTP2(true) // gRPC without TLS
	}
	r.url = scheme + "://" + l.Addr().String()
	r.http = &http.Client{Transport: tr, Timeout: time.Minute}
	r.grpc = kvpipev1connect.NewIndexServiceClient(r.http, r.url, connect.WithGRPC())
	t.Cleanup(func() { r.stop() })
	r.grpcgo = grpcgoClient(t, gl.Addr().String(), cfg.TLS) // closed before the stop above
	return r
}

func listen(t testing.TB) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// grpcgoClient is a grpc-go client of addr, over TLS trusting the
// certificate of server (a selfSigned config) when it is not nil.
func grpcgoClient(t *testing.T, addr string, server *tls.Config) kvpipev1.IndexServiceClient {
	t.Helper()
	creds := insecure.NewCredentials()
	if server != nil {
		creds = credentials.NewTLS(&tls.Config{RootCAs: testCA(t, server)})
	}
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return kvpipev1.NewIndexServiceClient(cc)
}

// tokenCtx is a grpc-go call's context carrying the bearer token.
func tokenCtx(token string) context.Context {
	if token == "" {
		return context.Background()
	}
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token)
}

// stop drains the server and returns Run's error (once; later calls nil).
func (r *running) stop() error {
	r.cancel()
	defer r.http.CloseIdleConnections()
	select {
	case err, ok := <-r.done:
		if ok {
			close(r.done)
		}
		return err
	case <-time.After(2 * time.Minute):
		r.t.Fatal("Run did not return after its ctx ended")
		return nil
	}
}

// call is a REST call: it returns the status and body.
func (r *running) call(method, path, token, body string) (int, string) {
	r.t.Helper()
	req, err := http.NewRequest(method, r.url+path, strings.NewReader(body))
	if err != nil {
		r.t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := r.http.Do(req)
	if err != nil {
		r.t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(data)
}

// withToken wraps m in a request carrying the bearer token.
func withToken[T any](m *T, token string) *connect.Request[T] {
	req := connect.NewRequest(m)
	if token != "" {
		req.Header().Set("Authorization", "Bearer "+token)
	}
	return req
}

// register registers name for the publisher through gRPC, with the token.
func (r *running) register(name string, pub *wiretest.Publisher) {
	r.t.Helper()
	spec := &kvpipev1.WorkerSpec{Name: name, Endpoint: "tcp://" + pub.Addr(), ReplayEndpoint: pub.ReplayAddr()}
	if spec.ReplayEndpoint != "" {
		spec.ReplayEndpoint = "tcp://" + spec.ReplayEndpoint
	}
	if _, err := r.grpc.RegisterWorker(context.Background(), withToken(&kvpipev1.RegisterWorkerRequest{Worker: spec}, testToken)); err != nil {
		r.t.Fatal(err)
	}
}

// matchGRPC returns each worker's leading blocks for tokens, over gRPC.
func (r *running) matchGRPC(tokens []uint32) map[string]uint32 {
	r.t.Helper()
	resp, err := r.grpc.Match(context.Background(), connect.NewRequest(&kvpipev1.MatchRequest{Tokens: tokens}))
	if err != nil {
		r.t.Fatal(err)
	}
	out := map[string]uint32{}
	for _, m := range resp.Msg.Matches {
		out[m.Worker] = m.Blocks
	}
	return out
}

// matchJSON is matchGRPC over POST /v1/match.
func (r *running) matchJSON(tokens []uint32) map[string]uint32 {
	r.t.Helper()
	body, _ := json.Marshal(map[string]any{"tokens": tokens})
	code, resp := r.call("POST", "/v1/match", "", string(body))
	if code != http.StatusOK {
		r.t.Fatalf("POST /v1/match: %d %s", code, resp)
	}
	var out struct {
		Matches []struct {
			Worker string
			Blocks uint32
		}
	}
	if err := json.Unmarshal([]byte(resp), &out); err != nil {
		r.t.Fatal(err)
	}
	m := map[string]uint32{}
	for _, w := range out.Matches {
		m[w.Worker] = w.Blocks
	}
	return m
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

// engine is a Go engine publisher (wiretest) whose cache is the chains it
// stored, so the answers can be checked exactly.
type engine struct {
	t   *testing.T
	pub *wiretest.Publisher
}

func newEngine(t *testing.T, ep string) *engine { return newEngineBuffer(t, ep, 0) }

// newEngineBuffer is newEngine whose replay buffer keeps steps batches.
func newEngineBuffer(t *testing.T, ep string, steps int) *engine {
	t.Helper()
	cfg := wiretest.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: steps}
	if ep != "" {
		cfg.Endpoint = ep
	}
	pub, err := wiretest.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	return &engine{t: t, pub: pub}
}

// chainTokens are the tokens of chain base's first n blocks.
func chainTokens(base, n int) []uint32 {
	out := make([]uint32, 0, n*testBlock)
	for i := range n * testBlock {
		out = append(out, uint32(base*1000+i))
	}
	return out
}

// store publishes chain base's first n blocks (engine hashes base*1000+i)
// in one batch.
func (e *engine) store(base, n int) {
	tokens := chainTokens(base, n)
	var b codec.Batch
	for i := range n {
		ev := codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{uint64(base*1000 + i)}, BlockSize: testBlock,
			TokenIDs: tokens[i*testBlock : (i+1)*testBlock], Medium: "GPU"}
		if i > 0 {
			ev.ParentHash, ev.HasParent = uint64(base*1000+i-1), true
		}
		b.Events = append(b.Events, ev)
	}
	e.pub.Publish(engineenc.AppendBatch(nil, &b, engineenc.CurrentVLLM))
}

// probe publishes an empty batch, as engines do while idle.
func (e *engine) probe() {
	e.pub.Publish(engineenc.AppendBatch(nil, &codec.Batch{}, engineenc.CurrentVLLM))
}

// subscribed probes until the server's worker name has a batch.
func (r *running) subscribed(name string, e *engine) {
	r.t.Helper()
	eventually(r.t, fmt.Sprintf("worker %s subscribed", name), func() bool {
		e.probe()
		ws, ok := r.p.Stats().Worker(name)
		return ok && ws.Wire.Batches > 0
	})
}

// gauge reads a gauge's value from the server's registry.
func (r *running) gauge(name string) float64 {
	mfs, err := r.reg.Gather()
	if err != nil {
		r.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.Metric) > 0 {
			return mf.Metric[0].GetGauge().GetValue()
		}
	}
	return -1
}
