// Package metricsserve serves a Prometheus registry at /metrics, for the
// kvpipe command (listen, relay) and the replay example.
package metricsserve

import (
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Serve registers cs on reg and serves reg on addr at /metrics until stop
// is called; stop waits for the server's goroutine. Nothing is served
// when a collector cannot be registered.
func Serve(addr string, reg *prometheus.Registry, cs ...prometheus.Collector) (stop func(), err error) {
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	// A client that never finishes its headers cannot hold a connection.
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() { srv.Serve(l); close(done) }()
	return func() { srv.Close(); <-done }, nil
}
