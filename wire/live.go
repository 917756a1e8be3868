package wire

import (
	"encoding/binary"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/internal/pace"
)

type frame struct {
	seq     uint64
	payload []byte
	epoch   []byte // from the topic frame; nil when the engine sends none
}

// liveQueue holds the live batches that wait for the handler: those a
// replay or a snapshot holds back, up to max.
type liveQueue struct {
	frames []frame
	max    int
	stats  *counters
	warn   *pace.Warner
}

// parse checks a live message's [topic, seq, payload] shape.
func (q *liveQueue) parse(m zmq4.Msg) (frame, bool) {
	if len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
		q.stats.Malformed.Add(1)
		q.warn.Warn("malformed message skipped", "frames", len(m.Frames), "seq_bytes", seqWidth(m))
		return frame{}, false
	}
	_, epoch, _ := splitTopic(m.Frames[0])
	return frame{seq: binary.BigEndian.Uint64(m.Frames[1]), payload: m.Frames[2], epoch: epoch}, true
}

func seqWidth(m zmq4.Msg) int {
	if len(m.Frames) < 2 {
		return 0
	}
	return len(m.Frames[1])
}

// hold keeps a live message that arrived during a replay for drain.
func (q *liveQueue) hold(m zmq4.Msg) {
	f, ok := q.parse(m)
	if !ok {
		return
	}
	if len(q.frames) >= q.max {
		q.stats.LiveOverflow.Add(1)
		return
	}
	q.frames = append(q.frames, f)
}

// drop throws the held batches away.
func (q *liveQueue) drop() {
	clear(q.frames) // drop payload references
	q.frames = q.frames[:0]
}

// from keeps the batches from i on, first.
func (q *liveQueue) from(i int) {
	n := copy(q.frames, q.frames[i:])
	clear(q.frames[n:])
	q.frames = q.frames[:n]
}
