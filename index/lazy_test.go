package index

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvpipe/kvpipe/internal/predict"
)

// lazyCase is a request as FindMatchesRequest takes it.
type lazyCase struct {
	r     Request
	bs    int
	eagle bool
}

// keys are the request's keys hashed all at once, as before
// FindMatchesRequest: Prompt or EaglePrompt for a base-model request,
// RequestKeys or EagleKeys otherwise.
func (c *lazyCase) keys(h *Hasher) []uint64 {
	bare := c.r.Lora == "" && !c.r.HasLoraID && c.r.Salt == "" && len(c.r.MultiModal) == 0
	switch {
	case bare && c.eagle:
		return h.EaglePrompt(nil, c.r.Tokens, c.bs)
	case bare:
		return h.Prompt(nil, c.r.Tokens, c.bs)
	case c.eagle:
		return h.EagleKeys(nil, &c.r, c.bs)
	}
	return h.RequestKeys(nil, &c.r, c.bs)
}

// The key stream hashes the keys hashing them all at once does, however far
// it is asked, in steps or at once, at every edge of a prompt's length and
// for every kind of request; so the golden vectors, which pin those, pin it.
func TestKeyStreamEqualsAllAtOnce(t *testing.T) {
	toks := make([]uint32, 16*70+5)
	for i := range toks {
		toks[i] = uint32(i*7919) % 151936
	}
	mm := []MultiModal{{Hash: "b", Offset: 300, Length: 40}, {Hash: "a", Offset: 20, Length: 30}}
	var cases []lazyCase
	for _, bs := range []int{16, 4, 1, 0, -1} {
		for _, n := range []int{0, 1, bs - 1, bs, bs + 1, 3 * bs, len(toks)} {
			n = max(min(n, len(toks)), 0)
			for _, eagle := range []bool{false, true} {
				for _, r := range []Request{{}, {Lora: "a"}, {LoraID: 3, HasLoraID: true, Salt: "s"}, {MultiModal: mm}, {MultiModal: mm[1:]}} {
					r.Tokens = toks[:n]
					cases = append(cases, lazyCase{r: r, bs: bs, eagle: eagle})
				}
			}
		}
	}
	var h Hasher
	for _, c := range cases {
		want := c.keys(&h)
		name := fmt.Sprintf("%d tokens, block %d, eagle %v, %+v", len(c.r.Tokens), c.bs, c.eagle, c.r.MultiModal)
		for _, step := range []int{1, 7, 64, len(want) + 1} {
			ks := newKeyStream(nil, &h, &c.r, c.bs, c.eagle)
			if ks.n != len(want) {
				t.Fatalf("%s: stream of %d keys, want %d", name, ks.n, len(want))
			}
			var got []uint64
			for n := step; len(got) < len(want); n += step {
				got = ks.upTo(n)
			}
			if got = ks.upTo(len(want) + 5); !slices.Equal(got, want) {
				t.Fatalf("%s, steps of %d: keys %x, want %x", name, step, got, want)
			}
		}
	}
}

// lazyWorld is a set of requests sharing prefixes of one long document, and
// workers caching their keys as engines do: prompts stored in order,
// evicted leaf first, holes, stores without links, lower tiers, clears.
type lazyWorld struct {
	cases []lazyCase
	keys  [][]uint64 // each case's keys, all at once
}

// newLazyWorld makes requests up to about 1,500 keys long, so that matches
// end in every round of FindMatchesRequest and past it.
func newLazyWorld(rng *rand.Rand) *lazyWorld {
	doc := make([]uint32, 4*1600)
	for i := range doc {
		doc[i] = uint32(rng.IntN(50))
	}
	w := &lazyWorld{}
	var h Hasher
	for i := range 24 {
		c := lazyCase{bs: []int{4, 4, 16, 2}[i%4], eagle: i%5 == 4}
		shared := []int{0, 8, 70, 130, 300, 1100, 3000, 6000}[rng.IntN(8)]
		toks := slices.Clone(doc[:shared])
		for range rng.IntN(400) {
			toks = append(toks, uint32(rng.IntN(50)))
		}
		c.r.Tokens = toks
		switch rng.IntN(6) {
		case 0:
			c.r.Lora = "ad"
		case 1:
			c.r.Salt = "t"
		case 2:
			c.r.MultiModal = []MultiModal{{Hash: "img", Offset: rng.IntN(len(toks) + 1), Length: 9}}
		}
		w.cases = append(w.cases, c)
		w.keys = append(w.keys, c.keys(&h))
	}
	return w
}

// step applies one random change for a random worker to both s and ref.
func (w *lazyWorld) step(next func(int) int, apply func(WorkerID, ...Op)) {
	id := WorkerID(next(6))
	keys := w.keys[next(len(w.keys))]
	if len(keys) == 0 {
		return
	}
	end := 1 + next(len(keys))
	switch r := next(100); {
	case r < 45: // a prompt stored in order, with links
		ops := make([]Op, 0, end)
		for i, k := range keys[:end] {
			o := Op{Kind: OpStore, Link: LinkRoot, Hash: k}
			if i > 0 {
				o.Link, o.Parent = LinkChild, keys[i-1]
			}
			ops = append(ops, o)
		}
		apply(id, ops...)
	case r < 65: // its last blocks evicted, leaf first
		for i := end - 1; i >= 0 && i >= end-next(300); i-- {
			apply(id, Op{Kind: OpRemove, Hash: keys[i]})
		}
	case r < 78: // a hole in the middle
		apply(id, Op{Kind: OpRemove, Hash: keys[next(end)]})
	case r < 86: // a block stored without a link
		apply(id, Op{Kind: OpStore, Hash: keys[next(end)]})
	case r < 93: // offloaded to the host: lower tiers in play
		for _, k := range keys[next(end):end] {
			apply(id, Op{Kind: OpStore, Tier: TierHost, Hash: k})
		}
	case r < 98:
		apply(id, Op{Kind: OpClearWorker})
	default:
		apply(id, Op{Kind: OpRemoveWorker})
	}
}

// lazyAgainstTree drives a lazyWorld through steps changes and checks, now
// and then, every request's FindMatchesRequest against the sequential
// reference's answer to all its keys. It returns how many answers needed
// more than one round.
func lazyAgainstTree(t *testing.T, w *lazyWorld, next func(int) int, steps int) (rounds int) {
	ctx := context.Background()
	s := NewShards(2, 4)
	defer s.Close()
	ref := NewTree()
	var h Hasher
	var got, want []Score
	for range steps {
		w.step(next, func(id WorkerID, ops ...Op) {
			for _, o := range ops {
				ref.Apply(id, o)
			}
			s.Queue(id) <- &Batch{Worker: id, Ops: ops}
		})
		if next(4) != 0 {
			continue
		}
		if err := s.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		i := next(len(w.cases))
		c := &w.cases[i]
		var err error
		if got, err = s.FindMatchesRequest(ctx, got[:0], &h, &c.r, c.bs, c.eagle); err != nil {
			t.Fatal(err)
		}
		want = sortScores(ref.FindMatches(want[:0], w.keys[i]))
		if !slices.Equal(got, want) {
			t.Fatalf("request %d (%d keys, block %d, eagle %v): lazily %v, reference %v", i, len(w.keys[i]), c.bs, c.eagle, got, want)
		}
		if reachEnd(got, lazyFirst) {
			rounds++
		}
	}
	return rounds
}

// FindMatchesRequest answers what the reference answers with every key
// hashed first, whatever the workers' caches look like.
func TestLazyAgainstTree(t *testing.T) {
	rounds := 0
	for seed := range uint64(6) {
		rng := rand.New(rand.NewPCG(seed, 11))
		rounds += lazyAgainstTree(t, newLazyWorld(rng), rng.IntN, 1500)
	}
	t.Logf("%d answers took more than one round", rounds)
	if rounds < 50 {
		t.Errorf("only %d answers took more than one round", rounds)
	}
}

// FuzzLazyAgainstTree: TestLazyAgainstTree's steps driven by the fuzzer's
// bytes (run it with -fuzzminimizetime 20x, as FuzzJumpAgainstTree).
func FuzzLazyAgainstTree(f *testing.F) {
	for seed := range uint64(4) {
		rng := rand.New(rand.NewPCG(seed, 13))
		b := make([]byte, 1024)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		f.Add(b)
	}
	w := newLazyWorld(rand.New(rand.NewPCG(3, 4)))
	f.Fuzz(func(t *testing.T, data []byte) {
		next := func(n int) int {
			if n <= 1 || len(data) < 2 {
				return 0
			}
			v := int(binary.LittleEndian.Uint16(data))
			data = data[2:]
			return v % n
		}
		lazyAgainstTree(t, w, next, min(len(data)/6, 300))
	})
}

// Predictions past the first round's keys take the search on: the answer
// is FindMatches' of every key.
func TestLazyFollowsPredictions(t *testing.T) {
	ctx := context.Background()
	s := NewShards(2, 4)
	defer s.Close()
	toks := make([]uint32, 16*500)
	for i := range toks {
		toks[i] = uint32(i)
	}
	var h Hasher
	r := &Request{Tokens: toks}
	keys := h.Prompt(nil, toks, 16)
	ops := []Op{{Kind: OpStore, Link: LinkRoot, Hash: keys[0]}}
	for i := 1; i < 60; i++ {
		ops = append(ops, Op{Kind: OpStore, Link: LinkChild, Hash: keys[i], Parent: keys[i-1]})
	}
	s.Queue(1) <- &Batch{Worker: 1, Ops: ops}
	var c1, c2 predict.Counts
	predictKeys(s, 1, &c1, 100, keys[:300]...)
	predictKeys(s, 2, &c2, 100, keys[:lazyFirst]...) // ends where the first round does
	if err := s.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	want, err := s.FindMatches(ctx, nil, keys)
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.FindMatchesRequest(ctx, nil, &h, r, 16, false)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) || got[0].Predicted != 300 || got[1].Predicted != lazyFirst {
		t.Errorf("lazily %v, every key %v (want Predicted 300 and %d)", got, want, lazyFirst)
	}
}

// FindMatchesRequest allocates nothing once its Hasher and dst have room,
// whatever the rounds.
func TestFindMatchesRequestAllocatesNothing(t *testing.T) {
	ctx := context.Background()
	s := NewShards(2, 4)
	defer s.Close()
	toks := make([]uint32, 16*2000)
	for i := range toks {
		toks[i] = uint32(i)
	}
	var h Hasher
	r := &Request{Tokens: toks}
	keys := h.Prompt(nil, toks, 16)
	for id := range WorkerID(4) {
		b := &Batch{Worker: id}
		for i := range 30 + 500*int(id) {
			o := Op{Kind: OpStore, Link: LinkRoot, Hash: keys[i]}
			if i > 0 {
				o.Link, o.Parent = LinkChild, keys[i-1]
			}
			b.Ops = append(b.Ops, o)
		}
		s.Queue(id) <- b
	}
	if err := s.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	salted := &Request{Tokens: toks, Salt: "s", MultiModal: []MultiModal{{Hash: "img", Offset: 20, Length: 30}}}
	dst := make([]Score, 0, 8)
	for _, c := range []struct {
		r     *Request
		eagle bool
		want  []Score
	}{
		{r, false, []Score{dev(0, 30), dev(1, 530), dev(2, 1030), dev(3, 1530)}},
		{salted, false, nil},
		{salted, true, nil},
	} {
		find := func() { dst, _ = s.FindMatchesRequest(ctx, dst[:0], &h, c.r, 16, c.eagle) }
		find()
		if a := testing.AllocsPerRun(50, find); a != 0 {
			t.Errorf("FindMatchesRequest (salt %q, eagle %v) allocated %v times", c.r.Salt, c.eagle, a)
		}
		if !slices.Equal(dst, c.want) && len(dst)+len(c.want) > 0 {
			t.Errorf("FindMatchesRequest (salt %q, eagle %v) = %v, want %v", c.r.Salt, c.eagle, dst, c.want)
		}
	}
}

// A match ending at a round's last key, or one key before or after it, is
// scored over every key: rounds go on exactly while a score reaches their
// end. Worker 1's stores carry links (jump search), worker 2's do not (key
// by key), on 1 and 4 shards.
func TestLazyRoundEdges(t *testing.T) {
	ctx := context.Background()
	const n = 700 // keys of the prompt
	toks := make([]uint32, 16*n+7)
	for i := range toks {
		toks[i] = uint32(i * 7)
	}
	var h Hasher
	r := &Request{Tokens: toks}
	keys := h.Prompt(nil, toks, 16)
	ends := []int{0, 1, n - 1, n}
	for end := lazyFirst; end < n; end *= lazyGrowth {
		ends = append(ends, end-1, end, end+1)
	}
	for _, shards := range []int{1, 4} {
		for _, held := range ends {
			s := NewShards(shards, 4)
			linked, bare := &Batch{Worker: 1}, &Batch{Worker: 2}
			for i, k := range keys[:held] {
				o := Op{Kind: OpStore, Link: LinkRoot, Hash: k}
				if i > 0 {
					o.Link, o.Parent = LinkChild, keys[i-1]
				}
				linked.Ops = append(linked.Ops, o)
				bare.Ops = append(bare.Ops, Op{Kind: OpStore, Hash: k})
			}
			s.Queue(1) <- linked
			s.Queue(2) <- bare
			if err := s.Sync(ctx); err != nil {
				t.Fatal(err)
			}
			got, err := s.FindMatchesRequest(ctx, nil, &h, r, 16, false)
			s.Close()
			var want []Score
			if held > 0 {
				want = []Score{dev(1, held), dev(2, held)}
			}
			if err != nil || !slices.Equal(got, want) {
				t.Errorf("%d shards, %d keys held: %v, %v; want %v", shards, held, got, err, want)
			}
		}
	}
}
