package relay

import (
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/nats-io/nats.go/jetstream"
)

// The zero Settings take the defaults their doc names, and each field
// reaches the settings relay and follower use.
func TestSettingsAsDocumented(t *testing.T) {
	got, err := opstream.Settings(Settings{}).WithDefaults()
	want := opstream.Settings{Prefix: "kvpipe.ops", Stream: "KVPIPE_OPS", Bucket: "kvpipe-snapshots", Object: "snapshot",
		Duplicates: 2 * time.Minute, MaxAge: time.Hour, MaxBytes: 1 << 30, Replicas: 1, Storage: jetstream.FileStorage}
	if err != nil || got != want {
		t.Errorf("zero Settings defaulted to %+v, %v; want %+v", got, err, want)
	}
	set := Settings{Prefix: "p", Stream: "S", Bucket: "b", Object: "o", Duplicates: time.Second, MaxAge: time.Minute,
		MaxBytes: 5, MaxMsgs: 6, Replicas: 3, Storage: jetstream.MemoryStorage}
	if got, err := opstream.Settings(set).WithDefaults(); err != nil || Settings(got) != set {
		t.Errorf("Settings %+v became %+v, %v", set, got, err)
	}
}
