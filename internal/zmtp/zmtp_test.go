package zmtp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/internal/ztest"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }

// Wire pieces a hostile peer is built from.

func greeting() []byte {
	g := make([]byte, greetingLen)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	return g
}

func command(body []byte) []byte {
	if len(body) > 255 {
		return append(binary.BigEndian.AppendUint64([]byte{flagCommand | flagLong}, uint64(len(body))), body...)
	}
	return append([]byte{flagCommand, byte(len(body))}, body...)
}

func property(k, v string) []byte {
	p := append([]byte{byte(len(k))}, k...)
	return append(binary.BigEndian.AppendUint32(p, uint32(len(v))), v...)
}

func ready(socketType string) []byte {
	return command(append([]byte(readyPrefix), property("Socket-Type", socketType)...))
}

func longHeader(flags byte, size uint64) []byte {
	return binary.BigEndian.AppendUint64([]byte{flags | flagLong}, size)
}

func handshake() []byte { return append(greeting(), ready("PUB")...) }

// serve runs a raw TCP peer that writes script to every connection, reads
// and discards whatever comes back, and holds the connection open until the
// test ends, so that only the guard can end it. It returns a tcp:// endpoint.
func serve(t *testing.T, script []byte) string {
	ep, _ := serveHangup(t, script)
	return ep
}

// serveHangup is serve that also returns a func that shuts the peer down.
func serveHangup(t *testing.T, script []byte) (string, func()) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() {
				c.Write(script)
				io.Copy(io.Discard, c)
			})
		}
	})
	hangup := func() {
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}
	t.Cleanup(hangup)
	return "tcp://" + l.Addr().String(), hangup
}

// reports records what the guard reported.
type reports struct {
	mu    sync.Mutex
	kinds []string
	got   chan struct{} // closed at the first report
}

func newReports() *reports { return &reports{got: make(chan struct{})} }

func (r *reports) report(kind string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.kinds) == 0 {
		close(r.got)
	}
	r.kinds = append(r.kinds, kind)
}

func (r *reports) list() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.kinds...)
}

func quiet() zmq4.Option { return zmq4.WithLogger(log.New(io.Discard, "", 0)) }

// allocBudget fails the test if more than budget bytes were allocated from
// now to the test's end. TotalAlloc counts every allocation, however short
// lived, so a single make of the size a peer claims would show.
func allocBudget(t *testing.T, budget uint64) {
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	t.Cleanup(func() {
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		if d := after.TotalAlloc - before.TotalAlloc; d > budget {
			t.Errorf("allocated %d MiB, over the budget of %d MiB", d>>20, budget>>20)
		}
	})
}

const budget = 32 << 20

// recvErr receives until Recv fails, and returns that error.
func recvErr(t *testing.T, sub zmq4.Socket) error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		for {
			if _, err := sub.Recv(); err != nil {
				done <- err
				return
			}
		}
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		sub.Close()
		<-done
		t.Fatal("Recv did not fail")
		return nil
	}
}

func wantKind(t *testing.T, what string, err error, kind string) {
	t.Helper()
	var v *Violation
	if !errors.As(err, &v) || v.Kind != kind {
		t.Fatalf("%s: got %v, want a %s violation", what, err, kind)
	}
}

func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 0))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// emptyFrames is one message of n empty frames.
func emptyFrames(n int) []byte {
	b := bytes.Repeat([]byte{flagMore, 0}, n)
	b[len(b)-2] = 0
	return b
}

// A peer that completes the handshake and then misbehaves: Dial succeeds,
// the SUB's Recv returns the Violation, report gets its kind once.
func TestHostileAfterHandshake(t *testing.T) {
	badReady := append([]byte(readyPrefix), property("Socket-Type", "PUB")...)
	cases := []struct {
		name   string
		script []byte
		limits Limits
		kinds  []string // any of these
	}{
		{"64GiB frame", longHeader(0, 64<<30), Limits{}, []string{KindOversize}},
		{"1TiB frame", longHeader(0, 1<<40), Limits{}, []string{KindOversize}},
		{"2^64-1 frame", longHeader(flagMore, ^uint64(0)), Limits{}, []string{KindOversize}},
		{"1TiB in a multipart message", append([]byte{flagMore, 3, 'a', 'b', 'c'}, longHeader(0, 1<<40)...), Limits{}, []string{KindOversize}},
		{"empty frames over the limit", emptyFrames(1<<20/frameOverhead + 1), Limits{MaxMessage: 1 << 20}, []string{KindOversize}},
		{"1TiB command", longHeader(flagCommand, 1<<40), Limits{}, []string{KindOversize}},
		{"reserved flag bit", []byte{0x80, 1, 'x'}, Limits{}, []string{KindBadFlags}},
		{"command with MORE", []byte{flagCommand | flagMore, 0}, Limits{}, []string{KindBadFlags}},
		{"command inside a multipart message", append([]byte{flagMore, 0}, command(badReady)...), Limits{}, []string{KindBadFlags}},
	}
	for seed := range uint64(4) {
		cases = append(cases, struct {
			name   string
			script []byte
			limits Limits
			kinds  []string
		}{"64KiB random seed " + string('0'+byte(seed)), randomBytes(seed, 64<<10), Limits{MaxMessage: 1 << 20},
			[]string{KindOversize, KindBadFlags}})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			allocBudget(t, budget)
			ep := serve(t, append(handshake(), tc.script...))
			rep := newReports()
			sub := zmq4.NewSub(WithLimits(context.Background(), tc.limits, rep.report), quiet())
			defer sub.Close()
			if err := sub.Dial(Endpoint(ep)); err != nil {
				t.Fatalf("Dial: %v", err)
			}
			err := recvErr(t, sub)
			var v *Violation
			if !errors.As(err, &v) {
				t.Fatalf("Recv: %v, want a Violation", err)
			}
			if got := rep.list(); len(got) != 1 || got[0] != v.Kind || !contains(tc.kinds, v.Kind) {
				t.Fatalf("reported %v, Recv %v; want one of %v", got, err, tc.kinds)
			}
		})
	}
}

func contains(s []string, x string) bool {
	for _, y := range s {
		if x == y {
			return true
		}
	}
	return false
}

// A peer that fails the handshake: Dial fails with the Violation.
func TestHostileHandshake(t *testing.T) {
	badGreeting := greeting()
	badGreeting[9] = 0
	plain := greeting()
	copy(plain[12:], "PLAIN")
	cases := []struct {
		name   string
		script []byte
		kind   string
	}{
		{"bad signature", badGreeting, KindGreeting},
		{"ZMTP 2", append(greeting()[:10], 1, 0), KindGreeting},
		{"PLAIN mechanism", plain, KindGreeting},
		{"HTTP", []byte("HTTP/1.1 400 Bad Request\r\n\r\n"), KindGreeting},
		{"READY claiming 1TiB", append(greeting(), longHeader(flagCommand, 1<<40)...), KindOversize},
		{"READY over 64KiB", append(greeting(), longHeader(flagCommand, maxCommand+1)...), KindOversize},
		{"message before READY", append(greeting(), 0, 1, 'x'), KindBadCommand},
		{"PING before READY", append(greeting(), command([]byte("\x04PING\x00\x00"))...), KindBadCommand},
		{"empty READY", append(greeting(), command(nil)...), KindBadCommand},
		// zmq4's Metadata.UnmarshalZMTP would index out of range on these.
		{"READY key overruns", append(greeting(), command([]byte(readyPrefix+"\x0bSocket-Typ"))...), KindBadCommand},
		{"READY value length cut", append(greeting(), command([]byte(readyPrefix+"\x01k\x00\x00"))...), KindBadCommand},
		{"READY value overruns", append(greeting(), command(append([]byte(readyPrefix+"\x01k"), 0xff, 0xff, 0xff, 0xff, 'v'))...), KindBadCommand},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			allocBudget(t, budget)
			ep := serve(t, tc.script)
			rep := newReports()
			sub := zmq4.NewSub(WithLimits(context.Background(), Limits{HandshakeTimeout: 5 * time.Second}, rep.report), quiet())
			defer sub.Close()
			start := time.Now()
			err := sub.Dial(Endpoint(ep))
			wantKind(t, "Dial", err, tc.kind)
			if d := time.Since(start); d > 2*time.Second {
				t.Errorf("Dial took %v: the guard waited for the timeout", d)
			}
			if got := rep.list(); len(got) != 1 || got[0] != tc.kind {
				t.Fatalf("reported %v, want [%s]", got, tc.kind)
			}
		})
	}
}

// A peer that accepts and never speaks: Dial fails after HandshakeTimeout.
func TestSilentPeerTimesOut(t *testing.T) {
	allocBudget(t, budget)
	ep := serve(t, nil)
	rep := newReports()
	const timeout = 300 * time.Millisecond
	sub := zmq4.NewSub(WithLimits(context.Background(), Limits{HandshakeTimeout: timeout}, rep.report), quiet())
	defer sub.Close()
	start := time.Now()
	err := sub.Dial(Endpoint(ep))
	d := time.Since(start)
	wantKind(t, "Dial", err, KindHandshakeTimeout)
	if d < timeout || d > timeout+time.Second {
		t.Errorf("Dial returned after %v, want about %v", d, timeout)
	}
	if got := rep.list(); len(got) != 1 || got[0] != KindHandshakeTimeout {
		t.Fatalf("reported %v", got)
	}
}

// A peer that stalls after half a greeting, with the dialling context
// cancelled: Dial returns at once, and cancellation is not a violation.
func TestCancelDuringHandshake(t *testing.T) {
	allocBudget(t, budget)
	ep := serve(t, greeting()[:20])
	rep := newReports()
	ctx, cancel := context.WithCancel(WithLimits(context.Background(), Limits{HandshakeTimeout: time.Minute}, rep.report))
	defer cancel()
	sub := zmq4.NewSub(ctx, quiet())
	defer sub.Close()
	done := make(chan error, 1)
	go func() { done <- sub.Dial(Endpoint(ep)) }()
	time.Sleep(100 * time.Millisecond)
	cancel()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Dial succeeded")
		}
	case <-time.After(time.Second):
		t.Fatal("Dial still blocked a second after cancel")
	}
	if got := rep.list(); len(got) != 0 {
		t.Fatalf("reported %v on cancel", got)
	}
}

// Without WithLimits the defaults hold: a 64 GiB header is still refused.
func TestDefaultsWithoutLimits(t *testing.T) {
	allocBudget(t, budget)
	ep := serve(t, append(handshake(), longHeader(0, 64<<30)...))
	sub := zmq4.NewSub(context.Background(), quiet())
	defer sub.Close()
	if err := sub.Dial(Endpoint(ep)); err != nil {
		t.Fatal(err)
	}
	wantKind(t, "Recv", recvErr(t, sub), KindOversize)
}

// pubSub starts a PUB on plain ep and a SUB dialled through the guard, and
// waits until the subscription has reached the PUB.
func pubSub(t *testing.T, ep string, l Limits, rep *reports) (pub, sub zmq4.Socket) {
	t.Helper()
	pub = zmq4.NewPub(context.Background(), quiet())
	t.Cleanup(func() { pub.Close() })
	if err := pub.Listen(ep); err != nil {
		t.Fatal(err)
	}
	sub = zmq4.NewSub(WithLimits(context.Background(), l, rep.report), quiet())
	t.Cleanup(func() { sub.Close() })
	if err := sub.Dial(Endpoint(ep)); err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	// PUB drops messages until the subscription is in: probe until one passes.
	got := make(chan error, 1)
	go func() {
		_, err := sub.Recv()
		got <- err
	}()
	for {
		if err := pub.Send(zmq4.NewMsgString("probe")); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-got:
			if err != nil {
				t.Fatal(err)
			}
			return pub, sub
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// recv receives one message, or fails the test after a while.
func recv(t *testing.T, sub zmq4.Socket) (zmq4.Msg, error) {
	t.Helper()
	type result struct {
		m   zmq4.Msg
		err error
	}
	c := make(chan result, 1)
	go func() {
		m, err := sub.Recv()
		c <- result{m, err}
	}()
	select {
	case r := <-c:
		return r.m, r.err
	case <-time.After(10 * time.Second):
		sub.Close()
		<-c
		t.Fatal("Recv timed out")
		return zmq4.Msg{}, nil
	}
}

// A good peer through the guard: messages pass unchanged up to the limit,
// and the first message past it ends the connection.
func TestGoodPeer(t *testing.T) {
	const limit = 1 << 20
	rep := newReports()
	pub, sub := pubSub(t, ztest.FreeTCP(t), Limits{MaxMessage: limit}, rep)

	seq := binary.BigEndian.AppendUint64(nil, 42)
	atLimit := zmq4.NewMsgFrom([]byte("kv@engine"), seq, randomBytes(1, limit-3*frameOverhead-len("kv@engine")-len(seq)))
	msgs := []zmq4.Msg{
		zmq4.NewMsgString(""),
		zmq4.NewMsgFrom([]byte("kv"), seq, []byte("small")),
		zmq4.NewMsgFrom([]byte("t"), make([]byte, 300)), // a long frame
		atLimit,
	}
	for _, m := range msgs {
		if err := pub.Send(m); err != nil {
			t.Fatal(err)
		}
		got, err := recv(t, sub)
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		if len(got.Frames) != len(m.Frames) {
			t.Fatalf("got %d frames, sent %d", len(got.Frames), len(m.Frames))
		}
		for i := range m.Frames {
			if !bytes.Equal(got.Frames[i], m.Frames[i]) {
				t.Fatalf("frame %d changed", i)
			}
		}
	}

	over := atLimit
	over.Frames = append(over.Frames[:2:2], append(over.Frames[2], 0))
	pub.Send(over) // may fail: the SUB hangs up on the last frame's header
	_, err := recv(t, sub)
	wantKind(t, "Recv of a message one byte over", err, KindOversize)
	if got := rep.list(); len(got) != 1 || got[0] != KindOversize {
		t.Fatalf("reported %v", got)
	}
}

// ipc:// goes through the guard too.
func TestGoodPeerIPC(t *testing.T) {
	ep := "ipc://" + filepath.Join(t.TempDir(), "pub.sock")
	if got := Endpoint(ep); !strings.HasPrefix(got, schemeIPC+"://") {
		t.Fatalf("Endpoint(%q) = %q", ep, got)
	}
	rep := newReports()
	pub, sub := pubSub(t, ep, Limits{}, rep)
	if err := pub.Send(zmq4.NewMsgFromString([]string{"a", "b"})); err != nil {
		t.Fatal(err)
	}
	m, err := recv(t, sub)
	if err != nil || len(m.Frames) != 2 || string(m.Frames[1]) != "b" {
		t.Fatalf("got %v, %v", m, err)
	}
}

// A DEALER made from a WithLimits context is guarded too, and a ROUTER's
// READY (Socket-Type and Identity) passes.
func TestDealerRouter(t *testing.T) {
	ep := ztest.FreeTCP(t)
	router := zmq4.NewRouter(context.Background(), quiet())
	defer router.Close()
	if err := router.Listen(ep); err != nil {
		t.Fatal(err)
	}
	rep := newReports()
	dealer := zmq4.NewDealer(WithLimits(context.Background(), Limits{MaxMessage: 1 << 10}, rep.report), quiet())
	defer dealer.Close()
	if err := dealer.Dial(Endpoint(ep)); err != nil {
		t.Fatal(err)
	}
	if err := dealer.Send(zmq4.NewMsgString("replay 7")); err != nil {
		t.Fatal(err)
	}
	req, err := recv(t, router)
	if err != nil || len(req.Frames) != 2 {
		t.Fatalf("ROUTER got %v, %v", req, err)
	}
	if err := router.Send(zmq4.NewMsgFrom(req.Frames[0], []byte("batch 7"))); err != nil {
		t.Fatal(err)
	}
	if m, err := recv(t, dealer); err != nil || string(m.Frames[0]) != "batch 7" {
		t.Fatalf("DEALER got %v, %v", m, err)
	}
	// The DEALER hangs up on the header, so the ROUTER may fail writing the body.
	router.Send(zmq4.NewMsgFrom(req.Frames[0], make([]byte, 1<<10)))
	_, err = recv(t, dealer)
	wantKind(t, "DEALER Recv over the limit", err, KindOversize)
	if got := rep.list(); len(got) != 1 || got[0] != KindOversize {
		t.Fatalf("reported %v", got)
	}
}

func TestEndpoint(t *testing.T) {
	for in, want := range map[string]string{
		"tcp://10.0.0.5:5557":  "kvpipe+tcp://10.0.0.5:5557",
		"ipc:///run/e.sock":    "kvpipe+ipc:///run/e.sock",
		"inproc://x":           "inproc://x",
		"kvpipe+tcp://h:1":     "kvpipe+tcp://h:1",
		"udp://127.0.0.1:5000": "udp://127.0.0.1:5000",
	} {
		if got := Endpoint(in); got != want {
			t.Errorf("Endpoint(%q) = %q, want %q", in, got, want)
		}
	}
}

// The reason for the guard, shown on zmq4 itself: over plain tcp:// zmq4
// allocates whatever size a frame header claims, before one body byte has
// come. 256 MiB, 8 times the budget above, is enough to show it: its pages
// are never touched, but under -race their shadow is (1 GiB took 8 s and
// 550 MB there). A 64 GiB claim would kill the process.
func TestUpstreamAllocatesClaimedSize(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates 256 MiB")
	}
	const claim = 256 << 20
	ep, hangup := serveHangup(t, append(handshake(), longHeader(0, claim)...))
	sub := zmq4.NewSub(context.Background(), quiet())
	defer sub.Close()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	if err := sub.Dial(ep); err != nil {
		t.Fatal(err)
	}
	// zmq4 now sits in io.ReadFull on the buffer it made for the claim.
	for deadline := time.Now().Add(10 * time.Second); ; {
		runtime.ReadMemStats(&after)
		if after.TotalAlloc-before.TotalAlloc >= claim {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("allocated %d MiB, expected zmq4 to allocate %d MiB", (after.TotalAlloc-before.TotalAlloc)>>20, claim>>20)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The peer hangs up: zmq4's io.ReadFull into the buffer fails, and Recv
	// says so once zmq4's reader is past the make.
	hangup()
	if err := recvErr(t, sub); err == nil {
		t.Fatal("Recv succeeded")
	}
	sub.Close()
	runtime.GC()
}

// And zmq4's READY parser panics on a property that overruns its command.
func TestUpstreamReadyPanics(t *testing.T) {
	for _, body := range []string{"\x0bSocket-Typ", "\x01k\x00\x00"} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("UnmarshalZMTP(%q) did not panic", body)
				}
			}()
			md := zmq4.Metadata{}
			md.UnmarshalZMTP([]byte(body))
		}()
	}
}

// blackhole is a dialer whose connect never completes, as for a host that
// drops connection attempts: only the context ends it.
type blackhole struct{}

func (blackhole) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// The connect counts toward HandshakeTimeout: zmq4's dialer would wait
// minutes for a host that drops SYNs.
func TestConnectIsBoundedByTheHandshakeTimeout(t *testing.T) {
	ctx := WithLimits(context.Background(), Limits{HandshakeTimeout: 200 * time.Millisecond}, nil)
	start := time.Now()
	_, err := guarded{network: "tcp"}.Dial(ctx, blackhole{}, "10.0.0.1:1")
	if err == nil {
		t.Fatal("a connect that never completes succeeded")
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Dial returned after %v, want about the 200ms handshake timeout", took)
	}
}
