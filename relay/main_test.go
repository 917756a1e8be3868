package relay

import (
	"testing"

	"github.com/kvpipe/kvpipe/internal/natstest"
	"github.com/kvpipe/kvpipe/internal/ztest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }

func startServer(t testing.TB) (*natstest.Server, jetstream.JetStream) {
	t.Helper()
	srv := natstest.Start(t)
	js, err := jetstream.New(srv.Connect(t, nats.ReconnectBufSize(-1)))
	if err != nil {
		t.Fatal(err)
	}
	return srv, js
}

// testSettings are small enough for tests to trim.
func testSettings() Settings {
	return Settings{Prefix: "test.ops", Stream: "TEST_OPS", Bucket: "test-snapshots", Object: "snap"}
}
