package kvpipe

import (
	"context"
	"testing"

	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/seam"
	"github.com/prometheus/client_golang/prometheus"
)

// RegisterMetrics registers a collector over p on reg. It is set by the
// external test package (metrics imports this one, so these tests cannot).
var RegisterMetrics func(reg prometheus.Registerer, p *Pipeline) error

// withMetrics registers p's collector on a fresh registry and returns it.
func withMetrics(t testing.TB, p *Pipeline) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := RegisterMetrics(reg, p); err != nil {
		t.Fatal(err)
	}
	return reg
}

// tapFuncs is a Tap of functions, as the tests write them.
type tapFuncs struct {
	bind  func(republish seam.Republish)
	ops   func(ctx context.Context, worker string, ops []index.Op, o seam.Origin) uint64
	flush func(ctx context.Context, worker string) (uint64, error)
}

func (t tapFuncs) Bind(republish seam.Republish) {
	if t.bind != nil {
		t.bind(republish)
	}
}

func (t tapFuncs) Ops(ctx context.Context, worker string, ops []index.Op, o seam.Origin) uint64 {
	return t.ops(ctx, worker, ops, o)
}

func (t tapFuncs) Flush(ctx context.Context, worker string) (uint64, error) {
	if t.flush == nil {
		return 0, nil
	}
	return t.flush(ctx, worker)
}
