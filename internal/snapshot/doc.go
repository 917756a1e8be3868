// Package snapshot is kvpipe's saved-state format: the versioned,
// checksummed binary form of a Pipeline's index and per-worker continuity
// state (msgp-generated types), and the File that kvpipe.FileStore keeps it in.
package snapshot
