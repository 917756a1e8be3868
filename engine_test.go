package kvpipe_test

import (
	"log"
	"os"
	"path/filepath"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/wiretest"
)

// engine plays a vLLM engine for the example, on ipc:// sockets (no port to find).
type engine struct {
	pub, replay string
	publisher   *wiretest.Publisher
	dir         string
}

func startEngine() *engine {
	dir, err := os.MkdirTemp("", "kvpipe-example")
	if err != nil {
		log.Fatal(err)
	}
	e := &engine{pub: "ipc://" + filepath.Join(dir, "pub"), replay: "ipc://" + filepath.Join(dir, "replay"), dir: dir}
	e.publisher, err = wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: e.pub, ReplayEndpoint: e.replay})
	if err != nil {
		log.Fatal(err)
	}
	return e
}

// caches publishes a BlockStored of tokens, two blocks of 16.
func (e *engine) caches(tokens []uint32) {
	ev := codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{101, 102}, TokenIDs: tokens, BlockSize: 16, Medium: "GPU"}
	e.publisher.Publish(engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{ev}}, engineenc.CurrentVLLM))
}

func (e *engine) stop() {
	e.publisher.Close()
	os.RemoveAll(e.dir)
}
