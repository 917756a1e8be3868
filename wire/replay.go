package wire

// replayState is the logic of one replay, without sockets: what each reply,
// end marker or timeout means for the worker's seqTracker. The Subscriber
// sends the requests it asks for and carries out its verdicts.
//
// Every request starts at the last seq applied, and its first reply must be
// that batch with the same fingerprint: the proof that the ROUTER belongs to
// the incarnation the history came from. The engine then sends every buffered
// seq after it and an end marker. Each request after the first of a replay
// goes out on a new connection, so no reply to an earlier one can follow it.
type replayState struct {
	t    *seqTracker
	upto uint64 // the live seq that showed the gap, or probe
	// lossy: batches missing at the start of the engine's buffer count as
	// lost: there is a history they belong to.
	lossy bool
	// continuous: the last batch applied came over the live connection that
	// is still up, so the engine is the same process even if its buffer no
	// longer holds that batch (a TCP connection does not survive a restart).
	continuous bool

	proven     bool   // this replay knows which incarnation answers: a failure loses no history
	proving    bool   // the current request's first reply must be t.last with t.fp
	first      bool   // no reply past the proof in the current request yet
	recheck    bool   // the current request re-asks a hole: a hole again means missing
	progressed bool   // delivered something since the current request was sent
	moves      uint64 // proofs and deliveries so far: what keeps a replay alive
	floor      uint64 // live batches from here on may arrive again as duplicates
}

type verdict uint8

const (
	vSkip    verdict = iota // stale, superseded, or the proof: nothing to do
	vDup                    // a reply already applied
	vDeliver                // hand the reply to the handler (the tracker has it)
	vMissing                // batches before the reply are gone; then deliver it
	vAsk                    // send a new request
	vRestart                // another incarnation answers: reset, then send a new request
	vDone                   // the replay is complete
	vFail                   // the request failed without progress
)

// step is a verdict with what it needs: how many batches are gone, and
// whether the history before them must be reset (there was one).
type step struct {
	v     verdict
	lost  uint64
	reset bool
}

// probe, as upto, marks a replay with no known gap (a tail check or a
// reconnect): an answer with nothing new in it means nothing was lost.
const probe = 1<<64 - 1

// begin starts a replay for the tracker's stream; lossy is false only
// where no history exists (a first connect: a router that starts late lost
// nothing).
func (r *replayState) begin(t *seqTracker, upto uint64, continuous bool) {
	*r = replayState{t: t, upto: upto, lossy: t.started, continuous: continuous, floor: t.next()}
}

// unfilled is how many batches of the known gap are still missing.
func (r *replayState) unfilled() uint64 {
	if next := r.t.next(); r.upto != probe && r.upto > next && r.t.started {
		return r.upto - next
	}
	return 0
}

// ask records a new request as current and returns the seq it asks from.
func (r *replayState) ask(recheck bool) uint64 {
	r.first, r.recheck, r.progressed = true, recheck, false
	r.proving = r.t.started
	if r.proving {
		return r.t.last
	}
	return 0
}

// restarted resets the tracker for a new incarnation, whose batches from its
// first on are then asked for.
func (r *replayState) restarted() {
	r.t.reset()
	r.lossy, r.floor, r.continuous, r.proven = true, 0, true, true
	r.upto = probe // a gap of the old incarnation means nothing in the new one
}

func (r *replayState) reply(seq uint64, payload []byte) step {
	if r.proving {
		switch {
		case seq < r.t.last:
			return step{v: vSkip} // not an answer to this request
		case seq == r.t.last && r.t.proves(payload):
			r.proving, r.proven = false, true
			r.moves++
			r.t.learn(payload)
			r.first = r.recheck // proven; a hole after it is a dropped reply, unless re-asked
			return step{v: vSkip}
		}
		r.proving = false
		if seq == r.t.last || !r.continuous {
			return step{v: vRestart} // the engine does not hold our last batch as we applied it
		}
		// Same process, but its buffer has moved past our last batch.
		r.first, r.proven = true, true
	}
	next := r.t.next()
	switch {
	case seq < next:
		return step{v: vDup}
	case seq == next:
		r.apply(seq, payload)
		return step{v: vDeliver}
	case r.first:
		// The buffer holds nothing between our history and seq: gone.
		s := step{v: vMissing, lost: seq - next, reset: r.t.started}
		if !r.lossy {
			s.lost = 0
		}
		r.t.reset()
		r.floor = seq
		r.apply(seq, payload)
		return s
	}
	// A reply went missing on the way (a ROUTER drops past its high-water
	// mark as silently as a PUB): ask again from the hole.
	return step{v: vAsk}
}

func (r *replayState) apply(seq uint64, payload []byte) {
	r.t.applyReplayed(seq, payload, r.floor)
	r.first, r.progressed, r.lossy = false, true, true
	r.moves++
}

// end handles an end marker.
func (r *replayState) end() step {
	if r.proving { // nothing at or after our last: not the engine we knew
		r.proving = false
		return step{v: vRestart}
	}
	if next := r.t.next(); r.upto != probe && next < r.upto {
		if r.progressed || !r.recheck {
			return step{v: vAsk} // the tail of the answer was dropped: ask once more
		}
		// The engine published these seqs and does not have them.
		s := step{v: vMissing, lost: r.upto - next, reset: r.t.started}
		if !r.lossy {
			s.lost = 0 // before any history: nothing of ours
		}
		r.t.reset()
		return s
	}
	return step{v: vDone}
}

// timeout handles a wait for a reply that ran out, or a connection that
// broke: the replay goes on only if it was getting somewhere.
func (r *replayState) timeout() step {
	if r.progressed {
		return step{v: vAsk}
	}
	return step{v: vFail}
}
