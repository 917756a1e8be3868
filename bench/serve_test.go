package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/serve"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1/kvpipev1connect"
)

// BenchmarkServe: BenchmarkLoopback's ingest (2 shards) into a pipeline run
// by kvpipe serve, with its matches asked in process, over gRPC (h2c: one
// Match a call; MatchBatch of batchSize prompts a call; MatchStream, one
// prompt a message on one stream, the next sent once the answer is in, or
// up to 8 in flight, grpc-stream-8), served and asked by connect-go (grpc,
// the main port) or by grpc-go (grpcgo, the --grpc-listen port), and over POST /v1/match on loopback, by
// one client flat out and at 5k calls/s (that only while the trace streams
// in flat out, and not for the batch and the streams); finds are calls,
// matches/s counts prompts; the client runs on the same cores.
// ingest=trace streams the trace in flat out (the cores saturated),
// ingest=paced spreads a pass over 10 s (about 90 times the trace's own
// pace), ingest=live streams it at the pace of its timestamps onto the
// index a first pass left, and ingest=idle asks that index with nothing
// streaming in: the transport's own cost. The idle and live cases share
// one server, and report the CPU time per match.
func BenchmarkServe(b *testing.B) {
	w := load(b)
	ingests := []string{"trace", "paced", "live", "idle"}
	if testing.Short() { // CI's once-over (-short -benchtime 1x): each transport on an idle index
		ingests = []string{"idle"}
	}
	for _, ingest := range ingests {
		b.Run("ingest="+ingest, func(b *testing.B) {
			switch ingest {
			case "trace", "paced":
				serveIngesting(b, w, ingest == "paced")
			default:
				serveSettled(b, w, ingest == "live")
			}
		})
	}
}

// serveVias are the ways BenchmarkServe asks; the stream with several
// requests in flight only where it is measured with CPU time.
var serveVias = []string{"inprocess", "grpc", "grpc-batch", "grpc-stream", "grpc-stream-8",
	"grpcgo", "grpcgo-batch", "grpcgo-stream", "grpcgo-stream-8", "json"}

// serveIngesting: each case its own pipeline, which each pass streams the
// trace into (over 10 s when paced), from empty to empty.
func serveIngesting(b *testing.B, w *workload, paced bool) {
	rates := []int{0, 5000}
	spread := time.Duration(0)
	if paced {
		rates, spread = []int{0}, 10*time.Second // 30 s a run even at -benchtime 1x: flat out says enough
	}
	for _, via := range serveVias {
		for _, rate := range rates {
			if rate > 0 && strings.Contains(via, "-") {
				continue
			}
			q := "query=flat"
			if rate > 0 {
				q = fmt.Sprintf("query=%dk", rate/1000)
			}
			b.Run(via+"/"+q, func(b *testing.B) {
				var at servers
				p, pass := loopback(b, w, 2, spread, func(b *testing.B, p *kvpipe.Pipeline) { at = runServe(b, p) })
				ask := newAsker(b, via, p, at, w.prompts)
				measure(b, w, rate, pass, ask.find)
				ask.report(b)
			})
		}
	}
}

// serveSettled: one pipeline for every case (settledServe), each iteration
// one of its ticks.
func serveSettled(b *testing.B, w *workload, live bool) {
	p, at, in := settledServe(b, w, live)
	for _, via := range serveVias {
		b.Run(via+"/query=flat", func(b *testing.B) {
			ask := newAsker(b, via, p, at, w.prompts)
			// The process's CPU time is the calls' (and the live ingest's):
			// per match, a figure the machine's load does not move.
			runtime.GC() // each case from the same heap, not the garbage of the one before
			before := cpuTime()
			in.n, in.blocks, in.events = 0, 0, 0
			measure(b, w, 0, in.next, ask.find)
			ask.report(b)
			n := float64(max(ask.matches(), 1))
			b.ReportMetric(float64((cpuTime()-before).Nanoseconds())/n, "cpu-ns/match")
			// What streamed in, not measure's passes of the whole trace.
			b.SetBytes(0)
			sec := (time.Duration(in.n) * in.tick).Seconds()
			b.ReportMetric(float64(in.blocks)/sec, "blocks/s")
			b.ReportMetric(float64(in.events)/sec, "events/s")
		})
	}
}

// settledServe runs kvpipe serve for a pipeline the trace's first pass
// has been applied to, and returns its ticks: a second (a tenth under
// -short) of nothing streaming in, or of the trace streaming in again at
// its own pace (live).
func settledServe(b *testing.B, w *workload, live bool) (*kvpipe.Pipeline, servers, *ticks) {
	tick := time.Second
	if testing.Short() {
		tick = 100 * time.Millisecond
	}
	settled := *w              // loopback's pass publishes what this holds when called
	settled.clear = emptyBatch // the index stays as the pass leaves it
	var at servers
	spread := time.Duration(0)
	if live {
		spread = tick
	}
	p, pass := loopback(b, &settled, 2, spread, func(b *testing.B, p *kvpipe.Pipeline) { at = runServe(b, p) })
	pass()
	in := &ticks{tick: tick, pass: func() { time.Sleep(tick) }}
	if live {
		in = livePass(b, w, &settled, pass, tick)
	}
	return p, at, in
}

// ticks is an iteration of serveSettled: a tick of the trace streaming in
// (or of nothing), counted.
type ticks struct {
	tick              time.Duration
	pass              func()
	n, blocks, events int // ticks, and the blocks and events they published
}

func (t *ticks) next() { t.pass(); t.n++ }

// emptyBatch is a batch of no events: it ends a pass and changes nothing.
var emptyBatch = engineenc.AppendBatch(nil, &codec.Batch{}, engineenc.CurrentVLLM)

// traceFrame is a frame's time in the trace and what it holds.
type traceFrame struct {
	at             time.Duration
	blocks, events int
}

// livePass makes each tick publish the frames the trace's timestamps put
// in the next tick of its time, each worker's spread over the tick
// (loopback's spread is the tick), around the trace again and again; it
// logs the trace's own pace.
func livePass(b *testing.B, w, settled *workload, pass func(), tick time.Duration) *ticks {
	var frames [workers][]traceFrame
	var d codec.Decoder
	var batch codec.Batch
	span := time.Duration(0)
	for i, fs := range w.frames {
		for _, f := range fs {
			if err := d.Decode(f, &batch); err != nil {
				b.Fatal(err)
			}
			tf := traceFrame{at: time.Duration(batch.TS * float64(time.Second)), events: len(batch.Events)}
			for _, e := range batch.Events {
				tf.blocks += len(e.BlockHashes)
			}
			frames[i], span = append(frames[i], tf), max(span, tf.at)
		}
	}
	span += time.Second
	b.Logf("trace: %.0f s, %.1f k blocks/s, %.1f events/s at its own pace", span.Seconds(),
		float64(w.blocks)/span.Seconds()/1e3, float64(w.events)/span.Seconds())
	t := &ticks{tick: tick}
	var from time.Duration
	var next [workers]int
	t.pass = func() {
		start, to := time.Now(), from+tick
		for i := range settled.frames {
			start := next[i]
			for ; next[i] < len(frames[i]) && frames[i][next[i]].at < to; next[i]++ {
				t.blocks += frames[i][next[i]].blocks
				t.events += frames[i][next[i]].events
			}
			settled.frames[i] = w.frames[i][start:next[i]]
		}
		pass()
		// A worker has a frame or none a tick: the spread waits for none.
		time.Sleep(tick - time.Since(start))
		if from = to; from >= span { // every frame published: the trace again
			from, next = 0, [workers]int{}
		}
	}
	return t
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// servers are where runServe answers: kvpipe serve's URL, and the address
// of its grpc-go port.
type servers struct{ url, grpcgo string }

// runServe runs kvpipe serve for p on loopback, with its grpc-go port,
// until the benchmark ends.
func runServe(b *testing.B, p *kvpipe.Pipeline) servers {
	l, gl := listen(b), listen(b)
	s, err := serve.New(context.Background(), serve.Config{Pipeline: p, BlockSize: blockSize, GRPCListener: gl})
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
	return servers{url: "http://" + l.Addr().String(), grpcgo: gl.Addr().String()}
}

func listen(b *testing.B) net.Listener {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	return l
}

// batchSize is how many prompts a grpc-batch call asks: what a router
// gathers in well under a millisecond at 20,000 requests/s.
const batchSize = 16

// asker asks one prompt's keys a way BenchmarkServe names, and counts the
// prompts answered.
type asker struct {
	find    func([]uint64) error
	perCall int              // prompts a call asks
	calls   atomic.Int64     // calls made
	stream  *pipelinedStream // grpc-stream-N: its own latencies
}

func (a *asker) matches() int64 { return a.calls.Load() * int64(a.perCall) }

// report adds matches/s, and a pipelined stream's latencies from a
// request's send to its answer (measure's are only the sends').
func (a *asker) report(b *testing.B) {
	if a.stream != nil {
		a.stream.finish(b)
		reportLatencies(b, a.stream.lat)
	}
	b.ReportMetric(float64(a.matches())/b.Elapsed().Seconds(), "matches/s")
}

func reportLatencies(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "find-p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "find-p99-ns")
}

func newAsker(b *testing.B, via string, p *kvpipe.Pipeline, at servers, prompts [][]uint64) *asker {
	find, perCall := matcher(b, via, p, at, prompts)
	a := &asker{perCall: perCall}
	if find == nil { // grpc-stream-N
		_, n, _ := strings.Cut(via, "-stream-")
		inFlight, err := strconv.Atoi(n)
		if err != nil {
			b.Fatalf("via %q: %v", via, err)
		}
		a.stream = newPipelinedStream(b, rpcClientOf(b, via, at).stream(), inFlight)
		find = a.stream.send
	}
	a.find = func(keys []uint64) error { a.calls.Add(1); return find(keys) }
	return a
}

// rpcClient is a gRPC client of the match calls, of either library.
type rpcClient struct {
	match  func(context.Context, *kvpipev1.MatchRequest) (*kvpipev1.MatchResponse, error)
	batch  func(context.Context, *kvpipev1.MatchBatchRequest) (*kvpipev1.MatchBatchResponse, error)
	stream func() matchStream
}

// matchStream is a client's MatchStream (connect-go's methods).
type matchStream interface {
	Send(*kvpipev1.MatchRequest) error
	Receive() (*kvpipev1.MatchResponse, error)
	CloseRequest() error
	CloseResponse() error
}

// rpcClientOf is the client via names: grpcgo... asks grpc-go's server
// with grpc-go, grpc... kvpipe serve's with connect-go.
func rpcClientOf(b *testing.B, via string, at servers) rpcClient {
	if strings.HasPrefix(via, "grpcgo") {
		return grpcgoClient(b, at.grpcgo)
	}
	return connectClient(b, at.url)
}

// connectClient is a connect-go gRPC client over h2c.
func connectClient(b *testing.B, url string) rpcClient {
	tr := &http.Transport{Protocols: new(http.Protocols), MaxIdleConnsPerHost: 4}
	tr.Protocols.SetUnencryptedHTTP2(true)
	client := &http.Client{Transport: tr}
	b.Cleanup(client.CloseIdleConnections)
	c := kvpipev1connect.NewIndexServiceClient(client, url, connect.WithGRPC())
	return rpcClient{
		match: func(ctx context.Context, r *kvpipev1.MatchRequest) (*kvpipev1.MatchResponse, error) {
			resp, err := c.Match(ctx, connect.NewRequest(r))
			if err != nil {
				return nil, err
			}
			return resp.Msg, nil
		},
		batch: func(ctx context.Context, r *kvpipev1.MatchBatchRequest) (*kvpipev1.MatchBatchResponse, error) {
			resp, err := c.MatchBatch(ctx, connect.NewRequest(r))
			if err != nil {
				return nil, err
			}
			return resp.Msg, nil
		},
		stream: func() matchStream { return c.MatchStream(context.Background()) },
	}
}

// matcher asks one prompt's keys the way via says, and says how many
// prompts each call asks: grpc-batch asks the prompt and the batchSize-1
// prompts after it in prompts. A nil func: via is grpc-stream-N (or
// grpcgo-stream-N).
func matcher(b *testing.B, via string, p *kvpipe.Pipeline, at servers, prompts [][]uint64) (func([]uint64) error, int) {
	ctx := context.Background()
	_, mode, _ := strings.Cut(via, "-")
	switch {
	case via == "inprocess":
		var dst []kvpipe.Match
		return func(keys []uint64) (err error) {
			dst, err = p.AppendMatchesKeys(ctx, dst[:0], keys, nil)
			return err
		}, 1
	case via == "json":
		return jsonMatcher(b, at.url), 1
	case mode == "":
		c := rpcClientOf(b, via, at)
		return func(keys []uint64) error {
			_, err := c.match(ctx, &kvpipev1.MatchRequest{Keys: keys})
			return err
		}, 1
	case mode == "batch":
		return batchMatcher(rpcClientOf(b, via, at), prompts), batchSize
	case mode == "stream":
		return streamMatcher(b, rpcClientOf(b, via, at)), 1
	}
	return nil, 1 // a stream with N in flight: newAsker's
}

// jsonMatcher asks POST /v1/match over HTTP/1.1 keep-alive, as curl or a
// plain HTTP client would.
func jsonMatcher(b *testing.B, url string) func([]uint64) error {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	b.Cleanup(client.CloseIdleConnections)
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

// batchMatcher asks, in one MatchBatch, the prompt it is given and the
// batchSize-1 after it in prompts (those after the last prompt so given).
func batchMatcher(c rpcClient, prompts [][]uint64) func([]uint64) error {
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
		resp, err := c.batch(context.Background(), &kvpipev1.MatchBatchRequest{Requests: reqs})
		if err == nil && len(resp.Responses) != batchSize {
			err = fmt.Errorf("MatchBatch: %d answers to %d requests", len(resp.Responses), batchSize)
		}
		return err
	}
}

// streamMatcher asks each prompt on one MatchStream, waiting for its
// answer before the next, until the benchmark ends.
func streamMatcher(b *testing.B, c rpcClient) func([]uint64) error {
	stream := c.stream()
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

// pipelinedStream asks on one MatchStream with up to n requests in flight:
// send returns once its request is sent, waiting only while n are
// unanswered; a goroutine receives the answers, in the order asked, and
// times each from its send.
type pipelinedStream struct {
	stream matchStream
	req    kvpipev1.MatchRequest
	sent   chan time.Time // one per request in flight: n at most
	done   chan error     // the receiver's end
	ended  chan struct{}  // closed once the receiver has ended
	lat    []time.Duration
	once   sync.Once
}

func newPipelinedStream(b *testing.B, stream matchStream, n int) *pipelinedStream {
	s := &pipelinedStream{stream: stream, sent: make(chan time.Time, n), done: make(chan error, 1),
		ended: make(chan struct{})}
	go s.receive()
	b.Cleanup(func() { s.finish(b) })
	return s
}

func (s *pipelinedStream) send(keys []uint64) error {
	select { // waits while n are in flight
	case s.sent <- time.Now():
	case <-s.ended: // nothing frees a place any more
		return errors.New("match stream: the answers ended")
	}
	s.req.Keys = keys
	return s.stream.Send(&s.req)
}

// receive takes the answers until the server ends the stream.
func (s *pipelinedStream) receive() {
	defer close(s.ended)
	for {
		a, err := s.stream.Receive()
		if err != nil {
			s.done <- err
			return
		}
		t := <-s.sent
		if a.Error != nil {
			s.done <- fmt.Errorf("match refused: %s: %s", a.Error.Code, a.Error.Message)
			return
		}
		s.lat = append(s.lat, time.Since(t))
	}
}

// finish closes the stream's requests, and waits for the answers to the
// ones in flight and the receiver's end.
func (s *pipelinedStream) finish(b *testing.B) {
	s.once.Do(func() {
		err := s.stream.CloseRequest()
		if rerr := <-s.done; !errors.Is(rerr, io.EOF) {
			err = rerr
		}
		s.stream.CloseResponse()
		if err != nil {
			b.Error(err)
		}
	})
}
