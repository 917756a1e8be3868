package wire

import (
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
)

// The engine snapshot conversation, without sockets: each reply's meaning,
// table by table.
func TestSnapshotTalk(t *testing.T) {
	header := func(epoch string, barrier uint64, records int) []byte {
		return engineenc.AppendEngineSnapshotHeader(nil, &codec.EngineSnapshotHeader{Version: 1, Epoch: epoch, BarrierSeq: barrier, RecordCount: records})
	}
	chunk := func(n int) []byte {
		blocks := make([]codec.EngineSnapshotBlock, n)
		for i := range blocks {
			blocks[i] = codec.EngineSnapshotBlock{Parent: uint64(i), HasParent: i > 0, Hashes: []uint64{uint64(i + 1)}}
		}
		return engineenc.AppendEngineSnapshotChunk(nil, blocks)
	}
	type reply struct {
		kind    string
		payload []byte
		want    snapshotStep
		err     string // in the error, when want is snapFail
	}
	for _, tc := range []struct {
		name    string
		epoch   string
		replies []reply
	}{
		{"whole", "e1", []reply{{"header", header("e1", 9, 3), snapBegin, ""}, {"chunk", chunk(2), snapChunk, ""},
			{"chunk", chunk(1), snapChunk, ""}, {"end", nil, snapEnd, ""}}},
		{"no epoch known", "", []reply{{"header", header("e7", 9, 0), snapBegin, ""}, {"end", nil, snapEnd, ""}}},
		{"another incarnation", "e1", []reply{{"header", header("e2", 9, 0), snapFail, "another publisher incarnation"}}},
		{"implausible barrier", "", []reply{{"header", header("", 1<<63, 0), snapFail, "implausible"}}},
		{"corrupt header", "", []reply{{"header", []byte{0xc1}, snapFail, ""}}},
		{"chunk first", "", []reply{{"chunk", chunk(1), snapFail, "unexpected chunk"}}},
		{"more records than announced", "", []reply{{"header", header("", 9, 1), snapBegin, ""}, {"chunk", chunk(2), snapFail, "more records"}}},
		{"a chunk lost", "", []reply{{"header", header("", 9, 3), snapBegin, ""}, {"chunk", chunk(2), snapChunk, ""}, {"end", nil, snapFail, "fewer records"}}},
		{"engine error", "", []reply{{"header", header("", 9, 3), snapBegin, ""}, {"error", []byte("busy"), snapFail, "busy"}}},
		{"second header", "", []reply{{"header", header("", 9, 0), snapBegin, ""}, {"header", header("", 9, 0), snapFail, "unexpected header"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			talk := &snapshotTalk{epoch: []byte(tc.epoch)}
			for i, r := range tc.replies {
				got, err := talk.reply(r.kind, r.payload)
				if got != r.want || (got == snapFail) != (err != nil) || err != nil && !strings.Contains(err.Error(), r.err) {
					t.Fatalf("reply %d (%s): %v, %v; want %v, %q", i, r.kind, got, err, r.want, r.err)
				}
			}
		})
	}
}
