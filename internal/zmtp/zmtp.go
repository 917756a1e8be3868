package zmtp

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

const (
	// DefaultMaxMessage bounds one inbound message. A KV-event batch is one
	// engine step: even a step that stores a million-token prefill is about
	// 5 MiB of msgpack token ids (5 bytes each) plus 9 bytes per block hash,
	// and one event at codec's limit of 4 Mi tokens is about 20 MiB.
	// 64 MiB is well above both, and is what one hostile connection may cost.
	DefaultMaxMessage = 64 << 20
	// DefaultHandshakeTimeout bounds greeting plus READY: a live peer on
	// any network answers in milliseconds.
	DefaultHandshakeTimeout = 5 * time.Second

	// frameOverhead is what zmq4 spends per frame beyond its body: a 24-byte
	// slice header in Msg.Frames, up to 2.25 times over while append grows
	// it, and the smallest allocation for a tiny body. Counting it toward
	// MaxMessage bounds a message of millions of empty frames too.
	frameOverhead = 64
	// maxCommand bounds a command frame. READY carries a few short
	// properties, PING a 16-bit TTL and a context of at most 16 bytes.
	maxCommand = 64 << 10
)

// Kinds of violation, passed to the report callback and found in Violation.
const (
	KindGreeting         = "greeting"          // not a ZMTP 3.x NULL-mechanism greeting
	KindOversize         = "oversize"          // a frame or message over the limit
	KindBadFlags         = "bad_flags"         // reserved flag bits, or a command with MORE
	KindBadCommand       = "bad_command"       // no READY first, or a malformed one
	KindHandshakeTimeout = "handshake_timeout" // greeting plus READY took too long
)

// Limits bound what a dialled peer may make this process hold or wait for.
// A zero field takes its default.
type Limits struct {
	// MaxMessage bounds the bytes of one message, counting 64 bytes per
	// frame on top of the frames' sizes (default DefaultMaxMessage).
	MaxMessage int64
	// HandshakeTimeout bounds the time from the start of the connect to
	// the peer's READY (default DefaultHandshakeTimeout).
	HandshakeTimeout time.Duration
}

func (l Limits) withDefaults() Limits {
	if l.MaxMessage <= 0 {
		l.MaxMessage = DefaultMaxMessage
	}
	if l.HandshakeTimeout <= 0 {
		l.HandshakeTimeout = DefaultHandshakeTimeout
	}
	return l
}

// Violation is the error a guarded connection's Read returns once the peer
// has broken a limit or the protocol; the connection is closed by then.
type Violation struct {
	Kind string // one of the Kind constants
	Err  error
}

func (v *Violation) Error() string { return "zmtp: " + v.Kind + ": " + v.Err.Error() }
func (v *Violation) Unwrap() error { return v.Err }

// Timeout and Temporary make Violation a net.Error that is neither, which is
// what makes zmq4 (Conn.checkIO) mark its Conn closed and drop it from the
// socket; any other error type would leave the dead Conn in place.
func (v *Violation) Timeout() bool   { return false }
func (v *Violation) Temporary() bool { return false }

var _ net.Error = (*Violation)(nil)

type settings struct {
	Limits
	report func(kind string, err error)
}

type ctxKey struct{}

// WithLimits returns a context that carries l and report to every socket
// made from it (zmq4.NewSub(ctx), zmq4.NewDealer(ctx), ...) and dialled on
// an Endpoint: zmq4 hands the socket's context to the transport's Dial.
// report, which may be nil, is called once per connection that breaks a
// rule, with one of the Kind constants; it runs on zmq4's goroutines,
// concurrently for different connections. Without WithLimits the guard uses
// the defaults and reports nothing.
func WithLimits(ctx context.Context, l Limits, report func(kind string, err error)) context.Context {
	return context.WithValue(ctx, ctxKey{}, settings{l.withDefaults(), report})
}

func fromContext(ctx context.Context) settings {
	if s, ok := ctx.Value(ctxKey{}).(settings); ok {
		return s
	}
	return settings{Limits: Limits{}.withDefaults()}
}

// Guarded schemes, as zmq4's splitAddr sees them: what precedes "://".
const (
	schemeTCP = "kvpipe+tcp"
	schemeIPC = "kvpipe+ipc"
)

// Endpoint rewrites a tcp:// or ipc:// endpoint to its guarded scheme, for
// Dial; any other endpoint is returned unchanged.
func Endpoint(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return schemeTCP + "://" + rest
	}
	if rest, ok := strings.CutPrefix(ep, "ipc://"); ok {
		return schemeIPC + "://" + rest
	}
	return ep
}

// Registration is once per process, as for database/sql drivers; the
// transports are stateless values, all state lives in each connection.
func init() {
	for scheme, network := range map[string]string{schemeTCP: "tcp", schemeIPC: "unix"} {
		if err := zmq4.RegisterTransport(scheme, guarded{network: network, plain: transport.New(network)}); err != nil {
			panic(fmt.Sprintf("zmtp: %v", err))
		}
	}
}

// guarded is a zmq4 transport whose dialled connections are checked.
// Listening is plain: only the dialling side (SUB, DEALER) needs the guard.
type guarded struct {
	network string
	plain   transport.Transport
}

// Dial bounds connect and handshake together by HandshakeTimeout: zmq4's
// own dialer waits minutes for a host that drops connection attempts.
func (g guarded) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	s := fromContext(ctx)
	deadline := time.Now().Add(s.HandshakeTimeout)
	dctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	nc, err := d.DialContext(dctx, g.network, addr)
	if err != nil {
		return nil, err
	}
	return newConn(ctx, nc, s, deadline)
}

func (g guarded) Listen(ctx context.Context, addr string) (net.Listener, error) {
	return g.plain.Listen(ctx, addr)
}

func (g guarded) Addr(ep string) (string, error) { return g.plain.Addr(ep) }
