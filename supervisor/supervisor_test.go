package supervisor

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var fast = Config{RestartMin: time.Millisecond, RestartMax: 5 * time.Millisecond}

// A member that panics or returns early is run again, after its Restart;
// the others go on.
func TestFailedMemberIsRestarted(t *testing.T) {
	g := New(context.Background(), fast)
	var runs, restarts, steady atomic.Int64
	g.Go(Member{Name: "flaky", Run: func(ctx context.Context) error {
		switch runs.Add(1) {
		case 1:
			panic("boom")
		case 2:
			return errors.New("gave up")
		}
		<-ctx.Done()
		return ctx.Err()
	}, Restart: func() { restarts.Add(1) }})
	g.Go(Member{Name: "steady", Run: func(ctx context.Context) error { steady.Add(1); <-ctx.Done(); return nil }})
	deadline := time.Now().Add(10 * time.Second)
	for runs.Load() < 3 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if err := g.Stop(); err != nil {
		t.Errorf("Stop = %v, want nil", err)
	}
	if runs.Load() != 3 || restarts.Load() != 2 || steady.Load() != 1 {
		t.Errorf("runs %d, restarts %d, steady runs %d; want 3, 2, 1", runs.Load(), restarts.Load(), steady.Load())
	}
}

// Remove stops one member and tells when it is gone; its name is free again.
func TestRemove(t *testing.T) {
	g := New(context.Background(), fast)
	defer g.Stop()
	if g.Remove("nobody") != nil {
		t.Error("Remove of an unknown name gave a channel")
	}
	run := func(ctx context.Context) error { <-ctx.Done(); return nil }
	ctx, done, err := g.Go(Member{Name: "a", Run: run})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := g.Go(Member{Name: "a", Run: run}); err == nil {
		t.Error("a second member named a started")
	}
	<-g.Remove("a")
	<-done
	if ctx.Err() == nil {
		t.Error("the removed member's context did not end")
	}
	if _, _, err := g.Go(Member{Name: "a", Run: run}); err != nil {
		t.Errorf("a removed name cannot be used again: %v", err)
	}
}

// Stop returns the cause the parent context ended with; a plain stop, nil.
func TestStopReportsTheParentsCause(t *testing.T) {
	cause := errors.New("router stopping")
	parent, cancel := context.WithCancelCause(context.Background())
	g := New(parent, fast)
	g.Go(Member{Name: "a", Run: func(ctx context.Context) error { <-ctx.Done(); return nil }})
	cancel(cause)
	if err := g.Stop(); !errors.Is(err, cause) {
		t.Errorf("Stop = %v, want %v", err, cause)
	}
}
