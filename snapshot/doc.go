// Package snapshot is the versioned, checksummed binary form of a Pipeline's
// index and per-worker continuity state (msgp-generated types), and where it
// is kept: a File here, a JetStream object store in package relay.
package snapshot
