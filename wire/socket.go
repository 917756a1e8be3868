package wire

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/url"
	"strings"
	"sync/atomic"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/internal/zmtp"
)

// validateEndpoint checks that ep is a ZMQ endpoint kvpipe can dial:
// tcp://host:port or ipc://path.
func validateEndpoint(ep string) error {
	u, err := url.Parse(ep)
	if err != nil {
		return fmt.Errorf("endpoint %q: %w", ep, err)
	}
	switch u.Scheme {
	case "tcp":
		if u.Host == "" || u.Port() == "" {
			return fmt.Errorf("endpoint %q: want tcp://host:port", ep)
		}
	case "ipc":
		if strings.TrimPrefix(ep, "ipc://") == "" {
			return fmt.Errorf("endpoint %q: want ipc://path", ep)
		}
	default:
		return fmt.Errorf("endpoint %q: scheme %q is not tcp or ipc", ep, u.Scheme)
	}
	return nil
}

// numProtocolErrors is how many kinds of protocol error Stats.ProtocolErrors
// tells apart.
const numProtocolErrors = 5

// ProtocolErrorKinds names the protocol error kinds, in Stats.ProtocolErrors'
// order, for metrics labels: a greeting that is not ZMTP 3.x NULL, a frame
// or message over MaxMessage, reserved flag bits or a command with MORE,
// no READY first or a malformed command, no READY within HandshakeTimeout.
var ProtocolErrorKinds = [numProtocolErrors]string{zmtp.KindGreeting, zmtp.KindOversize,
	zmtp.KindBadFlags, zmtp.KindBadCommand, zmtp.KindHandshakeTimeout}

// guard is what a dial checks the peer against, and where it counts what
// the peer broke.
type guard struct {
	limits zmtp.Limits
	errors *[numProtocolErrors]atomic.Uint64
}

// report is called on zmq4's connection goroutines: it only counts.
func (g guard) report(kind string, _ error) {
	for i, k := range ProtocolErrorKinds {
		if k == kind {
			g.errors[i].Add(1)
		}
	}
}

// dial creates a socket of the given kind and dials ep once, without zmq4's
// own retry loop: the caller retries with its own backoff. The connection
// goes through the zmtp guard, so a peer can neither make zmq4 allocate
// past the message limit nor hold the handshake past its timeout.
func dial(ctx context.Context, kind zmq4.SocketType, ep string, g guard) (zmq4.Socket, error) {
	ctx = zmtp.WithLimits(ctx, g.limits, g.report)
	opts := []zmq4.Option{zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(log.New(io.Discard, "", 0))}
	var s zmq4.Socket
	switch kind {
	case zmq4.Sub:
		s = zmq4.NewSub(ctx, opts...)
	case zmq4.Dealer:
		s = zmq4.NewDealer(ctx, opts...)
	default:
		return nil, fmt.Errorf("wire: cannot dial a %s socket", kind)
	}
	if err := s.Dial(zmtp.Endpoint(ep)); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}
