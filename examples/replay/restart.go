package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/sim"
)

// restartRun is what one replay with a router restart measured.
type restartRun struct {
	before, after, soon hits // the hits before the restart, after it, and in the first requests after it
	resyncs             uint64
	indexed             int64 // device blocks in the new router's index once it is connected
	// Of the snapshot, when one was taken.
	blocks, bytes int
	write, load   time.Duration
}

// soonAfter is how many requests after the restart count as soon after it,
// when a router that starts blind does worst.
const soonAfter = 2000

// runRestart replays the trace twice on fresh engines, each time stopping
// the router at o.restartAt of the trace and starting a new one, once from
// the old one's snapshot and once without, and compares their hit rates.
func runRestart(ctx context.Context, o options, reqs []sim.Request, source string, stdout, stderr io.Writer) error {
	dir, err := os.MkdirTemp("", "kvpipe-replay")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	at := int(o.restartAt * float64(len(reqs)))
	var runs [2]restartRun
	for i, withSnapshot := range []bool{true, false} {
		store := kvpipe.FileStore{Path: filepath.Join(dir, fmt.Sprintf("index-%d.kvps", i))}
		if runs[i], err = replayWithRestart(ctx, o, reqs, at, withSnapshot, store, stderr); err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "replay restart (%s, %d workers, capacity %d blocks, router restarted after request %d of %d)\n",
		source, o.workers, o.capacity, at, len(reqs))
	s := runs[0]
	fmt.Fprintf(stdout, "  snapshot           %d blocks in %d bytes (%.1f MB per million blocks), written in %s, loaded in %s\n",
		s.blocks, s.bytes, float64(s.bytes)/1e6/max(float64(s.blocks)/1e6, 1e-9), s.write.Round(time.Microsecond), s.load.Round(time.Microsecond))
	fmt.Fprintf(stdout, "  before the restart %s\n", s.before)
	soon := min(soonAfter, len(reqs)-at)
	for i, name := range []string{"with a snapshot", "without"} {
		fmt.Fprintf(stdout, "  restarted %-15s %d blocks indexed at once; hit rate after %s; first %d requests %s; resyncs %d\n",
			name, runs[i].indexed, runs[i].after, soon, runs[i].soon, runs[i].resyncs)
	}
	return nil
}

func replayWithRestart(ctx context.Context, o options, reqs []sim.Request, at int, withSnapshot bool, store kvpipe.Store, stderr io.Writer) (restartRun, error) {
	var out restartRun
	engines, err := startEngines(o, len(reqs))
	if err != nil {
		return out, err
	}
	defer stopEngines(engines)
	first, err := startRouter(ctx, o, engines, nil, nil, stderr)
	if err != nil {
		return out, err
	}
	defer first.stop()
	start := time.Now()
	if n := route(ctx, o, reqs[:at], 0, first.p, engines, stderr, start); n < at {
		return out, ctx.Err()
	}
	// The engines go quiet for the restart, so that their buffers hold what
	// follows the snapshot.
	quiesce(engines)
	settle(first.p, engines)
	snap, err := restart(ctx, first, withSnapshot, store, &out)
	if err != nil {
		return out, err
	}
	second, err := startRouter(ctx, o, engines, nil, snap, stderr)
	if err != nil {
		return out, err
	}
	defer second.stop()
	if err := second.p.Sync(ctx); err != nil {
		return out, err
	}
	out.indexed = second.p.Stats().Total().Actor.IndexedBlocks
	if n := route(ctx, o, reqs, at, second.p, engines, stderr, start); n < len(reqs) {
		return out, ctx.Err()
	}
	drainEngines(engines)
	out.resyncs = second.p.Stats().Total().Actor.Resyncs
	out.tally(engines[0].results, at)
	return out, second.stop()
}

// restart stops the first router, saving its snapshot in store first when
// asked, and loads it back for the second.
func restart(ctx context.Context, first *router, withSnapshot bool, store kvpipe.Store, out *restartRun) (*kvpipe.Snapshot, error) {
	if withSnapshot {
		t0 := time.Now()
		if err := first.p.SaveSnapshot(ctx, store); err != nil {
			return nil, err
		}
		out.write = time.Since(t0)
	}
	if err := first.stop(); err != nil || !withSnapshot {
		return nil, err
	}
	t0 := time.Now()
	data, err := store.Load(ctx, nil)
	if err != nil {
		return nil, err
	}
	snap := new(kvpipe.Snapshot)
	if err := snap.UnmarshalBinary(data); err != nil {
		return nil, err
	}
	out.load, out.bytes, out.blocks = time.Since(t0), len(data), snap.Blocks()
	return snap, nil
}

// tally counts the results before the restart at at, after it, and soon
// after it.
func (out *restartRun) tally(results []sim.Result, at int) {
	for i, r := range results {
		switch {
		case i < at:
			out.before.add(r)
		default:
			out.after.add(r)
			if i < at+soonAfter {
				out.soon.add(r)
			}
		}
	}
}
