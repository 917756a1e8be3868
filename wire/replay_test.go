package wire

import (
	"testing"

	"github.com/go-zeromq/zmq4"
)

// ev is one input to a replayState: a reply, an end marker, a timeout, or a
// new request; want is the verdict it must give.
type ev struct {
	kind    byte // 'r' reply, 'e' end marker, 't' timeout, 'a' ask (want: the seq asked from), 'R' restarted
	seq     uint64
	payload string
	want    verdict
	lost    uint64 // for vMissing
	reset   bool   // for vMissing
}

func reply(seq uint64, payload string, want verdict) ev {
	return ev{kind: 'r', seq: seq, payload: payload, want: want}
}
func endMark(want verdict) ev { return ev{kind: 'e', want: want} }
func askFrom(seq uint64) ev   { return ev{kind: 'a', seq: seq} }
func recheckFrom(seq uint64) ev {
	return ev{kind: 'a', seq: seq, payload: "recheck"}
}
func missingReply(seq uint64, lost uint64, reset bool) ev {
	return ev{kind: 'r', seq: seq, payload: "p", want: vMissing, lost: lost, reset: reset}
}

func TestReplayState(t *testing.T) {
	const p10 = "batch 10"
	cases := []struct {
		name    string
		history bool   // seq 10 applied with payload p10
		upto    uint64 // probe when 0
		steps   []ev
		last    uint64 // the tracker's last seq at the end (when started)
		started bool
		cont    bool // the history came over the live connection still up
	}{
		{"gap filled after the proof", true, 14, []ev{askFrom(10), reply(10, p10, vSkip),
			reply(11, "a", vDeliver), reply(12, "b", vDeliver), reply(13, "c", vDeliver), reply(14, "d", vDeliver),
			reply(15, "e", vDeliver), endMark(vDone)}, 15, true, false},
		{"tail check with nothing new", true, 0, []ev{askFrom(10), reply(10, p10, vSkip), endMark(vDone)}, 10, true, false},
		{"restart: same seq, other payload", true, 0, []ev{askFrom(10), reply(10, "another process", vRestart),
			{kind: 'R'}, askFrom(0), reply(0, "x", vDeliver), reply(1, "y", vDeliver), endMark(vDone)}, 1, true, false},
		{"restart: the buffer starts past our last after a reconnect", true, 0, []ev{askFrom(10), reply(40, "z", vRestart),
			{kind: 'R'}, askFrom(0), reply(0, "x", vDeliver), endMark(vDone)}, 0, true, false},
		{"same connection: the buffer moved past our last", true, 0, []ev{askFrom(10), missingReply(40, 29, true),
			reply(41, "z", vDeliver), endMark(vDone)}, 41, true, true},
		{"same connection: the same seq with another payload is still a restart", true, 0, []ev{askFrom(10),
			reply(10, "other", vRestart)}, 10, true, true},
		{"restart that went quiet: only the end marker", true, 0, []ev{askFrom(10), endMark(vRestart),
			{kind: 'R'}, askFrom(0), reply(0, "x", vDeliver), reply(1, "y", vDeliver), endMark(vDone)}, 1, true, false},
		{"restarted engine's buffer wrapped: its first batches are lost", true, 0, []ev{askFrom(10), endMark(vRestart),
			{kind: 'R'}, askFrom(0), missingReply(7, 7, false), reply(8, "y", vDeliver), endMark(vDone)}, 8, true, false},
		{"stale reply below the proof is skipped", true, 0, []ev{askFrom(10), reply(9, "old", vSkip),
			reply(10, p10, vSkip), reply(11, "a", vDeliver), endMark(vDone)}, 11, true, false},
		{"duplicate reply", true, 0, []ev{askFrom(10), reply(10, p10, vSkip), reply(11, "a", vDeliver),
			reply(11, "a", vDup), endMark(vDone)}, 11, true, false},
		{"hole in the middle is asked again and filled", true, 14, []ev{askFrom(10), reply(10, p10, vSkip),
			reply(11, "a", vDeliver), reply(13, "c", vAsk), recheckFrom(11), reply(11, "a", vSkip),
			reply(12, "b", vDeliver), reply(13, "c", vDeliver), endMark(vDone)}, 13, true, false},
		{"hole right after the proof, then filled", true, 14, []ev{askFrom(10), reply(10, p10, vSkip),
			reply(12, "b", vAsk), recheckFrom(10), reply(10, p10, vSkip), reply(11, "a", vDeliver),
			reply(12, "b", vDeliver), reply(13, "c", vDeliver), endMark(vDone)}, 13, true, false},
		{"a hole that stays is missing history", true, 14, []ev{askFrom(10), reply(10, p10, vSkip),
			reply(11, "a", vDeliver), reply(13, "c", vAsk), recheckFrom(11), reply(11, "a", vSkip),
			missingReply(13, 1, true), reply(14, "d", vDeliver), endMark(vDone)}, 14, true, false},
		{"tail dropped: asked again", true, 14, []ev{askFrom(10), reply(10, p10, vSkip), reply(11, "a", vDeliver),
			endMark(vAsk), recheckFrom(11), reply(11, "a", vSkip), reply(12, "b", vDeliver), reply(13, "c", vDeliver),
			endMark(vDone)}, 13, true, false},
		{"the engine lacks the gap: asked again, then missing", true, 14, []ev{askFrom(10), reply(10, p10, vSkip),
			endMark(vAsk), recheckFrom(10), reply(10, p10, vSkip), {kind: 'e', want: vMissing, lost: 3, reset: true}}, 0, false, false},
		{"first connect: buffer starts late, nothing lost", false, 0, []ev{askFrom(0), missingReply(500, 0, false),
			reply(501, "a", vDeliver), endMark(vDone)}, 501, true, false},
		{"first connect: buffer from 0", false, 0, []ev{askFrom(0), reply(0, "a", vDeliver), endMark(vDone)}, 0, true, false},
		{"first connect: empty buffer", false, 0, []ev{askFrom(0), endMark(vDone)}, 0, false, false},
		{"no history, a live seq past an empty buffer: nothing of ours is lost", false, 10, []ev{askFrom(0), endMark(vAsk),
			recheckFrom(0), {kind: 'e', want: vMissing}}, 0, false, false},
		{"no history, the PUB missed the first batches: replayed from 0", false, 3, []ev{askFrom(0), reply(0, "a", vDeliver),
			reply(1, "b", vDeliver), reply(2, "c", vDeliver), endMark(vDone)}, 2, true, false},
		{"timeout after progress asks again", true, 14, []ev{askFrom(10), reply(10, p10, vSkip),
			reply(11, "a", vDeliver), {kind: 't', want: vAsk}, recheckFrom(11), reply(11, "a", vSkip),
			reply(12, "b", vDeliver), reply(13, "c", vDeliver), endMark(vDone)}, 13, true, false},
		{"timeout without progress fails", true, 14, []ev{askFrom(10), {kind: 't', want: vFail}}, 10, true, false},
		{"timeout during the proof fails", true, 14, []ev{askFrom(10), reply(10, p10, vSkip), {kind: 't', want: vFail}}, 10, true, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var tr seqTracker
			if tc.history {
				tr.apply(9, []byte("batch 9"))
				tr.apply(10, []byte(p10))
			}
			upto := tc.upto
			if upto == 0 {
				upto = probe
			}
			var r replayState
			r.begin(&tr, upto, tc.cont)
			for i, e := range tc.steps {
				var st step
				switch e.kind {
				case 'a':
					if got := r.ask(e.payload == "recheck"); got != e.seq {
						t.Fatalf("step %d: asked from %d, want %d", i, got, e.seq)
					}
					continue
				case 'R':
					r.restarted()
					continue
				case 'r':
					st = r.reply(e.seq, []byte(e.payload))
				case 'e':
					st = r.end()
				case 't':
					st = r.timeout()
				}
				if st.v != e.want || st.lost != e.lost || st.reset != e.reset {
					t.Fatalf("step %d (%c %d): got %+v, want verdict %d lost %d reset %v", i, e.kind, e.seq, st, e.want, e.lost, e.reset)
				}
			}
			if last, ok := tr.latest(); ok != tc.started || (ok && last != tc.last) {
				t.Fatalf("tracker ends at %d (started %v), want %d (%v)", last, ok, tc.last, tc.started)
			}
		})
	}
}

// After a replay, live batches it already delivered are duplicates, not a
// restart: the floor is where the replay began.
func TestReplayStateSetsTheDuplicateFloor(t *testing.T) {
	var tr seqTracker
	tr.apply(10, []byte("p"))
	var r replayState
	r.begin(&tr, probe, true)
	r.ask(false)
	r.reply(10, []byte("p"))
	for seq := uint64(11); seq <= 20; seq++ {
		if st := r.reply(seq, nil); st.v != vDeliver {
			t.Fatalf("seq %d: %+v", seq, st)
		}
	}
	for _, seq := range []uint64{11, 20} {
		if got := tr.classify(seq); got != seqDuplicate {
			t.Errorf("live %d after the replay: %v, want duplicate", seq, got)
		}
	}
	if got := tr.classify(21); got != seqInOrder {
		t.Errorf("live 21: %v, want in order", got)
	}
}

func TestParseReply(t *testing.T) {
	seq := []byte{0, 0, 0, 0, 0, 0, 0, 7}
	cases := []struct {
		name   string
		frames [][]byte
		ok     bool
	}{
		{"sglang and vllm before 0.26", [][]byte{nil, seq, []byte("x")}, true},
		{"vllm 0.26 with topic", [][]byte{nil, []byte("kv"), seq, []byte("x")}, true},
		{"end marker", [][]byte{nil, {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, nil}, true},
		{"missing envelope", [][]byte{[]byte("id"), seq, []byte("x")}, false},
		{"two frames", [][]byte{nil, seq}, false},
		{"five frames", [][]byte{nil, nil, nil, seq, []byte("x")}, false},
		{"short seq", [][]byte{nil, seq[:4], []byte("x")}, false},
	}
	for _, tc := range cases {
		s, p, ok := parseReply(zmq4.NewMsgFrom(tc.frames...))
		if ok != tc.ok {
			t.Errorf("%s: ok %v, want %v", tc.name, ok, tc.ok)
			continue
		}
		if ok && tc.name != "end marker" && (s != 7 || string(p) != "x") {
			t.Errorf("%s: seq %d payload %q", tc.name, s, p)
		}
		if ok && tc.name == "end marker" && s != endMarker {
			t.Errorf("end marker parsed as %d", s)
		}
	}
}

// After a snapshot the stream is anchored at the barrier without its batch:
// the next replay takes the engine's copy of it on trust, and proves with
// it from then on.
func TestReplayStateAfterAnAnchor(t *testing.T) {
	var tr seqTracker
	tr.anchor(40, 40)
	var r replayState
	r.begin(&tr, 42, true)
	if from := r.ask(false); from != 40 {
		t.Fatalf("asked from %d, want the barrier 40", from)
	}
	for _, step := range []struct {
		seq  uint64
		want verdict
	}{{40, vSkip}, {41, vDeliver}, {42, vDeliver}} {
		if st := r.reply(step.seq, []byte{byte(step.seq)}); st.v != step.want {
			t.Fatalf("reply %d: %+v, want %d", step.seq, st, step.want)
		}
	}
	if st := r.end(); st.v != vDone {
		t.Fatalf("end: %+v", st)
	}
	r.begin(&tr, probe, true)
	r.ask(false)
	if st := r.reply(42, []byte("not what was applied")); st.v != vRestart {
		t.Errorf("a known fingerprint that differs: %+v, want a restart", st)
	}
}

// What a failed replay loses: only the part of the known gap it did not
// fill, and nothing once the answer comes from a new incarnation.
func TestReplayStateUnfilled(t *testing.T) {
	var tr seqTracker
	tr.apply(10, []byte("p"))
	var r replayState
	r.begin(&tr, 13, true)
	r.ask(false)
	r.reply(10, []byte("p"))
	if got := r.unfilled(); got != 2 {
		t.Errorf("before any delivery: unfilled %d, want 2 (11 and 12)", got)
	}
	for seq := uint64(11); seq <= 15; seq++ { // replay goes past the gap
		r.reply(seq, nil)
	}
	if got := r.unfilled(); got != 0 {
		t.Errorf("after the replay passed the gap: unfilled %d, want 0", got)
	}
	r.begin(&tr, 20, true)
	r.ask(false)
	if st := r.reply(15, []byte("another process")); st.v != vRestart {
		t.Fatalf("%+v, want a restart", st)
	}
	r.restarted()
	if got := r.unfilled(); got != 0 || !r.proven {
		t.Errorf("after a restart: unfilled %d, proven %v; want 0 and true", got, r.proven)
	}
}
