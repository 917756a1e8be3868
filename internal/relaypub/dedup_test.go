package relaypub

import (
	"context"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/nats-io/nats.go/jetstream"
)

// What the relay's snapshots rely on: a copy (same Nats-Msg-Id) within
// the window is acknowledged as a duplicate with the original's sequence,
// also after a server restart, and is not stored.
func TestDuplicateAckHasTheOriginalSequence(t *testing.T) {
	t.Parallel()
	srv, js := startServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s := testSettings()
	if _, _, err := opstream.Ensure(ctx, js, opstream.Settings(s)); err != nil {
		t.Fatal(err)
	}
	first, err := js.Publish(ctx, opstream.Settings(s).Subject("w"), []byte("a"), jetstream.WithMsgID("id-1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, opstream.Settings(s).Subject("w"), []byte("b"), jetstream.WithMsgID("id-2")); err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		var again *jetstream.PubAck
		eventually(t, "a publish "+when, func() error {
			actx, acancel := context.WithTimeout(ctx, time.Second)
			defer acancel()
			again, err = js.Publish(actx, opstream.Settings(s).Subject("w"), []byte("a"), jetstream.WithMsgID("id-1"))
			return err
		})
		if !again.Duplicate || again.Sequence != first.Sequence {
			t.Errorf("%s: copy acknowledged %+v; want a duplicate at seq %d", when, again, first.Sequence)
		}
		if st := streamState(t, js, s); st.Msgs != 2 {
			t.Errorf("%s: stream holds %d messages, want 2", when, st.Msgs)
		}
	}
	check("at once")
	srv.Restart()
	check("after a server restart")
}
