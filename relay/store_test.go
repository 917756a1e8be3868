package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/nats-io/nats.go/jetstream"
)

func TestObjectStore(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, obs, err := opstream.Ensure(ctx, js, opstream.Settings(testSettings()))
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
	_, meta, err := opstream.LoadSnapshot(ctx, obs, "snap", nil)
	if err != nil || meta.Known {
		t.Errorf("Save wrote metadata %+v, %v", meta, err)
	}
	created := time.Date(2026, 1, 2, 3, 4, 5, 6789, time.UTC)
	if err := opstream.SaveSnapshot(ctx, obs, "snap", []byte("small"), opstream.SnapshotMeta{Known: true, StreamCreated: created, StreamLast: 42}); err != nil {
		t.Fatal(err)
	}
	got, meta, err = opstream.LoadSnapshot(ctx, obs, "snap", got[:0])
	if err != nil || string(got) != "small" || !meta.Known || !meta.StreamCreated.Equal(created) || meta.StreamLast != 42 {
		t.Errorf("LoadSnapshot = %q, %+v, %v", got, meta, err)
	}
	if err := obs.Delete(ctx, "snap"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Load(ctx, nil); !errors.Is(err, snapshot.ErrNotFound) {
		t.Errorf("Load after Delete: %v, want ErrNotFound", err)
	}
	if _, err := obs.Put(ctx, jetstream.ObjectMeta{Name: "snap", Metadata: map[string]string{opstream.MetaCreated: "yesterday"}}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Load(ctx, nil); !errors.Is(err, snapshot.ErrCorrupt) {
		t.Errorf("Load with bad metadata: %v, want ErrCorrupt", err)
	}
}
