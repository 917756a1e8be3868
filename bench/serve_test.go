package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/serve"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1/kvpipev1connect"
)

// BenchmarkServe: BenchmarkLoopback's ingest (2 shards) into a pipeline run
// by kvpipe serve, with its matches asked in process, over gRPC (h2c: one
// Match a call, MatchBatch of batchSize prompts a call, or MatchStream, one
// prompt a message on one stream) and over POST /v1/match on loopback, by
// one client flat out and at 5k calls/s (flat out only for ingest=paced and
// the batch and the stream); finds are calls, matches/s counts prompts;
// the client runs on the same cores. ingest=trace streams the trace in flat
// out (the cores saturated), ingest=paced spread over 10 s a pass, and
// ingest=idle asks the index the trace's first pass left, a second per
// iteration, with nothing streaming in: the transport's own cost.
func BenchmarkServe(b *testing.B) {
	w := load(b)
	ingests, rates := []string{"trace", "paced", "idle"}, []int{0, 5000}
	if testing.Short() { // CI's once-over (-short -benchtime 1x): each transport, no ingest to wait for
		ingests, rates = []string{"idle"}, []int{0}
	}
	for _, ingest := range ingests {
		for _, via := range []string{"inprocess", "grpc", "grpc-batch", "grpc-stream", "json"} {
			for _, rate := range rates {
				if rate > 0 && (ingest == "paced" || strings.HasPrefix(via, "grpc-")) {
					continue // 30 s a run even at -benchtime 1x: flat out says enough
				}
				q := "query=flat"
				if rate > 0 {
					q = fmt.Sprintf("query=%dk", rate/1000)
				}
				b.Run("ingest="+ingest+"/"+via+"/"+q, func(b *testing.B) {
					var url string
					spread := time.Duration(0)
					if ingest == "paced" {
						spread = 10 * time.Second
					}
					p, pass := loopback(b, w, 2, spread, func(b *testing.B, p *kvpipe.Pipeline) { url = runServe(b, p) })
					find, perCall := matcher(b, via, p, url, w.prompts)
					var calls atomic.Int64
					counted := func(keys []uint64) error { calls.Add(1); return find(keys) }
					if ingest != "idle" {
						measure(b, w, rate, pass, counted)
						b.ReportMetric(float64(calls.Load()*int64(perCall))/b.Elapsed().Seconds(), "matches/s")
						return
					}
					// Idle, the process's CPU time is the calls': per match, a
					// figure the machine's load does not move.
					pass = idle(w, pass)
					before := cpuTime()
					measure(b, w, rate, pass, counted)
					n := float64(max(calls.Load()*int64(perCall), 1))
					b.ReportMetric(float64((cpuTime()-before).Nanoseconds())/n, "cpu-ns/match")
					b.ReportMetric(n/b.Elapsed().Seconds(), "matches/s")
				})
			}
		}
	}
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// idle publishes the workload's frames less their final clear, once, and
// then only waits a second per pass.
func idle(w *workload, pass func()) func() {
	saved := w.clear
	for _, fs := range w.frames { // a batch of the trace again, not a clear
		if len(fs) > 0 {
			w.clear = fs[len(fs)-1]
		}
	}
	pass()
	w.clear = saved
	return func() { time.Sleep(time.Second) }
}

// runServe runs kvpipe serve for p on loopback until the benchmark ends.
func runServe(b *testing.B, p *kvpipe.Pipeline) string {
	s, err := serve.New(context.Background(), serve.Config{Pipeline: p, BlockSize: blockSize})
	if err != nil {
		b.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, l) }()
	b.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
	})
	return "http://" + l.Addr().String()
}

// batchSize is how many prompts a grpc-batch call asks: what a router
// gathers in well under a millisecond at 20,000 requests/s.
const batchSize = 16

// matcher asks one prompt's keys the way via says, and says how many
// prompts each call asks: grpc-batch asks the prompt and the batchSize-1
// prompts after it in prompts.
func matcher(b *testing.B, via string, p *kvpipe.Pipeline, url string, prompts [][]uint64) (func([]uint64) error, int) {
	ctx := context.Background()
	tr := &http.Transport{Protocols: new(http.Protocols), MaxIdleConnsPerHost: 4}
	tr.Protocols.SetUnencryptedHTTP2(true)
	if via == "json" {
		tr.Protocols = nil // HTTP/1.1 keep-alive, as curl or a plain HTTP client
	}
	client := &http.Client{Transport: tr}
	b.Cleanup(client.CloseIdleConnections)
	switch via {
	case "grpc":
		c := kvpipev1connect.NewIndexServiceClient(client, url, connect.WithGRPC())
		return func(keys []uint64) error {
			_, err := c.Match(ctx, connect.NewRequest(&kvpipev1.MatchRequest{Keys: keys}))
			return err
		}, 1
	case "grpc-batch":
		return batchMatcher(kvpipev1connect.NewIndexServiceClient(client, url, connect.WithGRPC()), prompts), batchSize
	case "grpc-stream":
		return streamMatcher(b, kvpipev1connect.NewIndexServiceClient(client, url, connect.WithGRPC())), 1
	case "json":
		var body bytes.Buffer
		return func(keys []uint64) error {
			body.Reset()
			json.NewEncoder(&body).Encode(map[string][]uint64{"keys": keys})
			resp, err := client.Post(url+"/v1/match", "application/json", &body)
			if err != nil {
				return err
			}
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("POST /v1/match: %s", resp.Status)
			}
			return err
		}, 1
	}
	var dst []kvpipe.Match
	return func(keys []uint64) (err error) {
		dst, err = p.AppendMatches(ctx, dst[:0], keys)
		return err
	}, 1
}

// batchMatcher asks, in one MatchBatch, the prompt it is given and the
// batchSize-1 after it in prompts (those after the last prompt so given).
func batchMatcher(c kvpipev1connect.IndexServiceClient, prompts [][]uint64) func([]uint64) error {
	reqs := make([]*kvpipev1.MatchRequest, batchSize)
	for i := range reqs {
		reqs[i] = &kvpipev1.MatchRequest{}
	}
	next := 0
	return func(keys []uint64) error {
		reqs[0].Keys = keys
		for i := 1; i < batchSize; i++ {
			reqs[i].Keys = prompts[(next+i)%len(prompts)]
		}
		next = (next + batchSize) % len(prompts)
		resp, err := c.MatchBatch(context.Background(), connect.NewRequest(&kvpipev1.MatchBatchRequest{Requests: reqs}))
		if err == nil && len(resp.Msg.Responses) != batchSize {
			err = fmt.Errorf("MatchBatch: %d answers to %d requests", len(resp.Msg.Responses), batchSize)
		}
		return err
	}
}

// streamMatcher asks each prompt on one MatchStream, waiting for its
// answer before the next, until the benchmark ends.
func streamMatcher(b *testing.B, c kvpipev1connect.IndexServiceClient) func([]uint64) error {
	stream := c.MatchStream(context.Background())
	b.Cleanup(func() {
		stream.CloseRequest()
		stream.CloseResponse()
	})
	var req kvpipev1.MatchRequest
	return func(keys []uint64) error {
		req.Keys = keys
		if err := stream.Send(&req); err != nil {
			return err
		}
		_, err := stream.Receive()
		return err
	}
}
