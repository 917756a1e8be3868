package serve

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
)

// maxResets is how many resets the status page lists.
const maxResets = 20

// monitor samples the pipeline's counters every poll interval: what the
// root API does not keep (when a worker's last batch came, its events per
// second, its state changes and resets) is derived from their deltas.
type monitor struct {
	stats func() kvpipe.Stats
	spec  func(name string) *kvpipev1.WorkerSpec // nil for a worker a Source feeds
	poll  time.Duration
	cur   atomic.Pointer[sample]

	mu       sync.Mutex // guards watchers, resets and the order of samples
	watchers map[*watcher]struct{}
	resets   []reset
}

// sample is the pipeline as of one poll; it is never changed once published.
type sample struct {
	at      time.Time
	workers map[string]*seen
	order   []string // names, sorted
	nodes   int64
	events  float64 // per second, all workers
}

// seen is one worker as sampled.
type seen struct {
	status    *kvpipev1.WorkerStatus
	lastBatch time.Time // zero before any batch
	resets    uint64    // restarts + resyncs + reconnects so far
}

// reset is one line of the status page's recent resets.
type reset struct {
	At     time.Time
	Worker string
	What   string
}

// watcher is one WatchWorkers call's queue; lagged closes when it fell
// behind and was dropped.
type watcher struct {
	events chan *kvpipev1.WorkerEvent
	lagged chan struct{}
}

func newMonitor(stats func() kvpipe.Stats, spec func(string) *kvpipev1.WorkerSpec, poll time.Duration) *monitor {
	m := &monitor{stats: stats, spec: spec, poll: poll, watchers: map[*watcher]struct{}{}}
	m.cur.Store(&sample{workers: map[string]*seen{}})
	return m
}

// run samples until ctx ends.
func (m *monitor) run(ctx context.Context) {
	t := time.NewTicker(m.poll)
	defer t.Stop()
	for {
		m.step(time.Now())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// step takes one sample and tells the watchers what changed.
func (m *monitor) step(now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	prev := m.cur.Load()
	st := m.stats()
	next := &sample{at: now, workers: make(map[string]*seen, len(st.Workers))}
	for _, sh := range st.Shards {
		next.nodes += sh.Nodes
	}
	dt := now.Sub(prev.at).Seconds()
	for _, ws := range st.Workers {
		s := m.observe(ws, prev.workers[ws.Name], now, dt)
		next.workers[ws.Name] = s
		next.order = append(next.order, ws.Name)
		next.events += s.status.EventsPerSecond
		if old := prev.workers[ws.Name]; old == nil || old.status.State != s.status.State {
			m.notify(s.status, now)
		}
	}
	for name, old := range prev.workers {
		if next.workers[name] == nil {
			gone := &kvpipev1.WorkerStatus{Name: name, Spec: old.status.Spec, State: kvpipev1.WorkerState_WORKER_STATE_REMOVED}
			m.notify(gone, now)
		}
	}
	m.cur.Store(next)
}

// observe derives one worker's status from its counters and its last sample.
func (m *monitor) observe(ws kvpipe.WorkerStats, old *seen, now time.Time, dt float64) *seen {
	w, a := ws.Wire, ws.Actor
	st := &kvpipev1.WorkerStatus{
		Name: ws.Name, Spec: m.spec(ws.Name), Batches: max(w.Batches, a.Batches),
		Events: a.Stored + a.Removed + a.Cleared, IndexedBlocks: a.IndexedBlocks, TierBlocks: a.TierBlocks[:],
		Gaps: w.Gaps, Replayed: w.Replayed, Lost: w.Lost, Restarts: w.Restarts, Resyncs: a.Resyncs, Reconnects: w.Reconnects,
		LastEventAgeMs: -1,
	}
	st.State = state(ws, st.Spec != nil)
	s := &seen{status: st, resets: w.Restarts + a.Resyncs + w.Reconnects}
	defer func() { st.LastEventAgeMs = age(s, now) }()
	if old == nil {
		if st.Batches > 0 {
			s.lastBatch = now
		}
		return s
	}
	s.lastBatch = old.lastBatch
	if st.Batches != old.status.Batches {
		s.lastBatch = now
	}
	if dt > 0 && st.Events >= old.status.Events {
		st.EventsPerSecond = float64(st.Events-old.status.Events) / dt
	}
	if s.resets > old.resets {
		m.noteReset(now, ws.Name, st, old.status)
	}
	return s
}

func (m *monitor) noteReset(now time.Time, name string, st, old *kvpipev1.WorkerStatus) {
	what := "reconnect"
	switch {
	case st.Restarts > old.Restarts:
		what = "engine restart"
	case st.Resyncs > old.Resyncs:
		what = "resync"
	}
	m.resets = append(m.resets, reset{At: now, Worker: name, What: what})
	if len(m.resets) > maxResets {
		m.resets = m.resets[len(m.resets)-maxResets:]
	}
}

// notify queues ev for every watcher; one whose queue is full is dropped.
func (m *monitor) notify(st *kvpipev1.WorkerStatus, now time.Time) {
	ev := &kvpipev1.WorkerEvent{Worker: st, UnixMs: now.UnixMilli()}
	for w := range m.watchers {
		select {
		case w.events <- ev:
		default:
			close(w.lagged)
			delete(m.watchers, w)
		}
	}
}

// watch registers a watcher, its queue holding every worker's state now.
func (m *monitor) watch() *watcher {
	m.mu.Lock()
	defer m.mu.Unlock()
	cur := m.cur.Load()
	w := &watcher{events: make(chan *kvpipev1.WorkerEvent, len(cur.order)+256), lagged: make(chan struct{})}
	for _, name := range cur.order {
		w.events <- &kvpipev1.WorkerEvent{Worker: cur.workers[name].status, UnixMs: cur.at.UnixMilli()}
	}
	m.watchers[w] = struct{}{}
	return w
}

func (m *monitor) unwatch(w *watcher) {
	m.mu.Lock()
	delete(m.watchers, w)
	m.mu.Unlock()
}

// recentResets returns the resets noted, newest first.
func (m *monitor) recentResets() []reset {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]reset, len(m.resets))
	for i, r := range m.resets {
		out[len(out)-1-i] = r
	}
	return out
}

// age is how long ago s saw the worker's last batch, in ms; -1 before any.
func age(s *seen, now time.Time) int64 {
	if s == nil || s.lastBatch.IsZero() {
		return -1
	}
	return now.Sub(s.lastBatch).Milliseconds()
}

// state is how a router weighs a worker: one that never reached its engine
// is connecting (Stats flags it partial, as nothing of it is known).
func state(ws kvpipe.WorkerStats, engine bool) kvpipev1.WorkerState {
	switch {
	case engine && !connected(ws):
		return kvpipev1.WorkerState_WORKER_STATE_CONNECTING
	case ws.Actor.Partial:
		return kvpipev1.WorkerState_WORKER_STATE_PARTIAL
	case !engine:
		return kvpipev1.WorkerState_WORKER_STATE_FOLLOWED
	case ws.Wire.Connected:
		return kvpipev1.WorkerState_WORKER_STATE_CONNECTED
	}
	return kvpipev1.WorkerState_WORKER_STATE_CONNECTING
}

// connected: the worker is connected now, or was and has its batches.
func connected(ws kvpipe.WorkerStats) bool { return ws.Wire.Connected || ws.Wire.Batches > 0 }
