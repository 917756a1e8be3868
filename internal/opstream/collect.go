package opstream

import "github.com/prometheus/client_golang/prometheus"

// Metric is one value of a relay's, a follower's or a lease's stats S, as
// kvpipe_relay_<name>.
type Metric[S any] struct {
	desc  *prometheus.Desc
	typ   prometheus.ValueType
	value func(*S) float64
}

// Counter is the counter name of S's value.
func Counter[S any](name, help string, value func(*S) uint64) Metric[S] {
	return Metric[S]{prometheus.NewDesc("kvpipe_relay_"+name, help, nil, nil), prometheus.CounterValue,
		func(s *S) float64 { return float64(value(s)) }}
}

// Gauge is the gauge name of S's value.
func Gauge[S any](name, help string, value func(*S) float64) Metric[S] {
	return Metric[S]{prometheus.NewDesc("kvpipe_relay_"+name, help, nil, nil), prometheus.GaugeValue, value}
}

// Collector reads Stats at every scrape and emits Metrics.
type Collector[S any] struct {
	Stats   func() S
	Metrics []Metric[S]
}

// Describe sends every metric's description.
func (c *Collector[S]) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range c.Metrics {
		ch <- m.desc
	}
}

// Collect reads the stats once and sends every metric of them.
func (c *Collector[S]) Collect(ch chan<- prometheus.Metric) {
	s := c.Stats()
	for _, m := range c.Metrics {
		ch <- prometheus.MustNewConstMetric(m.desc, m.typ, m.value(&s))
	}
}
