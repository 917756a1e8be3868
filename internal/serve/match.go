package serve

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
)

// maxBatch bounds a MatchBatch's requests (each is bounded on its own, the
// message by MaxMessageBytes, and its multimodal inputs in all by
// maxMessageMultiModal).
const maxBatch = 4096

func (s *service) Match(ctx context.Context, req *connect.Request[kvpipev1.MatchRequest]) (*connect.Response[kvpipev1.MatchResponse], error) {
	out, err := s.match(ctx, req.Header(), req.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(out), nil
}

func (s *service) MatchBatch(ctx context.Context, req *connect.Request[kvpipev1.MatchBatchRequest]) (*connect.Response[kvpipev1.MatchBatchResponse], error) {
	out, err := s.matchBatch(ctx, req.Header(), req.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(out), nil
}

func (s *service) matchBatch(ctx context.Context, h http.Header, r *kvpipev1.MatchBatchRequest) (*kvpipev1.MatchBatchResponse, error) {
	c := decodeCount{batch: true, requests: len(r.Requests), multimodal: multimodalIn(r)}
	if err := cmp.Or(refusal(r), c.refusal(s.limits)); err != nil {
		s.guard.refused("invalid_argument")
		return nil, err
	}
	out := &kvpipev1.MatchBatchResponse{Responses: make([]*kvpipev1.MatchResponse, len(r.Requests))}
	for i, q := range r.Requests {
		a, err := refusedInPlace(s.match(ctx, h, q))
		if err != nil {
			return nil, err
		}
		out.Responses[i] = a
	}
	return out, nil
}

func multimodalIn(r *kvpipev1.MatchBatchRequest) int {
	n := 0
	for _, q := range r.Requests {
		n += len(q.GetMultimodal())
	}
	return n
}

// refusedInPlace is match's answer to one request of many: a refusal goes
// in the answer, and only what ends them all (the pipeline closed, the
// call cancelled) is returned.
func refusedInPlace(out *kvpipev1.MatchResponse, err error) (*kvpipev1.MatchResponse, error) {
	if err == nil {
		return out, nil
	}
	switch code := connect.CodeOf(err); code {
	case connect.CodeUnavailable, connect.CodeCanceled, connect.CodeDeadlineExceeded, connect.CodeInternal:
		return nil, err
	default:
		return &kvpipev1.MatchResponse{Error: &kvpipev1.MatchError{Code: code.String(), Message: message(err)}}, nil
	}
}

func (s *service) match(ctx context.Context, h http.Header, r *kvpipev1.MatchRequest) (*kvpipev1.MatchResponse, error) {
	if err := cmp.Or(refusal(r), s.limits.checkMatch(r)); err != nil {
		s.guard.refused("invalid_argument")
		return nil, err
	}
	if r.RoutedTo != "" {
		if err := s.guard.authorize(h); err != nil {
			return nil, err
		}
	}
	scratch, _ := s.scratch.Get().(*[]kvpipe.Match)
	if scratch == nil {
		scratch = new([]kvpipe.Match)
	}
	defer s.scratch.Put(scratch)
	var ms []kvpipe.Match
	var err error
	out := &kvpipev1.MatchResponse{}
	if len(r.Keys) > 0 || len(r.EagleKeys) > 0 {
		out.RequestBlocks = uint32(max(len(r.Keys), len(r.EagleKeys)))
		ms, err = s.p.AppendMatchesKeys(ctx, (*scratch)[:0], nilIfEmpty(r.Keys), nilIfEmpty(r.EagleKeys))
		*scratch = ms[:0]
	} else {
		out.RequestBlocks = uint32(len(r.Tokens) / s.limits.blockSize)
		ms, err = s.p.FindMatchesRequest(ctx, request(r))
	}
	if err != nil {
		return nil, pipelineError(err)
	}
	out.Matches = workerMatches(ms, s.mon.cur.Load(), time.Now())
	if r.RoutedTo != "" {
		if err := s.route(r, ms); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// workerMatches converts ms, highest score first, into one allocation of
// messages and one of tiers; cur gives each worker's last batch's age.
func workerMatches(ms []kvpipe.Match, cur *sample, now time.Time) []*kvpipev1.WorkerMatch {
	if len(ms) == 0 {
		return nil
	}
	slices.SortStableFunc(ms, func(a, b kvpipe.Match) int {
		if a.Score != b.Score {
			if a.Score > b.Score {
				return -1
			}
			return 1
		}
		return cmpString(a.Worker, b.Worker)
	})
	msgs := make([]kvpipev1.WorkerMatch, len(ms))
	tiers := make([]uint32, len(ms)*index.NumTiers)
	out := make([]*kvpipev1.WorkerMatch, len(ms))
	for i, m := range ms {
		wm := &msgs[i]
		wm.Worker, wm.Blocks, wm.Predicted, wm.Score = m.Worker, uint32(m.Blocks), uint32(m.Predicted), m.Score
		wm.Partial, wm.Eagle, wm.LastEventAgeMs = m.Partial, m.Eagle, age(cur.workers[m.Worker], now)
		wm.Tiers = tiers[i*index.NumTiers : (i+1)*index.NumTiers : (i+1)*index.NumTiers]
		for t, n := range m.Tiers {
			wm.Tiers[t] = uint32(n)
		}
		out[i] = wm
	}
	return out
}

// route records r as sent to r.RoutedTo (Pipeline.Routed), with the keys
// of that worker's kind: EAGLE keys for a worker keyed over EAGLE windows.
func (s *service) route(r *kvpipev1.MatchRequest, ms []kvpipe.Match) error {
	eagle := routedEagle(r, ms, s.spec(r.RoutedTo))
	var keys []uint64
	switch {
	case eagle && len(r.EagleKeys) > 0:
		keys = r.EagleKeys
	case !eagle && len(r.Keys) > 0:
		keys = r.Keys
	case len(r.Tokens) > 0:
		var h kvpipe.Hasher
		if eagle {
			keys = h.EagleKeys(nil, request(r), s.limits.blockSize)
		} else {
			keys = h.RequestKeys(nil, request(r), s.limits.blockSize)
		}
	}
	err := s.p.Routed(r.RoutedTo, keys)
	switch {
	case errors.Is(err, kvpipe.ErrNoWorker):
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("match: routed_to: no worker %q", r.RoutedTo))
	case err != nil:
		return pipelineError(err)
	}
	return nil
}

// routedEagle says whether r's worker is keyed over EAGLE windows: as it
// was matched, else as registered, else as r's keys say.
func routedEagle(r *kvpipev1.MatchRequest, ms []kvpipe.Match, spec *kvpipev1.WorkerSpec) bool {
	for _, m := range ms {
		if m.Worker == r.RoutedTo {
			return m.Eagle
		}
	}
	if spec != nil && spec.Eagle {
		return true
	}
	return len(r.Keys) == 0 && len(r.EagleKeys) > 0
}

// nilIfEmpty keeps AppendMatchesKeys' meaning of nil: leave that kind of
// worker out.
func nilIfEmpty(k []uint64) []uint64 {
	if len(k) == 0 {
		return nil
	}
	return k
}
