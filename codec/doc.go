// Package codec decodes the msgpack payload of one engine KV-event batch
// (vLLM, SGLang; every layout in docs/FORMAT.md §7-§8) into a reusable Batch
// with no allocations in steady state, and SGLang's snapshot replies. The
// encoder of the same layouts, for simulated engines and tests, is
// internal/engineenc.
package codec
