package index

// WorkerID names a worker inside the index.
type WorkerID uint32

// Score is how many leading blocks of a request one worker holds.
type Score struct {
	Worker WorkerID
	// Blocks is how many leading blocks the worker holds on device:
	// Tiers[TierDevice].
	Blocks int
	// Tiers[t] is how many leading blocks the worker holds each in tier t
	// or a faster one, so it never decreases with t, and Tiers[NumTiers-1]
	// is how far the worker's prefix reaches in any tier. A worker holding
	// the first block only in a lower tier scores Blocks 0.
	Tiers [NumTiers]int
	// Predicted, for a worker with predictions (Shards.Predict), is how
	// many leading blocks it holds on device or is predicted to: its Blocks
	// and the keys predicted in a row after them. 0 for the others.
	Predicted int
}
