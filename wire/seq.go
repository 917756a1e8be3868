package wire

// Outcome is what one sequence number means against the last one applied.
type Outcome uint8

const (
	First     Outcome = iota // no history yet: the stream starts here
	InOrder                  // last+1
	Duplicate                // already applied: drop
	Gap                      // seq > last+1: batches were lost
	Restart                  // seq went backwards: the publisher restarted
)

func (o Outcome) String() string {
	return [...]string{"first", "in_order", "duplicate", "gap", "restart"}[o]
}

// SeqTracker classifies the sequence numbers of one worker's stream. It is
// owned by that worker's goroutine.
type SeqTracker struct {
	last    uint64
	started bool
	// dupFloor is the lowest seq still taken as a duplicate rather than a
	// restart. It is last itself, except after a replay from S: live batches
	// from S on may then arrive again, until the live stream passes the replay.
	dupFloor uint64
}

// Classify reports what seq means without applying it.
func (t *SeqTracker) Classify(seq uint64) Outcome {
	switch {
	case !t.started:
		return First
	case seq == t.last+1:
		return InOrder
	case seq > t.last:
		return Gap
	case seq >= t.dupFloor:
		return Duplicate
	}
	return Restart
}

// Apply records seq, received live, as the last applied batch.
func (t *SeqTracker) Apply(seq uint64) {
	t.last, t.dupFloor, t.started = seq, seq, true
}

// applyReplayed records seq, received through a replay from start.
func (t *SeqTracker) applyReplayed(seq, start uint64) {
	if !t.started || start < t.dupFloor {
		t.dupFloor = start
	}
	t.last, t.started = seq, true
}

// Last returns the last applied seq and whether there is one.
func (t *SeqTracker) Last() (uint64, bool) { return t.last, t.started }

// Reset forgets the history: the next seq starts a new stream.
func (t *SeqTracker) Reset() { *t = SeqTracker{} }
