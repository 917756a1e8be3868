// Package codec decodes the msgpack payload of one engine KV-event batch
// (vLLM, SGLang; every layout in SPEC section 2) into a reusable Batch with no
// allocations in steady state, and encodes batches in the same format for tests.
package codec
