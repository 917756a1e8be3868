// Package wire is kvpipe's transport: a ZMQ SUB per engine that checks the
// [topic, seq, payload] frames, orders batches by seq, recovers gaps through the
// engine's ROUTER replay socket, and reconnects. internal/wiretest holds an engine-identical
// Publisher for tests and simulations.
//
// Continuity is proven, never assumed: every replay request starts at the
// last seq applied, and the engine's copy of that batch must carry the same
// fingerprint (engines stamp each batch with a timestamp). Otherwise the
// publisher is another incarnation: the handler is reset and the new one is
// replayed from its first batch. A replay runs at every (re)connect.
package wire
