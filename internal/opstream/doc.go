// Package opstream is what a relay and its followers share on NATS: the
// stream's settings and worker subjects, the message that carries one
// batch of a worker's ops, the snapshot object with its metadata, and the
// helpers their Prometheus collectors are built with.
package opstream
