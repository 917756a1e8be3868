package supervisor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvpipe/kvpipe/internal/conf"
	"github.com/kvpipe/kvpipe/internal/pace"
	"golang.org/x/sync/errgroup"
)

// Config configures a Group; it follows kvpipe's defaulting rule (package
// kvpipe's doc).
type Config struct {
	// RestartMin and RestartMax bound the jittered exponential backoff
	// before a member that panicked or returned is run again (defaults
	// 100ms and 10s; a RestartMax below RestartMin means the default).
	RestartMin, RestartMax time.Duration
	Logger                 *slog.Logger // nil discards
}

// A Member is one named long-running part of a Group.
type Member struct {
	Name string
	// Run runs the member until ctx ends. A return before that, or a panic,
	// is a failure: the member is run again after a backoff.
	Run func(ctx context.Context) error
	// Restart, when set, runs in the member's goroutine after a failure,
	// before Run is called again (a worker resyncs its state there).
	Restart func()
}

// Group runs members, each in a goroutine of its own, isolating their
// panics and restarting them with backoff until they are removed or the
// Group stops. Its methods may be called from any goroutine.
type Group struct {
	cfg    Config
	ctx    context.Context
	cancel context.CancelCauseFunc
	g      errgroup.Group

	mu      sync.Mutex
	members map[string]*running
}

type running struct {
	cancel context.CancelCauseFunc
	done   chan struct{}
}

// errRemoved and errStopped end members that are asked to stop: they are
// not failures.
var (
	errRemoved = errors.New("supervisor: member removed")
	errStopped = errors.New("supervisor: group stopped")
)

// New returns a Group whose members run under ctx: they stop when it ends.
func New(ctx context.Context, cfg Config) *Group {
	cfg.RestartMin, cfg.RestartMax = conf.Bounds(cfg.RestartMin, cfg.RestartMax, 100*time.Millisecond, 10*time.Second)
	cfg.Logger = conf.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithCancelCause(ctx)
	return &Group{cfg: cfg, ctx: ctx, cancel: cancel, members: make(map[string]*running)}
}

// Go starts m. It returns a channel closed once m's goroutine has
// returned, and its context, which ends when m is removed or the group
// stops. A name already running is an error.
func (g *Group) Go(m Member) (context.Context, <-chan struct{}, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, dup := g.members[m.Name]; dup {
		return nil, nil, fmt.Errorf("supervisor: member %q is running", m.Name)
	}
	ctx, cancel := context.WithCancelCause(g.ctx)
	r := &running{cancel: cancel, done: make(chan struct{})}
	g.members[m.Name] = r
	g.g.Go(func() error {
		defer close(r.done)
		defer g.forget(m.Name, r)
		return g.supervise(ctx, m)
	})
	return ctx, r.done, nil
}

func (g *Group) forget(name string, r *running) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.members[name] == r {
		delete(g.members, name)
	}
}

// Remove stops the named member and returns a channel closed once it has
// returned; nil when no member has that name.
func (g *Group) Remove(name string) <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	r, ok := g.members[name]
	if !ok {
		return nil
	}
	delete(g.members, name)
	r.cancel(errRemoved)
	return r.done
}

// Stop stops every member and waits for them. It returns the first error
// a member stopped with other than being asked to (its parent context's
// cause, when that ended first).
func (g *Group) Stop() error {
	g.cancel(errStopped)
	return g.g.Wait()
}

// supervise runs m until its context ends, restarting it with backoff
// after a failure. It returns nil when m was removed or the group stopped,
// and the parent context's cause when that ended.
func (g *Group) supervise(ctx context.Context, m Member) error {
	backoff := pace.Backoff{Min: g.cfg.RestartMin, Max: g.cfg.RestartMax}
	for {
		start := time.Now()
		err := g.runOnce(ctx, m)
		if ctx.Err() != nil {
			return stopError(ctx)
		}
		g.cfg.Logger.Error("kvpipe: "+m.Name+" failed; restarting it", "member", m.Name, "err", err)
		if time.Since(start) > time.Minute {
			backoff.Reset() // it ran well for a while
		}
		if !pace.Sleep(ctx, backoff.Next()) {
			return stopError(ctx)
		}
		if m.Restart != nil {
			m.Restart()
		}
	}
}

// stopError is how a member whose context ended stopped: nil when asked.
func stopError(ctx context.Context) error {
	switch err := context.Cause(ctx); {
	case errors.Is(err, errRemoved), errors.Is(err, errStopped), errors.Is(err, context.Canceled):
		return nil
	default:
		return err
	}
}

// runOnce runs m once; a panic is its error.
func (g *Group) runOnce(ctx context.Context, m Member) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	if err = m.Run(ctx); err == nil && ctx.Err() == nil {
		err = errors.New("returned before its context ended")
	}
	return err
}
