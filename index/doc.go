// Package index is the router's prefix index: chained router block hashes,
// and shard goroutines that each own a tree of the blocks their pinned workers
// hold and answer FindMatches with per-worker overlap scores.
package index
