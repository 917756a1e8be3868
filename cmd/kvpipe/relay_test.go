package main

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/natstest"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/kvpipe/kvpipe/relay"
	"github.com/nats-io/nats.go/jetstream"
)

// kvpipe relay against the embedded server, holding a lease: the engine's
// batches reach the stream, a snapshot reaches the bucket, and SIGINT (ctx)
// ends it with 0.
func TestRelayPublishes(t *testing.T) {
	srv := natstest.Start(t)
	js, err := jetstream.New(srv.Connect(t))
	if err != nil {
		t.Fatal(err)
	}
	ep, replay := freeTCP(t), freeTCP(t)
	pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	for i := range 20 {
		pub.Publish(engineenc.AppendBatch(nil, &codec.Batch{Events: []codec.Event{{Type: codec.BlockStored,
			BlockHashes: []uint64{uint64(i + 1)}, TokenIDs: make([]uint32, 16), BlockSize: 16}}}, engineenc.CurrentVLLM))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out strings.Builder
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"relay", "--nats", srv.URL(), "--endpoint", "e0=" + ep, "--replay", "e0=" + replay,
			"--snapshot-every", "50ms", "--stream", "T", "--prefix", "t.ops", "--bucket", "t-snap", "--lease", "engines", "--lease-ttl", "2s"}, nil, &out, io.Discard)
	}()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if time.Now().After(deadline) {
			t.Fatal("no messages and snapshot in time")
		}
		if msgs, snap := state(js); msgs >= 2 && snap { // the start clear and the batches
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 || !strings.Contains(out.String(), "published=") || !strings.Contains(out.String(), "terms=1 lease_lost=0") {
			t.Errorf("exit %d, stdout %q", code, out.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("relay did not exit")
	}
	for _, args := range [][]string{{}, {"--endpoint", "tcp://127.0.0.1:1", "--bucket", "a.b"},
		{"--endpoint", "tcp://127.0.0.1:1", "--lease", "x", "--lease-ttl", "1ms"}} {
		var errOut strings.Builder
		if code := run(context.Background(), append([]string{"relay"}, args...), nil, io.Discard, &errOut); code != 2 || errOut.Len() == 0 {
			t.Errorf("relay %v: exit %d, stderr %q; want 2 and a message", args, code, errOut.String())
		}
	}
}

// state is the stream's message count and whether the snapshot exists.
func state(js jetstream.JetStream) (uint64, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, "T")
	if err != nil {
		return 0, false
	}
	info, err := st.Info(ctx)
	if err != nil {
		return 0, false
	}
	obs, err := js.ObjectStore(ctx, "t-snap")
	if err != nil {
		return info.State.Msgs, false
	}
	_, err = relay.NewObjectStore(obs, opstream.DefaultObject).Load(ctx, nil)
	return info.State.Msgs, err == nil
}
