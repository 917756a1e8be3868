package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
)

func freeTCP(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "tcp://" + l.Addr().String()
}

// kvpipe listen against a vLLM-style libzmq publisher that drops batches on
// its PUB: with the replay endpoint given, every batch arrives and "lost" is 0.
func TestListenAgainstLibzmqEngine(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	engine := enginepeer.Start(t, "../../wire/testdata/engine_pub.py", "--endpoint", ep, "--replay", replay)
	engine.Expect("ready")

	stdoutR, stdoutW := io.Pipe()
	stderrR, stderrW := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"listen", "--endpoint", "engine0=" + ep, "--replay", "engine0=" + replay, "--json", "--events"},
			nil, stdoutW, stderrW)
		stdoutW.Close()
		stderrW.Close()
	}()
	stderr := bufio.NewScanner(stderrR)
	if !stderr.Scan() || !strings.Contains(stderr.Text(), "worker engine0: first batch") {
		t.Fatalf("stderr: %q, want the first-batch line", stderr.Text())
	}
	go io.Copy(io.Discard, stderrR)
	engine.Send("go")
	engine.Send("batches 30 2,3,4,17")
	engine.Expect("published")

	stdout := bufio.NewScanner(stdoutR)
	for stored := 0; stored < 30; {
		if !stdout.Scan() {
			t.Fatalf("stdout ended after %d events", stored)
		}
		var ev map[string]any
		if err := json.Unmarshal(stdout.Bytes(), &ev); err != nil {
			t.Fatalf("event line %q: %v", stdout.Text(), err)
		}
		if ev["type"] == "BlockStored" {
			stored++
		}
	}
	cancel()
	if !stdout.Scan() {
		t.Fatal("no summary line")
	}
	var sum map[string]uint64
	if err := json.Unmarshal(stdout.Bytes(), &sum); err != nil {
		t.Fatalf("summary %q: %v", stdout.Text(), err)
	}
	if sum["lost"] != 0 || sum["events"] != 30 || sum["replayed"] < 4 || sum["gaps"] < 1 || sum["decode_errors"] != 0 {
		t.Errorf("summary %v: want lost 0, events 30, replayed >= 4, gaps >= 1, no decode errors", sum)
	}
	select {
	case code := <-done:
		if code != 0 {
			t.Errorf("exit %d", code)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("listen did not exit after cancel")
	}
	engine.Send("quit")
}

func TestListenFlagErrors(t *testing.T) {
	for _, args := range [][]string{{}, {"--endpoint", "http://x:1"}, {"--endpoint", "tcp://127.0.0.1:1", "--block-size", "0"}} {
		var errOut strings.Builder
		if code := run(context.Background(), append([]string{"listen"}, args...), nil, io.Discard, &errOut); code != 2 || errOut.Len() == 0 {
			t.Errorf("listen %v: exit %d, stderr %q; want 2 and a message", args, code, errOut.String())
		}
	}
}
