package kvpipe

import (
	"context"
	"slices"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
)

// sglangEagle is how SGLang with EAGLE publishes: bigram token ids (one
// more token than its blocks), map events with signed hashes and a
// cache_salt key.
var sglangEagle = engineenc.Layout{SignedHashes: true, SaltKey: true}

// storeEagle publishes the blocks of tokens (whole blocks and the token
// after them) as one bigram BlockStored chained to the last.
func (e *engine) storeEagle(tokens []uint32, mods ...func(*codec.Event)) {
	ev := codec.Event{Type: codec.BlockStored, TokenIDs: tokens, Bigram: true, BlockSize: 16, HasParent: e.parent != 0, ParentHash: e.parent, Medium: "GPU"}
	for range (len(tokens) - 1) / 16 {
		e.next++
		ev.BlockHashes = append(ev.BlockHashes, e.next)
	}
	for _, m := range mods {
		m(&ev)
	}
	e.parent = e.next
	e.pub.Publish(engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{ev}}, sglangEagle))
}

// A mixed fleet: an SGLang worker with EAGLE and a plain one cache the same
// prompt, and a shared prompt scores right on both, each with its own keys.
func TestMixedFleetScoresBothKinds(t *testing.T) {
	p := startPipeline(t, Config{Shards: 2})
	pl, eg := newEngine(t), newEngine(t)
	if err := p.AddWorker("plain", WorkerConfig{Endpoint: pl.ep, ReplayEndpoint: pl.replay}); err != nil {
		t.Fatal(err)
	}
	if err := p.AddWorker("eagle", WorkerConfig{Endpoint: eg.ep, ReplayEndpoint: eg.replay}); err != nil {
		t.Fatal(err)
	}
	shared := append(prompt(1, 4), 9001, 9002) // four blocks and a bit
	eventually(t, "both workers' prompts indexed", func() {
		pl.parent, eg.parent = 0, 0
		pl.store(shared[:64], 16)
		eg.storeEagle(shared[:65]) // SGLang holds 64 bigrams: 4 pages of 16
	}, func() bool { s := scores(t, p, shared); return s["plain"] == 4 && s["eagle"] == 4 })

	ms, err := p.FindMatches(context.Background(), shared)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.Eagle != (m.Worker == "eagle") {
			t.Errorf("%s: Match.Eagle %v", m.Worker, m.Eagle)
		}
	}
	st := p.Stats()
	for _, w := range st.Workers {
		if w.Actor.Eagle != (w.Name == "eagle") {
			t.Errorf("%s: Stats Eagle %v", w.Name, w.Actor.Eagle)
		}
	}
	diverge := func(at int) []uint32 {
		q := append([]uint32(nil), shared...)
		q[at] = 7
		return q
	}
	for _, tc := range []struct {
		name         string
		tokens       []uint32
		plain, eagle int
	}{
		{"exactly four blocks: the last EAGLE window needs token 64", shared[:64], 4, 3},
		{"a change inside block 2", diverge(40), 2, 2},
		{"a change at block 2's first token ends EAGLE block 1's window", diverge(32), 2, 1},
		{"one block: no token after it", shared[:16], 1, 0},
		{"one block and a token", shared[:17], 1, 1},
	} {
		if s := scores(t, p, tc.tokens); s["plain"] != tc.plain || s["eagle"] != tc.eagle {
			t.Errorf("%s: scores %v, want plain %d, eagle %d", tc.name, s, tc.plain, tc.eagle)
		}
	}
}

// An EAGLE worker's salt, adapter and tiers work as a plain worker's: a
// request on them matches, one without does not; a host copy counts in
// its tier. A worker configured as EAGLE is scored with EAGLE keys from
// the start, and the pre-hashed entry points take either kind.
func TestEagleSaltAdapterAndTiers(t *testing.T) {
	p := startPipeline(t, Config{Shards: 1})
	eg := newEngine(t)
	if err := p.AddWorker("eagle", WorkerConfig{Endpoint: eg.ep, ReplayEndpoint: eg.replay, Eagle: true}); err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(); !st.Workers[0].Actor.Eagle {
		t.Error("WorkerConfig.Eagle is not in the worker's stats")
	}
	r := &Request{Tokens: append(prompt(2, 3), 5), Salt: "tenant-a", LoraID: 3, HasLoraID: true}
	tagged := func(ev *codec.Event) { ev.CacheSalt, ev.LoraID, ev.HasLoraID = r.Salt, r.LoraID, true }
	eventually(t, "the salted prompt indexed", func() {
		eg.parent = 0
		eg.storeEagle(r.Tokens[:33], tagged)
		eg.storeEagle(r.Tokens[32:], func(ev *codec.Event) { ev.Medium = "CPU_PINNED" })
	}, func() bool {
		ms, err := p.FindMatchesRequest(context.Background(), r)
		return err == nil && len(ms) == 1 && ms[0].Tiers[index.TierHost] == 3
	})
	ms, _ := p.FindMatchesRequest(context.Background(), r)
	if m := ms[0]; m.Blocks != 2 || m.Tiers != [index.NumTiers]int{2, 3, 3, 3} || !m.Eagle {
		t.Errorf("match %+v, want 2 on device, 3 with the host", m)
	}
	if s := scores(t, p, r.Tokens); len(s) != 0 {
		t.Errorf("a request without the salt and adapter matches: %v", s)
	}
	var h Hasher
	keys, eagleKeys := h.RequestKeys(nil, r, 16), h.EagleKeys(nil, r, 16)
	if ms, _ := p.AppendMatchesKeys(context.Background(), nil, eagleKeys, nil); len(ms) != 0 {
		t.Errorf("AppendMatchesKeys (plain keys) scored an EAGLE worker: %v", ms)
	}
	if ms, _ := p.AppendMatchesKeys(context.Background(), nil, keys, eagleKeys); len(ms) != 1 || ms[0].Tiers[index.TierHost] != 3 {
		t.Errorf("AppendMatchesKeys: %v", ms)
	}
}

// The kinds of keys a match hashes follow each worker's mode as its events
// show it, both ways: a fleet of one worker, EAGLE and then plain again
// (an engine restarted without speculative decoding), is matched with the
// keys of its current mode on the next match.
func TestModeChangesSeenByTheNextMatch(t *testing.T) {
	p := startPipeline(t, Config{})
	e := newEngine(t)
	if err := p.AddWorker("w", WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}); err != nil {
		t.Fatal(err)
	}
	first, second := prompt(1, 4), prompt(2, 4)
	if s := scores(t, p, first); len(s) != 0 { // a look at a fleet that is plain so far
		t.Fatalf("scores %v before any event", s)
	}
	eventually(t, "the EAGLE prompt indexed", func() {
		e.parent = 0
		e.storeEagle(append(first, 9001))
	}, func() bool { return scores(t, p, append(first, 9001))["w"] == 4 })
	eventually(t, "the plain prompt indexed", func() {
		e.parent = 0
		e.store(second, 16)
	}, func() bool { return scores(t, p, second)["w"] == 4 })
	if st := p.Stats(); st.Workers[0].Actor.Eagle {
		t.Error("the worker is still EAGLE after plain blocks")
	}
}

// A worker's mode is part of its saved state: an SGLang worker with EAGLE,
// not configured as such, is matched with EAGLE keys as soon as it is
// restored from a snapshot, before its engine stores anything more.
func TestEagleModeRestoredFromASnapshot(t *testing.T) {
	e := newEngine(t)
	wc := WorkerConfig{Endpoint: e.ep, ReplayEndpoint: e.replay}
	p1 := startPipeline(t, Config{})
	if err := p1.AddWorker("eg", wc); err != nil {
		t.Fatal(err)
	}
	tokens := append(prompt(1, 4), 9001)
	eventually(t, "the EAGLE prompt indexed", func() {
		e.parent = 0
		e.storeEagle(tokens)
	}, func() bool { return scores(t, p1, tokens)["eg"] == 4 })
	// A snapshot at the last store published, so that the next router has
	// none replayed: only the snapshot can tell it the mode.
	var st FileStore
	eventually(t, "a snapshot at the last store", nil, func() bool {
		st = snapshotTo(t, p1)
		s, err := LoadSnapshot(context.Background(), st)
		return err == nil && len(s.s.Workers) == 1 && s.s.Workers[0].Seq == e.pub.Published()-1
	})
	if err := p1.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}

	p2 := restoredPipeline(t, st)
	runUntilCleanup(t, p2)
	if err := p2.AddWorker("eg", wc); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the restored worker matched with EAGLE keys", nil, func() bool {
		return scores(t, p2, tokens)["eg"] == 4
	})
	if ws := p2.Stats().Workers[0]; !ws.Actor.Eagle || ws.Actor.Stored != 0 {
		t.Errorf("restored worker: Eagle %v after %d stores, want EAGLE after none", ws.Actor.Eagle, ws.Actor.Stored)
	}
}

// A Source's worker is matched with the keys of the mode its ops last
// said (FedState.Eagle), and a change of mode is seen by the next match:
// the read path's cache of which keys to hash is dropped on it.
func TestSourceWorkerModeFollowsItsOps(t *testing.T) {
	src := source{ops: make(chan fedOps)}
	p := startPipeline(t, Config{Source: src})
	var h index.Hasher
	toks := prompt(1, 3)
	plain := h.Prompt(nil, toks, 16)
	apply := func(st FedState, ops ...index.Op) {
		t.Helper()
		if err := src.apply(t, "remote", st, ops...); err != nil {
			t.Fatal(err)
		}
		if err := p.Sync(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	match := func(tokens []uint32) Match {
		t.Helper()
		ms, err := p.FindMatches(context.Background(), tokens)
		if err != nil || len(ms) != 1 {
			t.Fatalf("matches %+v, %v: want the source's worker", ms, err)
		}
		return ms[0]
	}
	apply(FedState{}, index.Op{Kind: index.OpStore, Hash: plain[0], Link: index.LinkRoot})
	if m := match(toks); m.Eagle || m.Blocks != 1 {
		t.Fatalf("plain worker: %+v, want 1 block by plain keys", m)
	}
	eagleToks := append(slices.Clone(toks), 9)
	eagle := h.EaglePrompt(nil, eagleToks, 16)
	apply(FedState{Eagle: true}, index.Op{Kind: index.OpClearWorker}, index.Op{Kind: index.OpStore, Hash: eagle[0], Link: index.LinkRoot})
	if m := match(eagleToks); !m.Eagle || m.Blocks != 1 {
		t.Errorf("after its ops said EAGLE: %+v, want 1 block by EAGLE keys", m)
	}
	if w, ok := p.Stats().Worker("remote"); !ok || !w.Actor.Eagle {
		t.Errorf("stats %+v, want Eagle", w.Actor)
	}
}
