package bench

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// clientEnv, set, makes this test binary BenchmarkServeRemote's client
// process (TestMain): "ADDR MODE CALLERS", MODE unary or stream.
const clientEnv = "KVPIPE_BENCH_CLIENT"

// BenchmarkServeRemote: kvpipe serve's grpc-go port asked by a client in
// a process of its own (this binary run again), so that this process's
// CPU time per match is the server's (and the live ingest's) alone, as a
// router in another process would see it. The index is serveSettled's
// (idle, or the trace streaming in at its own pace); the client runs
// callers=N callers at once on one connection, each with one prompt in
// flight: unary Match calls (grpcgo) or one MatchStream each
// (grpcgo-stream). Latency is the client's, from a request's send to its
// answer; each iteration is a tick of the ingest. A case with no client
// (none) says what the ingest alone takes.
func BenchmarkServeRemote(b *testing.B) {
	w := load(b)
	ingests := []string{"live", "idle"}
	if testing.Short() {
		ingests = []string{"idle"}
	}
	for _, ingest := range ingests {
		b.Run("ingest="+ingest, func(b *testing.B) {
			_, at, in := settledServe(b, w, ingest == "live")
			b.Run("none", func(b *testing.B) { ingestOnly(b, in) })
			for _, mode := range []string{"unary", "stream"} {
				for _, callers := range []int{1, 2, 4} {
					via := "grpcgo"
					if mode == "stream" {
						via += "-stream"
					}
					b.Run(fmt.Sprintf("%s/callers=%d", via, callers), func(b *testing.B) {
						askRemote(b, startClient(b, at.grpcgo, mode, callers, w.prompts), in)
					})
				}
			}
		})
	}
}

// ingestOnly reports the cores this process takes for b.N ticks of in
// with nothing asked: the ingest's share of BenchmarkServeRemote's
// server-cpu-ns/match.
func ingestOnly(b *testing.B, in *ticks) {
	runtime.GC()
	before := cpuTime()
	for b.Loop() {
		in.next()
	}
	b.ReportMetric(float64(cpuTime()-before)/float64(b.Elapsed()), "server-cores")
}

// askRemote lets c ask for b.N ticks of in, and reports its rate and
// latencies, both processes' CPU time per match and the server process's
// allocations per match.
func askRemote(b *testing.B, c *clientProcess, in *ticks) {
	runtime.GC()
	in.n, in.blocks = 0, 0
	var mem runtime.MemStats
	runtime.ReadMemStats(&mem)
	mallocs, bytes := mem.Mallocs, mem.TotalAlloc
	before := cpuTime()
	if err := c.start(); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		in.next()
	}
	res, err := c.stop()
	if err != nil {
		b.Fatal(err)
	}
	server := cpuTime() - before
	runtime.ReadMemStats(&mem)
	n := float64(max(res.Calls, 1))
	b.ReportMetric(float64(res.Calls)/res.Seconds, "matches/s")
	b.ReportMetric(float64(res.P50), "find-p50-ns")
	b.ReportMetric(float64(res.P99), "find-p99-ns")
	b.ReportMetric(float64(server.Nanoseconds())/n, "server-cpu-ns/match")
	b.ReportMetric(float64(res.CPU)/n, "client-cpu-ns/match")
	b.ReportMetric(float64(mem.Mallocs-mallocs)/n, "server-allocs/match")
	b.ReportMetric(float64(mem.TotalAlloc-bytes)/n, "server-B/match")
	b.SetBytes(0)
	b.ReportMetric(float64(in.blocks)/(time.Duration(in.n)*in.tick).Seconds(), "blocks/s")
}

// remoteResult is what the client process reports: the calls it made in
// Seconds, their latency percentiles and its own CPU time (ns).
type remoteResult struct {
	Calls    int64
	Seconds  float64
	P50, P99 int64
	CPU      int64
}

// clientProcess is the client process as the benchmark drives it: it
// starts asking at start, and stops and reports when its stdin closes.
type clientProcess struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Reader
	once   sync.Once
	err    error // cmd.Wait's
}

// startClient starts a client process of the server at addr with the
// prompts, and returns once it is connected and warmed up.
func startClient(b *testing.B, addr, mode string, callers int, prompts [][]uint64) *clientProcess {
	cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.bench=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %s %d", clientEnv, addr, mode, callers))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	c := &clientProcess{cmd: cmd, stdin: stdin, stdout: bufio.NewReader(stdout)}
	b.Cleanup(func() { c.wait() })
	bw := bufio.NewWriter(stdin)
	if err := writePrompts(bw, prompts); err != nil {
		b.Fatal(err)
	}
	if err := bw.Flush(); err != nil {
		b.Fatal(err)
	}
	if line, err := c.stdout.ReadString('\n'); err != nil || line != "ready\n" {
		b.Fatalf("client process: %q, %v (exit: %v)", line, err, c.wait())
	}
	return c
}

// start tells the client process to ask.
func (c *clientProcess) start() error {
	_, err := c.stdin.Write([]byte{1})
	return err
}

// stop ends the asking and returns what the client measured.
func (c *clientProcess) stop() (remoteResult, error) {
	c.stdin.Close()
	var res remoteResult
	err := json.NewDecoder(c.stdout).Decode(&res)
	return res, errors.Join(err, c.wait())
}

// wait closes the client's stdin (it stops asking) and waits for it to exit.
func (c *clientProcess) wait() error {
	c.once.Do(func() {
		c.stdin.Close()
		io.Copy(io.Discard, c.stdout) // Wait would close it under a reader
		c.err = c.cmd.Wait()
	})
	return c.err
}

// writePrompts writes how many prompts, then each prompt's length and
// keys, little-endian.
func writePrompts(w io.Writer, prompts [][]uint64) error {
	if err := binary.Write(w, binary.LittleEndian, uint32(len(prompts))); err != nil {
		return err
	}
	for _, p := range prompts {
		if err := binary.Write(w, binary.LittleEndian, uint32(len(p))); err != nil {
			return err
		}
		if err := binary.Write(w, binary.LittleEndian, p); err != nil {
			return err
		}
	}
	return nil
}

func readPrompts(r io.Reader) ([][]uint64, error) {
	var n uint32
	if err := binary.Read(r, binary.LittleEndian, &n); err != nil {
		return nil, err
	}
	prompts := make([][]uint64, n)
	for i := range prompts {
		var k uint32
		if err := binary.Read(r, binary.LittleEndian, &k); err != nil {
			return nil, err
		}
		prompts[i] = make([]uint64, k)
		if err := binary.Read(r, binary.LittleEndian, prompts[i]); err != nil {
			return nil, err
		}
	}
	return prompts, nil
}

// runClientProcess is the client process's main: it exits 1 on an error,
// said on stderr.
func runClientProcess(spec string, in io.Reader, out io.Writer) int {
	if err := askForParent(spec, bufio.NewReader(in), out); err != nil {
		fmt.Fprintln(os.Stderr, "client process:", err)
		return 1
	}
	return 0
}

// askForParent reads the prompts from in, connects, warms up and says
// "ready"; at the next byte on in, its callers ask until in ends; then it
// writes its remoteResult to out.
func askForParent(spec string, in *bufio.Reader, out io.Writer) error {
	var addr, mode string
	var callers int
	if _, err := fmt.Sscan(spec, &addr, &mode, &callers); err != nil {
		return fmt.Errorf("%s=%q: %w", clientEnv, spec, err)
	}
	prompts, err := readPrompts(in)
	if err != nil {
		return fmt.Errorf("prompts: %w", err)
	}
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer cc.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // ends the streams
	asks := make([]func([]uint64) error, callers)
	for i := range asks {
		if asks[i], err = remoteCaller(ctx, kvpipev1.NewIndexServiceClient(cc), mode); err != nil {
			return err
		}
		for j := range 100 {
			if err := asks[i](prompts[j%len(prompts)]); err != nil {
				return fmt.Errorf("warm-up: %w", err)
			}
		}
	}
	fmt.Fprintln(out, "ready")
	if _, err := in.ReadByte(); err != nil {
		return err
	}
	res, err := askUntilEOF(asks, prompts, in)
	if err != nil {
		return err
	}
	return json.NewEncoder(out).Encode(res)
}

// askUntilEOF runs each of asks on a goroutine of its own, over prompts
// from a place of its own, until in ends.
func askUntilEOF(asks []func([]uint64) error, prompts [][]uint64, in io.Reader) (remoteResult, error) {
	var stop atomic.Bool
	lats, errs := make([][]time.Duration, len(asks)), make([]error, len(asks))
	start, cpu := time.Now(), cpuTime()
	var wg sync.WaitGroup
	for i, ask := range asks {
		wg.Go(func() {
			lats[i] = make([]time.Duration, 0, 1<<16)
			for j := i * len(prompts) / len(asks); !stop.Load(); j++ {
				t := time.Now()
				if errs[i] = ask(prompts[j%len(prompts)]); errs[i] != nil {
					return
				}
				lats[i] = append(lats[i], time.Since(t))
			}
		})
	}
	io.Copy(io.Discard, in)
	stop.Store(true)
	wg.Wait()
	res := remoteResult{Seconds: time.Since(start).Seconds(), CPU: (cpuTime() - cpu).Nanoseconds()}
	all := slices.Concat(lats...)
	if len(all) > 0 {
		slices.Sort(all)
		res.Calls, res.P50, res.P99 = int64(len(all)), all[len(all)/2].Nanoseconds(), all[len(all)*99/100].Nanoseconds()
	}
	return res, errors.Join(errs...)
}

// remoteCaller asks one prompt at a time: a unary Match each, or on a
// MatchStream of its own.
func remoteCaller(ctx context.Context, c kvpipev1.IndexServiceClient, mode string) (func([]uint64) error, error) {
	switch mode {
	case "unary":
		return func(keys []uint64) error {
			_, err := c.Match(ctx, &kvpipev1.MatchRequest{Keys: keys})
			return err
		}, nil
	case "stream":
		s, err := c.MatchStream(ctx)
		if err != nil {
			return nil, err
		}
		var req kvpipev1.MatchRequest
		return func(keys []uint64) error {
			req.Keys = keys
			if err := s.Send(&req); err != nil {
				return err
			}
			_, err := s.Recv()
			return err
		}, nil
	}
	return nil, fmt.Errorf("mode %q: unary or stream", mode)
}
