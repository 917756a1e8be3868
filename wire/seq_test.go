package wire

import "testing"

func TestSeqTracker(t *testing.T) {
	type step struct {
		seq  uint64
		want seqOutcome
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"starts anywhere", []step{{41, seqFirst}, {42, seqInOrder}, {43, seqInOrder}}},
		{"gap", []step{{0, seqFirst}, {1, seqInOrder}, {5, seqGap}}},
		{"same seq again is a duplicate", []step{{0, seqFirst}, {1, seqInOrder}, {1, seqDuplicate}}},
		{"backwards is a restart", []step{{7, seqFirst}, {8, seqInOrder}, {0, seqRestart}}},
		{"restart to the very first seq", []step{{0, seqFirst}, {1, seqInOrder}, {2, seqInOrder}, {0, seqRestart}}},
		{"restart from far ahead", []step{{1<<64 - 2, seqFirst}, {1<<64 - 1, seqInOrder}, {5, seqRestart}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var tr seqTracker
			for i, s := range tc.steps {
				got := tr.classify(s.seq)
				if got != s.want {
					t.Fatalf("step %d: Classify(%d) = %v, want %v", i, s.seq, got, s.want)
				}
				if got != seqDuplicate && got != seqRestart {
					tr.apply(s.seq, nil)
				}
			}
		})
	}
}

// After a replay from S, live batches from S up to the replayed end are
// duplicates, not restarts; once the live stream passes them the window closes.
func TestSeqTrackerReplayWindow(t *testing.T) {
	var tr seqTracker
	tr.apply(10, nil)
	for seq := uint64(11); seq <= 20; seq++ {
		tr.applyReplayed(seq, nil, 11)
	}
	for _, seq := range []uint64{11, 15, 20} {
		if got := tr.classify(seq); got != seqDuplicate {
			t.Errorf("after replay: Classify(%d) = %v, want duplicate", seq, got)
		}
	}
	if got := tr.classify(3); got != seqRestart {
		t.Errorf("below the replay: Classify(3) = %v, want restart", got)
	}
	tr.apply(21, nil)
	if got := tr.classify(15); got != seqRestart {
		t.Errorf("after the live stream passed the replay: Classify(15) = %v, want restart", got)
	}
}
