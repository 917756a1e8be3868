package serve

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/grpc/status"
)

// Every guarded call is refused without the token, with a wrong one, and by
// a server that has none: gRPC Unauthenticated, HTTP 401.
func TestRefusedWithoutToken(t *testing.T) {
	for _, server := range []string{"", testToken} {
		r := start(t, Config{Token: server, Allow: []string{"127.0.0.1"}})
		for _, token := range []string{"", "wrong", testToken} {
			if server == testToken && token == testToken {
				continue
			}
			what := fmt.Sprintf("server token %q, call token %q", server, token)
			reg := &kvpipev1.RegisterWorkerRequest{Worker: &kvpipev1.WorkerSpec{Name: "x", Endpoint: "tcp://127.0.0.1:9"}}
			_, err := r.grpc.RegisterWorker(context.Background(), withToken(reg, token))
			wantCode(t, what+": RegisterWorker", err, connect.CodeUnauthenticated)
			_, err = r.grpc.UnregisterWorker(context.Background(), withToken(&kvpipev1.UnregisterWorkerRequest{Name: "x"}, token))
			wantCode(t, what+": UnregisterWorker", err, connect.CodeUnauthenticated)
			stream, err := r.grpc.Dump(context.Background(), withToken(&kvpipev1.DumpRequest{Worker: "x"}, token))
			if err == nil {
				for stream.Receive() {
					t.Errorf("%s: Dump sent a message", what)
				}
				err = stream.Err()
				stream.Close()
			}
			wantCode(t, what+": Dump", err, connect.CodeUnauthenticated)
			for _, c := range []struct{ method, path, body string }{
				{"POST", "/v1/workers", `{"worker":{"name":"x","endpoint":"tcp://127.0.0.1:9"}}`},
				{"DELETE", "/v1/workers/x", ""}, {"GET", "/v1/dump?worker=x", ""},
			} {
				if code, body := r.call(c.method, c.path, token, c.body); code != http.StatusUnauthorized || !strings.Contains(body, "token") {
					t.Errorf("%s: %s %s: %d %s, want 401", what, c.method, c.path, code, body)
				}
			}
		}
		if list := r.s.svc.registrations(); len(list) != 0 {
			t.Errorf("server token %q: registered %v", server, list)
		}
	}
}

func wantCode(t *testing.T, what string, err error, want connect.Code) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: no error, want %v", what, want)
		return
	}
	if got := codeOf(err); got != want {
		t.Errorf("%s: %v, want code %v", what, err, want)
	}
}

// codeOf is err's code, from either library's client: grpc-go's codes are
// connect-go's.
func codeOf(err error) connect.Code {
	if s, ok := status.FromError(err); ok {
		return connect.Code(s.Code())
	}
	return connect.CodeOf(err)
}

// A registration may only dial what the allow-list holds, each of its
// endpoints: PermissionDenied, HTTP 403.
func TestRefusedOffTheAllowList(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.0/8", "::1"}})
	for _, w := range offTheAllowList() {
		_, err := r.grpc.RegisterWorker(context.Background(), withToken(&kvpipev1.RegisterWorkerRequest{Worker: w}, testToken))
		wantCode(t, "register "+w.Name, err, connect.CodePermissionDenied)
	}
	code, body := r.call("POST", "/v1/workers", testToken, `{"worker":{"name":"e","endpoint":"tcp://8.8.8.8:5557"}}`)
	if code != http.StatusForbidden || !strings.Contains(body, "allow-list") {
		t.Errorf("POST /v1/workers off the list: %d %s, want 403", code, body)
	}
	// On the list: accepted, with the endpoint by the address checked.
	code, body = r.call("POST", "/v1/workers", testToken, `{"worker":{"name":"ok","endpoint":"tcp://127.0.0.2:5557"}}`)
	if code != http.StatusCreated || !strings.Contains(body, "tcp://127.0.0.2:5557") {
		t.Errorf("POST /v1/workers on the list: %d %s, want 201", code, body)
	}
	if list := r.s.svc.registrations(); len(list) != 1 || list[0].spec.Name != "ok" {
		t.Errorf("registered %v, want only ok", list)
	}
	// No allow-list: nothing may be registered.
	none := start(t, Config{Token: testToken})
	reg := &kvpipev1.RegisterWorkerRequest{Worker: &kvpipev1.WorkerSpec{Name: "x", Endpoint: "tcp://127.0.0.1:5557"}}
	_, err := none.grpc.RegisterWorker(context.Background(), withToken(reg, testToken))
	wantCode(t, "register with no allow-list", err, connect.CodePermissionDenied)
}

// offTheAllowList are registrations with an endpoint off the allow-list
// 127.0.0.0/8, ::1.
func offTheAllowList() []*kvpipev1.WorkerSpec {
	return []*kvpipev1.WorkerSpec{
		{Name: "a", Endpoint: "tcp://10.1.2.3:5557"},
		{Name: "b", Endpoint: "tcp://127.0.0.1:5557", ReplayEndpoint: "tcp://192.168.0.1:5558"},
		{Name: "c", Endpoint: "tcp://127.0.0.1:5557", SnapshotEndpoint: "tcp://[2001:db8::1]:5559"},
		{Name: "d", Endpoint: "tcp://no-such-host.invalid:5557"},
	}
}

// Requests past a limit or malformed are refused with what is wrong: gRPC
// InvalidArgument, HTTP 400; the server goes on answering.
func TestRefusedInvalid(t *testing.T) {
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}, MaxTokens: 64, MaxMessageBytes: 4096})
	for _, c := range invalidMatches() {
		_, err := r.grpc.Match(context.Background(), connect.NewRequest(c.req))
		wantCode(t, c.what, err, connect.CodeInvalidArgument)
	}
	for _, c := range []struct{ what, method, path, body string }{
		{"too many tokens", "POST", "/v1/match", fmt.Sprintf(`{"tokens":[%s0]}`, strings.Repeat("0,", 64))},
		{"not JSON", "POST", "/v1/match", `{"tokens":`},
		{"an unknown field", "POST", "/v1/match", `{"tokenz":[1]}`},
		{"a body past the limit", "POST", "/v1/match", `{"salt":"` + strings.Repeat("x", 5000) + `"}`},
		{"a bad worker name", "POST", "/v1/workers", `{"worker":{"name":"a/b","endpoint":"tcp://127.0.0.1:1"}}`},
		{"an ipc endpoint", "POST", "/v1/workers", `{"worker":{"name":"a","endpoint":"ipc:///tmp/x"}}`},
		{"a port out of range", "POST", "/v1/workers", `{"worker":{"name":"a","endpoint":"tcp://127.0.0.1:70000"}}`},
		{"a block size not the router's multiple", "POST", "/v1/workers", `{"worker":{"name":"a","endpoint":"tcp://127.0.0.1:1","blockSize":24}}`},
		{"no worker", "POST", "/v1/workers", `{}`},
	} {
		if code, body := r.call(c.method, c.path, testToken, c.body); code != http.StatusBadRequest || !strings.Contains(body, `"invalid_argument"`) {
			t.Errorf("%s: %d %s, want 400", c.what, code, body)
		}
	}
	// A gRPC message past the size limit: refused whole (gRPC's own code
	// for it, ResourceExhausted), never read.
	_, err := r.grpc.Match(context.Background(), connect.NewRequest(&kvpipev1.MatchRequest{Salt: strings.Repeat("x", 5000)}))
	wantCode(t, "a message past the limit", err, connect.CodeResourceExhausted)
	if code, _ := r.call("GET", "/healthz", "", ""); code != http.StatusOK {
		t.Errorf("healthz after the refusals: %d", code)
	}
	if !strings.Contains(r.metricsText(), `kvpipe_serve_refused_total{reason="invalid_argument"}`) {
		t.Error("refusals not counted")
	}
}

// invalidMatch is a match request refused as invalid argument.
type invalidMatch struct {
	what string
	req  *kvpipev1.MatchRequest
}

// invalidMatches are refused by a server of MaxTokens 64, block size 16.
func invalidMatches() []invalidMatch {
	return []invalidMatch{
		{"too many tokens", &kvpipev1.MatchRequest{Tokens: make([]uint32, 65)}},
		{"too many keys", &kvpipev1.MatchRequest{Keys: make([]uint64, 6)}},
		{"tokens and keys", &kvpipev1.MatchRequest{Tokens: make([]uint32, 16), Keys: []uint64{1}}},
		{"keys and a salt", &kvpipev1.MatchRequest{Keys: []uint64{1}, Salt: "s"}},
		{"multimodal past the tokens", &kvpipev1.MatchRequest{Tokens: make([]uint32, 16), Multimodal: []*kvpipev1.MultiModal{{Hash: "h", Offset: 10, Length: 7}}}},
		{"multimodal without a hash", &kvpipev1.MatchRequest{Tokens: make([]uint32, 16), Multimodal: []*kvpipev1.MultiModal{{Offset: 0, Length: 1}}}},
		{"a long salt", &kvpipev1.MatchRequest{Tokens: make([]uint32, 16), Salt: strings.Repeat("s", maxSalt+1)}},
		{"a bad routed_to", &kvpipev1.MatchRequest{Keys: []uint64{1}, RoutedTo: "a/b"}},
	}
}

func (r *running) metricsText() string {
	_, body := r.call("GET", "/metrics", "", "")
	return body
}
