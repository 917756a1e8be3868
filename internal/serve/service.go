package serve

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/snapshot"
	"google.golang.org/protobuf/proto"
)

// dumpChunk is how many blocks one Dump message carries.
const dumpChunk = 2048

// service implements kvpipev1connect.IndexServiceHandler on a Pipeline; the
// HTTP/JSON routes call the same methods.
type service struct {
	p        *kvpipe.Pipeline
	limits   limits
	guard    *guard
	mon      *monitor
	draining context.Context // done when the server drains: streams end
	saved    func()          // the registrations changed: save them
	// scratch holds *[]kvpipe.Match: the pipeline's answers while a
	// match's response is built, reused across calls.
	scratch sync.Pool

	mu    sync.Mutex // guards specs and added
	specs map[string]*kvpipev1.WorkerSpec
	added map[string]time.Time // when each spec was registered or loaded
}

func clone(w *kvpipev1.WorkerSpec) *kvpipev1.WorkerSpec { return proto.Clone(w).(*kvpipev1.WorkerSpec) }

// redact returns w without its endpoints, for a caller without the token:
// they are internal addresses, and name the engines to reach.
func redact(w *kvpipev1.WorkerSpec) *kvpipev1.WorkerSpec {
	if w == nil {
		return nil
	}
	return &kvpipev1.WorkerSpec{Name: w.Name, Topic: w.Topic, BlockSize: w.BlockSize, Eagle: w.Eagle, EndpointsRedacted: true}
}

func (s *service) spec(name string) *kvpipev1.WorkerSpec {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.specs[name]
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func pipelineError(err error) error {
	switch {
	case errors.Is(err, kvpipe.ErrClosed), errors.Is(err, kvpipe.ErrNotRunning):
		return connect.NewError(connect.CodeUnavailable, err)
	case errors.Is(err, context.Canceled):
		return connect.NewError(connect.CodeCanceled, err)
	case errors.Is(err, context.DeadlineExceeded):
		return connect.NewError(connect.CodeDeadlineExceeded, err)
	case errors.Is(err, kvpipe.ErrNoWorker):
		return connect.NewError(connect.CodeNotFound, err)
	}
	return connect.NewError(connect.CodeInternal, err)
}

func (s *service) RegisterWorker(ctx context.Context, req *connect.Request[kvpipev1.RegisterWorkerRequest]) (*connect.Response[kvpipev1.RegisterWorkerResponse], error) {
	w, err := s.register(ctx, req.Msg.GetWorker(), false)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&kvpipev1.RegisterWorkerResponse{Worker: w}), nil
}

// register adds a worker; a trusted one (from the operator's flags or
// config) skips the allow-list.
func (s *service) register(ctx context.Context, w *kvpipev1.WorkerSpec, trusted bool) (*kvpipev1.WorkerSpec, error) {
	if err := s.limits.checkSpec(w); err != nil {
		s.guard.refused("invalid_argument")
		return nil, err
	}
	w = clone(w)
	if !trusted {
		var err error
		if w, err = s.guard.pin(ctx, w); err != nil {
			return nil, err
		}
	}
	if err := s.add(w); err != nil {
		return nil, err
	}
	s.saved()
	return w, nil
}

func (s *service) add(w *kvpipev1.WorkerSpec) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, dup := s.specs[w.Name]; dup {
		return connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("register: worker %q exists: unregister it first", w.Name))
	}
	wc := kvpipe.WorkerConfig{Endpoint: w.Endpoint, ReplayEndpoint: w.ReplayEndpoint, SnapshotEndpoint: w.SnapshotEndpoint, Topic: w.Topic, Eagle: w.Eagle}
	if err := s.p.AddWorker(w.Name, wc); err != nil {
		if errors.Is(err, kvpipe.ErrClosed) {
			return pipelineError(err)
		}
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("register: %w", err))
	}
	s.specs[w.Name], s.added[w.Name] = w, time.Now()
	return nil
}

// registration is a registered worker and when it was registered (or
// loaded).
type registration struct {
	spec  *kvpipev1.WorkerSpec
	since time.Time
}

// registrations returns the registered workers, by name.
func (s *service) registrations() []registration {
	s.mu.Lock()
	out := make([]registration, 0, len(s.specs))
	for name, w := range s.specs {
		out = append(out, registration{w, s.added[name]})
	}
	s.mu.Unlock()
	slices.SortFunc(out, func(a, b registration) int { return cmpString(a.spec.Name, b.spec.Name) })
	return out
}

func (s *service) UnregisterWorker(ctx context.Context, req *connect.Request[kvpipev1.UnregisterWorkerRequest]) (*connect.Response[kvpipev1.UnregisterWorkerResponse], error) {
	if err := s.unregister(ctx, req.Msg.Name); err != nil {
		return nil, err
	}
	return connect.NewResponse(&kvpipev1.UnregisterWorkerResponse{}), nil
}

func (s *service) unregister(ctx context.Context, name string) error {
	s.mu.Lock()
	_, ok := s.specs[name]
	delete(s.specs, name)
	delete(s.added, name)
	s.mu.Unlock()
	if !ok {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("unregister: no registered worker %q", name))
	}
	s.saved()
	// The worker leaves answers at once; a removal ctx cuts short completes
	// in the background.
	if err := s.p.RemoveWorker(ctx, name); err != nil && !errors.Is(err, kvpipe.ErrNoWorker) {
		return pipelineError(err)
	}
	return nil
}

func (s *service) ListWorkers(ctx context.Context, req *connect.Request[kvpipev1.ListWorkersRequest]) (*connect.Response[kvpipev1.ListWorkersResponse], error) {
	return connect.NewResponse(s.list(s.guard.holds(req.Header()))), nil
}

// list reads the counters now, and the derived fields from the last sample;
// the endpoints only when full (the caller holds the token).
func (s *service) list(full bool) *kvpipev1.ListWorkersResponse {
	st := s.p.Stats()
	cur, now := s.mon.cur.Load(), time.Now()
	out := &kvpipev1.ListWorkersResponse{Workers: make([]*kvpipev1.WorkerStatus, 0, len(st.Workers))}
	for _, sh := range st.Shards {
		out.IndexNodes += uint64(max(sh.Nodes, 0))
	}
	for _, ws := range st.Workers {
		old := cur.workers[ws.Name]
		fresh := s.mon.observe(ws, nil, now, 0).status
		fresh.LastEventAgeMs = age(old, now)
		if old != nil {
			fresh.EventsPerSecond = old.status.EventsPerSecond
		}
		if !full {
			fresh.Spec = redact(fresh.Spec)
		}
		out.Workers = append(out.Workers, fresh)
	}
	return out
}

func (s *service) WatchWorkers(ctx context.Context, req *connect.Request[kvpipev1.WatchWorkersRequest], stream *connect.ServerStream[kvpipev1.WorkerEvent]) error {
	// Headers now: a client waits for them before its first Receive, and
	// with no worker yet nothing else would send them.
	if err := stream.Send(nil); err != nil {
		return err
	}
	return s.watch(ctx, s.guard.holds(req.Header()), stream.Send)
}

// errWatchDraining ends a watch when the server drains: a client tells it
// from an end of its own, and watches another server.
var errWatchDraining = connect.NewError(connect.CodeUnavailable,
	errors.New("watch: the server is shutting down: watch another server"))

// watch sends worker events until ctx ends or the server drains, with the
// endpoints only when full (the caller holds the token).
func (s *service) watch(ctx context.Context, full bool, send func(*kvpipev1.WorkerEvent) error) error {
	w := s.mon.watch()
	defer s.mon.unwatch(w)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.draining.Done():
			return errWatchDraining
		case <-w.lagged:
			return connect.NewError(connect.CodeResourceExhausted, errors.New("watch: the stream fell behind the workers' changes: call again"))
		case ev := <-w.events:
			if !full && ev.Worker.GetSpec() != nil {
				ev = &kvpipev1.WorkerEvent{Worker: proto.Clone(ev.Worker).(*kvpipev1.WorkerStatus), UnixMs: ev.UnixMs}
				ev.Worker.Spec = redact(ev.Worker.Spec)
			}
			if err := send(ev); err != nil {
				return err
			}
		}
	}
}

func (s *service) Dump(ctx context.Context, req *connect.Request[kvpipev1.DumpRequest], stream *connect.ServerStream[kvpipev1.DumpResponse]) error {
	return s.dump(ctx, req.Msg.Worker, stream.Send)
}

// dump sends a worker's blocks from a snapshot of the pipeline, the one
// place its engine hashes and keys are kept together.
func (s *service) dump(ctx context.Context, name string, send func(*kvpipev1.DumpResponse) error) error {
	if err := checkName(name); err != nil {
		return err
	}
	if s.spec(name) == nil {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("dump: no registered worker %q (a relay's workers are dumped at the relay)", name))
	}
	var taken kvpipe.Snapshot
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := s.p.Snapshot(sctx, &taken); err != nil {
		return pipelineError(err)
	}
	// The worker's columns are the format's own: read them back from its
	// bytes, the one form the pipeline hands out.
	var snap snapshot.Snapshot
	data, err := taken.AppendBinary(nil)
	if err == nil {
		err = snapshot.Decode(data, &snap)
	}
	if err != nil {
		return connect.NewError(connect.CodeInternal, fmt.Errorf("dump: %w", err))
	}
	i := slices.IndexFunc(snap.Workers, func(w snapshot.Worker) bool { return string(w.Name) == name })
	if i < 0 {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("dump: worker %q is not in the pipeline's snapshot yet", name))
	}
	w := &snap.Workers[i]
	for start := 0; start < len(w.Hashes) || start == 0; start += dumpChunk {
		end := min(start+dumpChunk, len(w.Hashes))
		chunk := &kvpipev1.DumpResponse{Blocks: make([]*kvpipev1.Block, 0, end-start)}
		for j := start; j < end; j++ {
			b := &kvpipev1.Block{Hash: w.Hashes[j], Key: w.Keys[j], Tiers: uint32(w.Flags[j]>>snapshot.TierShift) & (1<<4 - 1)}
			if w.Flags[j]&snapshot.FlagParent != 0 {
				b.Parent, b.HasParent = w.Parents[j], true
			}
			chunk.Blocks = append(chunk.Blocks, b)
		}
		if err := send(chunk); err != nil {
			return err
		}
	}
	return nil
}
