package main

import (
	"context"
	"io"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/ztest"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }

// The summary of a realistic replay shows every rule at work: partial
// tails and the sliding-window group filtered, the host tier indexed and
// hit, adapters' requests routed without claims across adapters.
func TestReplaySummary(t *testing.T) {
	var out strings.Builder
	// A small cache, so that blocks are evicted to the host tier and hit there.
	o := options{workers: 2, capacity: 2_000, blockSize: 16, requests: 300, shards: 2, progress: time.Hour,
		partialTails: true, slidingWindow: 4096, hostBlocks: 20_000, lora: true, eagle: 1}
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
	// The SGLang engine with EAGLE is routed to and hits its cache: its
	// bigram events were keyed as the router keys its requests.
	if n := field(`EAGLE engines \(1, SGLang bigram events\) ([\d.]+)%`); n == 0 {
		t.Errorf("the EAGLE engine scored no hit:\n%s", s)
	}
	if n := field(`requests\s+(\d+)`); n != 300 {
		t.Errorf("requests = %v, want 300", n)
	}
	if n := field(`\((\d+) on adapters\)`); n == 0 {
		t.Error("no request on an adapter")
	}
	if n := field(`\((\d+) stored in all\)`); n == 0 {
		t.Error("nothing indexed")
	}
	if n := field(`blocks held .*host=(\d+)`); n == 0 {
		t.Error("nothing held in the host tier at the end")
	}
	if n := field(`(\d+) lost`); n != 0 {
		t.Errorf("lost = %v on loopback with replay, want 0", n)
	}
	for _, reason := range []string{"partial_block", "non_main_attention"} {
		if n := field(reason + `=(\d+)`); n == 0 {
			t.Errorf("%s = 0: the engines' %s events were not filtered", reason, reason)
		}
	}
	for _, reason := range []string{"lower_tier", "unknown_medium", "unlearned_group", "block_size"} {
		if n := field(` ` + reason + `=(\d+)`); n != 0 {
			t.Errorf("%s = %v, want 0: the engines send nothing of the kind", reason, n)
		}
	}
	if kv := field(`kvpipe routing ([\d.]+)%`); kv == 0 {
		t.Error("kvpipe routing hit nothing")
	}
	if host := field(`kvpipe routing [\d.]+% \(device [\d.]+%, host ([\d.]+)%`); host == 0 {
		t.Error("no host-tier hit")
	}
	field(`random routing ([\d.]+)%`)
	if n := field(`adapters: (\d+) claimed`); n == 0 {
		t.Error("no device block claimed for a request on an adapter")
	}
	if n := field(`credited at least (\d+) more blocks`); n == 0 {
		t.Error("token-only keys would credit nothing across adapters: the trace's adapters share no prefix with the base model, so the test proves nothing")
	}
}

// In burst mode each request becomes 4 sharing its prompt as a new prefix,
// at once, before any event of the first can land (the engines publish
// once the prefill is done): a router that tells the pipeline where it
// sent each (Pipeline.Routed) keeps a burst on one worker, one that waits
// for events spreads it over all of them, and its wrong claims (predicted
// blocks the engine did not hold when the request reached it) are few.
func TestReplayBurst(t *testing.T) {
	var out strings.Builder
	o := options{workers: 4, capacity: 10_000, blockSize: 16, requests: 60, shards: 2, progress: time.Hour,
		speedup: 10, burst: 4, prefillRate: 20_000}
	if err := run(context.Background(), o, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	t.Log(s)
	type routing struct{ dup, bursts, wrong, claimed int }
	get := func(name string, predicted bool) routing {
		pattern := name + `\s+hit rate [\d.]+% .*duplicated prefills (\d+) in (\d+) bursts`
		if predicted {
			pattern += `, predicted but not held when served (\d+) of (\d+) blocks predicted`
		}
		m := regexp.MustCompile(pattern).FindStringSubmatch(s)
		if m == nil {
			t.Fatalf("summary lacks %q:\n%s", pattern, s)
		}
		var r routing
		for i, v := range []*int{&r.dup, &r.bursts, &r.wrong, &r.claimed}[:len(m)-1] {
			*v, _ = strconv.Atoi(m[i+1])
		}
		return r
	}
	with, without, approx, random := get("with predictions", true), get("events only", false), get("approximate only", true), get("random", false)
	if without.bursts < o.requests/2 || without.dup < without.bursts {
		t.Errorf("without predictions %d duplicated prefills in %d bursts: the bursts were not spread, the test proves nothing:\n%s", without.dup, without.bursts, s)
	}
	for name, r := range map[string]routing{"with predictions": with, "approximate only": approx} {
		if r.dup*4 > without.dup || r.dup*2 > random.dup {
			t.Errorf("%s: %d duplicated prefills, against %d without predictions and %d at random: not well below:\n%s", name, r.dup, without.dup, random.dup, s)
		}
		if r.claimed == 0 || r.wrong*100 > r.claimed {
			t.Errorf("%s: %d of %d blocks predicted were not held when served: want some predicted, under 1%% wrong:\n%s", name, r.wrong, r.claimed, s)
		}
	}
	if !regexp.MustCompile(`with predictions .*predictions confirmed [1-9]\d*`).MatchString(s) {
		t.Errorf("no prediction confirmed by the engines' events:\n%s", s)
	}
	if !regexp.MustCompile(`event lag\s+p50 [\d.]+s, p90 [\d.]+s, p99 [\d.]+s`).MatchString(s) {
		t.Errorf("no event lag:\n%s", s)
	}
}

func TestReplayRejectsBadFlags(t *testing.T) {
	for _, o := range []options{{workers: 0, capacity: 1, blockSize: 16}, {workers: 1, capacity: 1, blockSize: 24}} {
		if err := run(context.Background(), o, io.Discard, io.Discard); err == nil {
			t.Errorf("run(%+v): no error", o)
		}
	}
}

// A router restarted from its snapshot knows at once what the one before
// it knew, proven against the engines (no resync); one restarted without
// knows only what the engines' replay buffers still hold. The caches are
// large enough (10,000 blocks) that, by the restart, neither trace's engines
// have filled them from the 20 batches their replay buffers keep: with
// caches of 2,000 blocks, the synthetic trace's engines (whose routed
// requests hit more, and so publish fewer batches) replay every batch from
// the start of their streams, a router restarted without a snapshot
// rebuilds the whole index, and the comparison proves nothing.
func TestReplayRestart(t *testing.T) {
	var out strings.Builder
	o := options{workers: 2, capacity: 10_000, blockSize: 16, requests: 240, shards: 2, progress: time.Hour,
		hostBlocks: 5_000, restartAt: 0.5, bufferSteps: 20}
	if err := run(context.Background(), o, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	m := regexp.MustCompile(`with a snapshot\s+(\d+) blocks indexed.*resyncs (\d+)\n.*without\s+(\d+) blocks indexed`).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("summary lacks the restarts:\n%s", s)
	}
	with, _ := strconv.Atoi(m[1])
	without, _ := strconv.Atoi(m[3])
	if m[2] != "0" {
		t.Errorf("the restored router resynced %s times, want 0:\n%s", m[2], s)
	}
	if with <= without {
		t.Errorf("restored with %d blocks indexed, without a snapshot %d: the snapshot brought nothing:\n%s", with, without, s)
	}
	if !regexp.MustCompile(`snapshot\s+[1-9]\d* blocks in [1-9]\d* bytes`).MatchString(s) {
		t.Errorf("no snapshot size:\n%s", s)
	}
}

// Through a relay and an in-process JetStream server, both router replicas,
// and two routers that join late (one from the relay's snapshot), end with
// the same index; run fails if they do not.
func TestReplayNATS(t *testing.T) {
	var out strings.Builder
	o := options{workers: 2, capacity: 2_000, blockSize: 16, requests: 200, shards: 2, progress: time.Hour,
		hostBlocks: 5_000, nats: true, speedup: 0, failoverAt: 0.5}
	var logs syncBuilder // the relays' and routers' warnings, for a failure's report
	if err := run(context.Background(), o, &out, &logs); err != nil {
		t.Fatalf("%v:\n%s\n%s", err, out.String(), logs.String())
	}
	s := out.String()
	if !strings.Contains(s, "replicas agree     true") || strings.Count(s, "agrees true") != 2 {
		t.Errorf("the routers do not agree:\n%s", s)
	}
	// A worker in the middle of a replay when the leader stops is recorded
	// absent from its last snapshot, and the standby starts it afresh: the
	// other still comes from the snapshot.
	m := regexp.MustCompile(`at request 100 the leading relay stopped.*: (\d+) workers from the snapshot \((\d+) recorded absent`).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("no failover to the standby:\n%s\n%s", s, logs.String())
	}
	restored, _ := strconv.Atoi(m[1])
	absent, _ := strconv.Atoi(m[2])
	if restored < 1 || restored+absent < 2 {
		t.Errorf("%d workers from the snapshot, %d absent from it; want both accounted for, one at least restored:\n%s\n%s", restored, absent, s, logs.String())
	}
}

// syncBuilder is a strings.Builder the example's goroutines may log to.
type syncBuilder struct {
	mu sync.Mutex
	b  strings.Builder
}

func (w *syncBuilder) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.b.Len() > 1<<20 {
		return len(p), nil
	}
	return w.b.Write(p)
}

func (w *syncBuilder) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}
