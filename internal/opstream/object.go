package opstream

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"time"

	"github.com/kvpipe/kvpipe/internal/snapshot"
	"github.com/nats-io/nats.go/jetstream"
)

// SnapshotMeta is what a relay writes beside a snapshot in the object's
// metadata, for followers to check it against the stream.
type SnapshotMeta struct {
	// Known: the fields below were written. A snapshot saved without them
	// (relay.NewObjectStore's Save, a router's own state) has none.
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
	MetaCreated = "kvpipe-stream-created"
	MetaLast    = "kvpipe-stream-last"
)

// SaveSnapshot replaces the snapshot in object of obs with data, and m in
// the object's metadata when m.Known. The object store writes the new
// chunks before the metadata that names them, so a reader sees the old
// snapshot or the new one; the old chunks are purged after.
func SaveSnapshot(ctx context.Context, obs jetstream.ObjectStore, object string, data []byte, m SnapshotMeta) error {
	meta := jetstream.ObjectMeta{Name: object}
	if m.Known {
		meta.Metadata = map[string]string{
			MetaCreated: m.StreamCreated.UTC().Format(time.RFC3339Nano),
			MetaLast:    strconv.FormatUint(m.StreamLast, 10),
		}
	}
	if _, err := obs.Put(ctx, meta, bytes.NewReader(data)); err != nil {
		return fmt.Errorf("relay: saving snapshot %s: %w", object, err)
	}
	return nil
}

// preallocMax is the most LoadSnapshot allocates on the object's word
// before reading it; a bigger snapshot grows as it is read.
const preallocMax = 64 << 20

// LoadSnapshot appends the bytes of the snapshot in object of obs to dst
// and returns them with its SnapshotMeta; the error wraps
// snapshot.ErrNotFound when there is none. The bytes are checked against
// the object's SHA-256 digest: a read cut short or damaged is an error
// (wrapping snapshot.ErrCorrupt), not a shorter snapshot, and so is one
// past snapshot.DefaultMaxSize.
func LoadSnapshot(ctx context.Context, obs jetstream.ObjectStore, object string, dst []byte) ([]byte, SnapshotMeta, error) {
	r, err := obs.Get(ctx, object)
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return dst, SnapshotMeta{}, fmt.Errorf("%w: object %s: %w", snapshot.ErrNotFound, object, err)
	}
	if err != nil {
		return dst, SnapshotMeta{}, fmt.Errorf("relay: loading snapshot %s: %w", object, err)
	}
	defer r.Close()
	info, err := r.Info()
	if err != nil {
		return dst, SnapshotMeta{}, fmt.Errorf("relay: loading snapshot %s: %w", object, err)
	}
	m, err := parseMeta(info.Metadata)
	if err != nil {
		return dst, SnapshotMeta{}, fmt.Errorf("%w: object %s: %w", snapshot.ErrCorrupt, object, err)
	}
	// The size is the object's metadata, which whoever can write the bucket
	// writes: it bounds the read, and only up to preallocMax the memory
	// taken before any byte is read, so a forged one costs an error.
	if info.Size > snapshot.DefaultMaxSize {
		return dst, SnapshotMeta{}, fmt.Errorf("%w: object %s: %d bytes, more than the %d a snapshot may have", snapshot.ErrCorrupt, object, info.Size, int64(snapshot.DefaultMaxSize))
	}
	start, size := len(dst), int(info.Size)
	dst = slices.Grow(dst, min(size, preallocMax)+1) // +1: the read that finds EOF (and checks the digest) needs room
	for {
		if len(dst) == cap(dst) {
			dst = slices.Grow(dst, 4096)
		}
		n, err := r.Read(dst[len(dst):cap(dst)])
		dst = dst[:len(dst)+n]
		if len(dst)-start > size {
			return dst[:start], SnapshotMeta{}, fmt.Errorf("%w: object %s: more than the %d bytes its metadata says", snapshot.ErrCorrupt, object, size)
		}
		if err == io.EOF {
			break
		}
		if errors.Is(err, jetstream.ErrDigestMismatch) {
			return dst[:start], SnapshotMeta{}, fmt.Errorf("%w: object %s: %w", snapshot.ErrCorrupt, object, err)
		}
		if err != nil {
			return dst[:start], SnapshotMeta{}, fmt.Errorf("relay: loading snapshot %s: %w", object, err)
		}
	}
	return dst, m, nil
}

func parseMeta(md map[string]string) (SnapshotMeta, error) {
	created, okC := md[MetaCreated]
	last, okL := md[MetaLast]
	if !okC && !okL {
		return SnapshotMeta{}, nil
	}
	var m SnapshotMeta
	var err error
	if m.StreamCreated, err = time.Parse(time.RFC3339Nano, created); err != nil {
		return m, fmt.Errorf("metadata %s: %w", MetaCreated, err)
	}
	if m.StreamLast, err = strconv.ParseUint(last, 10, 64); err != nil {
		return m, fmt.Errorf("metadata %s: %w", MetaLast, err)
	}
	m.Known = true
	return m, nil
}
