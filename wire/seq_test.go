package wire

import "testing"

func TestSeqTracker(t *testing.T) {
	type step struct {
		seq  uint64
		want Outcome
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"starts anywhere", []step{{41, First}, {42, InOrder}, {43, InOrder}}},
		{"gap", []step{{0, First}, {1, InOrder}, {5, Gap}}},
		{"same seq again is a duplicate", []step{{0, First}, {1, InOrder}, {1, Duplicate}}},
		{"backwards is a restart", []step{{7, First}, {8, InOrder}, {0, Restart}}},
		{"restart to the very first seq", []step{{0, First}, {1, InOrder}, {2, InOrder}, {0, Restart}}},
		{"restart from far ahead", []step{{1<<64 - 2, First}, {1<<64 - 1, InOrder}, {5, Restart}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var tr SeqTracker
			for i, s := range tc.steps {
				got := tr.Classify(s.seq)
				if got != s.want {
					t.Fatalf("step %d: Classify(%d) = %v, want %v", i, s.seq, got, s.want)
				}
				if got != Duplicate && got != Restart {
					tr.Apply(s.seq, nil)
				}
			}
		})
	}
}

// After a replay from S, live batches from S up to the replayed end are
// duplicates, not restarts; once the live stream passes them the window closes.
func TestSeqTrackerReplayWindow(t *testing.T) {
	var tr SeqTracker
	tr.Apply(10, nil)
	for seq := uint64(11); seq <= 20; seq++ {
		tr.applyReplayed(seq, nil, 11)
	}
	for _, seq := range []uint64{11, 15, 20} {
		if got := tr.Classify(seq); got != Duplicate {
			t.Errorf("after replay: Classify(%d) = %v, want duplicate", seq, got)
		}
	}
	if got := tr.Classify(3); got != Restart {
		t.Errorf("below the replay: Classify(3) = %v, want restart", got)
	}
	tr.Apply(21, nil)
	if got := tr.Classify(15); got != Restart {
		t.Errorf("after the live stream passed the replay: Classify(15) = %v, want restart", got)
	}
}
