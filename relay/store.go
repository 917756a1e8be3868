package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"time"

	"github.com/kvpipe/kvpipe/snapshot"
	"github.com/nats-io/nats.go/jetstream"
)

// SnapshotMeta is what a relay writes beside a snapshot in the object's
// metadata, for followers to check it against the stream.
type SnapshotMeta struct {
	// Known: the fields below were written. A snapshot saved through Save
	// (the plain snapshot.Store) has none.
	Known bool
	// StreamCreated is the stream's creation time when the snapshot was
	// taken: a stream deleted and made again under the same name has
	// another, and the snapshot's sequences mean nothing in it.
	StreamCreated time.Time
	// StreamLast is the stream's last sequence, read before any worker was
	// captured. Every message stored up to it was made before the capture,
	// so its ops are in the snapshot (if the snapshot's relay made them):
	// every worker's snapshot covers at least up to it.
	StreamLast uint64
}

// Object metadata keys.
const (
	metaCreated = "kvpipe-stream-created"
	metaLast    = "kvpipe-stream-last"
)

// ObjectStore keeps the snapshot as one object of a JetStream object
// store. It is a snapshot.Store; SaveMeta and LoadMeta also carry the
// SnapshotMeta a relay writes.
type ObjectStore struct {
	obs    jetstream.ObjectStore
	object string
}

var _ snapshot.Store = (*ObjectStore)(nil)

// NewObjectStore returns the Store of the object named object in obs.
func NewObjectStore(obs jetstream.ObjectStore, object string) *ObjectStore {
	return &ObjectStore{obs: obs, object: object}
}

// Save replaces the snapshot with data. The object store writes the new
// chunks before the metadata that names them, so a reader sees the old
// snapshot or the new one; the old chunks are purged after.
func (s *ObjectStore) Save(ctx context.Context, data []byte) error {
	return s.SaveMeta(ctx, data, SnapshotMeta{})
}

// SaveMeta is Save with m in the object's metadata.
func (s *ObjectStore) SaveMeta(ctx context.Context, data []byte, m SnapshotMeta) error {
	meta := jetstream.ObjectMeta{Name: s.object}
	if m.Known {
		meta.Metadata = map[string]string{
			metaCreated: m.StreamCreated.UTC().Format(time.RFC3339Nano),
			metaLast:    strconv.FormatUint(m.StreamLast, 10),
		}
	}
	if _, err := s.obs.Put(ctx, meta, bytes.NewReader(data)); err != nil {
		return fmt.Errorf("relay: saving snapshot %s: %w", s.object, err)
	}
	return nil
}

// Load appends the snapshot's bytes to dst; the error wraps
// snapshot.ErrNotFound when there is none.
func (s *ObjectStore) Load(ctx context.Context, dst []byte) ([]byte, error) {
	dst, _, err := s.LoadMeta(ctx, dst)
	return dst, err
}

// LoadMeta is Load that also returns the object's SnapshotMeta. The bytes
// are checked against the object's SHA-256 digest: a read cut short or
// damaged is an error, not a shorter snapshot.
func (s *ObjectStore) LoadMeta(ctx context.Context, dst []byte) ([]byte, SnapshotMeta, error) {
	r, err := s.obs.Get(ctx, s.object)
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return dst, SnapshotMeta{}, fmt.Errorf("%w: object %s: %w", snapshot.ErrNotFound, s.object, err)
	}
	if err != nil {
		return dst, SnapshotMeta{}, fmt.Errorf("relay: loading snapshot %s: %w", s.object, err)
	}
	defer r.Close()
	info, err := r.Info()
	if err != nil {
		return dst, SnapshotMeta{}, fmt.Errorf("relay: loading snapshot %s: %w", s.object, err)
	}
	m, err := parseMeta(info.Metadata)
	if err != nil {
		return dst, SnapshotMeta{}, fmt.Errorf("%w: object %s: %w", snapshot.ErrCorrupt, s.object, err)
	}
	start := len(dst)
	dst = slices.Grow(dst, int(info.Size)+1) // +1: the read that finds EOF (and checks the digest) needs room
	for {
		if len(dst) == cap(dst) {
			dst = slices.Grow(dst, 4096)
		}
		n, err := r.Read(dst[len(dst):cap(dst)])
		dst = dst[:len(dst)+n]
		if err == io.EOF {
			break
		}
		if errors.Is(err, jetstream.ErrDigestMismatch) {
			return dst[:start], SnapshotMeta{}, fmt.Errorf("%w: object %s: %w", snapshot.ErrCorrupt, s.object, err)
		}
		if err != nil {
			return dst[:start], SnapshotMeta{}, fmt.Errorf("relay: loading snapshot %s: %w", s.object, err)
		}
	}
	return dst, m, nil
}

func parseMeta(md map[string]string) (SnapshotMeta, error) {
	created, okC := md[metaCreated]
	last, okL := md[metaLast]
	if !okC && !okL {
		return SnapshotMeta{}, nil
	}
	var m SnapshotMeta
	var err error
	if m.StreamCreated, err = time.Parse(time.RFC3339Nano, created); err != nil {
		return m, fmt.Errorf("metadata %s: %w", metaCreated, err)
	}
	if m.StreamLast, err = strconv.ParseUint(last, 10, 64); err != nil {
		return m, fmt.Errorf("metadata %s: %w", metaLast, err)
	}
	m.Known = true
	return m, nil
}
