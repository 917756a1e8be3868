package serve

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1/kvpipev1connect"
)

// streamAhead is how many of a MatchStream's requests are read ahead of
// the one being answered: while any wait, answers are not flushed one by
// one but together, after the last. streamAheadBytes bounds them in
// memory too (decodedSize): a client that sends and never reads its
// answers would else pin 64 requests of up to MaxMessageBytes a stream.
const (
	streamAhead      = 64
	streamAheadBytes = 1 << 20
)

// aheadBytes counts the decoded bytes of a stream's requests read and not
// yet taken to be answered; the reader waits while they are past
// streamAheadBytes, and each take wakes it.
type aheadBytes struct {
	n     atomic.Int64
	taken chan struct{}
}

func newAheadBytes() *aheadBytes { return &aheadBytes{taken: make(chan struct{}, 1)} }

// add counts req in, as it is read.
func (a *aheadBytes) add(req *kvpipev1.MatchRequest) { a.n.Add(int64(decodedSize(req))) }

// wait waits while the count is past the bound; false if stop came first.
func (a *aheadBytes) wait(stop <-chan struct{}) bool {
	for a.n.Load() > streamAheadBytes {
		select {
		case <-a.taken:
		case <-stop:
			return false
		}
	}
	return true
}

// take counts req out, as it is taken to be answered.
func (a *aheadBytes) take(req *kvpipev1.MatchRequest) {
	a.n.Add(-int64(decodedSize(req)))
	select {
	case a.taken <- struct{}{}:
	default: // a wake-up already waits
	}
}

// decodedSize is about what r holds in memory: its slices, strings and
// objects, and the unknown fields protobuf keeps.
func decodedSize(r *kvpipev1.MatchRequest) int {
	n := 256 + 4*cap(r.Tokens) + 8*(cap(r.Keys)+cap(r.EagleKeys)) + len(r.LoraName) + len(r.Salt) + len(r.RoutedTo) +
		len(r.ProtoReflect().GetUnknown())
	for _, mm := range r.Multimodal {
		n += 96 + len(mm.GetHash()) + len(mm.ProtoReflect().GetUnknown())
	}
	return n
}

// errDraining ends a MatchStream when the server drains, after the
// answers to the requests it had read.
var errDraining = connect.NewError(connect.CodeUnavailable,
	errors.New("match stream: the server is shutting down; requests not answered were not read: send them to another server"))

// streamConn is a MatchStream's own view of its HTTP exchange, set up by
// the server's handler: the flush of each answer, which MatchStream holds
// while more requests wait, and the request body, which it closes to stop
// its reader when it ends first (the server draining).
type streamConn struct {
	http.ResponseWriter
	body io.Closer
	hold bool // set and read on the handler's goroutine only
}

func (c *streamConn) Flush() {
	if !c.hold {
		http.NewResponseController(c.ResponseWriter).Flush()
	}
}

func (c *streamConn) Unwrap() http.ResponseWriter { return c.ResponseWriter }

type streamConnKey struct{}

// withStreamConn gives a MatchStream call its streamConn.
func withStreamConn(w http.ResponseWriter, r *http.Request) (http.ResponseWriter, *http.Request) {
	if r.URL.Path != kvpipev1connect.IndexServiceMatchStreamProcedure {
		return w, r
	}
	c := &streamConn{ResponseWriter: w, body: r.Body}
	return c, r.WithContext(context.WithValue(r.Context(), streamConnKey{}, c))
}

// MatchStream answers the stream's requests in order until the client
// closes its side. A goroutine reads them ahead, so that a client with
// several in flight has their answers written together. A draining server
// answers the requests read and then ends the stream with Unavailable, at
// once, even an idle one.
func (s *service) MatchStream(ctx context.Context, stream *connect.BidiStream[kvpipev1.MatchRequest, kvpipev1.MatchResponse]) error {
	c, ok := ctx.Value(streamConnKey{}).(*streamConn)
	if !ok {
		return connect.NewError(connect.CodeInternal, errors.New("match stream: served without the server's handler"))
	}
	reqs, stop := make(chan *kvpipev1.MatchRequest, streamAhead), make(chan struct{})
	ahead := newAheadBytes()
	var readErr error
	var wg sync.WaitGroup
	wg.Go(func() { readErr = readRequests(stream.Receive, reqs, ahead, stop) })
	err := s.answerStream(ctx, stream.RequestHeader(), reqs, ahead, func(a *kvpipev1.MatchResponse, more bool) error {
		c.hold = more
		return stream.Send(a)
	})
	close(stop)
	c.body.Close() // the reader may wait on the client
	wg.Wait()
	if err == nil {
		err = readErr
	}
	return err
}

// readRequests sends the requests recv returns on reqs, counted in ahead,
// until the client ends its side (nil), the stream fails, or stop; then
// closes reqs.
func readRequests(recv func() (*kvpipev1.MatchRequest, error), reqs chan<- *kvpipev1.MatchRequest, ahead *aheadBytes, stop <-chan struct{}) error {
	defer close(reqs)
	for {
		req, err := recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		ahead.add(req) // counted in before the answerer may take it
		select {
		case reqs <- req:
		case <-stop:
			return nil
		}
		if !ahead.wait(stop) {
			return nil
		}
	}
}

// answerStream answers reqs in order until it is closed, ctx ends or the
// server drains; send is told whether another request waits (its answer
// need not be flushed yet). h is the call's header.
func (s *service) answerStream(ctx context.Context, h http.Header, reqs <-chan *kvpipev1.MatchRequest, ahead *aheadBytes, send func(a *kvpipev1.MatchResponse, more bool) error) error {
	draining := false
	for {
		req, ok, err := nextRequest(ctx, reqs, s.draining.Done(), &draining)
		if err != nil || !ok {
			return err
		}
		ahead.take(req)
		a, err := refusedInPlace(s.match(ctx, h, req))
		if err != nil {
			return err
		}
		if err := send(a, len(reqs) > 0); err != nil {
			return err
		}
	}
}

// nextRequest is the next request of reqs to answer (ok false once reqs is
// closed): any, until closing is closed; from then on (draining) only those
// already read, and errDraining once none is left.
func nextRequest(ctx context.Context, reqs <-chan *kvpipev1.MatchRequest, closing <-chan struct{}, draining *bool) (*kvpipev1.MatchRequest, bool, error) {
	if !*draining {
		select {
		case req, ok := <-reqs:
			return req, ok, nil
		case <-ctx.Done():
			return nil, false, ctx.Err()
		case <-closing:
			*draining = true
		}
	}
	// Never after a request taken above: with both ready, select picks at
	// random, and a second take would skip the first's answer.
	select {
	case req, ok := <-reqs:
		return req, ok, nil
	default:
		return nil, false, errDraining
	}
}

// streamGrace is how long a stream may go on writing once the server
// drains: time enough to send what it owes (the answers to a MatchStream's
// requests read, each stream's end) to a client that reads. One that does
// not is cut then, rather than hold the drain for all of DrainTimeout.
const streamGrace = time.Second

// streamPath reports whether path is one of the main port's streams,
// which end when the server drains, whatever their client does: calls
// (Dump among them) are answered instead, up to DrainTimeout.
func streamPath(path string) bool {
	switch path {
	case kvpipev1connect.IndexServiceMatchStreamProcedure, kvpipev1connect.IndexServiceWatchWorkersProcedure, "/v1/watch":
		return true
	}
	return false
}

// cutOnDrain sets a write deadline on w, streamGrace after draining is
// done (the server drains), so that a write waiting on a client that does
// not read fails. The returned func, called before the handler returns,
// stops it: once it has, w is not touched (net/http reuses it).
func cutOnDrain(draining context.Context, w http.ResponseWriter) (stop func()) {
	rc := http.NewResponseController(w)
	var mu sync.Mutex // held while the deadline is set
	done := false
	stopAfter := context.AfterFunc(draining, func() {
		mu.Lock()
		defer mu.Unlock()
		if !done {
			rc.SetWriteDeadline(time.Now().Add(streamGrace))
		}
	})
	return func() {
		if !stopAfter() {
			mu.Lock()
			done = true
			mu.Unlock()
		}
	}
}
