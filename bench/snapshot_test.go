package bench

import (
	"context"
	"testing"

	"github.com/kvpipe/kvpipe/actor"
	"github.com/kvpipe/kvpipe/index"
	"github.com/kvpipe/kvpipe/internal/snapshot"
)

// BenchmarkSnapshot: the state the trace leaves in eight workers' actors,
// taken (Export, then the encoding) and restored (the decoding, then Import,
// which rebuilds the index entries in the shards), as a router's restart
// does. Both reuse their buffers, as a router taking one every few seconds
// would.
func BenchmarkSnapshot(b *testing.B) {
	w := load(b)
	shards := index.NewShards(2, 256)
	defer shards.Close()
	var actors [workers]*actor.Actor
	for i := range actors {
		actors[i] = actor.New(actor.Config{Worker: index.WorkerID(i), BlockSize: blockSize, Sink: index.NewSender(index.WorkerID(i), shards.Queue(index.WorkerID(i)), nil)})
		for _, f := range w.frames[i] {
			actors[i].HandleBatch(0, f)
		}
	}
	snap := snapshot.Snapshot{Version: snapshot.Version, BlockSize: blockSize, KeySeed: index.Seed, Workers: make([]snapshot.Worker, workers)}
	take := func(buf []byte) []byte {
		for i, a := range actors {
			a.Export(&snap.Workers[i])
			snap.Workers[i].Name = append(snap.Workers[i].Name[:0], byte('a'+i))
		}
		buf, err := snapshot.Append(buf[:0], &snap)
		if err != nil {
			b.Fatal(err)
		}
		return buf
	}
	data := take(nil)
	blocks := snap.Blocks()
	report := func(b *testing.B) {
		b.ReportMetric(float64(blocks)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
		b.ReportMetric(float64(len(data))/float64(blocks), "bytes/block")
		b.ReportMetric(float64(len(data))/1e6/(float64(blocks)/1e6), "MB/Mblocks")
	}
	b.Run("take", func(b *testing.B) {
		buf := take(nil)
		b.ReportAllocs()
		for b.Loop() {
			buf = take(buf)
		}
		report(b)
	})
	b.Run("restore", func(b *testing.B) {
		var back snapshot.Snapshot
		b.ReportAllocs()
		for b.Loop() {
			if err := snapshot.Decode(data, &back); err != nil {
				b.Fatal(err)
			}
			for i, a := range actors {
				a.Import(&back.Workers[i])
				a.HandleResumed() // as once the engine proves the snapshot's seq
			}
			if err := shards.Sync(context.Background()); err != nil {
				b.Fatal(err)
			}
		}
		report(b)
	})
}
