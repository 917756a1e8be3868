package actor

import (
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/engineenc"
)

// With Block, a shard that stops reading holds the actor at exactly its
// queue's capacity; closing Done lets the stopping worker go, uncounted.
func TestBlockStopsAtTheShardQueue(t *testing.T) {
	const depth = 8
	ch := make(chan *index.Batch, depth) // nobody reads: a stalled shard
	done := make(chan struct{})
	a := New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, done)})
	var payloads [][]byte
	for i := range 3 * depth {
		payloads = append(payloads, engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{stored(uint64(i+1), 16)}}, engineenc.CurrentVLLM))
	}
	handled := make(chan int, 3*depth)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		for i := range 3 * depth {
			a.HandleBatch(uint64(i), payloads[i])
			handled <- i
		}
	}()
	poll := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s: queue %d, handled %d, entered %d", what, len(ch), len(handled), a.Stats().Batches)
			}
		}
	}
	poll("the queue to fill", func() bool { return len(ch) == depth && len(handled) == depth })
	// The shard applies one batch: exactly one more gets in, and the actor
	// waits with the one after it.
	<-ch
	poll("one more batch in", func() bool { return len(ch) == depth && len(handled) == depth+1 })
	poll("the next batch to wait", func() bool { return a.Stats().Batches == depth+2 })
	if got := len(handled); got != depth+1 {
		t.Errorf("%d batches handed over against a stalled shard, want %d (its queue and the one it took)", got, depth+1)
	}
	close(done)
	select {
	case <-finished:
	case <-time.After(10 * time.Second):
		t.Fatal("closing Done did not release the blocked actor")
	}
	if got := a.Stats().DroppedBatches; got != 0 {
		t.Errorf("dropped batches = %d after a stop, want 0 (not an overload)", got)
	}
}

// With Drop, an overloaded shard costs no allocation per flush: the batch
// that cannot be sent goes back to the actor's pool.
func TestDropOverloadAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates; test.sh runs this without it")
	}
	ch := make(chan *index.Batch, 2) // filled below, never read
	a := New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, nil), Drop: true})
	// Each batch stores and removes one block, so each has ops to flush.
	remove := codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{1}}
	payload := engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{stored(1, 16), remove}}, engineenc.CurrentVLLM)
	for i := range 16 { // fill the queue and make every batch the actor may have
		a.HandleBatch(uint64(i), payload)
	}
	before := a.Stats().DroppedBatches
	allocs := testing.AllocsPerRun(200, func() { a.HandleBatch(99, payload) })
	if allocs != 0 {
		t.Errorf("%.1f allocations per batch dropped, want 0", allocs)
	}
	if got := a.Stats().DroppedBatches - before; got < 200 {
		t.Errorf("dropped %d batches in the measured runs, want every one", got)
	}
}

// A stopping worker still hands over what its shard has room for: the
// drain at shutdown applies a worker's last batches.
func TestStoppingWorkerStillSendsWhatFits(t *testing.T) {
	for range 50 { // the old select picked between a ready send and Done at random
		ch := make(chan *index.Batch, 1)
		done := make(chan struct{})
		close(done)
		a := New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, done)})
		a.HandleBatch(0, engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{stored(1, 16)}}, engineenc.CurrentVLLM))
		if len(ch) != 1 {
			t.Fatal("a stopping worker dropped a batch its shard had room for")
		}
		if st := a.Stats(); st.IndexedBlocks != 1 || st.DroppedBatches != 0 {
			t.Fatalf("indexed %d, dropped %d; want 1 and 0", st.IndexedBlocks, st.DroppedBatches)
		}
	}
}

// A batch dropped (Drop) while a block's ops are being made must not split
// them from the mapping: the block then goes wholly into the next batch,
// after the resync's clear, and the mapping says so, so that its remove
// takes it out again.
func TestDropBetweenBatchesKeepsTheMappingTrue(t *testing.T) {
	ch := make(chan *index.Batch, 1)
	a := New(Config{Worker: 1, BlockSize: 16, Sink: index.NewSender(1, ch, nil), Drop: true})
	ch <- &index.Batch{} // the shard is behind
	a.out.out = a.out.take()
	for range maxOps { // and the batch being filled is full
		a.out.out.Ops = append(a.out.out.Ops, index.Op{Kind: index.OpStore, Hash: 999})
	}
	a.apply(&codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1}, TokenIDs: tokens(1, 1, 16), BlockSize: 16})
	<-ch // the shard catches up
	a.out.flush()
	b := <-ch
	if len(b.Ops) != 2 || b.Ops[0].Kind != index.OpClearWorker || b.Ops[1].Kind != index.OpStore {
		t.Fatalf("ops after the drop %v, want the clear, then the block", b.Ops)
	}
	key := b.Ops[1].Hash
	a.apply(&codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{1}})
	a.out.flush()
	select {
	case b = <-ch:
		if len(b.Ops) != 1 || b.Ops[0] != (index.Op{Kind: index.OpRemove, Hash: key}) {
			t.Errorf("ops of the remove %v, want the block's key removed", b.Ops)
		}
	default:
		t.Error("the remove sent nothing: the mapping lost the block stored after the drop")
	}
	if st := a.Stats(); st.IndexedBlocks != 0 || st.DroppedBatches != 1 {
		t.Errorf("indexed %d, dropped %d; want 0 and 1", st.IndexedBlocks, st.DroppedBatches)
	}
}

// The clear a dropped batch owes, sent alone once the shard has room
// (HandleIdle), is for the index only: a Tap had the dropped batch's ops.
func TestSettledClearIsForTheIndexOnly(t *testing.T) {
	ch := make(chan *index.Batch, 1)
	var tapped []index.Op
	see := func(ops []index.Op) { tapped = append(tapped, ops...) }
	a := New(Config{Worker: 1, BlockSize: 16, Sink: tapping{index.NewSender(1, ch, nil), see}, Drop: true})
	ch <- &index.Batch{} // the shard is behind
	a.HandleBatch(0, engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{stored(1, 16)}}, engineenc.CurrentVLLM))
	<-ch // and catches up
	if owed := a.HandleIdle(); owed {
		t.Fatal("HandleIdle still owes the clear with room in the shard")
	}
	b := <-ch
	if len(b.Ops) != 1 || b.Ops[0].Kind != index.OpClearWorker || !b.IndexOnly {
		t.Errorf("settled batch %+v (index only %v), want a lone clear for the index only", b.Ops, b.IndexOnly)
	}
	if len(tapped) != 1 || tapped[0].Kind != index.OpStore {
		t.Errorf("the Tap saw %+v, want the dropped batch's store alone", tapped)
	}
}

// trimming is a Sink whose Trim says what the test wants, and remembers
// when it was asked.
type trimming struct {
	Sink
	more  bool
	asked []time.Time
}

func (t *trimming) Trim(now time.Time) bool {
	t.asked = append(t.asked, now)
	return t.more
}

// HandleIdle lets the Sink give back a flood's batches, and asks to be
// called again while the Sink has more to give back or a clear is owed.
func TestIdleTrimsTheSink(t *testing.T) {
	cases := []struct {
		name       string
		behind     bool // the shard has no room: the clear a drop owes stays owed
		more, want bool
	}{
		{"nothing to do", false, false, false},
		{"batches to give back", false, true, true},
		{"a clear owed", true, false, true},
		{"both", true, true, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ch := make(chan *index.Batch, 1)
			sink := &trimming{Sink: index.NewSender(1, ch, nil), more: c.more}
			a := New(Config{Worker: 1, BlockSize: 16, Sink: sink, Drop: true})
			ch <- &index.Batch{} // the shard is behind
			a.HandleBatch(0, engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{stored(1, 16)}}, engineenc.CurrentVLLM))
			if !c.behind {
				<-ch
			}
			before := time.Now()
			if got := a.HandleIdle(); got != c.want {
				t.Errorf("HandleIdle reported %v, want %v", got, c.want)
			}
			if len(sink.asked) != 1 || sink.asked[0].Before(before) {
				t.Errorf("Trim asked at %v, want once, with the time (after %v)", sink.asked, before)
			}
		})
	}
}
