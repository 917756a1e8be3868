// Package metrics exposes a pipeline's counters to Prometheus: a collector
// that reads every worker's and shard's atomics at scrape time (nothing is
// counted twice on the hot path), registered on a registry the caller injects.
package metrics
