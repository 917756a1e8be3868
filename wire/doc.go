// Package wire is kvpipe's transport: a ZMQ SUB per engine that checks the
// [topic, seq, payload] frames, orders batches by seq, recovers gaps through the
// engine's ROUTER replay socket, and reconnects; plus an engine-identical Publisher.
package wire
