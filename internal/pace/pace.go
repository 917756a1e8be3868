// Package pace spaces out what must not come in bursts: retries (a jittered
// exponential backoff) and warnings (one per interval, the rest counted).
package pace

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"
)

// Backoff is a jittered exponential backoff from Min to Max. The zero value
// of its state starts at Min; it is owned by one goroutine.
type Backoff struct {
	Min, Max time.Duration
	cur      time.Duration
}

// Next returns the next wait, between half and all of the current step, and
// doubles the step up to Max.
func (b *Backoff) Next() time.Duration {
	if b.cur < b.Min {
		b.cur = b.Min
	}
	d := b.cur/2 + rand.N(b.cur/2+1)
	b.cur = min(2*b.cur, b.Max)
	return d
}

// Reset starts again from Min.
func (b *Backoff) Reset() { b.cur = 0 }

// Sleep waits d, or less if ctx ends first; it reports whether it waited d.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Limiter lets one event through per Every and counts the rest; it is owned
// by one goroutine.
type Limiter struct {
	Every      time.Duration
	last       time.Time
	suppressed int
}

// Allow reports whether an event at now may pass, and how many were held
// back since the last one that did.
func (l *Limiter) Allow(now time.Time) (suppressed int, ok bool) {
	if !l.last.IsZero() && now.Sub(l.last) < l.Every {
		l.suppressed++
		return 0, false
	}
	n := l.suppressed
	l.last, l.suppressed = now, 0
	return n, true
}

// Warner logs warnings through an slog.Logger, at most one per second,
// adding how many it held back to the next one it lets through. Any
// goroutine may call it; it is kvpipe's one rate-limited logger.
type Warner struct {
	log    *slog.Logger
	prefix string
	mu     sync.Mutex
	lim    Limiter
}

// NewWarner returns a Warner on log (nil discards) prefixing every message.
func NewWarner(log *slog.Logger, prefix string) *Warner {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Warner{log: log, prefix: prefix, lim: Limiter{Every: time.Second}}
}

// Warn logs msg with args, unless another warning passed within the second.
func (w *Warner) Warn(msg string, args ...any) {
	w.mu.Lock()
	n, ok := w.lim.Allow(time.Now())
	w.mu.Unlock()
	if !ok {
		return
	}
	if n > 0 {
		args = append(args, "suppressed", n)
	}
	w.log.Warn(w.prefix+msg, args...)
}
