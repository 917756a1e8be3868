package relay

import (
	"testing"

	"github.com/kvpipe/kvpipe/internal/natstest"
	"github.com/kvpipe/kvpipe/internal/ztest"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }

var startServer = natstest.StartJetStream

// testSettings are small enough for tests to trim.
func testSettings() Settings {
	return Settings{Prefix: "test.ops", Stream: "TEST_OPS", Bucket: "test-snapshots", Object: "snap"}
}
