package index

import "strconv"

// Tier is the storage medium an engine keeps a block in, fastest first: an
// Op stores or removes a block in one tier, and a Score counts the leading
// blocks a worker holds in each tier or a faster one.
type Tier uint8

const (
	TierDevice Tier = iota // accelerator memory (vLLM medium "GPU"); Op's zero value
	TierHost               // host memory (CPU offload)
	TierDisk               // local disk or NVMe
	TierRemote             // a remote or shared pool

	// NumTiers is the number of tiers; Tier values from it on are invalid:
	// the index ignores ops that carry them.
	NumTiers = 4
)

var tierNames = [NumTiers]string{"device", "host", "disk", "remote"}

func (t Tier) String() string {
	if t < NumTiers {
		return tierNames[t]
	}
	return "tier(" + strconv.Itoa(int(t)) + ")"
}

// Weights is what one block is worth to a request per tier it has to be
// read from, for Score.Weighted.
type Weights [NumTiers]float64

// DefaultWeights: a device block counts 1, a host block 0.8 (llm-d's
// precise prefix scorer weighs its cpu tier so), a disk block 0.5 and a
// remote one 0.3, because they must be loaded into device memory before the
// prefill can use them, disk and network being slower than a host copy.
var DefaultWeights = Weights{1, 0.8, 0.5, 0.3}

// Weighted is the score with each leading block charged at the weight of
// the slowest tier its worker needed to reach it: the sum over tiers t of
// w[t] * (Tiers[t] - Tiers[t-1]), with Tiers[-1] = 0. A zero weight turns a
// tier off: the blocks it extends the prefix by count nothing (a faster tier
// holding them still counts them at its weight).
func (s Score) Weighted(w Weights) float64 {
	var sum float64
	prev := 0
	for t, n := range s.Tiers {
		sum += w[t] * float64(n-prev)
		prev = n
	}
	return sum
}
