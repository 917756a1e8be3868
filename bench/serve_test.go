package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
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
// by kvpipe serve, with its matches asked in process, over gRPC (h2c) and
// over POST /v1/match on loopback, by one client flat out and at 5k/s
// (flat out only for ingest=paced);
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
		for _, via := range []string{"inprocess", "grpc", "json"} {
			for _, rate := range rates {
				if ingest == "paced" && rate > 0 {
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
					find := matcher(b, via, p, url)
					if ingest != "idle" {
						measure(b, w, rate, pass, find)
						return
					}
					// Idle, the process's CPU time is the calls': per call, a
					// figure the machine's load does not move.
					var calls atomic.Int64
					pass = idle(w, pass)
					before := cpuTime()
					measure(b, w, rate, pass, func(keys []uint64) error { calls.Add(1); return find(keys) })
					b.ReportMetric(float64((cpuTime()-before).Nanoseconds())/float64(max(calls.Load(), 1)), "cpu-ns/call")
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

// matcher asks one prompt's keys the way via says.
func matcher(b *testing.B, via string, p *kvpipe.Pipeline, url string) func([]uint64) error {
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
		}
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
		}
	}
	var dst []kvpipe.Match
	return func(keys []uint64) (err error) {
		dst, err = p.AppendMatches(ctx, dst[:0], keys)
		return err
	}
}
