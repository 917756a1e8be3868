package actor

import (
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
)

// groups applies the group and medium rules (docs/FORMAT.md §9.2 and
// §9.3), learning each attention group's kind from events that carry both.
type groups struct {
	main    map[int]bool // what each group_idx was learned to be
	weights *index.Weights
}

// filter says whether e passes, and why not.
func (g *groups) filter(e *codec.Event) (Reason, bool) {
	if e.SpecKind != "" {
		main := isMainAttention(e.SpecKind)
		if e.HasGroupIdx && e.Type == codec.BlockStored {
			g.main[e.GroupIdx] = main
		}
		if !main {
			return NonMainAttention, false
		}
	} else if e.HasGroupIdx {
		main, learned := g.main[e.GroupIdx]
		switch {
		case learned && !main:
			return NonMainAttention, false
		case !learned && e.GroupIdx != 0:
			return UnlearnedGroup, false
		}
	}
	return g.mediumOK(e.Medium)
}

func (g *groups) mediumOK(medium string) (Reason, bool) {
	t, ok := mediumTier(medium)
	if !ok {
		return UnknownMedium, false
	}
	if g.weights[t] == 0 {
		return LowerTier, false
	}
	return 0, true
}

// tierOf maps a medium that mediumOK passed to its index tier.
func tierOf(medium string) index.Tier {
	t, _ := mediumTier(medium)
	return t
}

// media is every medium the engines are known to publish, with its tier
// (docs/FORMAT.md §8.5). vLLM: "GPU" (and nil before mediums existed),
// "CPU" from its offloading connector, storage tiers from offload
// backends. SGLang: "GPU", "CPU_PINNED" (host cache), "DISK" and
// "EXTERNAL" (a shared / remote pool, e.g. Mooncake store or 3FS).
var media = [...]struct {
	name string
	tier index.Tier
}{
	{"", index.TierDevice}, // no medium field, or nil: older engines publish device blocks only
	{"GPU", index.TierDevice},
	{"CPU", index.TierHost},
	{"CPU_PINNED", index.TierHost},
	{"DISK", index.TierDisk},
	{"NVME", index.TierDisk},
	{"STORAGE", index.TierDisk},
	{"EXTERNAL", index.TierRemote},
	{"REMOTE", index.TierRemote},
}

// mediumTier maps a medium string to its tier; ok is false for a medium
// kvpipe does not know.
func mediumTier(medium string) (t index.Tier, ok bool) {
	for _, m := range media {
		if m.name == medium {
			return m.tier, true
		}
	}
	return index.TierDevice, false
}

// isMainAttention reports whether a kv_cache_spec_kind names a main-attention
// group, the only kind a prefix index may hold. An empty kind is not main:
// the caller decides what an absent kind means.
func isMainAttention(kind string) bool {
	switch kind {
	case "full_attention", "mla_attention", "sink_full_attention":
		return true
	}
	return false
}
