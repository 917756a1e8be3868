package pace

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestBackoffDoublesWithJitterUpToMax(t *testing.T) {
	b := Backoff{Min: 100 * time.Millisecond, Max: 400 * time.Millisecond}
	for i, step := range []time.Duration{100, 200, 400, 400} {
		step *= time.Millisecond
		if d := b.Next(); d < step/2 || d > step {
			t.Errorf("wait %d = %v, want within [%v, %v]", i, d, step/2, step)
		}
	}
	b.Reset()
	if d := b.Next(); d > 100*time.Millisecond {
		t.Errorf("after Reset: %v, want at most Min", d)
	}
}

func TestLimiterCountsWhatItHoldsBack(t *testing.T) {
	l := Limiter{Every: time.Second}
	t0 := time.Unix(1000, 0)
	if _, ok := l.Allow(t0); !ok {
		t.Fatal("the first event must pass")
	}
	for i := range 3 {
		if _, ok := l.Allow(t0.Add(time.Duration(i+1) * 100 * time.Millisecond)); ok {
			t.Fatal("an event within the interval passed")
		}
	}
	if n, ok := l.Allow(t0.Add(time.Second)); !ok || n != 3 {
		t.Errorf("after the interval: ok=%v suppressed=%d, want true and 3", ok, n)
	}
}

func TestSleepEndsWithTheContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Sleep(ctx, time.Hour) {
		t.Error("Sleep waited out a cancelled context")
	}
	if !Sleep(context.Background(), time.Millisecond) {
		t.Error("Sleep did not wait")
	}
}

// A Warner lets the first warning through, holds back the next ones within
// the second, and names how many it held back in the next one it passes.
func TestWarnerRateLimits(t *testing.T) {
	var buf bytes.Buffer
	w := NewWarner(slog.New(slog.NewTextHandler(&buf, nil)), "kvpipe/test: ")
	for range 3 {
		w.Warn("trouble", "n", 1)
	}
	if got := strings.Count(buf.String(), "trouble"); got != 1 {
		t.Fatalf("%d warnings within a second, want 1:\n%s", got, buf.String())
	}
	w.mu.Lock()
	w.lim.last = w.lim.last.Add(-2 * time.Second) // a second has passed
	w.mu.Unlock()
	w.Warn("trouble again")
	if !strings.Contains(buf.String(), `msg="kvpipe/test: trouble again" suppressed=2`) {
		t.Errorf("the next warning does not say 2 were held back:\n%s", buf.String())
	}
	NewWarner(nil, "").Warn("discarded") // a nil logger discards
}
