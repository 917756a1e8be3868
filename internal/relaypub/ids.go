package relaypub

import (
	"strconv"

	"github.com/zeebo/xxh3"
)

// Message ids. The stream drops a message whose Nats-Msg-Id it stored
// within its Duplicates window, and acknowledges it with the first one's
// sequence. An id is
//
//	<worker token>.<seq>.<fingerprint>.<part>.<lineage>   the ops of engine batch seq
//	<worker token>.start.<lineage>                         a fresh worker's first message (its clear)
//	<worker token>.r<nonce>.<counter>.<lineage>            any other ops (a reset, a recovery)
//
// with fingerprint, nonce and lineage in hex. The lineage chains every
// message a relay published for the worker: it hashes the previous
// message's lineage, this id's other fields and the message's bytes. Two
// relays therefore give a message the same id exactly when they published
// the same messages for the worker up to and including it: two relays that
// followed the engine from its start, or one started from the other's
// snapshot.
//
// Why that matters: the index counts each (worker, tier, key) — an engine
// may hold two blocks under one router key — so each worker's messages
// must reach a router once each, as one relay's sequence. Applied twice, a
// store counts twice and a later remove leaves the key; mixed with another
// relay's different ops for the same batches (a relay that joined late or
// resynced makes other ops), the counts are wrong too. Ids on the engine
// batch alone would have the server keep an arbitrary mix of two such
// relays' versions; with the lineage, the copies it drops are true copies.
//
// A relay restarted from its snapshot does not rely on the window for its
// replay: it reads back the ids of the messages the stream holds for each
// worker after the snapshot's sequence, and its replay, making the same
// messages again, sends none of them (Stats.Replayed). A replay that makes
// another message than the stream holds, or a copy acknowledged at or
// before the worker's last sequence, means the worker's ops no longer
// follow the stream's: the worker is reset there (removed, then added
// again to start from its engine afresh), never continued.
//
// What the ids do not do: keep two relays of different states apart. Two
// relays of one engine are only safe while they publish the same messages
// (both from the engine's start within the Duplicates window, or the
// second from the first's snapshot); one whose worker resyncs on its own
// publishes ops the other's never match, and the stream then holds both.
// Run one relay per engine, and a second only as described.

// lineage is the hash that chains a worker's messages.
type lineage = uint64

// freshLineage is the lineage of a worker a relay starts from nothing: the
// same in every relay, so two that both follow the engine from its start
// publish the same ids.
func freshLineage(token string) lineage { return xxh3.HashString(token) }

// appendBatchID appends the id of the message msg of engine batch seq
// (fingerprint fp), part part, after prev, and returns it with the new
// lineage.
func appendBatchID(dst []byte, token string, seq, fp uint64, part int, prev lineage, msg []byte) ([]byte, lineage) {
	dst = append(dst, token...)
	dst = append(dst, '.')
	dst = strconv.AppendUint(dst, seq, 10)
	dst = append(dst, '.')
	dst = strconv.AppendUint(dst, fp, 16)
	dst = append(dst, '.')
	dst = strconv.AppendInt(dst, int64(part), 10)
	return chain(dst, prev, msg)
}

// appendStartID appends the id of a fresh worker's first message, msg.
func appendStartID(dst []byte, token string, prev lineage, msg []byte) ([]byte, lineage) {
	dst = append(dst, token...)
	dst = append(dst, ".start"...)
	return chain(dst, prev, msg)
}

// appendOtherID appends the id of msg, made of no engine batch: nonce
// and counter make it this relay process's alone.
func appendOtherID(dst []byte, token string, nonce, counter uint64, prev lineage, msg []byte) ([]byte, lineage) {
	dst = append(dst, token...)
	dst = append(dst, ".r"...)
	dst = strconv.AppendUint(dst, nonce, 16)
	dst = append(dst, '.')
	dst = strconv.AppendUint(dst, counter, 10)
	return chain(dst, prev, msg)
}

// chain hashes the id so far (its last bytes after the token), prev and
// msg into the next lineage and appends it.
func chain(id []byte, prev lineage, msg []byte) ([]byte, lineage) {
	next := xxh3.HashSeed(id, xxh3.HashSeed(msg, prev))
	id = append(id, '.')
	return strconv.AppendUint(id, next, 16), next
}

// lineageOf reads the lineage from a message id.
func lineageOf(id string) (lineage, bool) {
	for i := len(id) - 1; i >= 0; i-- {
		if id[i] == '.' {
			v, err := strconv.ParseUint(id[i+1:], 16, 64)
			return v, err == nil
		}
	}
	return 0, false
}
