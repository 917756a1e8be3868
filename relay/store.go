package relay

import (
	"context"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/nats-io/nats.go/jetstream"
)

// objectStore keeps a snapshot as one object of a JetStream object store:
// a kvpipe.Store for a router's saved state, beside a relay's.
type objectStore struct {
	obs    jetstream.ObjectStore
	object string
}

// NewObjectStore returns the Store of the object named object in obs. Its
// Save replaces the snapshot, so that a reader sees the old one or the new
// one; its Load checks the bytes against the object's SHA-256 digest and
// wraps kvpipe.ErrNoSnapshot when there is none.
func NewObjectStore(obs jetstream.ObjectStore, object string) kvpipe.Store {
	return &objectStore{obs: obs, object: object}
}

// Save replaces the snapshot with data. The object store writes the new
// chunks before the metadata that names them, so a reader sees the old
// snapshot or the new one; the old chunks are purged after.
func (s *objectStore) Save(ctx context.Context, data []byte) error {
	return opstream.SaveSnapshot(ctx, s.obs, s.object, data, opstream.SnapshotMeta{})
}

// Load appends the snapshot's bytes to dst; the error wraps
// kvpipe.ErrNoSnapshot when there is none. The bytes are checked against
// the object's SHA-256 digest: a read cut short or damaged is an error,
// not a shorter snapshot.
func (s *objectStore) Load(ctx context.Context, dst []byte) ([]byte, error) {
	dst, _, err := opstream.LoadSnapshot(ctx, s.obs, s.object, dst)
	return dst, err
}
