package wire

import "bytes"

// A snapshot-capable SGLang publisher (docs/FORMAT.md §6) suffixes the
// topic frame of every live message with its epoch, and a snapshot
// barrier's with the barrier id too.
const (
	// epochTopicMarker follows the configured topic in every live message of
	// a snapshot-capable SGLang publisher; the epoch follows it.
	epochTopicMarker = "\x00sgl-kv-epoch="
	// snapshotTopicMarker follows the epoch in the topic of a snapshot
	// barrier batch; the barrier id follows it.
	snapshotTopicMarker = "\x00sgl-kv-snapshot="
)

var (
	epochMarker    = []byte(epochTopicMarker)
	snapshotMarker = []byte(snapshotTopicMarker)
)

// splitTopic splits a live topic frame, topic + epochTopicMarker + epoch
// [+ snapshotTopicMarker + barrier id], into its parts, as subslices of
// topic (no allocation). Absent parts are nil; a part that is present but
// empty is an empty non-nil slice. A topic without the epoch marker (vLLM,
// SGLang with snapshots disabled) is all base. The markers are searched from
// the left: the configured topic must not contain epochTopicMarker.
func splitTopic(topic []byte) (base []byte, epoch []byte, snapshotID []byte) {
	i := bytes.Index(topic, epochMarker)
	if i < 0 {
		return topic, nil, nil
	}
	base, rest := topic[:i], topic[i+len(epochMarker):]
	j := bytes.Index(rest, snapshotMarker)
	if j < 0 {
		return base, rest, nil
	}
	return base, rest[:j], rest[j+len(snapshotMarker):]
}
