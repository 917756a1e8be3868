package codec_test

import (
	"testing"

	gocmp "github.com/google/go-cmp/cmp"
	. "github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
)

// The decoder reads each array slot where the encoder writes it: the two
// keep one slot table each, and engineenc's slots_test.go checks the
// encoder's against docs/FORMAT.md §8.2.
func TestSlotTablesAgree(t *testing.T) {
	for _, typ := range []EventType{BlockStored, BlockRemoved, AllBlocksCleared, EventUnknown} {
		if diff := gocmp.Diff(engineenc.SlotNames(typ), SlotNames(typ)); diff != "" {
			t.Errorf("%s slots (-encoder +decoder):\n%s", typ, diff)
		}
	}
	if len(SlotNames(BlockStored)) == 0 {
		t.Error("no BlockStored slots: the comparison above compared nothing")
	}
}
