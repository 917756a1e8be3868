package serve

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/enginepeer"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
)

// pyClient runs examples/python/kvpipe_client.py against the server.
type pyClient struct {
	t      *testing.T
	python string
	server string
}

// newPyClient is a Python client of the server at addr (host:port).
func newPyClient(t *testing.T, addr string) *pyClient {
	t.Helper()
	python := enginepeer.Python(t)
	if exec.Command(python, "-c", "import grpc, grpc_tools").Run() != nil {
		enginepeer.Missing(t, "python3 with grpc and grpc_tools (apt-get install python3-grpcio python3-grpc-tools)")
	}
	return &pyClient{t: t, python: python, server: addr}
}

// run runs one client command and decodes its first line of JSON.
func (c *pyClient) run(out any, args ...string) {
	c.t.Helper()
	lines := c.lines(args...)
	if err := json.Unmarshal([]byte(lines[0]), out); err != nil {
		c.t.Fatalf("kvpipe_client.py %v printed %q: %v", args, lines[0], err)
	}
}

// lines runs one client command and returns the lines it printed.
func (c *pyClient) lines(args ...string) []string {
	c.t.Helper()
	cmd := exec.Command(c.python, append([]string{"../../examples/python/kvpipe_client.py", "--server", c.server}, args...)...)
	cmd.Env = append(os.Environ(), "KVPIPE_TOKEN="+testToken)
	data, err := cmd.Output()
	if err != nil {
		c.t.Fatalf("kvpipe_client.py %v: %v: %s", args, err, data)
	}
	return strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
}

type pyMatch struct {
	Matches []struct {
		Worker    string
		Blocks    int
		Predicted int
		Tiers     []int
		Score     float64
		Partial   bool
	}
	RequestBlocks int `json:"request_blocks"`
}

func (c *pyClient) match(tokens []uint32, args ...string) pyMatch {
	c.t.Helper()
	var m pyMatch
	c.run(&m, append([]string{"match", "--tokens-file", c.tokensFile(tokens)}, args...)...)
	return m
}

// tokensFile writes tokens to a file, one a line.
func (c *pyClient) tokensFile(tokens []uint32) string {
	var b strings.Builder
	for _, tok := range tokens {
		fmt.Fprintln(&b, tok)
	}
	file := filepath.Join(c.t.TempDir(), "tokens")
	os.WriteFile(file, []byte(b.String()), 0o600)
	return file
}

// checkBatchAndRouted asks a batch of the engine's 20 blocks and 12 of
// them, then routes 6 blocks no engine stored to e0: they are predicted
// there, not held.
func (c *pyClient) checkBatchAndRouted(full, half []uint32) {
	c.t.Helper()
	lines := c.lines("batch", "--tokens-file", c.tokensFile(full), "--tokens-file", c.tokensFile(half))
	for i, want := range []int{20, 12} {
		var m pyMatch
		if len(lines) != 2 || json.Unmarshal([]byte(lines[i]), &m) != nil || len(m.Matches) != 1 || m.Matches[0].Blocks != want {
			c.t.Errorf("Python batch: answer %d of %q: want %d blocks", i, lines, want)
			return
		}
	}
	fresh := enginepeer.ChainTokens(5000, 6)
	c.match(fresh, "--routed-to", "e0")
	if m := c.match(fresh); len(m.Matches) != 1 || m.Matches[0].Blocks != 0 || m.Matches[0].Predicted != 6 {
		c.t.Errorf("Python match of 6 blocks routed to e0: %+v, want 6 predicted, none held", m)
	}
}

// The Python client (grpcio) registers a C libzmq engine with a live serve
// and asks it, on both ports: the scores are the engine's blocks, and a
// dump names them.
func TestInteropPythonClient(t *testing.T) {
	engine, eps := enginepeer.StartBound(t, freeTCP, "../../wire/testdata/engine_pub.py", []string{"--endpoint", "--replay"})
	ep, replay := eps[0], eps[1]
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}})
	py := newPyClient(t, strings.TrimPrefix(r.url, "http://"))
	var reg struct {
		Worker struct{ Name, Endpoint string }
	}
	py.run(&reg, "register", "--name", "e0", "--endpoint", ep, "--replay", replay)
	if reg.Worker.Name != "e0" || reg.Worker.Endpoint != ep {
		t.Fatalf("registered %+v, want e0 at %s", reg.Worker, ep)
	}
	eventually(t, "the subscription", func() bool { ws, ok := r.p.Stats().Worker("e0"); return ok && ws.Wire.Batches > 0 })
	engine.Send("go")
	engine.Send("chain 20 1000")
	engine.Expect("published")
	full := enginepeer.ChainTokens(1000, 20)
	eventually(t, "the chain indexed", func() bool { return r.matchGRPC(full)["e0"] == 20 })

	m := py.match(full)
	if len(m.Matches) != 1 || m.Matches[0].Worker != "e0" || m.Matches[0].Blocks != 20 || m.Matches[0].Score != 20 || m.RequestBlocks != 20 {
		t.Errorf("Python match of the engine's 20 blocks: %+v", m)
	}
	half := append(enginepeer.ChainTokens(1000, 12), enginepeer.ChainTokens(3000, 8)...)
	if m := py.match(half); len(m.Matches) != 1 || m.Matches[0].Blocks != 12 {
		t.Errorf("Python match of 12 of the engine's blocks, then others: %+v", m)
	}
	py.checkBatchAndRouted(full, half)
	pyGo := newPyClient(t, r.s.cfg.GRPCListener.Addr().String())
	if m := pyGo.match(full); len(m.Matches) != 1 || m.Matches[0].Worker != "e0" || m.Matches[0].Blocks != 20 {
		t.Errorf("Python match on the grpc-go port of the engine's 20 blocks: %+v", m)
	}
	pyGo.checkBatchAndRouted(full, half)
	var dump struct{ Blocks []struct{ Hash string } }
	py.run(&dump, "dump", "--worker", "e0")
	var hashes []string
	for _, b := range dump.Blocks {
		hashes = append(hashes, b.Hash)
	}
	for i := range 20 {
		if !slices.Contains(hashes, fmt.Sprint(1000+i)) {
			t.Errorf("dump %v lacks the engine's block %d", hashes, 1000+i)
		}
	}
	var gone map[string]any
	py.run(&gone, "unregister", "--name", "e0")
	if resp, err := r.grpc.Match(context.Background(), connect.NewRequest(&kvpipev1.MatchRequest{Tokens: full})); err != nil || len(resp.Msg.Matches) != 0 {
		t.Errorf("after unregister: %v, %v; want no match", resp, err)
	}
	engine.Send("quit")
}
