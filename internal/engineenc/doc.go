// Package engineenc encodes what inference engines send, as each engine
// version does: KV event batches (vLLM's and SGLang's layouts, extra keys
// in each form) and SGLang's snapshot replies. The simulated engines, the
// tests and the benchmarks publish with it; package codec decodes.
package engineenc
