package serve

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1/kvpipev1connect"
	"github.com/kvpipe/kvpipe/metrics"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
)

// compressMinBytes: smaller answers go uncompressed even to a client that
// accepts gzip (grpc-go and connect-go do by default). A match answer is a
// few hundred bytes; gzip's setup per message took a third of the server's
// CPU per call and saved nothing a LAN notices.
const compressMinBytes = 64 << 10

// Config configures a Server; zero fields take their defaults.
type Config struct {
	Pipeline  *kvpipe.Pipeline // not running yet: Run runs it
	BlockSize int              // the pipeline's router block size (required)
	// Workers are the operator's (flags, config file): added at start,
	// without the allow-list.
	Workers []*kvpipev1.WorkerSpec
	// Token is the bearer token of the calls that change or dump state;
	// empty refuses them all.
	Token string
	// Allow lists the CIDRs, addresses and host names a registration may
	// make the server dial; empty refuses every registration.
	Allow    []string
	Resolver *net.Resolver // nil: net.DefaultResolver
	// MaxTokens bounds a match request's tokens (default 1 Mi), its keys
	// MaxTokens/BlockSize+1; MaxMessageBytes a request's size (default 8 MiB).
	MaxTokens, MaxMessageBytes int
	// Snapshot is the file of the saved state (the index, and the
	// registrations beside it in Snapshot+".workers"): loaded by Run,
	// saved when it drains, and every SnapshotEvery meanwhile (0: only
	// then). Empty: none.
	Snapshot      string
	SnapshotEvery time.Duration
	// DrainTimeout bounds how long in-flight calls may take once Run's ctx
	// ends (default 10s); Poll is how often the workers are sampled
	// (default 250ms).
	DrainTimeout, Poll time.Duration
	// ReadyTimeout is how long a registered worker that has not connected
	// holds /readyz back (default 30s; negative: for ever): past it the
	// worker counts as partial (none of its engine's blocks are indexed),
	// so that one engine down does not keep the service out of a load
	// balancer's rotation. The service is not ready while no registered
	// worker has connected.
	ReadyTimeout time.Duration
	// IdleTimeout closes a connection with no call open for that long, on
	// both ports (default 2 minutes): a router reconnects when it next
	// calls, and connections that are left open are not kept for ever.
	IdleTimeout time.Duration
	TLS         *tls.Config // nil: plain HTTP (gRPC over h2c)
	Registry    *prometheus.Registry
	Logger      *slog.Logger // nil discards
	// GRPCListener, if set, is where Run also serves every call of the
	// service through grpc-go (its own HTTP/2 server: about half the CPU a
	// match of the main port's), with the same token, limits and TLS.
	GRPCListener net.Listener
}

// Server is kvpipe serve: it runs the pipeline and answers for it.
type Server struct {
	cfg     Config
	svc     *service
	grpc    *grpcService
	handler http.Handler
	// draining is done once the server drains (startDrain): streams end.
	draining   context.Context
	startDrain context.CancelFunc
	save       sync.Mutex // serialises saving the registrations
	inFlight   prometheus.Gauge
}

// New checks cfg, resolves the allow-list and builds the handler; it
// starts nothing.
func New(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.Pipeline == nil || cfg.BlockSize <= 0 {
		return nil, errors.New("serve: a Pipeline and its BlockSize are required")
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	cfg.MaxTokens = orInt(cfg.MaxTokens, 1<<20)
	cfg.MaxMessageBytes = orInt(cfg.MaxMessageBytes, 8<<20)
	cfg.DrainTimeout = orInt(cfg.DrainTimeout, 10*time.Second)
	cfg.Poll = orInt(cfg.Poll, 250*time.Millisecond)
	cfg.ReadyTimeout = orInt(cfg.ReadyTimeout, 30*time.Second)
	cfg.IdleTimeout = orInt(cfg.IdleTimeout, 2*time.Minute)
	s := &Server{cfg: cfg}
	s.draining, s.startDrain = context.WithCancel(context.Background())
	refused, err := s.registerMetrics()
	if err != nil {
		return nil, err
	}
	g, err := newGuard(ctx, cfg.Token, cfg.Allow, cfg.Resolver, func(r string) { refused.WithLabelValues(r).Inc() })
	if err != nil {
		return nil, err
	}
	s.svc = &service{p: cfg.Pipeline, limits: limits{maxTokens: cfg.MaxTokens, blockSize: cfg.BlockSize}, guard: g,
		draining: s.draining, saved: s.saveWorkers, specs: map[string]*kvpipev1.WorkerSpec{}, added: map[string]time.Time{}}
	s.svc.mon = newMonitor(cfg.Pipeline.Stats, s.svc.spec, cfg.Poll)
	s.grpc = &grpcService{svc: s.svc, codec: newMatchCodec(s.svc.limits), inFlight: s.inFlight}
	s.handler = s.routes()
	return s, nil
}

func orInt[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}

func (s *Server) registerMetrics() (*prometheus.CounterVec, error) {
	refused := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvpipe_serve_refused_total",
		Help: "Requests refused, by reason: unauthenticated, permission_denied (allow-list), invalid_argument."}, []string{"reason"})
	s.inFlight = prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvpipe_serve_in_flight_requests",
		Help: "Requests being answered, /metrics scrapes left out."})
	for _, c := range []prometheus.Collector{metrics.NewCollector(s.cfg.Pipeline.Stats), refused, s.inFlight} {
		if err := s.cfg.Registry.Register(c); err != nil {
			return nil, fmt.Errorf("serve: metrics: %w", err)
		}
	}
	return refused, nil
}

// Handler serves every route: the gRPC/Connect service, the HTTP/JSON
// routes, /metrics, /healthz, /readyz and the status page.
func (s *Server) Handler() http.Handler { return s.handler }

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	opts := append(connectCodecs(s.svc.limits), connect.WithInterceptors(s.svc.guard.interceptor()),
		connect.WithReadMaxBytes(s.cfg.MaxMessageBytes), connect.WithCompressMinBytes(compressMinBytes))
	path, h := kvpipev1connect.NewIndexServiceHandler(s.svc, opts...)
	mux.Handle(path, h)
	s.restRoutes(mux)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			s.inFlight.Inc()
			defer s.inFlight.Dec()
		}
		if streamPath(r.URL.Path) {
			defer cutOnDrain(s.draining, w)()
		}
		w, r = withStreamConn(w, r)
		mux.ServeHTTP(w, r)
	})
}

// Run loads the saved state, runs the pipeline, its workers and the
// server on l (and grpc-go's on GRPCListener) until ctx ends, then drains:
// new connections are refused, streams end, in-flight calls are answered
// (up to DrainTimeout), the state is saved, and the pipeline stops. It
// returns once all of it has.
func (s *Server) Run(ctx context.Context, l net.Listener) error {
	if err := s.load(ctx); err != nil {
		return err
	}
	var wg sync.WaitGroup
	pctx, stopPipeline := context.WithCancel(context.WithoutCancel(ctx))
	defer stopPipeline()
	runErr := make(chan error, 1)
	wg.Go(func() { runErr <- s.cfg.Pipeline.Run(pctx) })
	// The monitor and the periodic saves stop before the last save.
	var bg sync.WaitGroup
	mctx, stopMonitor := context.WithCancel(context.WithoutCancel(ctx))
	bg.Go(func() { s.svc.mon.run(mctx) })
	bg.Go(func() { s.saveEvery(mctx) })
	srv, gsrv := s.httpServer(), s.grpcServer()
	served := make(chan error, 2)
	wg.Go(func() { served <- s.serve(srv, l) })
	if gsrv != nil {
		wg.Go(func() { served <- serveGRPC(gsrv, s.cfg.GRPCListener, &s.grpc.conns) })
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-served:
	case err = <-runErr:
		err = fmt.Errorf("serve: pipeline stopped: %w", err)
	}
	s.drain(srv, gsrv)
	stopMonitor()
	bg.Wait()
	if saveErr := s.saveState(); saveErr != nil && err == nil {
		err = saveErr
	}
	stopPipeline()
	wg.Wait()
	return err
}

// handshakeTimeout bounds how long a connection may take to send a
// request's header (HTTP/1, each request) or its preface (HTTP/2, and TLS
// before either).
const handshakeTimeout = 10 * time.Second

func (s *Server) httpServer() *http.Server {
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetHTTP2(true)
	protocols.SetUnencryptedHTTP2(true) // gRPC without TLS (h2c, prior knowledge)
	return &http.Server{Handler: s.handler, Protocols: &protocols, TLSConfig: s.cfg.TLS,
		ReadHeaderTimeout: handshakeTimeout, IdleTimeout: s.cfg.IdleTimeout, ErrorLog: slog.NewLogLogger(s.cfg.Logger.Handler(), slog.LevelWarn)}
}

func (s *Server) serve(srv *http.Server, l net.Listener) error {
	var err error
	if s.cfg.TLS != nil {
		err = srv.ServeTLS(l, "", "")
	} else {
		err = srv.Serve(l)
	}
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// grpcServer is grpc-go's server, nil without a GRPCListener.
func (s *Server) grpcServer() *grpc.Server {
	if s.cfg.GRPCListener == nil {
		return nil
	}
	return newGRPCServer(s.grpc, &s.cfg)
}

// drain ends the streams and waits for in-flight calls on both servers;
// past DrainTimeout the connections left are closed.
func (s *Server) drain(srv *http.Server, gsrv *grpc.Server) {
	s.startDrain()
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.DrainTimeout)
	defer cancel()
	var wg sync.WaitGroup
	if gsrv != nil {
		wg.Go(func() { stopGRPC(ctx, gsrv, &s.grpc.conns) })
	}
	if err := srv.Shutdown(ctx); err != nil {
		s.cfg.Logger.Warn("serve: drain cut short", "err", err)
		srv.Close()
	}
	wg.Wait()
	s.grpc.readers.Wait() // their streams have ended
}
