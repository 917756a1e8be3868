package wire

import "github.com/zeebo/xxh3"

// seqOutcome is what one sequence number means against the last one applied.
type seqOutcome uint8

const (
	seqFirst     seqOutcome = iota // no history yet: the stream starts here
	seqInOrder                     // last+1
	seqDuplicate                   // already applied: drop
	seqGap                         // seq > last+1: batches were lost
	seqRestart                     // seq went backwards: the publisher restarted, or the seq is garbage
)

func (o seqOutcome) String() string {
	return [...]string{"first", "in_order", "duplicate", "gap", "restart"}[o]
}

// seqTracker classifies the sequence numbers of one worker's stream and keeps
// the fingerprint of the last batch applied, by which a replay proves that the
// publisher is still the same incarnation. It is owned by that worker's goroutine.
type seqTracker struct {
	last    uint64
	fp      uint64 // xxh3 of the last applied payload
	fpKnown bool   // false after anchor: the stream is placed at a seq whose batch it never saw
	started bool
	// dupFloor is the lowest seq still taken as a duplicate rather than a
	// restart. It is last itself, except after a replay from S: live batches
	// from S on may then arrive again, until the live stream passes the replay.
	dupFloor uint64
}

// Fingerprint is what identifies a batch across a replay. Engines stamp every
// batch with a float timestamp, so a restarted engine's batch at the same seq
// has another fingerprint even when its events are the same.
func fingerprint(payload []byte) uint64 { return xxh3.Hash(payload) }

// classify reports what seq means without applying it.
func (t *seqTracker) classify(seq uint64) seqOutcome {
	switch {
	case !t.started:
		return seqFirst
	case seq == t.last+1:
		return seqInOrder
	case seq > t.last:
		return seqGap
	case seq >= t.dupFloor:
		return seqDuplicate
	}
	return seqRestart
}

// apply records the batch seq, received live, as the last applied.
func (t *seqTracker) apply(seq uint64, payload []byte) {
	t.last, t.fp, t.fpKnown, t.dupFloor, t.started = seq, fingerprint(payload), true, seq, true
}

// anchor places the stream at seq without its batch, as after a snapshot
// taken at that seq; live batches from floor on are duplicates. Until the
// batch itself is seen (learn), the next replay takes the engine's copy on trust.
func (t *seqTracker) anchor(seq, floor uint64) {
	*t = seqTracker{last: seq, dupFloor: min(floor, seq), started: true}
}

// learn takes payload as the batch at the last seq, when it was not seen.
func (t *seqTracker) learn(payload []byte) {
	if !t.fpKnown {
		t.fp, t.fpKnown = fingerprint(payload), true
	}
}

// proves reports whether payload, the engine's batch at the last seq, is the
// one applied.
func (t *seqTracker) proves(payload []byte) bool {
	return !t.fpKnown || fingerprint(payload) == t.fp
}

// applyReplayed records the batch seq, received through a replay that may
// make live batches from floor on arrive again.
func (t *seqTracker) applyReplayed(seq uint64, payload []byte, floor uint64) {
	if !t.started || floor < t.dupFloor {
		t.dupFloor = floor
	}
	t.last, t.fp, t.fpKnown, t.started = seq, fingerprint(payload), true, true
}

// latest returns the last applied seq and whether there is one.
func (t *seqTracker) latest() (uint64, bool) { return t.last, t.started }

// next is the seq that continues the stream: last+1, or 0 without history.
func (t *seqTracker) next() uint64 {
	if !t.started {
		return 0
	}
	return t.last + 1
}

// reset forgets the history: the next seq starts a new stream.
func (t *seqTracker) reset() { *t = seqTracker{} }
