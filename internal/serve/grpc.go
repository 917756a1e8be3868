package serve

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// grpcMaxStreams bounds the calls one connection has open at once, as
// net/http's HTTP/2 server does on the main port (grpc-go's own default
// is unbounded).
const grpcMaxStreams = 250

// grpcMaxHeaderBytes bounds a call's metadata, net/http's default.
const grpcMaxHeaderBytes = 1 << 20

// grpcWindowBytes is the grpc-go port's flow-control window, a stream's
// and a connection's: many requests of 600 keys in flight.
const grpcWindowBytes = 1 << 20

// grpcService serves the IndexService through grpc-go, on a port of its
// own (Config.GRPCListener): grpc-go's HTTP/2 server takes about half of
// connect-go's CPU per match (docs/PERFORMANCE.md), and it cannot share the
// main port's net/http server without giving that up. It answers with
// service's code; the interceptors add the token check and turn service's
// connect errors into gRPC statuses (the codes are the same).
type grpcService struct {
	kvpipev1.UnimplementedIndexServiceServer
	svc      *service
	codec    *matchCodec
	inFlight prometheus.Gauge
	// conns are the port's connections, for stopGRPC.
	conns connSet
	// readers are the MatchStreams' request readers (streamAnswerer). One
	// blocked in Recv returns only once its stream has ended, after its
	// handler: Run waits for them once the server has stopped.
	readers sync.WaitGroup
}

// newGRPCServer is a grpc-go server of g with the limits and TLS of cfg.
func newGRPCServer(g *grpcService, cfg *Config) *grpc.Server {
	opts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(cfg.MaxMessageBytes), grpc.MaxConcurrentStreams(grpcMaxStreams),
		grpc.MaxHeaderListSize(grpcMaxHeaderBytes),
		grpc.ConnectionTimeout(handshakeTimeout),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: cfg.IdleTimeout}),
		// Fixed windows: grpc-go's dynamic ones probe the bandwidth with a
		// ping on data received, which for a router's request-answer
		// traffic never grows the window and comes with every request, a
		// write and a read more each (docs/PERFORMANCE.md). A connection
		// buffers no more than its window either way.
		grpc.StaticStreamWindowSize(grpcWindowBytes), grpc.StaticConnWindowSize(grpcWindowBytes),
		// Stopped, it waits for the handlers too: none asks the pipeline
		// once Run stops it, and none starts a stream reader once Run
		// waits for them.
		grpc.WaitForHandlers(true),
		grpc.ForceServerCodecV2(g.codec),
		grpc.ChainUnaryInterceptor(g.unary), grpc.ChainStreamInterceptor(g.stream),
	}
	if cfg.TLS != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(cfg.TLS)))
	}
	srv := grpc.NewServer(opts...)
	kvpipev1.RegisterIndexServiceServer(srv, g)
	return srv
}

// serveGRPC serves srv on l until it stops, its connections kept in conns.
func serveGRPC(srv *grpc.Server, l net.Listener, conns *connSet) error {
	if err := srv.Serve(conns.listener(l)); !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// stopGRPC stops srv as the main port's server drains: new calls refused,
// in-flight ones answered until ctx ends, then every connection closed.
// Streams end as the drain begins, but one may still owe its client what
// the client does not read: its handler waiting in a send, or returned
// with the rest queued (grpc-go holds the stream until it is written).
// grpc-go cannot end one stream alone, so streamGrace in, the connections
// of such streams are closed (conns.cutStreaming), with their other calls.
func stopGRPC(ctx context.Context, srv *grpc.Server, conns *connSet) {
	var wg sync.WaitGroup
	stopped := make(chan struct{})
	wg.Go(func() {
		srv.GracefulStop()
		close(stopped)
	})
	grace := time.NewTimer(streamGrace)
	defer grace.Stop()
	for done := false; !done; {
		select {
		case <-stopped:
			done = true
		case <-ctx.Done():
			srv.Stop() // GracefulStop returns too
			done = true
		case <-grace.C:
			conns.cutStreaming()
		}
	}
	wg.Wait()
}

// streaming marks the connection of the stream of ctx as one a drain cuts
// (stopGRPC) while the stream is open; the returned func, called as its
// handler returns, unmarks it, unless the drain has begun: the stream may
// still owe its client what is queued.
func (g *grpcService) streaming(ctx context.Context) (done func()) {
	p, _ := peer.FromContext(ctx)
	var c *trackedConn
	if p != nil {
		if a, ok := p.Addr.(trackedAddr); ok {
			c = a.conn
		}
	}
	if c == nil {
		return func() {}
	}
	c.streams.Add(1)
	return func() {
		if g.svc.draining.Err() == nil {
			c.streams.Add(-1)
		}
	}
}

// callHeader is the call's Authorization metadata as guard reads it.
func callHeader(ctx context.Context) http.Header {
	md, _ := metadata.FromIncomingContext(ctx)
	return http.Header{"Authorization": md.Get("authorization")}
}

// grpcError is err as a gRPC status: service's connect errors keep their
// code and message; grpc-go's own pass as they are.
func grpcError(err error) error {
	if err == nil {
		return nil
	}
	if ce := new(connect.Error); errors.As(err, &ce) {
		return status.Error(codes.Code(ce.Code()), ce.Message())
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return status.FromContextError(err).Err()
	}
	return err
}

func (g *grpcService) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	g.inFlight.Inc()
	defer g.inFlight.Dec()
	if guarded(info.FullMethod) {
		if err := g.svc.guard.authorize(callHeader(ctx)); err != nil {
			return nil, grpcError(err)
		}
	}
	resp, err := next(ctx, req)
	return resp, grpcError(err)
}

func (g *grpcService) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, next grpc.StreamHandler) error {
	g.inFlight.Inc()
	defer g.inFlight.Dec()
	switch info.FullMethod {
	case kvpipev1.IndexService_MatchStream_FullMethodName, kvpipev1.IndexService_WatchWorkers_FullMethodName:
		defer g.streaming(ss.Context())()
	}
	if guarded(info.FullMethod) {
		if err := g.svc.guard.authorize(callHeader(ss.Context())); err != nil {
			return grpcError(err)
		}
	}
	return grpcError(next(srv, ss))
}

func (g *grpcService) Match(ctx context.Context, r *kvpipev1.MatchRequest) (*kvpipev1.MatchResponse, error) {
	defer g.release(r)
	return g.svc.match(ctx, routedHeader(ctx, r), r)
}

// release gives r's keys back to the codec once r is answered, but for a
// routed request's: the pipeline keeps them as its prediction.
func (g *grpcService) release(r *kvpipev1.MatchRequest) {
	if r.RoutedTo == "" {
		g.codec.keys.put(r.Keys)
		r.Keys = nil
	}
}

// routedHeader is the header match reads only for a request with
// routed_to: the others go without one.
func routedHeader(ctx context.Context, r *kvpipev1.MatchRequest) http.Header {
	if r.RoutedTo == "" {
		return nil
	}
	return callHeader(ctx)
}

func (g *grpcService) MatchBatch(ctx context.Context, r *kvpipev1.MatchBatchRequest) (*kvpipev1.MatchBatchResponse, error) {
	return g.svc.matchBatch(ctx, callHeader(ctx), r)
}

// MatchStream answers as the main port's does, but its requests are read
// and answered, one at a time, by a goroutine of its own (one of readers):
// a draining server must end an idle stream, which a handler waiting in
// Recv could not, and a hand-off of each request to the handler would
// cost a wake-up a match. The handler waits for that goroutine's end or
// the drain; draining, it lets the answer in progress be sent, and none
// after: only the handler's goroutine may send once it has returned.
func (g *grpcService) MatchStream(stream grpc.BidiStreamingServer[kvpipev1.MatchRequest, kvpipev1.MatchResponse]) error {
	a := &streamAnswerer{stream: stream, g: g}
	ended := make(chan error, 1)
	g.readers.Go(func() { ended <- a.run() })
	select {
	case err := <-ended:
		return err
	case <-g.svc.draining.Done():
		a.mu.Lock() // the answer in progress sent
		a.draining = true
		a.mu.Unlock()
		return errDraining // the reader ends with the stream
	}
}

// streamAnswerer answers a grpc-go MatchStream's requests in order on the
// goroutine that reads them.
type streamAnswerer struct {
	stream grpc.BidiStreamingServer[kvpipev1.MatchRequest, kvpipev1.MatchResponse]
	g      *grpcService
	// mu is held while a request is answered; draining, set under it,
	// says the handler has returned: no more answers.
	mu       sync.Mutex
	draining bool
}

// run answers requests until the client ends its side (nil), the stream
// fails, or the server drains.
func (a *streamAnswerer) run() error {
	ctx := a.stream.Context()
	h := callHeader(ctx)
	for {
		req, err := a.stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := a.answer(ctx, h, req); err != nil {
			return err
		}
	}
}

func (a *streamAnswerer) answer(ctx context.Context, h http.Header, req *kvpipev1.MatchRequest) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.draining {
		return errDraining // not sent: the handler has ended the stream
	}
	out, err := refusedInPlace(a.g.svc.match(ctx, h, req))
	// Given back before the send, which waits on the client: one that
	// does not read its answers pins none of its requests.
	a.g.release(req)
	if err != nil {
		return err
	}
	return a.stream.Send(out)
}

func (g *grpcService) RegisterWorker(ctx context.Context, r *kvpipev1.RegisterWorkerRequest) (*kvpipev1.RegisterWorkerResponse, error) {
	w, err := g.svc.register(ctx, r.GetWorker(), false)
	if err != nil {
		return nil, err
	}
	return &kvpipev1.RegisterWorkerResponse{Worker: w}, nil
}

func (g *grpcService) UnregisterWorker(ctx context.Context, r *kvpipev1.UnregisterWorkerRequest) (*kvpipev1.UnregisterWorkerResponse, error) {
	if err := g.svc.unregister(ctx, r.Name); err != nil {
		return nil, err
	}
	return &kvpipev1.UnregisterWorkerResponse{}, nil
}

func (g *grpcService) ListWorkers(ctx context.Context, _ *kvpipev1.ListWorkersRequest) (*kvpipev1.ListWorkersResponse, error) {
	return g.svc.list(g.svc.guard.holds(callHeader(ctx))), nil
}

func (g *grpcService) WatchWorkers(_ *kvpipev1.WatchWorkersRequest, stream grpc.ServerStreamingServer[kvpipev1.WorkerEvent]) error {
	// Headers now, as on the main port: with no worker yet nothing else
	// would send them.
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	ctx := stream.Context()
	return g.svc.watch(ctx, g.svc.guard.holds(callHeader(ctx)), stream.Send)
}

func (g *grpcService) Dump(r *kvpipev1.DumpRequest, stream grpc.ServerStreamingServer[kvpipev1.DumpResponse]) error {
	return g.svc.dump(stream.Context(), r.Worker, stream.Send)
}

// connSet holds a listener's open connections, so that a drain can cut
// those of streams that do not end (stopGRPC).
type connSet struct {
	mu sync.Mutex
	m  map[*trackedConn]struct{}
}

// listener is l with each connection it accepts kept in s until closed.
func (s *connSet) listener(l net.Listener) net.Listener { return trackingListener{l, s} }

// cutStreaming closes the connections with a stream marked (streaming).
func (s *connSet) cutStreaming() {
	s.mu.Lock()
	var cut []*trackedConn
	for c := range s.m {
		if c.streams.Load() > 0 {
			cut = append(cut, c)
		}
	}
	s.mu.Unlock()
	for _, c := range cut {
		c.Close()
	}
}

type trackingListener struct {
	net.Listener
	set *connSet
}

func (l trackingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	t := &trackedConn{Conn: c, set: l.set}
	l.set.mu.Lock()
	if l.set.m == nil {
		l.set.m = make(map[*trackedConn]struct{})
	}
	l.set.m[t] = struct{}{}
	l.set.mu.Unlock()
	return t, nil
}

// trackedConn is a connection of a connSet. Its RemoteAddr carries it, so
// that a handler finds it from its peer (grpc-go's peer.Addr is it).
type trackedConn struct {
	net.Conn
	set     *connSet
	streams atomic.Int32 // streams marked by streaming
	once    sync.Once
}

// trackedAddr is a trackedConn's remote address, the connection with it.
type trackedAddr struct {
	net.Addr
	conn *trackedConn
}

func (c *trackedConn) RemoteAddr() net.Addr { return trackedAddr{c.Conn.RemoteAddr(), c} }

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.set.mu.Lock()
		delete(c.set.m, c)
		c.set.mu.Unlock()
	})
	return c.Conn.Close()
}
