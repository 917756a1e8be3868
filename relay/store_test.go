package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/snapshot"
	"github.com/nats-io/nats.go/jetstream"
)

func TestObjectStore(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, obs, err := Ensure(ctx, js, testSettings())
	if err != nil {
		t.Fatal(err)
	}
	st := NewObjectStore(obs, "snap")
	if _, err := st.Load(ctx, nil); !errors.Is(err, snapshot.ErrNotFound) {
		t.Fatalf("Load of nothing: %v, want ErrNotFound", err)
	}
	big := make([]byte, 300_000) // several chunks
	for i := range big {
		big[i] = byte(i * 7)
	}
	if err := st.Save(ctx, big); err != nil {
		t.Fatal(err)
	}
	got, err := st.Load(ctx, []byte("x"))
	if err != nil || string(got) != "x"+string(big) {
		t.Fatalf("Load: %d bytes, %v; want dst then the %d saved", len(got), err, len(big))
	}
	_, meta, err := st.LoadMeta(ctx, nil)
	if err != nil || meta.Known {
		t.Errorf("Save wrote metadata %+v, %v", meta, err)
	}
	created := time.Date(2026, 1, 2, 3, 4, 5, 6789, time.UTC)
	if err := st.SaveMeta(ctx, []byte("small"), SnapshotMeta{Known: true, StreamCreated: created, StreamLast: 42}); err != nil {
		t.Fatal(err)
	}
	got, meta, err = st.LoadMeta(ctx, got[:0])
	if err != nil || string(got) != "small" || !meta.Known || !meta.StreamCreated.Equal(created) || meta.StreamLast != 42 {
		t.Errorf("LoadMeta = %q, %+v, %v", got, meta, err)
	}
	if err := obs.Delete(ctx, "snap"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Load(ctx, nil); !errors.Is(err, snapshot.ErrNotFound) {
		t.Errorf("Load after Delete: %v, want ErrNotFound", err)
	}
	if _, err := obs.Put(ctx, jetstream.ObjectMeta{Name: "snap", Metadata: map[string]string{metaCreated: "yesterday"}}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Load(ctx, nil); !errors.Is(err, snapshot.ErrCorrupt) {
		t.Errorf("Load with bad metadata: %v, want ErrCorrupt", err)
	}
}

// What the relay's snapshots rely on: a copy (same Nats-Msg-Id) within
// the window is acknowledged as a duplicate with the original's sequence,
// also after a server restart, and is not stored.
func TestDuplicateAckHasTheOriginalSequence(t *testing.T) {
	t.Parallel()
	srv, js := startServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s := testSettings()
	if _, _, err := Ensure(ctx, js, s); err != nil {
		t.Fatal(err)
	}
	first, err := js.Publish(ctx, s.Subject("w"), []byte("a"), jetstream.WithMsgID("id-1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, s.Subject("w"), []byte("b"), jetstream.WithMsgID("id-2")); err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		var again *jetstream.PubAck
		eventually(t, "a publish "+when, func() error {
			actx, acancel := context.WithTimeout(ctx, time.Second)
			defer acancel()
			again, err = js.Publish(actx, s.Subject("w"), []byte("a"), jetstream.WithMsgID("id-1"))
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
