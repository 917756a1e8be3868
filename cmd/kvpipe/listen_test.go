package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/enginepeer"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/kvpipe/kvpipe/internal/ztest"
)

var freeTCP = ztest.FreeTCP

// listening is a `kvpipe listen --json --events` run against one engine.
type listening struct {
	t      *testing.T
	stdout *bufio.Scanner
	cancel context.CancelFunc
	done   chan int
}

type listenSummary struct {
	Lost, Events, Replayed, Gaps, Batches, Restarts, Resyncs uint64
	DecodeErrors                                             uint64 `json:"decode_errors"`
	IndexedBlocks                                            uint64 `json:"indexed_blocks"`
	Filtered                                                 map[string]uint64
}

// startListen runs the libzmq engine peer and `kvpipe listen` against it.
func startListen(t *testing.T) (*listening, *enginepeer.Peer) {
	engine, eps := enginepeer.StartBound(t, freeTCP, "../../wire/testdata/engine_pub.py", []string{"--endpoint", "--replay"})
	return listenTo(t, eps[0], eps[1]), engine
}

func listenTo(t *testing.T, ep, replay string) *listening {
	stdoutR, stdoutW := io.Pipe()
	stderrR, stderrW := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	l := &listening{t: t, stdout: bufio.NewScanner(stdoutR), cancel: cancel, done: make(chan int, 1)}
	go func() {
		l.done <- run(ctx, []string{"listen", "--endpoint", "engine0=" + ep, "--replay", "engine0=" + replay, "--json", "--events"},
			nil, stdoutW, stderrW)
		stdoutW.Close()
		stderrW.Close()
	}()
	stderr := bufio.NewScanner(stderrR)
	if !stderr.Scan() || !strings.Contains(stderr.Text(), "worker engine0: first batch") {
		t.Fatalf("stderr: %q, want the first-batch line", stderr.Text())
	}
	go io.Copy(io.Discard, stderrR)
	return l
}

// stored reads event lines until n BlockStored events have been printed.
func (l *listening) stored(n int) {
	l.t.Helper()
	for stored := 0; stored < n; {
		if !l.stdout.Scan() {
			l.t.Fatalf("stdout ended after %d events", stored)
		}
		var ev map[string]any
		if err := json.Unmarshal(l.stdout.Bytes(), &ev); err != nil {
			l.t.Fatalf("event line %q: %v", l.stdout.Text(), err)
		}
		if ev["type"] == "BlockStored" {
			stored++
		}
	}
}

// stop cancels the run and returns its summary line, parsed.
func (l *listening) stop() (listenSummary, string) {
	l.t.Helper()
	l.cancel()
	if !l.stdout.Scan() {
		l.t.Fatal("no summary line")
	}
	var sum listenSummary
	if err := json.Unmarshal(l.stdout.Bytes(), &sum); err != nil {
		l.t.Fatalf("summary %q: %v", l.stdout.Text(), err)
	}
	select {
	case code := <-l.done:
		if code != 0 {
			l.t.Errorf("exit %d", code)
		}
	case <-time.After(5 * time.Second):
		l.t.Fatal("listen did not exit after cancel")
	}
	return sum, l.stdout.Text()
}

// kvpipe listen against a vLLM-style libzmq publisher that drops batches on
// its PUB: with the replay endpoint given, every batch arrives and "lost" is 0.
func TestListenAgainstLibzmqEngine(t *testing.T) {
	l, engine := startListen(t)
	engine.Send("go")
	engine.Send("batches 30 2,3,4,17")
	engine.Expect("published")
	l.stored(30)
	sum, line := l.stop()
	if sum.Lost != 0 || sum.Events != 30 || sum.Replayed < 4 || sum.Gaps < 1 || sum.DecodeErrors != 0 || sum.IndexedBlocks != 30 {
		t.Errorf("summary %s: want lost 0, events 30, replayed >= 4, gaps >= 1, no decode errors, 30 indexed blocks", line)
	}
	if len(sum.Filtered) != int(actor.NumReasons) || sum.Filtered["partial_block"] != 0 {
		t.Errorf("filtered counts %v: want every reason, all 0", sum.Filtered)
	}
	engine.Send("quit")
}

// An engine restarted within milliseconds, whose new seqs are past the old
// last one before listen's SUB is back: one restart, one resync, no loss, and
// the index holds the new engine's blocks only.
func TestListenReportsAFastRestart(t *testing.T) {
	l, engine := startListen(t)
	engine.Send("go")
	engine.Send("chain 10 1000")
	engine.Expect("published")
	l.stored(10)
	engine.Send("restart-ahead 5 5000")
	line := engine.Expect("restarted")
	n, err := strconv.Atoi(line[strings.LastIndexByte(line, ' ')+1:])
	if err != nil {
		t.Fatal(line)
	}
	l.stored(n)
	sum, text := l.stop()
	if sum.Restarts != 1 || sum.Resyncs != 1 || sum.Lost != 0 || sum.IndexedBlocks != uint64(n) {
		t.Errorf("summary %s: want restarts 1, resyncs 1, lost 0, %d indexed blocks", text, n)
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

// Several engines at once, until --exit-after-batches.
func TestListenSeveralWorkersExitsAfterBatches(t *testing.T) {
	var pubs []*wiretest.Publisher
	args := []string{"listen", "--json", "--exit-after-batches", "50"}
	for _, name := range []string{"a", "b"} {
		ep := freeTCP(t)
		pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: ep})
		if err != nil {
			t.Fatal(err)
		}
		defer pub.Close()
		pubs = append(pubs, pub)
		args = append(args, "--endpoint", name+"="+ep)
	}
	payload := engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{{Type: codec.BlockStored,
		BlockHashes: []uint64{1}, TokenIDs: make([]uint32, 16), BlockSize: 16}}}, engineenc.CurrentVLLM)
	var out strings.Builder
	done := make(chan int, 1)
	go func() { done <- run(context.Background(), args, nil, &out, io.Discard) }()
	for {
		select {
		case code := <-done:
			if code != 0 {
				t.Fatalf("exit %d", code)
			}
			var sum map[string]json.RawMessage
			if err := json.Unmarshal([]byte(out.String()), &sum); err != nil {
				t.Fatalf("summary %q: %v", out.String(), err)
			}
			var batches uint64
			json.Unmarshal(sum["batches"], &batches)
			if batches < 50 {
				t.Errorf("batches = %d, want at least 50", batches)
			}
			return
		case <-time.After(5 * time.Millisecond):
			for _, p := range pubs {
				p.Publish(payload)
			}
		}
	}
}
