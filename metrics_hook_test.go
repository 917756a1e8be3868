package kvpipe_test

import (
	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/metrics"
	"github.com/prometheus/client_golang/prometheus"
)

func init() {
	kvpipe.RegisterMetrics = func(reg prometheus.Registerer, p *kvpipe.Pipeline) error {
		return reg.Register(metrics.NewCollector(p.Stats))
	}
}
