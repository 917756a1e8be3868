package relay

import (
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Settings name what a relay and its followers share on NATS: the stream
// of ops (one subject per worker, <Prefix>.<worker token>), its retention
// and de-duplication window, and the object store holding the snapshot. A
// relay and every follower of it must use the same ones; the zero value
// means the defaults, which `kvpipe relay` uses too. A relay keeps an hour
// of ops by default, 240 snapshot intervals: a router can join (or a relay
// restart) from any snapshot of the last hour and find every message after
// it still in the stream.
type Settings struct {
	Prefix string // subject prefix (default "kvpipe.ops"); the stream holds <Prefix>.>
	Stream string // stream name (default "KVPIPE_OPS")
	Bucket string // object store bucket (default "kvpipe-snapshots"), [A-Za-z0-9_-]+
	Object string // the snapshot's object name in Bucket (default "snapshot")
	// Duplicates is the stream's de-duplication window (default 2m): a
	// message whose id the stream stored less than this long ago is
	// acknowledged with the first one's sequence and not stored again. It
	// must not exceed MaxAge.
	Duplicates time.Duration
	// MaxAge (default 1h) and MaxBytes (default 1 GiB) bound what the
	// stream keeps (the oldest messages go first). Keep several snapshot
	// intervals: a snapshot whose next messages are gone is refused, and
	// routers then start from a trimmed stream, partial. MaxMsgs, 0 by
	// default, bounds the message count.
	MaxAge   time.Duration
	MaxBytes int64
	MaxMsgs  int64
	Replicas int // stream and bucket replicas (default 1)
	// Storage of the stream and the bucket: jetstream.FileStorage (the
	// zero value and the default) or MemoryStorage.
	Storage jetstream.StorageType
}
