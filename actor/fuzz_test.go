package actor

import (
	"testing"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/index"
)

// FuzzActor: no payload, however it decodes, makes the actor panic, and the
// blocks it says it indexed never go below zero.
func FuzzActor(f *testing.F) {
	seeds := []codec.Batch{
		{Events: []codec.Event{stored(1, 16), stored(2, 4), cleared()}},
		{Events: []codec.Event{stored(1, 16, group(1, "mamba")), {Type: codec.BlockRemoved, BlockHashes: []uint64{1, 9}}}},
		{Events: []codec.Event{{Type: codec.BlockStored, BlockHashes: []uint64{1, 2, 3}, TokenIDs: []uint32{1}, BlockSize: 1 << 20, HasParent: true, ParentHash: 7}}},
	}
	for _, b := range seeds {
		f.Add(codec.AppendBatch(nil, &b, codec.CurrentVLLM))
		f.Add(codec.AppendBatch(nil, &b, codec.Layout{ArrayEvents: true}))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		shards := index.NewShards(1, 4)
		defer shards.Close()
		a := New(Config{Worker: 1, BlockSize: 16, Shard: shards.Queue(1)})
		a.HandleBatch(0, payload)
		a.HandleBatch(1, payload) // the second sees the state the first left
		if n := a.Stats().IndexedBlocks; n < 0 {
			t.Fatalf("indexed blocks %d", n)
		}
	})
}
