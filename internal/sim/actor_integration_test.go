package sim

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
)

// All options at once, through kvpipe's actor and index: the partial-tail
// and sliding-window filters count, the host tier is indexed, and the index
// scores each worker exactly as many leading blocks as its device holds,
// and as its device and host tier together hold.
func TestRealisticEnginesThroughTheActor(t *testing.T) {
	for _, lora := range []bool{false, true} {
		t.Run(fmt.Sprint("lora=", lora), func(t *testing.T) {
			const workers, bs = 3, 64
			reqs := SyntheticTrace(400, 5)
			shards := index.NewShards(2, 4)
			defer shards.Close()
			opts := []Option{WithPartialTails(), WithSlidingWindow(4096), WithCPUOffload(300)}
			if lora {
				opts = append(opts, WithLoRA())
			}
			var engines [workers]*Engine
			var actors [workers]*actor.Actor
			for w := range workers {
				engines[w] = NewEngine(bs, 150, opts...)
				actors[w] = actor.New(actor.Config{Worker: index.WorkerID(w), BlockSize: bs, Sink: index.NewSender(index.WorkerID(w), shards.Queue(index.WorkerID(w)), nil)})
			}
			var h index.Hasher
			hostHits := 0
			for i := range reqs {
				w := int(reqs[i].HashIDs[len(reqs[i].HashIDs)-1] % workers)
				evs, res := engines[w].ServeResult(nil, &reqs[i], InputTokens(nil, &reqs[i]))
				hostHits += res.HostHits
				if len(evs) > 0 {
					actors[w].HandleBatch(uint64(i), engineenc.AppendBatch(nil, &codec.Batch{Events: evs}, engineenc.CurrentVLLM))
				}
				if err := shards.Sync(context.Background()); err != nil {
					t.Fatal(err)
				}
				q := &reqs[(i*7)%(i+1)]
				ir := &index.Request{Tokens: InputTokens(nil, q)}
				if lora { // the router keys a request under its adapter, as the actor keys the engine's blocks
					ir.Lora = q.Lora
				}
				got, err := shards.FindMatches(context.Background(), nil, h.RequestKeys(nil, ir, bs))
				if err != nil {
					t.Fatal(err)
				}
				gotBy := map[index.WorkerID]int{}
				hostBy := map[index.WorkerID]int{}
				for _, s := range got {
					gotBy[s.Worker] = s.Blocks
					hostBy[s.Worker] = s.Tiers[index.TierHost]
				}
				for ew, e := range engines {
					want, either := e.Held(q)
					if hostBy[index.WorkerID(ew)] != either {
						t.Fatalf("step %d: worker %d scores %d in device or host, its engine holds %d", i, ew, hostBy[index.WorkerID(ew)], either)
					}
					if gotBy[index.WorkerID(ew)] != want {
						t.Fatalf("step %d: worker %d scores %d, its engine holds %d leading blocks", i, ew, gotBy[index.WorkerID(ew)], want)
					}
				}
			}
			var st actor.Stats
			for _, a := range actors {
				st.Add(a.Stats())
			}
			for _, r := range []actor.Reason{actor.PartialBlock, actor.NonMainAttention} {
				if st.Filtered[r] == 0 {
					t.Errorf("no event filtered as %s: %v", r, st.Filtered)
				}
			}
			if st.TierBlocks[index.TierHost] == 0 {
				t.Error("nothing indexed in the host tier")
			}
			if hostHits == 0 || st.DecodeErrors != 0 || st.UnknownParent != 0 {
				t.Errorf("%d host hits, %d decode errors, %d unknown parents", hostHits, st.DecodeErrors, st.UnknownParent)
			}
		})
	}
}

// A mixed fleet through the actor and the index: EAGLE engines (SGLang's
// bigram events) beside plain ones, with offload and adapters. Each worker
// scores, against its own kind of keys, exactly the leading blocks its
// engine holds, on device and in either tier.
func TestEagleEnginesBesidePlainOnes(t *testing.T) {
	const workers, bs = 4, 64
	reqs := SyntheticTrace(300, 7)
	shards := index.NewShards(2, 4)
	defer shards.Close()
	var engines [workers]*Engine
	var actors [workers]*actor.Actor
	for w := range workers {
		opts := []Option{WithPartialTails(), WithCPUOffload(200), WithLoRA()}
		if w%2 == 1 {
			opts = append(opts, WithEagle())
		}
		engines[w] = NewEngine(bs, 120, opts...)
		actors[w] = actor.New(actor.Config{Worker: index.WorkerID(w), BlockSize: bs, Sink: index.NewSender(index.WorkerID(w), shards.Queue(index.WorkerID(w)), nil)})
	}
	var h index.Hasher
	for i := range reqs {
		w := int(reqs[i].HashIDs[len(reqs[i].HashIDs)-1] % workers)
		evs, _ := engines[w].ServeResult(nil, &reqs[i], InputTokens(nil, &reqs[i]))
		l := engineenc.CurrentVLLM
		if engines[w].Options().Eagle {
			l = engineenc.Layout{SignedHashes: true, SaltKey: true} // SGLang's
		}
		if len(evs) > 0 {
			actors[w].HandleBatch(uint64(i), engineenc.AppendBatch(nil, &codec.Batch{Events: evs}, l))
		}
		if err := shards.Sync(context.Background()); err != nil {
			t.Fatal(err)
		}
		q := &reqs[(i*7)%(i+1)]
		ir := &index.Request{Tokens: InputTokens(nil, q), Lora: q.Lora}
		for kind, keys := range [][]uint64{h.RequestKeys(nil, ir, bs), h.EagleKeys(nil, ir, bs)} {
			got, err := shards.FindMatches(context.Background(), nil, keys)
			if err != nil {
				t.Fatal(err)
			}
			dev, anyTier := map[index.WorkerID]int{}, map[index.WorkerID]int{}
			for _, s := range got {
				dev[s.Worker], anyTier[s.Worker] = s.Blocks, s.Tiers[index.TierRemote]
			}
			for ew, e := range engines {
				if e.Options().Eagle != (kind == 1) {
					continue // scored with the other kind's keys
				}
				want, either := e.Held(q)
				if id := index.WorkerID(ew); dev[id] != want || anyTier[id] != either {
					t.Fatalf("step %d: worker %d (eagle %v) scores %d/%d, its engine holds %d/%d", i, ew, kind == 1, dev[id], anyTier[id], want, either)
				}
			}
		}
	}
	for w, a := range actors {
		if st := a.Stats(); st.Eagle != engines[w].Options().Eagle || st.BlocksStored == 0 || st.DecodeErrors != 0 || st.UnknownParent != 0 {
			t.Errorf("worker %d: %+v", w, st)
		}
	}
}
