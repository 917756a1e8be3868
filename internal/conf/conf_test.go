package conf

import (
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRule(t *testing.T) {
	if Or(0, 5) != 5 || Or(3, 5) != 3 || Or(-1, 5) != -1 || Or("", "x") != "x" {
		t.Error("Or: zero takes the default, anything else stays")
	}
	for _, tc := range []struct{ lo, hi, wantLo, wantHi time.Duration }{
		{0, 0, 1, 10},
		{2, 0, 2, 10},
		{20, 0, 20, 20},
		{2, 5, 2, 5},
		{6, 5, 6, 10},
		{20, 5, 20, 20},
	} {
		if lo, hi := Bounds(tc.lo, tc.hi, 1, 10); lo != tc.wantLo || hi != tc.wantHi {
			t.Errorf("Bounds(%v, %v) = %v, %v; want %v, %v", tc.lo, tc.hi, lo, hi, tc.wantLo, tc.wantHi)
		}
	}
}
