package faultproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// Proxy forwards TCP connections from Addr to a target and injects faults on
// request. Its methods are safe for concurrent use.
type Proxy struct {
	target string // host:port
	ln     net.Listener
	ctx    context.Context // done on Close; ends dials and held writes
	cancel context.CancelFunc
	wg     sync.WaitGroup // every goroutine the proxy starts

	mu         sync.Mutex
	links      map[*link]struct{} // live links; membership means not yet closed
	closed     bool
	down       bool
	stallUntil time.Time
	wake       chan struct{} // closed and replaced by Stall, so held pumps re-read stallUntil
	stats      Stats

	closeOnce sync.Once
	closeErr  error
}

// Stats counts what the proxy has done since it started.
type Stats struct {
	// Accepted counts every connection the listener accepted, including
	// those refused while down.
	Accepted int
	// Cuts counts connections the proxy closed on purpose: by Cut, by
	// Down(true), or at once because it was down. Connections that end on
	// their own, or at Close, are not cuts.
	Cuts int
}

// link is one client connection and its leg to the target. server is nil
// until the dial completes; both it and membership in Proxy.links are
// guarded by Proxy.mu.
type link struct {
	client net.Conn
	server net.Conn
	ctx    context.Context // done once the link is closed, so a held pump or a dial gives up
	cancel context.CancelFunc
}

// Start returns a running proxy to target ("host:port" or "tcp://host:port")
// that is closed, and waited for, when the test ends.
func Start(t testing.TB, target string) *Proxy {
	t.Helper()
	p, err := New(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("faultproxy: close: %v", err)
		}
	})
	return p
}

// New listens on 127.0.0.1 on a free port and forwards every accepted
// connection to target ("host:port" or "tcp://host:port"). The caller must
// Close it.
func New(target string) (*Proxy, error) {
	hostport := strings.TrimPrefix(target, "tcp://")
	if _, _, err := net.SplitHostPort(hostport); err != nil {
		return nil, fmt.Errorf("faultproxy: target %q: %w", target, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{
		target: hostport,
		ln:     ln,
		ctx:    ctx,
		cancel: cancel,
		links:  make(map[*link]struct{}),
		wake:   make(chan struct{}),
	}
	p.wg.Go(p.accept)
	return p, nil
}

// Addr returns the proxy's endpoint as a ZMQ tcp:// address.
func (p *Proxy) Addr() string { return "tcp://" + p.ln.Addr().String() }

// Close stops the listener, closes every connection and waits for every
// goroutine of the proxy. Later calls return the first call's result.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		p.closeErr = p.ln.Close()
		p.cancel()
		p.mu.Lock()
		p.closed = true
		for l := range p.links {
			p.closeLocked(l)
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p.closeErr
}

// Cut closes both sides of every current connection at once, with a reset,
// as a network failure would; connections accepted afterwards are forwarded
// as usual.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cutAllLocked()
}

// Down makes the proxy a dead port with a listener: while down, existing
// connections are cut and new ones are accepted and closed at once, so a
// dialler sees its connection succeed and then end. Down(false) restores
// forwarding for new connections.
func (p *Proxy) Down(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
	if down {
		p.cutAllLocked()
	}
}

// Stall stops forwarding in both directions, on current and new connections,
// for d from now. Connections stay open and bytes are held, not dropped: the
// proxy keeps what it has read and TCP flow control backs up the rest, so
// everything is delivered in order when the stall ends. A later call
// replaces the end of the stall; Stall(0) resumes at once.
func (p *Proxy) Stall(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stallUntil = time.Now().Add(d)
	close(p.wake)
	p.wake = make(chan struct{})
}

// Stats returns the proxy's counts so far.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if p.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: back off rather than spin,
			// and rather than leave the test with a proxy that no longer accepts.
			select {
			case <-p.ctx.Done():
				return
			case <-time.After(5 * time.Millisecond):
			}
			continue
		}
		p.mu.Lock()
		p.stats.Accepted++
		switch {
		case p.closed:
			c.Close()
		case p.down:
			p.stats.Cuts++
			c.Close()
		default:
			ctx, cancel := context.WithCancel(p.ctx)
			l := &link{client: c, ctx: ctx, cancel: cancel}
			p.links[l] = struct{}{}
			// Started under mu, after the closed check, so Close's Wait
			// cannot miss it.
			p.wg.Go(func() { p.serve(l) })
		}
		p.mu.Unlock()
	}
}

// serve dials the target for l and runs the two pumps until both end.
func (p *Proxy) serve(l *link) {
	defer p.drop(l)
	var d net.Dialer
	server, err := d.DialContext(l.ctx, "tcp", p.target)
	if err != nil {
		return // the target refused: the client sees its connection end
	}
	p.mu.Lock()
	if _, live := p.links[l]; !live {
		// Cut, Down or Close came while dialling.
		p.mu.Unlock()
		server.Close()
		return
	}
	l.server = server
	p.mu.Unlock()

	var pumps sync.WaitGroup
	pumps.Go(func() { p.pump(l, server, l.client) })
	pumps.Go(func() { p.pump(l, l.client, server) })
	pumps.Wait()
}

// pump copies src to dst, holding each chunk while the proxy is stalled. One
// pump per direction keeps the bytes of that direction in order.
func (p *Proxy) pump(l *link, dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.hold(l.ctx) {
				return // the link was closed while the chunk was held
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				p.drop(l)
				return
			}
		}
		if errors.Is(err, io.EOF) {
			// Pass the half-close on, so a peer that finishes sending but
			// still reads behaves as it would without the proxy.
			if cw, ok := dst.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
				return
			}
			p.drop(l)
			return
		}
		if err != nil {
			p.drop(l)
			return
		}
	}
}

// hold waits while the proxy is stalled. It reports false if ctx ends first.
func (p *Proxy) hold(ctx context.Context) bool {
	for {
		p.mu.Lock()
		wait, wake := time.Until(p.stallUntil), p.wake
		p.mu.Unlock()
		if wait <= 0 {
			return ctx.Err() == nil
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return false
		case <-wake:
		case <-timer.C:
		}
		timer.Stop()
	}
}

// drop closes l because it ended on its own; unlike a cut, it is not counted.
func (p *Proxy) drop(l *link) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closeLocked(l)
}

// cutAllLocked aborts every link with a reset rather than a FIN: a cut models
// a failure, so bytes still queued in the proxy's socket buffers must not
// reach either peer after Cut returns.
func (p *Proxy) cutAllLocked() {
	for l := range p.links {
		abort(l.client)
		if l.server != nil {
			abort(l.server)
		}
		p.closeLocked(l)
		p.stats.Cuts++
	}
}

// abort makes the next Close discard unsent data and send a reset.
func abort(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
}

// closeLocked closes both sides of l once; the map entry is the flag that
// says it is still open.
func (p *Proxy) closeLocked(l *link) {
	if _, live := p.links[l]; !live {
		return
	}
	delete(p.links, l)
	l.cancel()
	l.client.Close()
	if l.server != nil {
		l.server.Close()
	}
}
