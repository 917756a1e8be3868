package zmtp

import (
	"context"
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// conn checks what zmq4 reads from a dialled connection.
//
// zmq4 reads a frame header with io.ReadFull (2 bytes, then 7 more for a long
// frame) and calls make(size) as soon as the last one is in. So the check
// must be on the header bytes before they are handed over: Read reads from
// the network straight into zmq4's buffer, runs the parser over what came in,
// and reports only the bytes the parser accepted. The byte that completes an
// oversize header is never reported, so io.ReadFull gets the error instead
// of a size. No byte is copied or held back in a buffer: bytes before the
// violation are passed on, the ones after it are dropped with the connection.
type conn struct {
	net.Conn
	report func(kind string, err error)
	stop   func() bool // stops the context.AfterFunc that closes the conn

	p   parser // owned by the goroutine that reads (Open, then zmq4's reader)
	err error  // sticky: the violation, once one happened

	shaken atomic.Bool // the peer's READY is in and the deadline cleared
	once   sync.Once
}

func newConn(ctx context.Context, nc net.Conn, s settings, deadline time.Time) (net.Conn, error) {
	// zmq4's Open runs the handshake inside Dial with no timeout: the
	// deadline bounds it, and is cleared once the peer's READY is in.
	if err := nc.SetDeadline(deadline); err != nil {
		nc.Close()
		return nil, err
	}
	c := &conn{Conn: nc, report: s.report, p: newParser(s.MaxMessage, maxCommand)}
	// Cancelling the socket's context must not wait for a silent peer: a
	// blocked Read returns once the conn is closed.
	c.stop = context.AfterFunc(ctx, func() { nc.Close() })
	return c, nil
}

func (c *conn) Read(b []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.Conn.Read(b)
	ok, v := c.p.feed(b[:n])
	if v != nil {
		c.err = c.fail(v)
		// io.ReadFull drops the error if ok completes what it wanted; the
		// next Read then returns it.
		return ok, c.err
	}
	if !c.shaken.Load() {
		if c.p.ready {
			c.shaken.Store(true)
			c.Conn.SetDeadline(time.Time{})
		} else if errors.Is(err, os.ErrDeadlineExceeded) {
			c.err = c.fail(&Violation{Kind: KindHandshakeTimeout, Err: err})
			return n, c.err
		}
	}
	return n, err
}

func (c *conn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if err != nil && !c.shaken.Load() && errors.Is(err, os.ErrDeadlineExceeded) {
		return n, c.fail(&Violation{Kind: KindHandshakeTimeout, Err: err})
	}
	return n, err
}

func (c *conn) Close() error {
	c.stop()
	return c.Conn.Close()
}

// fail closes the connection, because zmq4 does not close a conn whose
// handshake failed, and reports the violation once.
func (c *conn) fail(v *Violation) error {
	c.once.Do(func() {
		c.stop()
		c.Conn.Close()
		if c.report != nil {
			c.report(v.Kind, v.Err)
		}
	})
	return v
}
