package wire

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/enginepeer"
	"github.com/kvpipe/kvpipe/internal/wiretest"
)

// realBatches reads handler calls until it has n batches with events,
// skipping probes, and returns the block hashes in order and the resets seen.
func realBatches(t *testing.T, rec *recorder, n int) (hashes []uint64, resets []ResetReason) {
	t.Helper()
	d := codec.NewDecoder()
	var b codec.Batch
	var lastSeq uint64
	for len(hashes) < n {
		c := rec.next(t)
		if c.reset {
			resets = append(resets, c.why)
			hashes = hashes[:0] // a new stream starts
			continue
		}
		if err := d.Decode([]byte(c.body), &b); err != nil {
			t.Fatalf("seq %d: libzmq peer's payload does not decode: %v", c.seq, err)
		}
		if len(hashes) > 0 && c.seq != lastSeq+1 {
			t.Fatalf("seq %d after %d", c.seq, lastSeq)
		}
		lastSeq = c.seq
		if len(b.Events) == 0 {
			continue // a probe
		}
		if b.Events[0].Type != codec.BlockStored || b.Events[0].BlockSize != 16 || len(b.Events[0].TokenIDs) != 16 {
			t.Fatalf("seq %d: unexpected event %+v", c.seq, b.Events[0])
		}
		hashes = append(hashes, b.Events[0].BlockHashes...)
	}
	return hashes, resets
}

func wantHashes(t *testing.T, got []uint64, n int) {
	t.Helper()
	if len(got) != n {
		t.Fatalf("got %d batches, want %d", len(got), n)
	}
	for i, h := range got {
		if h != uint64(1000+i) {
			t.Fatalf("batch %d has hash %d, want %d: %v", i, h, 1000+i, got)
		}
	}
}

// The C libzmq plays the engine: the Go subscriber receives every batch in
// order, the ones the PUB dropped recovered through the ROUTER, across a restart.
func TestInteropLibzmqEngineToGoSubscriber(t *testing.T) {
	for _, replyTopic := range []bool{false, true} {
		t.Run(map[bool]string{false: "sglang-and-old-vllm-replies", true: "vllm-0.26-replies"}[replyTopic], func(t *testing.T) {
			args := []string{"--topic", "kv"}
			if replyTopic {
				args = append(args, "--reply-topic")
			}
			engine, eps := enginepeer.StartBound(t, freeTCP, "testdata/engine_pub.py", []string{"--endpoint", "--replay"}, args...)
			ep, replay := eps[0], eps[1]
			s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: replay, Topic: "kv"})
			rec.next(t) // a probe arrived: the subscription is in place
			engine.Send("go")
			engine.Send("batches 30 0,5,6,7,20,29")
			engine.Expect("published")
			// Batch 29, the last, was dropped: nothing shows its gap until
			// another batch comes, so publish one more.
			engine.Send("batches 1")
			engine.Expect("published")
			hashes, resets := realBatches(t, rec, 31)
			if len(resets) != 0 {
				t.Fatalf("resets %v, want none", resets)
			}
			wantHashes(t, hashes[:30], 30)
			st := s.Stats()
			if st.Lost != 0 || st.Replayed < 6 || st.Gaps < 1 {
				t.Fatalf("lost=%d replayed=%d gaps=%d; want 0 lost, >= 6 replayed, >= 1 gap",
					st.Lost, st.Replayed, st.Gaps)
			}

			engine.Send("restart")
			engine.Expect("restarted")
			// Wait until the restarted engine's probes arrive after a restart reset.
			for sawRestart := false; ; {
				c := rec.next(t)
				if c.reset {
					if c.why != ResetRestart {
						t.Fatalf("reset %v after a restart, want restart", c.why)
					}
					sawRestart = true
				} else if sawRestart {
					break
				}
			}
			engine.Send("go")
			engine.Send("batches 10 3,4")
			engine.Expect("published")
			hashes, resets = realBatches(t, rec, 10)
			if len(resets) != 0 {
				t.Fatalf("resets %v after the restart, want none", resets)
			}
			wantHashes(t, hashes, 10)
			if st := s.Stats(); st.Restarts != 1 || st.Reconnects < 1 || st.Lost != 0 {
				t.Errorf("restarts=%d reconnects=%d lost=%d; want 1, >= 1, 0", st.Restarts, st.Reconnects, st.Lost)
			}
			engine.Send("quit")
		})
	}
}

type subLine struct {
	Kind   string   `json:"kind"`
	Frames int      `json:"frames"`
	Topic  string   `json:"topic"`
	Seq    int64    `json:"seq"`
	Events []string `json:"events"`
	Hashes []uint64 `json:"hashes"`
}

// The reverse: a libzmq SUB and DEALER read the Go wiretest.Publisher's live stream
// and replay replies, proving the wiretest.Publisher is wire-identical to an engine.
func TestInteropGoPublisherToLibzmqSubscriber(t *testing.T) {
	ep, replay := freeTCP(t), freeTCP(t)
	pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay, Topic: "kv@w0", ReplyWithTopic: true})
	defer pub.Close()
	probe := engineenc.AppendBatch(nil, &codec.Batch{TS: 1}, engineenc.CurrentVLLM)
	// Seqs 0..9 are probes for sure; real batches follow from the first seq the subscriber sees + some.
	const n = 20
	sub := enginepeer.Start(t, "testdata/engine_sub.py", "--endpoint", ep, "--replay", replay, "--topic", "kv", "--count", "20", "--replay-from", "0")
	var first subLine
	for deadline := time.Now().Add(15 * time.Second); ; {
		if time.Now().After(deadline) {
			t.Fatal("the libzmq subscriber received nothing")
		}
		pub.Publish(probe)
		select {
		case l := <-sub.Lines:
			if err := json.Unmarshal([]byte(l), &first); err != nil {
				t.Fatal(l, err)
			}
		case <-time.After(20 * time.Millisecond):
			continue
		}
		break
	}
	for i := range n {
		b := codec.Batch{TS: 2, Events: []codec.Event{{Type: codec.BlockStored, BlockHashes: []uint64{uint64(1000 + i)},
			TokenIDs: make([]uint32, 16), BlockSize: 16, Medium: "GPU"}}}
		pub.Publish(engineenc.AppendBatch(nil, &b, engineenc.CurrentVLLM))
	}
	var live, replayed []uint64
	var liveSeqs []int64
	lastReplay := int64(-2)
	for l := range sub.Lines {
		var sl subLine
		if err := json.Unmarshal([]byte(l), &sl); err != nil {
			t.Fatal(l, err)
		}
		switch sl.Kind {
		case "live":
			if sl.Frames != 3 || sl.Topic != "kv@w0" {
				t.Fatalf("live message %+v: want 3 frames on topic kv@w0", sl)
			}
			if len(sl.Events) > 0 {
				live = append(live, sl.Hashes...)
				liveSeqs = append(liveSeqs, sl.Seq)
			}
		case "replay":
			if sl.Frames != 4 {
				t.Fatalf("replay reply %+v: want [empty, topic, seq, payload]", sl)
			}
			if sl.Seq != -1 && sl.Seq != lastReplay+1 && lastReplay != -2 {
				t.Fatalf("replay seq %d after %d", sl.Seq, lastReplay)
			}
			lastReplay = sl.Seq
			replayed = append(replayed, sl.Hashes...)
		}
	}
	wantHashes(t, live, n)
	for i := 1; i < len(liveSeqs); i++ {
		if liveSeqs[i] != liveSeqs[i-1]+1 {
			t.Fatalf("live seqs not consecutive: %v", liveSeqs)
		}
	}
	if lastReplay != -1 {
		t.Fatalf("replay did not end with the -1 marker (last %d)", lastReplay)
	}
	wantHashes(t, replayed, n) // probes carry no hashes; the buffer holds them all
}
