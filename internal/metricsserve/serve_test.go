package metricsserve

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// freeAddr is a loopback address nothing listens on (it was free a moment ago).
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// The registry's metrics, the collectors given included, are served at
// /metrics until stop, which leaves no goroutine behind (TestMain).
func TestServeServesTheRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	own := prometheus.NewCounter(prometheus.CounterOpts{Name: "test_own_total", Help: "Registered by the caller."})
	reg.MustRegister(own)
	given := prometheus.NewCounter(prometheus.CounterOpts{Name: "test_given_total", Help: "Registered by Serve."})
	given.Add(3)
	addr := freeAddr(t)
	stop, err := Serve(addr, reg, given)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"test_own_total 0", "test_given_total 3"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %q:\n%s", want, body)
		}
	}
}

// A collector that cannot be registered is an error, and nothing listens.
func TestServeRefusesACollectorTwice(t *testing.T) {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "test_twice_total", Help: "Registered twice."})
	addr := freeAddr(t)
	if stop, err := Serve(addr, prometheus.NewRegistry(), c, c); err == nil {
		stop()
		t.Fatal("the same collector twice: no error")
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("the address is taken after a refused Serve: %v", err)
	}
	l.Close()
}
