// Package enginepeer runs the Python (C libzmq) engine peers that the interop
// tests talk to, skipping the test when python3-zmq is not installed.
package enginepeer

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Python finds an interpreter with pyzmq (the C libzmq) and msgpack, as
// Debian's python3-zmq and python3-msgpack provide them.
func Python(t testing.TB) string {
	t.Helper()
	for _, p := range []string{"/usr/bin/python3", "python3"} {
		if path, err := exec.LookPath(p); err == nil && exec.Command(path, "-c", "import zmq, msgpack").Run() == nil {
			return path
		}
	}
	Missing(t, "python3 with zmq and msgpack (apt-get install python3-zmq python3-msgpack)")
	return ""
}

// Missing skips the test for want of a Python peer, or fails it where
// KVPIPE_REQUIRE_PEERS is set (CI installs them: a skip there would hide a
// broken install step).
func Missing(t testing.TB, what string) {
	t.Helper()
	if os.Getenv("KVPIPE_REQUIRE_PEERS") != "" {
		t.Fatalf("KVPIPE_REQUIRE_PEERS is set but %s is missing", what)
	}
	t.Skipf("skipped: needs %s", what)
}

// Peer is a Python process driven line by line: commands on its stdin,
// its stdout lines on Lines.
type Peer struct {
	t     testing.TB
	cmd   *exec.Cmd
	stdin io.WriteCloser
	Lines chan string
}

// Start runs script with args under Python until the test ends.
func Start(t testing.TB, script string, args ...string) *Peer {
	t.Helper()
	cmd := exec.Command(Python(t), append([]string{script}, args...)...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &Peer{t: t, cmd: cmd, stdin: stdin, Lines: make(chan string, 1024)}
	go func() {
		defer close(p.Lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.Lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGCONT) // a test may have stopped it
		stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		for range p.Lines { // let the reader goroutine finish
		}
	})
	return p
}

// StartBound starts script with an endpoint picked by free for each of
// flags (flag, endpoint, ...), then args, and returns the peer once it says
// "ready", with the endpoints. A peer that exits instead (it could not
// bind: another process took a port between its pick and the bind) is
// started again on new ones, up to three times.
func StartBound(t testing.TB, free func(testing.TB) string, script string, flags []string, args ...string) (*Peer, []string) {
	t.Helper()
	for range 3 {
		eps := make([]string, len(flags))
		var all []string
		for i, f := range flags {
			eps[i] = free(t)
			all = append(all, f, eps[i])
		}
		p := Start(t, script, append(all, args...)...)
		select {
		case l, ok := <-p.Lines:
			if ok && strings.HasPrefix(l, "ready") {
				return p, eps
			}
		case <-time.After(15 * time.Second):
			t.Fatal("peer silent, want \"ready\"")
		}
	}
	t.Fatalf("%s never bound its endpoints", script)
	return nil, nil
}

// Signal sends sig to the peer's process, e.g. SIGSTOP to freeze an engine
// with its sockets open (Start's cleanup continues it).
func (p *Peer) Signal(sig os.Signal) {
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatal(err)
	}
}

// Send writes one command line.
func (p *Peer) Send(line string) {
	if _, err := io.WriteString(p.stdin, line+"\n"); err != nil {
		p.t.Fatal(err)
	}
}

// Expect reads the next line and fails the test unless it starts with prefix.
func (p *Peer) Expect(prefix string) string {
	p.t.Helper()
	select {
	case l, ok := <-p.Lines:
		if !ok || !strings.HasPrefix(l, prefix) {
			p.t.Fatalf("peer said %q (open %v), want %q", l, ok, prefix)
		}
		return l
	case <-time.After(15 * time.Second):
		p.t.Fatalf("peer silent, want %q", prefix)
		return ""
	}
}

// ChainTokens is the prompt whose blocks wire/testdata/engine_pub.py's
// "chain n base" stores: n blocks of 16 tokens, the engine hashes
// base..base+n-1.
func ChainTokens(base, n int) []uint32 {
	out := make([]uint32, 0, n*16)
	for i := range n {
		for t := range 16 {
			out = append(out, uint32(((base-1000+i)*16+t)%50000))
		}
	}
	return out
}
