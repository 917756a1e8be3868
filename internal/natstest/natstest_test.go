package natstest

import (
	"context"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/ztest"
	"github.com/nats-io/nats.go/jetstream"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }

// A stream and its messages survive a restart on the same store, and a
// client made with Connect reconnects to the same URL by itself.
func TestRestartKeepsStreamsAndClientsReconnect(t *testing.T) {
	s := Start(t)
	url := s.URL()
	nc := s.Connect(t)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "t.a", []byte("one")); err != nil {
		t.Fatal(err)
	}
	s.Restart()
	if s.URL() != url {
		t.Fatalf("URL %s after restart, was %s", s.URL(), url)
	}
	var ack *jetstream.PubAck
	for ack == nil {
		actx, acancel := context.WithTimeout(ctx, 500*time.Millisecond)
		ack, err = js.Publish(actx, "t.a", []byte("two"))
		acancel()
		if ctx.Err() != nil {
			t.Fatalf("no publish went through after the restart: %v", err)
		}
	}
	if ack.Sequence != 2 {
		t.Errorf("second message at seq %d, want 2: the stream did not survive", ack.Sequence)
	}
	s.Stop()
	s.Stop() // idempotent
	if nc.IsClosed() {
		t.Error("client closed by a server stop; want it reconnecting")
	}
	s.StartAgain()
	// A flush sent before the client has seen the stop fails as that
	// connection closes ("connection closed"): ask again until one is
	// answered, on the connection made again.
	again, cancelAgain := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancelAgain()
	for err := nc.FlushTimeout(time.Second); err != nil; err = nc.FlushTimeout(time.Second) {
		if again.Err() != nil || nc.IsClosed() {
			t.Fatalf("client did not reconnect after StartAgain: %v (status %v)", err, nc.Status())
		}
	}
}
