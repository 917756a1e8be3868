// Package index is the router's prefix index: chained router block hashes,
// and shard goroutines that each apply their pinned workers' batches to a
// flat table of the blocks those workers hold (block key -> worker bitset),
// one table per storage tier (device, host, disk, remote; a lower tier's
// is made on its first store, so an index without offload has the device's
// alone). FindMatches reads the tables on the caller's goroutine, without
// waiting for the shards, and returns per-worker overlap scores: the
// leading blocks held on device (Blocks) and, per tier, those held in that
// tier or a faster one (Tiers), which Score.Weighted folds into one
// number. An answer may mix states from before and after a batch being
// applied meanwhile; after Sync it is exact (Shards says precisely what
// holds). The tests keep the same index as a plain single-goroutine
// prefix tree (tree_test.go), the reference the tables are checked against.
package index
