package serve

import (
	"fmt"
	"net"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
)

// Bounds of a request's fields besides the configurable ones: far above
// what a router sends, low enough that no request costs much.
const (
	maxLoraName   = 256
	maxSalt       = 1024
	maxMultiModal = 1024
	maxMMHash     = 256
	maxNameLen    = 128
	maxTopic      = 256
	maxEndpoint   = 512
)

func invalid(format string, args ...any) error {
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(format, args...))
}

// limits are the configurable bounds of a match request.
type limits struct {
	maxTokens, blockSize int
}

// maxKeys bounds the keys of a request: one per block of maxTokens tokens.
func (l limits) maxKeys() int { return l.maxTokens/l.blockSize + 1 }

// checkMatch reports whether r is a request the index can answer, with a
// message that says what to change; it never panics, whatever r holds.
func (l limits) checkMatch(r *kvpipev1.MatchRequest) error {
	hashed := len(r.Keys) > 0 || len(r.EagleKeys) > 0
	if len(r.Tokens) > 0 && hashed {
		return invalid("match: tokens or keys, not both")
	}
	if err := requestCount(r).refusal(l); err != nil { // the counts a codec checks too
		return err
	}
	switch {
	case hashed && (r.LoraName != "" || r.HasLoraId || r.LoraId != 0 || r.Salt != "" || len(r.Multimodal) > 0):
		return invalid("match: keys already include the adapter, salt and multimodal inputs: send them with tokens only")
	case len(r.LoraName) > maxLoraName:
		return invalid("match: lora_name of %d bytes, more than %d", len(r.LoraName), maxLoraName)
	case len(r.Salt) > maxSalt:
		return invalid("match: salt of %d bytes, more than %d", len(r.Salt), maxSalt)
	}
	if r.RoutedTo != "" {
		if err := checkName(r.RoutedTo); err != nil {
			return invalid("match: routed_to: %s", message(err))
		}
	}
	for i, mm := range r.Multimodal {
		end := uint64(mm.Offset) + uint64(mm.Length)
		switch {
		case mm.Hash == "" || len(mm.Hash) > maxMMHash:
			return invalid("match: multimodal[%d]: hash of %d bytes, want 1 to %d", i, len(mm.Hash), maxMMHash)
		case mm.Length == 0 || end > uint64(len(r.Tokens)):
			return invalid("match: multimodal[%d]: tokens [%d, %d) not within the request's %d tokens", i, mm.Offset, end, len(r.Tokens))
		}
	}
	return nil
}

// request converts a checked match request for Pipeline.FindMatchesRequest.
func request(r *kvpipev1.MatchRequest) *kvpipe.Request {
	q := &kvpipe.Request{Tokens: r.Tokens, Lora: r.LoraName, Salt: r.Salt}
	q.LoraID, q.HasLoraID = r.LoraId, r.HasLoraId
	if len(r.Multimodal) > 0 {
		q.MultiModal = make([]index.MultiModal, len(r.Multimodal))
		for i, mm := range r.Multimodal {
			q.MultiModal[i] = index.MultiModal{Hash: mm.Hash, Offset: int(mm.Offset), Length: int(mm.Length)}
		}
	}
	return q
}

// checkSpec reports whether w describes a worker kvpipe can subscribe to.
func (l limits) checkSpec(w *kvpipev1.WorkerSpec) error {
	if w == nil {
		return invalid("register: no worker")
	}
	if err := checkName(w.Name); err != nil {
		return err
	}
	if len(w.Topic) > maxTopic {
		return invalid("register: topic of %d bytes, more than %d", len(w.Topic), maxTopic)
	}
	if w.BlockSize != 0 && (w.BlockSize > 1<<20 || int(w.BlockSize)%l.blockSize != 0) {
		return invalid("register: block_size %d is not a multiple of the router's %d", w.BlockSize, l.blockSize)
	}
	if w.Endpoint == "" {
		return invalid("register: endpoint is required")
	}
	for _, ep := range []string{w.Endpoint, w.ReplayEndpoint, w.SnapshotEndpoint} {
		if ep == "" {
			continue
		}
		if _, _, err := splitEndpoint(ep); err != nil {
			return err
		}
	}
	return nil
}

// checkName accepts names safe in a URL path, a metric label and a page.
func checkName(name string) error {
	if name == "" || len(name) > maxNameLen {
		return invalid("worker name of %d bytes, want 1 to %d", len(name), maxNameLen)
	}
	for _, c := range []byte(name) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-' || c == ':'
		if !ok {
			return invalid("worker name %q: only letters, digits and . _ - : are allowed", name)
		}
	}
	return nil
}

// splitEndpoint splits tcp://host:port; other transports are refused, since
// the allow-list speaks of hosts.
func splitEndpoint(ep string) (host, port string, err error) {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok || len(ep) > maxEndpoint {
		return "", "", invalid("endpoint %.64q: want tcp://host:port", ep)
	}
	host, port, err = net.SplitHostPort(rest)
	if err != nil || host == "" {
		return "", "", invalid("endpoint %.64q: want tcp://host:port", ep)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return "", "", invalid("endpoint %.64q: port %q is not 1 to 65535", ep, port)
	}
	return host, port, nil
}
