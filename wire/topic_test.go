package wire

import (
	"bytes"
	"testing"
)

func TestSplitTopic(t *testing.T) {
	cases := []struct {
		topic                string
		base, epoch, barrier string
		hasEpoch, hasBarrier bool
	}{
		{"", "", "", "", false, false},
		{"kv", "kv", "", "", false, false},
		{"kv\x00other", "kv\x00other", "", "", false, false},
		{"kv\x00sgl-kv-epoch=abc", "kv", "abc", "", true, false},
		{"\x00sgl-kv-epoch=abc", "", "abc", "", true, false},
		{"kv\x00sgl-kv-epoch=", "kv", "", "", true, false},
		{"kv\x00sgl-kv-epoch=abc\x00sgl-kv-snapshot=b1", "kv", "abc", "b1", true, true},
		{"\x00sgl-kv-epoch=abc\x00sgl-kv-snapshot=", "", "abc", "", true, true},
		{"kv\x00sgl-kv-epoch=\x00sgl-kv-snapshot=b1", "kv", "", "b1", true, true},
		// Without the epoch marker the snapshot marker is not the format: all base.
		{"kv\x00sgl-kv-snapshot=b1", "kv\x00sgl-kv-snapshot=b1", "", "", false, false},
		{"kv\x00sgl-kv-epoc=abc", "kv\x00sgl-kv-epoc=abc", "", "", false, false},
	}
	for _, tc := range cases {
		topic := []byte(tc.topic)
		base, epoch, barrier := splitTopic(topic)
		if string(base) != tc.base || string(epoch) != tc.epoch || string(barrier) != tc.barrier ||
			(epoch != nil) != tc.hasEpoch || (barrier != nil) != tc.hasBarrier {
			t.Errorf("splitTopic(%q) = %q, %q (nil %v), %q (nil %v); want %q, %q (nil %v), %q (nil %v)", tc.topic,
				base, epoch, epoch == nil, barrier, barrier == nil, tc.base, tc.epoch, !tc.hasEpoch, tc.barrier, !tc.hasBarrier)
		}
		if len(topic) > 0 && len(base) > 0 && &base[0] != &topic[0] {
			t.Errorf("splitTopic(%q): base is not a subslice of the topic", tc.topic)
		}
	}
	if base, epoch, barrier := splitTopic(nil); base != nil || epoch != nil || barrier != nil {
		t.Errorf("splitTopic(nil) = %q, %q, %q; want all nil", base, epoch, barrier)
	}
}

func TestSplitTopicAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	topic := []byte("kv\x00sgl-kv-epoch=0123456789abcdef\x00sgl-kv-snapshot=fedcba")
	if allocs := testing.AllocsPerRun(100, func() { splitTopic(topic) }); allocs != 0 {
		t.Errorf("splitTopic allocates %.1f times, want 0", allocs)
	}
}

// FuzzSplitTopic: no topic panics, and a topic that splits joins back to
// itself.
func FuzzSplitTopic(f *testing.F) {
	f.Add([]byte("kv\x00sgl-kv-epoch=0123\x00sgl-kv-snapshot=ab"))
	f.Add([]byte("kv\x00sgl-kv-snapshot=ab"))
	f.Add([]byte("\x00sgl-kv-epoch="))
	f.Fuzz(func(t *testing.T, p []byte) {
		base, epoch, barrier := splitTopic(p)
		joined := append([]byte{}, base...)
		if epoch != nil {
			joined = append(append(joined, epochTopicMarker...), epoch...)
		}
		if barrier != nil {
			joined = append(append(joined, snapshotTopicMarker...), barrier...)
		}
		if !bytes.Equal(joined, p) {
			t.Fatalf("splitTopic(%q) = %q, %q, %q, which do not join back", p, base, epoch, barrier)
		}
	})
}
