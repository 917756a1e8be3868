package relaypub

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/nats-io/nats.go/jetstream"
)

// A relay's EAGLE worker is matched, by a router that follows the stream,
// with EAGLE keys, as by the relay itself: each message says its worker's
// mode (opstream.FlagEagle). A follower used to match every worker with
// plain keys, so that a prompt the EAGLE worker held scored nothing there.
// A router started after, from the relay's snapshot, knows the mode too.
func TestFollowerMatchesEagleWorkersWithTheirKeys(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	eg, pl := newEngine(t, "eagle"), newEngine(t, "plain")
	rr := startRelay(t, js, relayConfig(s), eg, pl)
	r := startRouter(t, js, s)
	tokens := make([]uint32, 4*bs+1) // four blocks, and the token after them an EAGLE window needs
	for i := range tokens {
		tokens[i] = uint32(7000 + i)
	}
	store := func(e *engine, bigram bool, tokens []uint32) {
		e.pub.Publish(appendEvents(codec.Event{Type: codec.BlockStored, TokenIDs: tokens, Bigram: bigram, BlockSize: bs,
			BlockHashes: []uint64{11, 12, 13, 14}, Medium: "GPU"}))
	}
	matched := func(p *kvpipe.Pipeline) error {
		ms, err := p.FindMatches(context.Background(), tokens)
		if err != nil {
			return err
		}
		got := map[string]kvpipe.Match{}
		for _, m := range ms {
			got[m.Worker] = m
		}
		if e, p := got["eagle"], got["plain"]; e.Blocks != 4 || !e.Eagle || p.Blocks != 4 || p.Eagle {
			return fmt.Errorf("matches %+v, want 4 blocks each, eagle's with EAGLE keys", ms)
		}
		return nil
	}
	eventually(t, "both workers' blocks at the relay", func() error {
		if err := matched(rr.Pipeline()); err != nil {
			store(eg, true, tokens)
			store(pl, false, tokens[:4*bs])
			time.Sleep(50 * time.Millisecond)
			return err
		}
		return nil
	})
	caughtUp(t, js, s, r)
	eventually(t, "the router matching as the relay", func() error { return matched(r.p) })
	for _, name := range []string{"eagle", "plain"} {
		if w, ok := r.p.Stats().Worker(name); !ok || w.Actor.Eagle != (name == "eagle") {
			t.Errorf("router's stats of %s: %+v, want Eagle %v", name, w.Actor, name == "eagle")
		}
	}
	rr.snapshotNow(t)
	late := startRouter(t, js, s)
	caughtUp(t, js, s, late)
	if late.f.Stats().SnapshotsLoaded == 0 {
		t.Errorf("late router %+v: want it started from the snapshot", late.f.Stats())
	}
	eventually(t, "a router started from the snapshot matching as the relay", func() error { return matched(late.p) })
}

// The stream carries each store's link (index.Op.Link), so that a router
// reads a following worker's chains by jumping as the relay does (the
// index reads device links only): an engine's first request, stored from
// nothing, is a root and its chain.
func TestStreamCarriesLinks(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a := newEngine(t, "a")
	rr := startRelay(t, js, relayConfig(s), a)
	a.serve(trace(20, 3))
	relayed(t, rr, a)
	var first []index.Op // the first message of stores
	forEachMessage(t, js, s, func(m *jetstream.RawStreamMsg) {
		ops, _, err := opstream.DecodeMessage(m.Data, nil)
		if err != nil {
			t.Fatalf("message %d: %v", m.Sequence, err)
		}
		if first == nil && ops[0].Kind == index.OpStore {
			first = ops
		}
	})
	n := 0 // its device stores, first: the request's chain (host copies and evictions follow)
	for n < len(first) && first[n].Kind == index.OpStore && first[n].Tier == index.TierDevice {
		n++
	}
	if n < 2 {
		t.Fatalf("first message of stores %+v: want a chain on device first", first)
	}
	for i, op := range first[:n] {
		want := index.Op{Kind: index.OpStore, Hash: op.Hash, Link: index.LinkRoot}
		if i > 0 {
			want.Link, want.Parent = index.LinkChild, first[i-1].Hash
		}
		if op != want {
			t.Errorf("op %d: %+v, want %+v", i, op, want)
		}
	}
}

// Engines without a host tier, so that both sides answer by jump search
// (a shard with lower-tier blocks reads key by key): a router following
// the stream, and one started later from the relay's snapshot (its stores
// linked by snapshot.Worker.AppendOps), answer every served prompt as the
// engines hold it, and hold what the relay holds.
func TestFollowersJumpExactly(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a, b := newEngineOf(t, "a", sim.NewEngine(bs, 200)), newEngineOf(t, "b", sim.NewEngine(bs, 200)) // evicting, on device only
	reqs := trace(600, 17)
	rr := startRelay(t, js, relayConfig(s), a, b)
	r := startRouter(t, js, s)
	a.serve(reqs[:300])
	b.serve(reqs[300:])
	relayed(t, rr, a, b)
	rr.snapshotNow(t)
	a.serve(reqs[100:200])
	relayed(t, rr, a, b)
	late := startRouter(t, js, s)
	caughtUp(t, js, s, r, late)
	if late.f.Stats().SnapshotsLoaded == 0 {
		t.Errorf("late router %+v: want it started from the snapshot", late.f.Stats())
	}
	for i, rt := range []*router{r, late} {
		if err := exact(rt.p, a, b); err != nil {
			t.Errorf("router %d: %v", i, err)
		}
	}
	if err := sameBlocks(rr.Pipeline(), r, late); err != nil {
		t.Error(err)
	}
}
