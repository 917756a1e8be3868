// Package serve is kvpipe serve: a Pipeline's index as a service, over gRPC,
// gRPC-Web and Connect (package kvpipev1, from proto/kvpipe/v1) and HTTP/JSON,
// with metrics, health checks, a status page, and its state saved across restarts.
package serve

//go:generate ../../scripts/protogen.sh
