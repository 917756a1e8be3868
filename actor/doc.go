// Package actor holds the per-worker step between wire and index: one actor
// per worker, run in that worker's goroutine, decodes batches, filters what a
// prefix index must not hold (each drop counted by reason) and hashes blocks.
package actor
