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
		main := codec.IsMainAttention(e.SpecKind)
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
	t := codec.MediumTier(medium)
	if t == codec.TierUnknown {
		return UnknownMedium, false
	}
	if g.weights[tierOf(medium)] == 0 {
		return LowerTier, false
	}
	return 0, true
}

// tierOf maps a medium that mediumOK passed to its index tier.
func tierOf(medium string) index.Tier {
	switch codec.MediumTier(medium) {
	case codec.TierHost:
		return index.TierHost
	case codec.TierDisk:
		return index.TierDisk
	case codec.TierRemote:
		return index.TierRemote
	}
	return index.TierDevice
}
