package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
)

// pythonClient runs examples/python/kvpipe_client.py (grpcio) against a
// server, with the token in its environment.
type pythonClient struct {
	t              *testing.T
	python, server string
	token          string
}

// run runs one client command and returns its output, or the error.
func (c *pythonClient) run(args ...string) (string, error) {
	cmd := exec.Command(c.python, append([]string{"../../examples/python/kvpipe_client.py", "--server", c.server}, args...)...)
	cmd.Env = append(os.Environ(), "KVPIPE_TOKEN="+c.token)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// match returns each worker's leading device blocks for tokens.
func (c *pythonClient) match(tokens []uint32) map[string]int {
	c.t.Helper()
	var b strings.Builder
	for _, tok := range tokens {
		fmt.Fprintln(&b, tok)
	}
	file := filepath.Join(c.t.TempDir(), "tokens")
	if err := os.WriteFile(file, []byte(b.String()), 0o600); err != nil {
		c.t.Fatal(err)
	}
	out, err := c.run("match", "--tokens-file", file)
	if err != nil {
		c.t.Fatalf("kvpipe_client.py match: %v: %s", err, out)
	}
	var m struct {
		Matches []struct {
			Worker string
			Blocks int
		}
	}
	if err := json.Unmarshal([]byte(strings.SplitN(out, "\n", 2)[0]), &m); err != nil {
		c.t.Fatalf("kvpipe_client.py match printed %q: %v", out, err)
	}
	scores := map[string]int{}
	for _, w := range m.Matches {
		scores[w.Worker] = w.Blocks
	}
	return scores
}

// The kvpipe serve command next to two C libzmq engines, asked by the
// Python client on both its ports: one engine from the command line, one
// registered at run time by the client (on the allow-list, with the token;
// refused without it), the scores the engines' blocks; SIGTERM drains it.
func TestServeCommandWithPythonClientAndLibzmqEngines(t *testing.T) {
	python := enginepeer.Python(t)
	if exec.Command(python, "-c", "import grpc, grpc_tools").Run() != nil {
		enginepeer.Missing(t, "python3 with grpc and grpc_tools (apt-get install python3-grpcio python3-grpc-tools)")
	}
	type engine struct {
		ep, replay string
		peer       *enginepeer.Peer
	}
	var engines [2]engine
	for i := range engines {
		e := &engines[i]
		var eps []string
		e.peer, eps = enginepeer.StartBound(t, freeTCP, "../../wire/testdata/engine_pub.py", []string{"--endpoint", "--replay"})
		e.ep, e.replay = eps[0], eps[1]
	}
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("t0k3n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	stderrR, stderrW := io.Pipe()
	exit := serveUntilDone(t, func(ctx context.Context) int {
		defer stderrW.Close()
		return run(ctx, []string{"serve", "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0",
			"--endpoint", "e0=" + engines[0].ep, "--replay", "e0=" + engines[0].replay,
			"--allow", "127.0.0.1", "--token-file", token}, nil, io.Discard, stderrW)
	})
	lines := bufio.NewScanner(stderrR)
	if !lines.Scan() || !strings.Contains(lines.Text(), "listening on") {
		t.Fatalf("stderr %q, want the listening line", lines.Text())
	}
	port := &pythonClient{t: t, python: python, server: strings.Fields(lines.Text())[4], token: "t0k3n"}
	if !lines.Scan() || !strings.Contains(lines.Text(), "gRPC (grpc-go) on") {
		t.Fatalf("stderr %q, want the grpc-go line", lines.Text())
	}
	grpcgo := &pythonClient{t: t, python: python, server: strings.Fields(lines.Text())[5], token: "t0k3n"}
	rest := make(chan string, 1)
	go func() {
		var b strings.Builder
		for lines.Scan() {
			b.WriteString(lines.Text() + "\n")
		}
		rest <- b.String()
	}()

	until := func(what string, c *pythonClient, tokens []uint32, want map[string]int) {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for {
			got := c.match(tokens)
			if fmt.Sprint(got) == fmt.Sprint(want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %v, want %v", what, got, want)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	// e0, from the command line: the engine stores a chain of 20 blocks.
	engines[0].peer.Send("go")
	engines[0].peer.Send("chain 20 1000")
	engines[0].peer.Expect("published")
	until("e0's chain on the main port", port, enginepeer.ChainTokens(1000, 20), map[string]int{"e0": 20})
	until("e0's chain on the grpc-go port", grpcgo, enginepeer.ChainTokens(1000, 20), map[string]int{"e0": 20})

	// e1, registered by the client: refused without the token.
	register := []string{"register", "--name", "e1", "--endpoint", engines[1].ep, "--replay", engines[1].replay}
	if out, err := (&pythonClient{t: t, python: python, server: port.server}).run(register...); err == nil || !strings.Contains(out, "UNAUTHENTICATED") {
		t.Errorf("register without the token: %v, %s; want UNAUTHENTICATED", err, out)
	}
	if out, err := port.run(register...); err != nil {
		t.Fatalf("register: %v: %s", err, out)
	}
	engines[1].peer.Send("go")
	engines[1].peer.Send("chain 12 1000") // the first 12 blocks of e0's prompt
	engines[1].peer.Expect("published")
	until("both engines' blocks", grpcgo, enginepeer.ChainTokens(1000, 20), map[string]int{"e0": 20, "e1": 12})
	until("a prompt of 8 more blocks after e1's 12", port, append(enginepeer.ChainTokens(1000, 12), enginepeer.ChainTokens(3000, 8)...), map[string]int{"e0": 12, "e1": 12})

	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code, log := exit(), <-rest; code != 0 || !strings.Contains(log, "drained") {
		t.Errorf("exit %d, stderr %q: want 0 and drained", code, log)
	}
	for _, e := range engines {
		e.peer.Send("quit")
	}
}

// serveUntilDone runs serve (run with its args) on a goroutine and returns
// its exit code's wait, bounded by a minute; should the test end first,
// its cleanup cancels serve and waits for it.
func serveUntilDone(t *testing.T, serve func(ctx context.Context) int) (exit func() int) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() { done <- serve(ctx) }()
	code, got := 0, false
	t.Cleanup(func() {
		cancel()
		if !got {
			select {
			case <-done:
			case <-time.After(time.Minute):
				t.Error("serve did not return a minute after its ctx ended")
			}
		}
	})
	return func() int {
		t.Helper()
		select {
		case code = <-done:
			got = true
		case <-time.After(time.Minute):
			t.Fatal("serve did not exit a minute after SIGTERM")
		}
		return code
	}
}
