package main

import (
	"context"
	"io"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/ztest"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }

func TestReplaySummary(t *testing.T) {
	var out strings.Builder
	o := options{workers: 2, capacity: 20_000, blockSize: 16, requests: 300, shards: 2, progress: time.Hour}
	if err := run(context.Background(), o, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	field := func(pattern string) float64 {
		m := regexp.MustCompile(pattern).FindStringSubmatch(s)
		if m == nil {
			t.Fatalf("summary lacks %q:\n%s", pattern, s)
		}
		v, _ := strconv.ParseFloat(m[1], 64)
		return v
	}
	if n := field(`requests\s+(\d+)`); n != 300 {
		t.Errorf("requests = %v, want 300", n)
	}
	if n := field(`blocks indexed\s+(\d+) stored`); n == 0 {
		t.Error("nothing indexed")
	}
	if n := field(`(\d+) lost`); n != 0 {
		t.Errorf("lost = %v on loopback with replay, want 0", n)
	}
	if kv := field(`kvpipe routing ([\d.]+)%`); kv <= 0 {
		t.Errorf("kvpipe routing hit rate %v%%, want above 0", kv)
	}
	field(`random routing ([\d.]+)%`)
}

func TestReplayRejectsBadFlags(t *testing.T) {
	for _, o := range []options{{workers: 0, capacity: 1, blockSize: 16}, {workers: 1, capacity: 1, blockSize: 24}} {
		if err := run(context.Background(), o, io.Discard, io.Discard); err == nil {
			t.Errorf("run(%+v): no error", o)
		}
	}
}
