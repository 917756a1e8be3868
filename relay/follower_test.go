package relay

import (
	"context"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/nats-io/nats.go/jetstream"
)

// A message that removes its worker and then stores under its name makes
// a new worker of that name (Feed.Apply): the follower has fed it, so a
// run that must start over without a snapshot clears it as it clears the
// others. It used to forget it at the remove, and a new run kept its
// blocks, whole.
func TestRemovedAndMadeAgainInOneMessageIsClearedOnARestart(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, _, err := opstream.Ensure(ctx, js, opstream.Settings(s))
	if err != nil {
		t.Fatal(err)
	}
	publish := func(worker string, ops ...index.Op) uint64 {
		t.Helper()
		msg, err := opstream.AppendMessage(nil, opstream.Header{}, ops)
		if err != nil {
			t.Fatal(err)
		}
		ack, err := js.Publish(ctx, opstream.Settings(s).Subject(worker), msg)
		if err != nil {
			t.Fatal(err)
		}
		return ack.Sequence
	}
	clear := index.Op{Kind: index.OpClearWorker}
	store := func(k uint64) index.Op { return index.Op{Kind: index.OpStore, Hash: k} }
	publish("a", clear, store(1))
	publish("a", index.Op{Kind: index.OpRemoveWorker}, store(7))
	last := publish("c", clear, store(8))

	f, err := NewFollower(js, s, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvpipe.New(kvpipe.Config{BlockSize: 16, Source: f, RestartMin: 10 * time.Millisecond, RestartMax: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	defer func() {
		p.Shutdown(context.Background())
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	applied := func(seq uint64) {
		t.Helper()
		for f.Stats().LastApplied < seq {
			if ctx.Err() != nil {
				t.Fatalf("follower at %d, want %d: %+v", f.Stats().LastApplied, seq, f.Stats())
			}
			time.Sleep(5 * time.Millisecond)
		}
		if err := p.Sync(ctx); err != nil {
			t.Fatal(err)
		}
	}
	holds := func(key uint64) (blocks int, partial bool) {
		ms, err := p.AppendMatchesKeys(ctx, nil, []uint64{key}, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range ms {
			if m.Worker == "a" {
				return m.Blocks, m.Partial
			}
		}
		return 0, false
	}
	applied(last)
	if b, _ := holds(7); b != 1 {
		t.Fatalf("worker a made again holds key 7 %d times, want 1", b)
	}
	runs := f.Stats().Runs
	// The stream loses its messages up to here: the next is a gap, and the
	// run after it starts from the stream's first message, no snapshot.
	if err := st.Purge(ctx, jetstream.WithPurgeSequence(last+5)); err != nil {
		t.Fatal(err)
	}
	publish("b", clear, store(30))
	last = publish("b", store(31))
	for f.Stats().Runs == runs && ctx.Err() == nil {
		time.Sleep(5 * time.Millisecond)
	}
	applied(last)
	if b, partial := holds(7); b != 0 && !partial {
		t.Errorf("after a restart without a snapshot, worker a holds key 7 whole (%d): the earlier run's, kept", b)
	}
}
