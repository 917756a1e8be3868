package faultproxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvpipe/kvpipe/internal/ztest"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }

// patience bounds every wait on something that should happen; it is far
// above what loopback needs, so it only fires when the proxy is broken.
const patience = 10 * time.Second

// echoServer echoes every connection until its peer half-closes, then
// closes it and reports the end on ended, so a test can see the target side go.
type echoServer struct {
	ln    net.Listener
	ended chan struct{}
	wg    sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

func startEcho(t *testing.T) *echoServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &echoServer{ln: ln, ended: make(chan struct{}, 100), conns: make(map[net.Conn]struct{})}
	e.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			e.mu.Lock()
			e.conns[c] = struct{}{}
			e.mu.Unlock()
			e.wg.Go(func() {
				io.Copy(c, c)
				c.Close()
				e.mu.Lock()
				delete(e.conns, c)
				e.mu.Unlock()
				e.ended <- struct{}{}
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		e.mu.Lock()
		for c := range e.conns {
			c.Close()
		}
		e.mu.Unlock()
		e.wg.Wait()
	})
	return e
}

func (e *echoServer) addr() string { return e.ln.Addr().String() }

// waitEnded waits for the echo server to see one connection end.
func (e *echoServer) waitEnded(t *testing.T) {
	t.Helper()
	select {
	case <-e.ended:
	case <-time.After(patience):
		t.Fatal("the target side of the connection was not closed")
	}
}

func dial(t *testing.T, p *Proxy) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(p.Addr(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip checks that msg comes back unchanged through the echo target.
func roundTrip(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(patience))
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatalf("round trip: %v", err)
	}
	if string(got) != msg {
		t.Fatalf("round trip: got %q, want %q", got, msg)
	}
}

// expectClosed checks that c's next read fails with something other than a
// timeout: the proxy closed it.
func expectClosed(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(patience))
	n, err := c.Read(make([]byte, 1))
	var ne net.Error
	if err == nil || (errors.As(err, &ne) && ne.Timeout()) {
		t.Fatalf("read after close: n=%d err=%v, want the connection closed", n, err)
	}
}

// sequence is n numbered records, so a reordered or lost chunk shows.
func sequence(n int) []byte {
	var b bytes.Buffer
	for i := range n {
		fmt.Fprintf(&b, "record-%08d\n", i)
	}
	return b.Bytes()
}

func TestForwardsBothWaysUnchanged(t *testing.T) {
	echo := startEcho(t)
	p := Start(t, echo.addr())
	if !strings.HasPrefix(p.Addr(), "tcp://127.0.0.1:") {
		t.Fatalf("Addr() = %q, want tcp://127.0.0.1:port", p.Addr())
	}
	c := dial(t, p).(*net.TCPConn)

	want := make([]byte, 4<<20)
	rand.Read(want)
	var writer sync.WaitGroup
	defer writer.Wait()
	writer.Go(func() {
		if _, err := c.Write(want); err != nil {
			t.Error(err)
		}
		// The half-close must travel through the proxy: the echo server
		// stops at EOF, and the proxy passes its EOF back.
		c.CloseWrite()
	})
	c.SetReadDeadline(time.Now().Add(patience))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("got %d bytes back, want the %d sent, unchanged", len(got), len(want))
	}
	if s := p.Stats(); s != (Stats{Accepted: 1}) {
		t.Fatalf("Stats() = %+v, want one accepted and no cuts", s)
	}
}

func TestTargetAsZMQEndpoint(t *testing.T) {
	echo := startEcho(t)
	p := Start(t, "tcp://"+echo.addr())
	roundTrip(t, dial(t, p), "hello")
}

func TestNewRejectsBadTarget(t *testing.T) {
	if p, err := New("no-port"); err == nil {
		p.Close()
		t.Fatal("New accepted a target without a port")
	}
}

func TestCutClosesBothSidesAndAcceptsAgain(t *testing.T) {
	echo := startEcho(t)
	p := Start(t, echo.addr())
	a, b := dial(t, p), dial(t, p)
	roundTrip(t, a, "a")
	roundTrip(t, b, "b")

	p.Cut()
	expectClosed(t, a)
	expectClosed(t, b)
	echo.waitEnded(t)
	echo.waitEnded(t)
	if s := p.Stats(); s != (Stats{Accepted: 2, Cuts: 2}) {
		t.Fatalf("Stats() = %+v, want 2 accepted, 2 cut", s)
	}

	roundTrip(t, dial(t, p), "after the cut")
	if s := p.Stats(); s != (Stats{Accepted: 3, Cuts: 2}) {
		t.Fatalf("Stats() = %+v, want 3 accepted, 2 cut", s)
	}
}

func TestStallHoldsBytesThenDeliversAllInOrder(t *testing.T) {
	const d = 300 * time.Millisecond
	echo := startEcho(t)
	p := Start(t, echo.addr())
	old := dial(t, p)
	roundTrip(t, old, "before the stall")

	want := sequence(20_000) // ~400 KB: more than one pump buffer, so flow control holds some
	start := time.Now()
	p.Stall(d)
	fresh := dial(t, p) // a connection made during the stall is held too

	var writers sync.WaitGroup
	defer writers.Wait()
	for _, c := range []net.Conn{old, fresh} {
		writers.Go(func() {
			if _, err := c.Write(want); err != nil {
				t.Error(err)
			}
		})
	}

	for name, c := range map[string]net.Conn{"existing": old, "new": fresh} {
		// Nothing may arrive before the stall ends; reading with a deadline
		// inside the stall must time out empty.
		if left := time.Until(start.Add(d / 2)); left > 0 {
			c.SetReadDeadline(start.Add(d / 2))
			if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
				t.Fatalf("%s connection: read %d bytes (err %v) during the stall", name, n, err)
			}
		}
		c.SetReadDeadline(time.Now().Add(patience))
		got := make([]byte, len(want))
		if _, err := io.ReadFull(c, got[:1]); err != nil {
			t.Fatalf("%s connection: nothing after the stall: %v", name, err)
		}
		if since := time.Since(start); since < d {
			t.Fatalf("%s connection: first byte %v after Stall(%v)", name, since, d)
		}
		if _, err := io.ReadFull(c, got[1:]); err != nil {
			t.Fatalf("%s connection: %v", name, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%s connection: bytes after the stall are not the bytes sent, in order", name)
		}
	}
	if s := p.Stats(); s.Cuts != 0 {
		t.Fatalf("Stats() = %+v, want no cuts: a stall keeps connections open", s)
	}
}

func TestStallZeroResumesAtOnce(t *testing.T) {
	echo := startEcho(t)
	p := Start(t, echo.addr())
	c := dial(t, p)
	p.Stall(time.Hour)
	if _, err := c.Write([]byte("held")); err != nil {
		t.Fatal(err)
	}
	p.Stall(0)
	c.SetReadDeadline(time.Now().Add(patience))
	got := make([]byte, 4)
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "held" {
		t.Fatalf("after Stall(0): got %q, %v; want \"held\"", got, err)
	}
}

func TestDownRefusesThenRecovers(t *testing.T) {
	echo := startEcho(t)
	p := Start(t, echo.addr())
	existing := dial(t, p)
	roundTrip(t, existing, "up")

	p.Down(true)
	expectClosed(t, existing)
	echo.waitEnded(t)
	refused := dial(t, p) // the listener still accepts...
	expectClosed(t, refused)
	refused2 := dial(t, p)
	expectClosed(t, refused2)
	if s := p.Stats(); s != (Stats{Accepted: 3, Cuts: 3}) {
		t.Fatalf("Stats() = %+v, want 3 accepted, 3 cut", s)
	}
	select {
	case <-echo.ended:
		t.Fatal("a connection refused while down reached the target")
	default:
	}

	p.Down(false)
	roundTrip(t, dial(t, p), "up again")
}

// TestCloseEndsStalledConnections uses the non-test constructor, as a
// command would: Close must not wait for a stall, and must leave no goroutine.
func TestCloseEndsStalledConnections(t *testing.T) {
	echo := startEcho(t)
	p, err := New(echo.addr())
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, p)
	roundTrip(t, c, "x")
	p.Stall(time.Hour)
	if _, err := c.Write([]byte("held forever")); err != nil {
		t.Fatal(err)
	}
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(patience):
		t.Fatal("Close waited for the stall")
	}
	expectClosed(t, c)
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// TestZMQSubscriberThroughProxy runs real zmq4 sockets through the proxy:
// messages flow, and a cut is seen by the SUB as a Recv error, which is what
// a subscriber's reconnect logic keys on.
func TestZMQSubscriberThroughProxy(t *testing.T) {
	quiet := zmq4.WithLogger(log.New(io.Discard, "", 0))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	pub := zmq4.NewPub(ctx, quiet)
	defer pub.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	p := Start(t, "tcp://"+pub.Addr().String())

	sub := zmq4.NewSub(ctx, zmq4.WithDialerMaxRetries(0), quiet)
	if err := sub.Dial(p.Addr()); err != nil {
		sub.Close()
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		sub.Close()
		t.Fatal(err)
	}

	// zmq4's Recv has no timeout, so one owned goroutine reads and the test
	// waits on its channel.
	type received struct {
		msg zmq4.Msg
		err error
	}
	msgs := make(chan received, 1024)
	reader := make(chan struct{})
	go func() {
		defer close(reader)
		for {
			m, err := sub.Recv()
			select {
			case msgs <- received{m, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	defer func() {
		sub.Close()
		cancel()
		<-reader
		// zmq4's per-connection reader may be blocked handing over a last
		// message; once the socket is closed each Recv returns at once.
		for range 64 {
			sub.Recv()
		}
	}()
	next := func() received {
		t.Helper()
		select {
		case r := <-msgs:
			return r
		case <-time.After(patience):
			t.Fatal("SUB received nothing")
			return received{}
		}
	}

	// PUB drops what it sends before the subscription has crossed the
	// proxy, so probe until one arrives.
	for synced := false; !synced; {
		if err := pub.Send(zmq4.NewMsgString("probe")); err != nil {
			t.Fatal(err)
		}
		select {
		case r := <-msgs:
			if r.err != nil {
				t.Fatalf("SUB Recv: %v", r.err)
			}
			synced = true
		case <-time.After(20 * time.Millisecond):
		}
	}
	const n = 100
	for i := range n {
		if err := pub.Send(zmq4.NewMsgFrom([]byte("topic"), fmt.Appendf(nil, "msg-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	r := next()
	for r.err == nil && len(r.msg.Frames) == 1 { // probes still in flight
		r = next()
	}
	for i := range n {
		if i > 0 {
			r = next()
		}
		if r.err != nil {
			t.Fatalf("message %d: %v", i, r.err)
		}
		if len(r.msg.Frames) != 2 || string(r.msg.Frames[1]) != fmt.Sprintf("msg-%d", i) {
			t.Fatalf("message %d: got %q", i, r.msg.Frames)
		}
	}

	p.Cut()
	if r := next(); r.err == nil {
		t.Fatalf("after Cut, SUB Recv returned %q, want an error", r.msg.Frames)
	} else {
		t.Logf("SUB Recv after Cut: %v", r.err)
	}
	if s := p.Stats(); s != (Stats{Accepted: 1, Cuts: 1}) {
		t.Fatalf("Stats() = %+v, want 1 accepted, 1 cut", s)
	}
}
