// Package bench holds kvpipe's end-to-end benchmarks: the Mooncake trace,
// pre-encoded as engine frames, pushed through the whole pipeline (in process
// and over loopback ZMQ) while FindMatches is asked at the same time.
package bench
