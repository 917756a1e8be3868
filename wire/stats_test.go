package wire

import (
	"testing"

	"github.com/kvpipe/kvpipe/internal/statstest"
)

func TestStatsSnapshotCopiesEveryCounter(t *testing.T) {
	var c counters
	statstest.CheckLoad(t, &c, c.load)
	statstest.CheckAdd(t, (*Stats).Add, "Connected")
}
