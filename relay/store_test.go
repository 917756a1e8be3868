package relay

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/nats-io/nats.go"
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

// An object's size is its metadata's word, which whoever writes the bucket
// writes: a forged one is refused or read for what the object holds,
// never a panic or an allocation of the size claimed.
func TestObjectStoreForgedSize(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s := testSettings()
	_, obs, err := opstream.Ensure(ctx, js, opstream.Settings(s))
	if err != nil {
		t.Fatal(err)
	}
	saved := []byte("a tiny snapshot")
	for _, c := range []struct {
		size    uint64
		corrupt bool
	}{
		{1 << 62, true},    // past any snapshot: refused (was a panic in growslice)
		{16<<30 + 1, true}, // past snapshot.DefaultMaxSize
		{8 << 30, false},   // under it: the object's bytes, read as they come (was 8 GiB allocated)
		{5, true},          // fewer than the object holds
	} {
		if err := opstream.SaveSnapshot(ctx, obs, "snap", saved, opstream.SnapshotMeta{}); err != nil {
			t.Fatal(err)
		}
		forgeSize(t, js, s.Bucket, "snap", c.size)
		if info, err := obs.GetInfo(ctx, "snap"); err != nil || info.Size != c.size {
			t.Fatalf("forged size %d: info %+v, %v", c.size, info, err)
		}
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		got, _, err := opstream.LoadSnapshot(ctx, obs, "snap", nil)
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		if c.corrupt != errors.Is(err, snapshot.ErrCorrupt) {
			t.Errorf("size %d: %v, want ErrCorrupt %v", c.size, err, c.corrupt)
		}
		if !c.corrupt && string(got) != string(saved) {
			t.Errorf("size %d: loaded %q, want %q", c.size, got, saved)
		}
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 256<<20 {
			t.Errorf("size %d: the load allocated %d bytes", c.size, alloc)
		}
	}
}

// forgeSize rewrites the metadata of object in bucket's object store with
// another size, as anyone who may write the bucket's stream can.
func forgeSize(t *testing.T, js jetstream.JetStream, bucket, object string, size uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, "OBJ_"+bucket)
	if err != nil {
		t.Fatal(err)
	}
	subject := "$O." + bucket + ".M." + base64.URLEncoding.EncodeToString([]byte(object))
	raw, err := st.GetLastMsgForSubject(ctx, subject)
	if err != nil {
		t.Fatal(err)
	}
	var meta map[string]any
	if err := json.Unmarshal(raw.Data, &meta); err != nil {
		t.Fatal(err)
	}
	meta["size"] = size
	msg := nats.NewMsg(subject)
	if msg.Data, err = json.Marshal(meta); err != nil {
		t.Fatal(err)
	}
	msg.Header.Set("Nats-Rollup", "sub")
	if _, err := js.PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}
}
