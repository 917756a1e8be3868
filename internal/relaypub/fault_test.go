package relaypub

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/natstest"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/kvpipe/kvpipe/metrics"
	"github.com/kvpipe/kvpipe/relay"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// gathered reads a gauge or counter of one worker from reg; it fails the
// test when reg does not serve it.
func gathered(t *testing.T, reg *prometheus.Registry, name, worker string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "worker" && l.GetValue() == worker {
					if m.GetGauge() != nil {
						return m.GetGauge().GetValue()
					}
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("%s{worker=%q} not served", name, worker)
	return 0
}

// NATS stops in the middle of the stream and comes back on the same store:
// the relay's workers retry until their publishes go through, none lost
// and none out of order (no reset); the router's consumer resumes after the
// last message it applied, and applies every message of the stream exactly
// once. Both ways of connecting: without a reconnect buffer (many messages
// in flight) and with one (one at a time).
func TestNATSRestartMidStream(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		opts   []nats.Option
		window int
	}{
		{"no reconnect buffer", []nats.Option{nats.ReconnectBufSize(-1)}, 128},
		{"reconnect buffer", nil, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			srv := natstest.Start(t)
			js, err := jetstream.New(srv.Connect(t, c.opts...))
			if err != nil {
				t.Fatal(err)
			}
			natsRestartMidStream(t, srv, js, c.window)
		})
	}
}

func natsRestartMidStream(t *testing.T, srv *natstest.Server, js jetstream.JetStream, window int) {
	s := testSettings()
	a, b := newEngine(t, "a"), newEngine(t, "b")
	reqs := trace(600, 2)
	rr := startRelay(t, js, relayConfig(s), a, b)
	if rr.window != window {
		t.Fatalf("relay keeps %d messages in flight, want %d", rr.window, window)
	}
	r := startRouter(t, js, s)
	a.serve(reqs[:100])
	b.serve(reqs[100:200])
	relayed(t, rr, a, b)
	caughtUp(t, js, s, r)

	srv.Stop()
	a.serve(reqs[200:300]) // published by the engines while NATS is down
	b.serve(reqs[300:400])
	eventually(t, "the relay retrying", func() error {
		if rr.Stats().Retries == 0 {
			return fmt.Errorf("no retry yet")
		}
		return nil
	})
	srv.StartAgain()
	a.serve(reqs[400:500])
	b.serve(reqs[500:])
	converged(t, js, s, rr, r, a, b)
	st, fs, ss := rr.Stats(), r.f.Stats(), streamState(t, js, s)
	// Each publish is a message of its own here (nothing is replayed): a
	// duplicate can only be a retry of one the server stored but could
	// not acknowledge before it stopped.
	if st.Abandoned != 0 || st.Resets != 0 || ss.Msgs != st.Published || st.Duplicates > st.Retries || ss.FirstSeq != 1 || ss.Msgs != ss.LastSeq {
		t.Errorf("relay %+v, stream %+v: want nothing abandoned and every publish stored once", st, ss)
	}
	if fs.Applied != ss.Msgs || fs.Gaps != 0 || fs.BadMessages != 0 {
		t.Errorf("router %+v: want each of the stream's %d messages applied once", fs, ss.Msgs)
	}
}

// takeSnapshot copies the bytes and metadata of the bucket's snapshot.
func takeSnapshot(t *testing.T, js jetstream.JetStream, s relay.Settings) ([]byte, opstream.SnapshotMeta) {
	t.Helper()
	data, meta, err := loadSnapshot(js, s)
	if err != nil {
		t.Fatal(err)
	}
	return data, meta
}

func loadSnapshot(js jetstream.JetStream, s relay.Settings) ([]byte, opstream.SnapshotMeta, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	obs, err := js.ObjectStore(ctx, s.Bucket)
	if err != nil {
		return nil, opstream.SnapshotMeta{}, err
	}
	return opstream.LoadSnapshot(ctx, obs, s.Object, nil)
}

// putSnapshot puts data and meta back as the bucket's snapshot.
func putSnapshot(t *testing.T, js jetstream.JetStream, s relay.Settings, data []byte, meta opstream.SnapshotMeta) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	obs, err := js.ObjectStore(ctx, s.Bucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := opstream.SaveSnapshot(ctx, obs, s.Object, data, meta); err != nil {
		t.Fatal(err)
	}
}

// A relay killed after a snapshot (its last snapshot lost with it) and
// started again: its workers resume from the snapshot and replay from the
// engines what they had published since; every replayed message is a
// duplicate the stream drops, it publishes no reset, and the router's
// index is still the engines'.
func TestRelayRestartedFromSnapshot(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a, b := newEngine(t, "a"), newEngine(t, "b")
	reqs := trace(500, 3)
	rr := startRelay(t, js, relayConfig(s), a, b)
	a.serve(reqs[:150])
	b.serve(reqs[150:250])
	relayed(t, rr, a, b)
	rr.snapshotNow(t)
	old, oldMeta := takeSnapshot(t, js, s)
	a.serve(reqs[250:320])
	b.serve(reqs[320:400])
	relayed(t, rr, a, b)
	before := streamState(t, js, s)
	rr.stop()
	putSnapshot(t, js, s, old, oldMeta) // as if it died before its last snapshot

	rr2 := startRelay(t, js, relayConfig(s), a, b)
	r := startRouter(t, js, s)
	relayed(t, rr2, a, b)
	if st := rr2.Stats(); st.Restored != 2 || st.SnapshotIgnored != 0 || st.Published != 0 || st.Resets != 0 ||
		st.Replayed != before.LastSeq-oldMeta.StreamLast {
		t.Errorf("restarted relay %+v: want both workers restored, and the %d messages after the snapshot made again, none sent",
			st, before.LastSeq-oldMeta.StreamLast)
	}
	if after := streamState(t, js, s); after.LastSeq != before.LastSeq {
		t.Errorf("stream at seq %d after the restart, %d before: the replays (or a reset) were stored", after.LastSeq, before.LastSeq)
	}
	a.serve(reqs[400:])
	b.serve(reqs[:50])
	converged(t, js, s, rr2, r, a, b)
}

// A relay started from a snapshot that records a worker absent (the last
// relay could not take its state in time) restores the others and starts
// that one afresh: its clear reaches the stream under an id of its own, a
// router that starts from the snapshot keeps the worker partial until that
// clear, and then both indexes are the engines' again.
func TestRelayStartsAnAbsentWorkerAfresh(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a, b := newEngine(t, "a"), newEngine(t, "b")
	reqs := trace(300, 3)
	rr := startRelay(t, js, relayConfig(s), a, b)
	a.serve(reqs[:100])
	b.serve(reqs[100:200])
	relayed(t, rr, a, b)
	rr.snapshotNow(t)
	data, meta := takeSnapshot(t, js, s)
	rr.stop()
	var snap snapshot.Snapshot
	if err := snapshot.Decode(data, &snap); err != nil {
		t.Fatal(err)
	}
	for i := range snap.Workers {
		if w := &snap.Workers[i]; string(w.Name) == "b" {
			w.SetAbsent("b")
		}
	}
	data, err := snapshot.Append(nil, &snap)
	if err != nil {
		t.Fatal(err)
	}
	putSnapshot(t, js, s, data, meta) // as if b had been in a replay at the last snapshot

	// A router from that snapshot, before any relay runs again: what the
	// stream held of b is not in it.
	r := startRouter(t, js, s)
	caughtUp(t, js, s, r)
	for name, want := range map[string]bool{"a": false, "b": true} {
		if w, ok := r.p.Stats().Worker(name); !ok || w.Actor.Partial != want {
			t.Errorf("router from the snapshot: worker %s known %v, partial %v; want partial %v", name, ok, w.Actor.Partial, want)
		}
	}
	rr2 := startRelay(t, js, relayConfig(s), a, b)
	relayed(t, rr2, a, b)
	if st := rr2.Stats(); st.Restored != 1 || st.Resets != 0 {
		t.Errorf("relay from the snapshot %+v: want a restored, b started afresh, no reset", st)
	}
	a.serve(reqs[200:])
	b.serve(reqs[:50])
	converged(t, js, s, rr2, r, a, b)
}

// Two relays for the same engines, the second started late: it catches up
// through the engines' replay buffers with the same ops, so the stream
// holds each engine batch's messages once, whichever relay sent them, and
// the router's index is right.
func TestSecondRelay(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a, b := newEngine(t, "a"), newEngine(t, "b")
	reqs := trace(400, 4)
	r1 := startRelay(t, js, relayConfig(s), a, b)
	a.serve(reqs[:100])
	b.serve(reqs[100:200])
	relayed(t, r1, a, b)
	r2 := startRelay(t, js, relayConfig(s), a, b)
	r := startRouter(t, js, s)
	relayed(t, r2, a, b)
	a.serve(reqs[200:300])
	b.serve(reqs[300:])
	relayed(t, r1, a, b)
	relayed(t, r2, a, b)
	caughtUp(t, js, s, r)
	if err := exact(r.p, a, b); err != nil {
		t.Error(err)
	}
	// A publish whose acknowledgement timed out (under load) is tried
	// again and acknowledged as a duplicate of itself: each retry may turn
	// one message a relay stored into one it counts as a copy.
	st1, st2, ss := r1.Stats(), r2.Stats(), streamState(t, js, s)
	fresh := st1.Published - st1.Duplicates + st2.Published - st2.Duplicates
	if st2.Duplicates == 0 || ss.Msgs < fresh || ss.Msgs > fresh+st1.Retries+st2.Retries {
		t.Errorf("relays %+v and %+v, stream %+v: want the second's catch-up all duplicates", st1, st2, ss)
	}
	seen := map[string]bool{}
	began := map[string]bool{} // workers whose messages the stream has shown
	starts := 0
	forEachMessage(t, js, s, func(m *jetstream.RawStreamMsg) {
		id := m.Header.Get(jetstream.MsgIDHeader)
		f := strings.Split(id, ".")
		first := !began[f[0]]
		began[f[0]] = true
		// Each worker's first: its clear (the other worker's batches may
		// come before it, when that worker started first).
		if len(f) == 3 && f[1] == "start" && first {
			starts++
			return
		}
		if len(f) != 5 {
			t.Errorf("message %d: id %q is not an engine batch's", m.Sequence, id)
			return
		}
		key := strings.Join(f[:4], ".") // worker, seq, fingerprint, part
		if seen[key] {
			t.Errorf("message %d: engine batch %s stored twice", m.Sequence, key)
		}
		seen[key] = true
	})
	if starts != 2 || len(seen) != int(ss.Msgs)-2 {
		t.Errorf("%d engine batch parts and %d starts in %d messages", len(seen), starts, ss.Msgs)
	}
}

func forEachMessage(t *testing.T, js jetstream.JetStream, s relay.Settings, f func(*jetstream.RawStreamMsg)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, s.Stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A deadline for each message, not for all of them: a loaded machine
	// slows every read, and a stream holds hundreds.
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		mctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		m, err := st.GetMsg(mctx, seq)
		cancel()
		if err != nil {
			t.Fatalf("message %d: %v", seq, err)
		}
		f(m)
	}
}

// A router that joins after a snapshot loads it and consumes only the
// messages after it, and ends equal to the engines.
func TestRouterJoinsLate(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a, b := newEngine(t, "a"), newEngine(t, "b")
	reqs := trace(400, 5)
	rr := startRelay(t, js, relayConfig(s), a, b)
	a.serve(reqs[:150])
	b.serve(reqs[150:250])
	relayed(t, rr, a, b)
	rr.snapshotNow(t)
	_, meta := takeSnapshot(t, js, s)
	a.serve(reqs[250:])
	relayed(t, rr, a, b)
	r := startRouter(t, js, s)
	b.serve(reqs[:80])
	converged(t, js, s, rr, r, a, b)
	fs, ss := r.f.Stats(), streamState(t, js, s)
	if fs.SnapshotsLoaded != 1 || fs.SnapshotsRefused != 0 || fs.Applied+fs.Skipped != ss.LastSeq-meta.StreamLast {
		t.Errorf("router %+v: want the snapshot loaded and only the %d messages after its seq %d read", fs, ss.LastSeq-meta.StreamLast, meta.StreamLast)
	}
}

// A snapshot whose sequences are past the stream's last (the stream was
// deleted and made again) is refused, saying so; the router follows the new
// stream from its start with the workers partial and no key the engines
// dropped. The relay, started again on the new stream, writes a snapshot
// of it that a later router loads, and that one is exact.
func TestSnapshotPastTheStreamsLast(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a := newEngine(t, "a")
	reqs := trace(400, 6)
	rr := startRelay(t, js, relayConfig(s), a)
	a.serve(reqs[:200])
	relayed(t, rr, a)
	rr.stop() // writes its last snapshot
	makeStreamAgain(t, js, s)
	r := startRouter(t, js, s)
	eventually(t, "the snapshot refused", func() error {
		if fs := r.f.Stats(); fs.SnapshotsRefused == 0 || !strings.Contains(fs.RefusedReason, "past the stream's last 0") {
			return fmt.Errorf("%+v", fs)
		}
		return nil
	})
	rr2 := startRelay(t, js, relayConfig(s), a)
	a.serve(reqs[200:])
	relayed(t, rr2, a)
	caughtUp(t, js, s, r)
	// The new relay's first message of the worker is its whole state, from
	// the old stream's snapshot: a router on the new stream is exact.
	if err := exact(r.p, a); err != nil {
		t.Error(err)
	}
	if err := sameBlocks(rr2.Pipeline(), r); err != nil {
		t.Error(err)
	}
	rr2.snapshotNow(t)
	late := startRouter(t, js, s)
	caughtUp(t, js, s, late)
	if err := exact(late.p, a); err != nil {
		t.Errorf("router started on the new stream's snapshot: %v", err)
	}
}

// A stream deleted and made again while the relay runs, between two of its
// snapshots: the relay goes on publishing into the new stream until it
// notices, and those ops are newer than its last snapshot. The next relay,
// from that snapshot, makes the same ops again from the engine's replay.
// It starts the worker in the new stream with its whole state, a clear
// first, so that a router counts none of those ops twice (it used to:
// stores counted twice, blocks held after their remove).
func TestStreamRemadeBetweenSnapshots(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a := newEngine(t, "a")
	reqs := trace(400, 11)
	rr := startRelay(t, js, relayConfig(s), a)
	a.serve(reqs[:150])
	relayed(t, rr, a)
	rr.snapshotNow(t)
	a.serve(reqs[150:250])
	relayed(t, rr, a)
	makeStreamAgain(t, js, s)
	a.serve(reqs[250:320]) // into the new stream, unnoticed
	relayed(t, rr, a)
	if ss := streamState(t, js, s); ss.Msgs == 0 {
		t.Fatalf("new stream %+v: the relay published nothing into it", ss)
	}
	rr.stop() // finds the stream changed: no last snapshot
	r := startRouter(t, js, s)
	rr2 := startRelay(t, js, relayConfig(s), a)
	a.serve(reqs[320:])
	relayed(t, rr2, a)
	caughtUp(t, js, s, r)
	if err := exact(r.p, a); err != nil {
		t.Error(err)
	}
	if err := sameBlocks(rr2.Pipeline(), r); err != nil {
		t.Error(err)
	}
}

// The whole state a relay publishes into a new stream is its snapshot's,
// which it keeps out of its own answers until its engine proves it: the
// router keeps the worker partial as long (it was told exact, with a dead
// engine's blocks, when the whole state carried the snapshot's flag), and
// is exact once the engine is back.
func TestRestoredIntoANewStreamPartialUntilProven(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a := newEngine(t, "a")
	reqs := trace(400, 6)
	rr := startRelay(t, js, relayConfig(s), a)
	a.serve(reqs[:200])
	relayed(t, rr, a)
	rr.stop()
	makeStreamAgain(t, js, s)
	a.pub.Close() // the engine is down: the snapshot stays unproven
	r := startRouter(t, js, s)
	rr2 := startRelay(t, js, relayConfig(s), a)
	eventually(t, "the router holding the restored blocks, partial", func() error {
		if w, ok := r.p.Stats().Worker("a"); !ok || !w.Actor.Partial || !holdsSome(r.p, a) {
			return fmt.Errorf("router's worker a: %+v", w.Actor)
		}
		return nil
	})
	a.restart(t) // back, another incarnation: the proof fails, the worker resyncs
	a.serve(reqs[200:260])
	relayed(t, rr2, a)
	caughtUp(t, js, s, r)
	if err := exact(r.p, a); err != nil {
		t.Error(err)
	}
	if err := sameBlocks(rr2.Pipeline(), r); err != nil {
		t.Error(err)
	}
}

// A snapshot whose next messages the stream no longer holds is refused,
// saying so; the router starts from the stream's first message with the
// workers partial, and keeps no key the engines dropped.
func TestSnapshotOlderThanTheStreamsRetention(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	s.MaxMsgs = 40
	a := newEngine(t, "a")
	reqs := trace(500, 7)
	rr := startRelay(t, js, relayConfig(s), a)
	a.serve(reqs[:100])
	relayed(t, rr, a)
	rr.snapshotNow(t)
	a.serve(reqs[100:])
	relayed(t, rr, a)
	if ss := streamState(t, js, s); ss.FirstSeq < 50 {
		t.Fatalf("stream %+v: not trimmed", ss)
	}
	r := startRouter(t, js, s)
	caughtUp(t, js, s, r)
	fs := r.f.Stats()
	if fs.SnapshotsRefused != 1 || !strings.Contains(fs.RefusedReason, "no longer holds") {
		t.Errorf("router %+v: want the snapshot refused as older than the retention", fs)
	}
	if err := sound(r.p, a); err != nil {
		t.Error(err)
	}
	if w, ok := r.p.Stats().Worker("a"); !ok || !w.Actor.Partial {
		t.Errorf("router's worker a: %+v, want it partial", w)
	}
	rr.snapshotNow(t)
	late := startRouter(t, js, s)
	caughtUp(t, js, s, late)
	if err := exact(late.p, a); err != nil {
		t.Errorf("router started on a fresh snapshot: %v", err)
	}
}

// A corrupt or truncated snapshot in the bucket is refused with the
// decoder's reason, counted; the router falls back to the stream (whole
// here, so its index ends exact) and nothing of the bad snapshot is
// applied. A relay started on it ignores it and resyncs its workers from
// the engines.
func TestBadSnapshots(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		damage func(*testing.T, []byte) []byte
		reason string
	}{
		{"corrupt", func(_ *testing.T, b []byte) []byte { b[len(b)/2] ^= 0x40; return b }, "checksum mismatch"},
		{"truncated", func(_ *testing.T, b []byte) []byte { return b[:len(b)*2/3] }, "checksum mismatch"},
		{"empty", func(*testing.T, []byte) []byte { return nil }, "truncated: 0 bytes"},
		{"not a snapshot", func(*testing.T, []byte) []byte { return []byte("hello, world: not a snapshot") }, "bad magic"},
		{"another key seed", func(t *testing.T, b []byte) []byte { // keys no prompt of this kvpipe hashes to
			var snap snapshot.Snapshot
			if err := snapshot.Decode(b, &snap); err != nil {
				t.Fatal(err)
			}
			snap.KeySeed = index.Seed + 1
			out, err := snapshot.Append(nil, &snap)
			if err != nil {
				t.Fatal(err)
			}
			return out
		}, "key seed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, js := startServer(t)
			s := testSettings()
			a := newEngine(t, "a")
			reqs := trace(160, 8)
			rr := startRelay(t, js, relayConfig(s), a)
			a.serve(reqs[:80])
			relayed(t, rr, a)
			rr.snapshotNow(t)
			a.serve(reqs[80:])
			relayed(t, rr, a)
			rr.stop()
			data, meta := takeSnapshot(t, js, s)
			putSnapshot(t, js, s, tc.damage(t, data), meta)

			r := startRouter(t, js, s)
			caughtUp(t, js, s, r)
			fs := r.f.Stats()
			if fs.SnapshotsRefused != 1 || fs.SnapshotsLoaded != 0 || !strings.Contains(fs.RefusedReason, tc.reason) {
				t.Errorf("router %+v: want the snapshot refused for %q", fs, tc.reason)
			}
			if err := exact(r.p, a); err != nil {
				t.Error(err)
			}
			if ss := streamState(t, js, s); fs.Applied != ss.Msgs {
				t.Errorf("router applied %d messages, the stream holds %d", fs.Applied, ss.Msgs)
			}
			if tc.name != "corrupt" {
				return // the relay reads it as the router does
			}
			rr2 := startRelay(t, js, relayConfig(s), a)
			relayed(t, rr2, a)
			if st := rr2.Stats(); st.SnapshotIgnored != 1 || st.Restored != 0 {
				t.Errorf("relay started on the bad snapshot: %+v; want it ignored", st)
			}
		})
	}
}

// The stream deleted under a running relay: the relay makes it again, sees
// the new incarnation, and starts its pipeline again from its snapshot;
// its next snapshot is of the new stream, and a router started on it is
// exact.
//
// A collector over the relay's current pipeline, registered once by the
// caller, serves the metrics throughout and reads the new pipeline.
func TestStreamDeletedUnderARunningRelay(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a := newEngine(t, "a")
	reqs := trace(400, 9)
	cfg := relayConfig(s)
	cfg.SnapshotEvery = 50 * time.Millisecond // a snapshot is where the relay finds the stream changed
	rr := startRelay(t, js, cfg, a)
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewCollector(func() kvpipe.Stats {
		if p := rr.Pipeline(); p != nil {
			return p.Stats()
		}
		return kvpipe.Stats{}
	}))
	a.serve(reqs[:150])
	relayed(t, rr, a)
	eventually(t, "a snapshot", func() error {
		if rr.Stats().Snapshots == 0 {
			return fmt.Errorf("none")
		}
		return nil
	})
	remakeStream(t, js, s, rr, a, reqs[150:250], reqs[250:])
	p := rr.Pipeline()
	if p == nil {
		t.Fatal("the relay stopped on the new stream")
	}
	w, ok := p.Stats().Worker("a")
	if !ok {
		t.Fatal("the new pipeline has no worker a")
	}
	if got := gathered(t, reg, "kvpipe_indexed_blocks", "a"); got != float64(w.Actor.IndexedBlocks) || got == 0 {
		t.Errorf("kvpipe_indexed_blocks{worker=a} = %v, the new pipeline's worker holds %d", got, w.Actor.IndexedBlocks)
	}
	// The relay stops, writing its last snapshot: a snapshot read while the
	// relay writes the next fails, and on a loaded machine a read can take
	// longer than the 50ms between writes.
	rr.stop()
	if rr.err != nil && !errors.Is(rr.err, context.Canceled) {
		t.Fatalf("relay: %v", rr.err)
	}
	_, meta, err := loadSnapshot(js, s)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	info, err := js.Stream(ctx, s.Stream)
	if err != nil {
		t.Fatal(err)
	}
	if !meta.StreamCreated.Equal(info.CachedInfo().Created) {
		t.Fatal("the relay's snapshot is of the old stream")
	}
	r := startRouter(t, js, s)
	caughtUp(t, js, s, r)
	if err := exact(r.p, a); err != nil {
		t.Error(err)
	}
	if fs := r.f.Stats(); fs.SnapshotsLoaded != 1 {
		t.Errorf("router %+v: want the new snapshot loaded", fs)
	}
}

// A message the follower cannot decode clears its worker (a remove may be
// among its ops), which stays partial, and never holds a key its engine
// dropped, until the engine clears its cache and the worker is whole again.
func TestBadMessageClearsItsWorker(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a := newEngine(t, "a")
	reqs := trace(300, 10)
	rr := startRelay(t, js, relayConfig(s), a)
	r := startRouter(t, js, s)
	a.serve(reqs[:100])
	relayed(t, rr, a)
	caughtUp(t, js, s, r)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, garbage := range []string{"\x07nonsense", "\x01\x00\x09"} {
		if _, err := js.Publish(ctx, opstream.Settings(s).Subject("a"), []byte(garbage)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := js.Publish(ctx, s.Prefix+".~!", []byte("\x01\x00")); err != nil { // no worker's subject
		t.Fatal(err)
	}
	a.serve(reqs[100:200])
	relayed(t, rr, a)
	caughtUp(t, js, s, r)
	if fs := r.f.Stats(); fs.BadMessages != 3 {
		t.Errorf("router %+v: want 3 bad messages", fs)
	}
	if w, ok := r.p.Stats().Worker("a"); !ok || !w.Actor.Partial {
		t.Errorf("worker a %+v: want it partial", w)
	}
	if err := sound(r.p, a); err != nil {
		t.Error(err)
	}
	// The engine clears its cache: whole again, and exact from then on.
	ev := a.sim.Clear()
	a.pub.Publish(appendEvents(ev))
	a.serve(reqs[200:])
	relayed(t, rr, a)
	caughtUp(t, js, s, r)
	if err := exact(r.p, a); err != nil {
		t.Error(err)
	}
}

// A relay restarted from a snapshot older than the Duplicates window: the
// server no longer knows its replay's first ids (it would store them
// again, and count their blocks twice) but still knows later ones. The
// relay matches its replay against the stream's messages instead, sends
// none of it, and routers, one that watched it all and one that joins
// after, end exact.
func TestReplayStraddlingTheDuplicatesWindow(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	s.Duplicates = 400 * time.Millisecond
	a := newEngine(t, "a")
	reqs := trace(300, 11)
	rr := startRelay(t, js, relayConfig(s), a)
	r := startRouter(t, js, s)
	a.serve(reqs[:80])
	relayed(t, rr, a)
	rr.snapshotNow(t)
	old, oldMeta := takeSnapshot(t, js, s)
	a.serve(reqs[80:160])
	relayed(t, rr, a)
	// What is waited for is the clock: the window of those messages ends.
	for end := time.Now().Add(s.Duplicates + 300*time.Millisecond); time.Now().Before(end); {
		time.Sleep(20 * time.Millisecond)
	}
	a.serve(reqs[160:220]) // still in the window when replayed
	relayed(t, rr, a)
	rr.stop()
	putSnapshot(t, js, s, old, oldMeta)
	rr2 := startRelay(t, js, relayConfig(s), a)
	relayed(t, rr2, a)
	if st := rr2.Stats(); st.Restored != 1 || st.Resets != 0 || st.Published != 0 || st.Replayed == 0 {
		t.Errorf("restarted relay %+v: want the worker restored and its replay matched, none of it sent", st)
	}
	a.serve(reqs[220:])
	relayed(t, rr2, a)
	late := startRouter(t, js, s)
	caughtUp(t, js, s, r, late)
	for i, x := range []*router{r, late} {
		if err := exact(x.p, a); err != nil {
			t.Errorf("router %d: %v", i, err)
		}
	}
}

// A relay restarted from its snapshot whose engine restarted meanwhile:
// the worker's ops no longer follow what the stream holds of it (the relay
// before published batches of the old incarnation after the snapshot). The
// worker is reset in the stream, by publishing its whole state again, and
// the router ends exact for the new incarnation.
func TestRestoredWorkerPartsFromTheStream(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a := newEngine(t, "a")
	reqs := trace(300, 12)
	rr := startRelay(t, js, relayConfig(s), a)
	r := startRouter(t, js, s)
	a.serve(reqs[:100])
	relayed(t, rr, a)
	rr.snapshotNow(t)
	old, oldMeta := takeSnapshot(t, js, s)
	a.serve(reqs[100:160]) // published after the snapshot
	relayed(t, rr, a)
	rr.stop()
	putSnapshot(t, js, s, old, oldMeta)
	a.restart(t)
	a.serve(reqs[160:])
	rr2 := startRelay(t, js, relayConfig(s), a)
	relayed(t, rr2, a)
	if st := rr2.Stats(); st.Resets != 1 || st.Republished != 1 || st.Restored != 1 {
		t.Errorf("restarted relay %+v: want the restored worker reset once", st)
	}
	caughtUp(t, js, s, r)
	if err := exact(r.p, a); err != nil {
		t.Error(err)
	}
	if err := sameBlocks(rr2.Pipeline(), r); err != nil {
		t.Error(err)
	}
}

// A worker removed and added again within the stream's Duplicates window
// makes, from its engine's start, the same ops as its first run: its new
// messages go on from its removal's id, so the server keeps them (none is
// taken for a copy of the first run's) and every router ends with it.
func TestWorkerRemovedAndAddedAgain(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a, b := newEngine(t, "a"), newEngine(t, "b")
	reqs := trace(200, 4)
	rr := startRelay(t, js, relayConfig(s), a, b)
	r := startRouter(t, js, s)
	a.serve(reqs[:100])
	b.serve(reqs[100:])
	relayed(t, rr, a, b)
	caughtUp(t, js, s, r)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := rr.RemoveWorker(ctx, a.name); err != nil {
		t.Fatal(err)
	}
	if err := rr.AddWorker(a.name, a.config()); err != nil {
		t.Fatal(err)
	}
	converged(t, js, s, rr, r, a, b)
	// A publish retried after its acknowledgement timed out (under load)
	// is acknowledged as a copy of itself: only those may be duplicates.
	if st := rr.Stats(); st.Duplicates > st.Retries || st.Resets != 0 {
		t.Errorf("relay %+v: want no duplicate but of a retry, and no reset", st)
	}
}

// NATS is down when a worker is removed, for longer than the pipeline
// waits for the removal, and the worker is added again before NATS comes
// back. The removal still goes into the stream before anything of the
// worker's new run, so every router ends with the worker, as its engine
// holds it.
func TestWorkerAddedAgainBeforeItsRemovalIsStored(t *testing.T) {
	t.Parallel()
	srv, js := startServer(t)
	s := testSettings()
	a, b := newEngine(t, "a"), newEngine(t, "b")
	reqs := trace(300, 3)
	rr := startRelay(t, js, relayConfig(s), a, b)
	r := startRouter(t, js, s)
	a.serve(reqs[:100])
	b.serve(reqs[100:200])
	relayed(t, rr, a, b)
	caughtUp(t, js, s, r)

	srv.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := rr.RemoveWorker(ctx, a.name); err != nil { // returns once the pipeline stops waiting
		t.Fatal(err)
	}
	if err := rr.AddWorker(a.name, a.config()); err != nil {
		t.Fatal(err)
	}
	a.serve(reqs[200:])
	time.Sleep(200 * time.Millisecond) // the new run's first messages made, and retrying
	srv.StartAgain()
	converged(t, js, s, rr, r, a, b)
	// a's subject: its first run, one removal, then its second run.
	var kinds []string
	forEachMessage(t, js, s, func(m *jetstream.RawStreamMsg) {
		if m.Subject != opstream.Settings(s).Subject(a.name) {
			return
		}
		ops, _, err := opstream.DecodeMessage(m.Data, nil)
		if err != nil {
			t.Fatalf("message %d: %v", m.Sequence, err)
		}
		if len(ops) == 1 && ops[0].Kind == index.OpRemoveWorker {
			kinds = append(kinds, "removal")
		} else if len(kinds) == 0 || kinds[len(kinds)-1] == "removal" {
			kinds = append(kinds, "run")
		}
	})
	if got := strings.Join(kinds, " "); got != "run removal run" {
		t.Errorf("a's messages in the stream: %s, want run removal run", got)
	}
}

// The stream deleted under a running router, and made again by the relay:
// the new stream numbers its messages from 1, and the router's consumer,
// resuming after the last it delivered, would have skipped those and kept
// what the old stream built (the index held blocks the engine had dropped,
// unflagged). The router notices the new stream within streamCheck, counts
// it, starts a run on it, and ends as the relay and the engine are.
func TestStreamRemadeUnderARunningRouter(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a := newEngine(t, "a")
	reqs := trace(400, 9)
	cfg := relayConfig(s)
	cfg.SnapshotEvery = 50 * time.Millisecond // a snapshot is where the relay finds the stream changed
	rr := startRelay(t, js, cfg, a)
	r := startRouter(t, js, s)
	a.serve(reqs[:150])
	relayed(t, rr, a)
	caughtUp(t, js, s, r)
	runs := r.f.Stats().Runs
	remakeStream(t, js, s, rr, a, reqs[150:250], reqs[250:])
	eventually(t, "the router on the new stream", func() error {
		if fs := r.f.Stats(); fs.StreamsRemade == 0 || fs.Runs == runs {
			return fmt.Errorf("%+v", fs)
		}
		return nil
	})
	// Polled: until the new run has read its start, LastApplied is still
	// the old run's, past the new stream's last, and caughtUp would pass.
	eventually(t, "the router as the relay and sound", func() error {
		err := sameBlocks(rr.Pipeline(), r)
		if err == nil {
			err = sound(r.p, a)
		}
		if err != nil { // what each side did, for a failure seen once in CI (at 87099c3) and not again
			return fmt.Errorf("%w; router %+v; relay %+v", err, r.f.Stats(), rr.Stats())
		}
		return nil
	})
}

// A router whose own engine worker has the name of one of the stream's
// workers skips that worker's messages, counted as bad, and follows the
// others: the run goes on (it used to end at that message, and every run
// after it, for good).
func TestStreamWorkerNamedAsTheRoutersOwn(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	r := startRouter(t, js, s)
	if err := r.p.AddWorker("a", kvpipe.WorkerConfig{Endpoint: "tcp://127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	a, b := newEngine(t, "a"), newEngine(t, "b")
	reqs := trace(200, 10)
	rr := startRelay(t, js, relayConfig(s), a, b)
	b.serve(reqs[100:])
	relayed(t, rr, b)
	caughtUp(t, js, s, r)
	runs := r.f.Stats().Runs
	a.serve(reqs[:100])
	relayed(t, rr, a, b)
	caughtUp(t, js, s, r)
	fs := r.f.Stats()
	if fs.BadMessages == 0 || fs.Runs != runs {
		t.Errorf("router %+v: want worker a's messages skipped as bad, in the run that was going (%d)", fs, runs)
	}
	if err := exact(r.p, b); err != nil {
		t.Error(err)
	}
	if w, ok := r.p.Stats().Worker("a"); !ok || w.Actor.IndexedBlocks != 0 {
		t.Errorf("the router's own worker a: %+v, want it holding nothing of the stream's", w.Actor)
	}
}

// A message deleted from the middle of the stream (an operator's
// DeleteMsg, a purged subject) is a gap no run can fill: the router's run
// ends on it once, as on any gap, and the next, finding it again, goes on
// past it with every worker cleared and partial (the lost message's
// worker is unknown, its removes among the ops lost), never claiming a
// block its engine dropped. It used to start over at that gap forever.
func TestStreamHoleIsGonePast(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a := newEngine(t, "a")
	reqs := trace(200, 11)
	rr := startRelay(t, js, relayConfig(s), a)
	a.serve(reqs)
	relayed(t, rr, a)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, s.Stream)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.DeleteMsg(ctx, 5); err != nil {
		t.Fatal(err)
	}
	last := streamState(t, js, s).LastSeq
	r := startRouter(t, js, s)
	eventually(t, "the router past the hole, or starting over", func() error {
		if fs := r.f.Stats(); fs.LastApplied < last && fs.Runs <= 5 {
			return fmt.Errorf("%+v", fs)
		}
		return nil
	})
	if fs := r.f.Stats(); fs.Gaps != 1 || fs.Holes != 1 || fs.Runs > 3 {
		t.Fatalf("router %+v: want one gap, gone past the second time", fs)
	}
	caughtUp(t, js, s, r) // and its shards have applied it
	if err := sound(r.p, a); err != nil {
		t.Error(err)
	}
	if w, ok := r.p.Stats().Worker("a"); !ok || !w.Actor.Partial {
		t.Errorf("router's worker a: %+v, want it partial", w.Actor)
	}
}

// makeStreamAgain deletes the stream and makes it again, empty, as an
// operator would.
func makeStreamAgain(t *testing.T, js jetstream.JetStream, s relay.Settings) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := js.DeleteStream(ctx, s.Stream); err != nil {
		t.Fatal(err)
	}
	if _, _, err := opstream.Ensure(ctx, js, opstream.Settings(s)); err != nil {
		t.Fatal(err)
	}
}

// remakeStream deletes the stream under the running relay rr while a
// serves during (the relay makes it again and starts over on it), then
// serves after, relayed.
func remakeStream(t *testing.T, js jetstream.JetStream, s relay.Settings, rr *running, a *engine, during, after []sim.Request) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := js.DeleteStream(ctx, s.Stream); err != nil {
		t.Fatal(err)
	}
	a.serve(during)
	eventually(t, "the relay started again on the new stream", func() error {
		if rr.Stats().StreamChanges == 0 {
			return fmt.Errorf("%+v", rr.Stats())
		}
		return nil
	})
	a.serve(after)
	relayed(t, rr, a)
}
