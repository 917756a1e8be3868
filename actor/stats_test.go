package actor

import (
	"testing"

	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/statstest"
)

func TestStatsSnapshotCopiesEveryCounter(t *testing.T) {
	var c counters
	statstest.CheckLoad(t, &c, c.load, "IndexedBlocks")
	if st := c.load(); st.IndexedBlocks != st.TierBlocks[index.TierDevice] {
		t.Errorf("IndexedBlocks %d, device blocks %d", st.IndexedBlocks, st.TierBlocks[index.TierDevice])
	}
	statstest.CheckAdd(t, (*Stats).Add, "Partial")
	var a, b Stats
	b.Partial = true
	if a.Add(b); !a.Partial {
		t.Error("Add of a partial worker is not partial")
	}
}
