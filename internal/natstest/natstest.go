// Package natstest runs a real nats-server with JetStream inside the test
// process, on loopback and a temporary store directory, and restarts it on
// the same port and store, as a NATS outage does.
package natstest

import (
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Server is an in-process nats-server with JetStream. Its methods are safe
// for concurrent use; it is shut down and waited for when the test ends.
type Server struct {
	t   testing.TB
	dir string

	mu   sync.Mutex
	srv  *server.Server // nil while stopped
	port int            // fixed after the first start, so clients reconnect
}

// Start starts a server on 127.0.0.1 with a free port and JetStream on a
// directory of t's, and shuts it down when t ends.
func Start(t testing.TB) *Server {
	t.Helper()
	s := &Server{t: t, dir: t.TempDir(), port: -1}
	s.start()
	t.Cleanup(s.Stop)
	return s
}

func (s *Server) start() {
	s.t.Helper()
	opts := &server.Options{
		Host: "127.0.0.1", Port: s.port, JetStream: true, StoreDir: s.dir,
		NoLog: true, NoSigs: true,
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		s.t.Fatalf("natstest: %v", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		srv.WaitForShutdown()
		s.t.Fatal("natstest: server not ready within 10s")
	}
	s.srv = srv
	s.port = srv.Addr().(*net.TCPAddr).Port
}

// URL is the server's client URL (nats://127.0.0.1:PORT); it stays the
// same across Restart.
func (s *Server) URL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return "nats://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Stop shuts the server down and waits for it; clients see it gone. It
// does nothing if the server is stopped.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stop()
}

func (s *Server) stop() {
	if s.srv == nil {
		return
	}
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
	s.srv = nil
}

// Restart stops the server (if running) and starts it again on the same
// port and store directory: streams, objects and their sequences survive,
// connections and ephemeral consumers do not.
func (s *Server) Restart() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stop()
	s.start()
}

// StartAgain starts a stopped server on its port and store; see Restart.
func (s *Server) StartAgain() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv == nil {
		s.start()
	}
}

// Connect dials the server with options that ride out a Restart (retry
// forever, 50ms apart) and closes the connection when t ends.
func (s *Server) Connect(t testing.TB, opts ...nats.Option) *nats.Conn {
	t.Helper()
	opts = append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond),
		nats.ReconnectJitter(0, 0)}, opts...)
	nc, err := nats.Connect(s.URL(), opts...)
	if err != nil {
		t.Fatalf("natstest: connect: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// StartJetStream starts a server and returns a JetStream client on the
// relay's recommended connection: no reconnect buffer, so that it keeps
// many messages in flight.
func StartJetStream(t testing.TB) (*Server, jetstream.JetStream) {
	t.Helper()
	srv := Start(t)
	js, err := jetstream.New(srv.Connect(t, nats.ReconnectBufSize(-1)))
	if err != nil {
		t.Fatalf("natstest: jetstream: %v", err)
	}
	return srv, js
}
