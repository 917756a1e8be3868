package serve

import (
	"context"
	"errors"
	"net"
	"net/http"
	"sync"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// grpcMaxStreams bounds the calls one connection has open at once, as
// net/http's HTTP/2 server does on the main port (grpc-go's own default
// is unbounded).
const grpcMaxStreams = 250

// grpcMaxHeaderBytes bounds a call's metadata, net/http's default.
const grpcMaxHeaderBytes = 1 << 20

// grpcService serves the IndexService through grpc-go, on a port of its
// own (Config.GRPCListener): grpc-go's HTTP/2 server takes about half of
// connect-go's CPU per match (docs/PERFORMANCE.md), and it cannot share the
// main port's net/http server without giving that up. It answers with
// service's code; the interceptors add the token check and turn service's
// connect errors into gRPC statuses (the codes are the same).
type grpcService struct {
	kvpipev1.UnimplementedIndexServiceServer
	svc      *service
	inFlight prometheus.Gauge
	// readers are the MatchStreams' request readers. One blocked in Recv
	// returns only once its stream has ended, after its handler: Run waits
	// for them once the server has stopped.
	readers sync.WaitGroup
}

// newGRPCServer is a grpc-go server of g with the limits and TLS of cfg.
func newGRPCServer(g *grpcService, cfg *Config) *grpc.Server {
	opts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(cfg.MaxMessageBytes), grpc.MaxConcurrentStreams(grpcMaxStreams),
		grpc.MaxHeaderListSize(grpcMaxHeaderBytes),
		// Stopped, it waits for the handlers too: none asks the pipeline
		// once Run stops it, and none starts a stream reader once Run
		// waits for them.
		grpc.WaitForHandlers(true),
		grpc.ChainUnaryInterceptor(g.unary), grpc.ChainStreamInterceptor(g.stream),
	}
	if cfg.TLS != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(cfg.TLS)))
	}
	srv := grpc.NewServer(opts...)
	kvpipev1.RegisterIndexServiceServer(srv, g)
	return srv
}

// serveGRPC serves srv on l until it stops.
func serveGRPC(srv *grpc.Server, l net.Listener) error {
	if err := srv.Serve(l); !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// stopGRPC stops srv as the main port's server drains: new calls refused,
// in-flight ones answered until ctx ends, then every connection closed.
func stopGRPC(ctx context.Context, srv *grpc.Server) {
	var wg sync.WaitGroup
	stopped := make(chan struct{})
	wg.Go(func() {
		srv.GracefulStop()
		close(stopped)
	})
	select {
	case <-stopped:
	case <-ctx.Done():
		srv.Stop() // GracefulStop returns too
	}
	wg.Wait()
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
	if guarded(info.FullMethod) {
		if err := g.svc.guard.authorize(callHeader(ss.Context())); err != nil {
			return grpcError(err)
		}
	}
	return grpcError(next(srv, ss))
}

func (g *grpcService) Match(ctx context.Context, r *kvpipev1.MatchRequest) (*kvpipev1.MatchResponse, error) {
	return g.svc.match(ctx, routedHeader(ctx, r), r)
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

// MatchStream answers as the main port's does. Its requests are read by a
// goroutine of their own, so that a draining server can end an idle
// stream, which a handler waiting in Recv could not.
func (g *grpcService) MatchStream(stream grpc.BidiStreamingServer[kvpipev1.MatchRequest, kvpipev1.MatchResponse]) error {
	reqs, stop := make(chan *kvpipev1.MatchRequest, streamAhead), make(chan struct{})
	var readErr error
	done := make(chan struct{})
	g.readers.Go(func() {
		defer close(done)
		readErr = readRequests(stream.Recv, reqs, stop)
	})
	ctx := stream.Context()
	// grpc-go's writer merges the answers ready together by itself.
	err := g.svc.answerStream(ctx, callHeader(ctx), reqs, func(a *kvpipev1.MatchResponse, _ bool) error { return stream.Send(a) })
	close(stop)
	if err != nil {
		return err // the reader ends with the stream
	}
	<-done // reqs is closed: the reader has returned
	return readErr
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
