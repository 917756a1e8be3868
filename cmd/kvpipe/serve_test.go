package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/natstest"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// kvpipe serve with a worker from a --config file: it answers, on its
// --grpc-listen port too, and SIGTERM drains it (exit 0) with its snapshot
// saved.
func TestServeDrainsOnSIGTERM(t *testing.T) {
	dir := t.TempDir()
	config := filepath.Join(dir, "workers.json")
	os.WriteFile(config, []byte(`{"workers":[{"name":"e0","endpoint":"`+freeTCP(t)+`"}]}`), 0o600)
	token := filepath.Join(dir, "token")
	os.WriteFile(token, []byte("t0k3n\n"), 0o600)
	snap := filepath.Join(dir, "index.snap")
	stderrR, stderrW := io.Pipe()
	exit := serveUntilDone(t, func(ctx context.Context) int {
		defer stderrW.Close()
		return run(ctx, []string{"serve", "--listen", "127.0.0.1:0", "--config", config,
			"--token-file", token, "--snapshot", snap, "--grpc-listen", "127.0.0.1:0"}, nil, io.Discard, stderrW)
	})
	lines := bufio.NewScanner(stderrR)
	if !lines.Scan() || !strings.Contains(lines.Text(), "listening on") {
		t.Fatalf("stderr %q, want the listening line", lines.Text())
	}
	addr := strings.Fields(lines.Text())[4]
	if !lines.Scan() || !strings.Contains(lines.Text(), "gRPC (grpc-go) on") {
		t.Fatalf("stderr %q, want the grpc-go line", lines.Text())
	}
	grpcAddr := strings.Fields(lines.Text())[5]
	client := &http.Client{Timeout: time.Minute}
	defer client.CloseIdleConnections()
	resp, err := client.Get("http://" + addr + "/v1/workers")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `"e0"`) {
		t.Errorf("GET /v1/workers: %s, want e0", body)
	}
	if names := grpcgoWorkers(t, grpcAddr); len(names) != 1 || names[0] != "e0" {
		t.Errorf("ListWorkers over grpc-go: %v, want e0", names)
	}
	// Our own process: serve's handler takes the signal, as in production.
	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	var rest strings.Builder
	for lines.Scan() {
		rest.WriteString(lines.Text() + "\n")
	}
	if code := exit(); code != 0 || !strings.Contains(rest.String(), "drained") {
		t.Errorf("exit %d, stderr %q: want 0 and drained", code, rest.String())
	}
	if _, err := os.Stat(snap); err != nil {
		t.Errorf("snapshot not saved: %v", err)
	}
}

// grpcgoWorkers lists the workers of the grpc-go port at addr.
func grpcgoWorkers(t *testing.T, addr string) []string {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	list, err := kvpipev1.NewIndexServiceClient(cc).ListWorkers(context.Background(), &kvpipev1.ListWorkersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, w := range list.Workers {
		names = append(names, w.Name)
	}
	return names
}

// A --grpc-listen address taken: exit 1, saying which flag.
func TestServeGRPCListenTaken(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var errOut strings.Builder
	if code := run(context.Background(), []string{"serve", "--listen", "127.0.0.1:0", "--grpc-listen", l.Addr().String()}, nil, io.Discard, &errOut); code != 1 || !strings.Contains(errOut.String(), "--grpc-listen") {
		t.Errorf("exit %d, stderr %q; want 1 and --grpc-listen", code, errOut.String())
	}
}

func TestServeFlagErrors(t *testing.T) {
	empty := filepath.Join(t.TempDir(), "empty")
	os.WriteFile(empty, nil, 0o600)
	for _, args := range [][]string{
		{"--tls-cert", "x.pem"}, {"--token-file", empty}, {"--token-file", "/no/such/file"},
		{"--config", empty}, {"--block-size", "0"}, {"--allow", "not a host name!"},
	} {
		var errOut strings.Builder
		if code := run(context.Background(), append([]string{"serve", "--listen", "127.0.0.1:0"}, args...), nil, io.Discard, &errOut); code != 2 || errOut.Len() == 0 {
			t.Errorf("serve %v: exit %d, stderr %q; want 2 and a message", args, code, errOut.String())
		}
	}
}

// kvpipe serve --nats follows a relay's stream: it answers with the blocks
// the relay's engine stored, without a connection to the engine.
func TestServeFollowsARelay(t *testing.T) {
	srv := natstest.Start(t)
	ep, replay := freeTCP(t), freeTCP(t)
	pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	var b codec.Batch
	tokens := make([]uint32, 5*16)
	for i := range tokens {
		tokens[i] = uint32(100 + i)
	}
	for i := range 5 {
		b.Events = append(b.Events, codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{uint64(i + 1)}, ParentHash: uint64(i),
			HasParent: i > 0, TokenIDs: tokens[i*16 : (i+1)*16], BlockSize: 16})
	}
	pub.Publish(engineenc.AppendBatch(nil, &b, engineenc.CurrentVLLM))
	ctx, cancel := context.WithCancel(context.Background())
	nats := []string{"--nats", srv.URL(), "--stream", "T", "--prefix", "t.ops", "--bucket", "t-snap"}
	relayDone := make(chan int, 1)
	go func() {
		relayDone <- run(ctx, append([]string{"relay", "--endpoint", "e0=" + ep, "--replay", "e0=" + replay}, nats...), nil, io.Discard, io.Discard)
	}()
	stderrR, stderrW := io.Pipe()
	serveDone := make(chan int, 1)
	go func() {
		serveDone <- run(ctx, append([]string{"serve", "--listen", "127.0.0.1:0"}, nats...), nil, io.Discard, stderrW)
		stderrW.Close()
	}()
	lines := bufio.NewScanner(stderrR)
	if !lines.Scan() || !strings.Contains(lines.Text(), "listening on") {
		t.Fatalf("stderr %q, want the listening line", lines.Text())
	}
	go io.Copy(io.Discard, stderrR)
	url := "http://" + strings.Fields(lines.Text())[4]
	client := &http.Client{Timeout: time.Minute}
	defer client.CloseIdleConnections()
	body, _ := json.Marshal(map[string]any{"tokens": tokens})
	var got string
	for deadline := time.Now().Add(time.Minute); !matched(got, "e0", 5); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the relayed blocks never answered: last %s", got)
		}
		resp, err := client.Post(url+"/v1/match", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		got = string(data)
	}
	cancel()
	if code := <-serveDone; code != 0 {
		t.Errorf("serve exit %d", code)
	}
	if code := <-relayDone; code != 0 {
		t.Errorf("relay exit %d", code)
	}
}

// matched reports whether a /v1/match answer gives worker blocks blocks.
func matched(answer, worker string, blocks int) bool {
	var m struct {
		Matches []struct {
			Worker string
			Blocks int
		}
	}
	json.Unmarshal([]byte(answer), &m)
	for _, w := range m.Matches {
		if w.Worker == worker && w.Blocks == blocks {
			return true
		}
	}
	return false
}
