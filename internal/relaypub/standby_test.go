package relaypub

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/natstest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Two relays for the same engines, each with a Lease on one key: only the
// holder subscribes and writes; when it stops, or goes silent (its NATS
// connection cut), the standby takes over from the snapshot and the
// engines' replay, and the router, which never saw a second writer, ends
// exact.
func TestStandbyRelayTakesOver(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"stopped", "silent"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			srv := natstest.Start(t)
			s := testSettings()
			a, b := newEngine(t, "a"), newEngine(t, "b")
			reqs := trace(400, 21)
			relayWithLease := func() (*running, *nats.Conn) {
				nc := srv.Connect(t, nats.ReconnectBufSize(-1))
				js, err := jetstream.New(nc)
				if err != nil {
					t.Fatal(err)
				}
				// A TTL that a holder renews in time on a loaded machine
				// too: a holder that misses a renewal rightly gives way,
				// and the test would see two terms.
				l, err := NewLease(js, LeaseConfig{Bucket: "test-leases", Key: "engines", TTL: 8 * time.Second, Logger: testLogger()})
				if err != nil {
					t.Fatal(err)
				}
				cfg := relayConfig(s)
				cfg.Lease = l
				return startRelay(t, js, cfg, a, b), nc
			}
			first, firstConn := relayWithLease()
			eventually(t, "the first relay leading", func() error {
				if first.Stats().Terms != 1 {
					return fmt.Errorf("%+v", first.Stats())
				}
				return nil
			})
			second, _ := relayWithLease()
			rjs, err := jetstream.New(srv.Connect(t))
			if err != nil {
				t.Fatal(err)
			}
			r := startRouter(t, rjs, s)
			a.serve(reqs[:100])
			b.serve(reqs[100:200])
			relayed(t, first, a, b)
			first.snapshotNow(t)
			a.serve(reqs[200:250]) // after the snapshot: the standby gets these from the engines' replay
			relayed(t, first, a, b)
			if st := second.Stats(); st.Terms != 0 || st.Published != 0 {
				t.Fatalf("standby %+v: want it waiting, nothing published", st)
			}
			switch how {
			case "stopped":
				first.stop()
			case "silent":
				firstConn.Close() // it can neither renew nor publish: it stops, the lease expires
			}
			eventually(t, "the standby leading", func() error {
				if second.Stats().Terms != 1 {
					return fmt.Errorf("%+v", second.Stats())
				}
				return nil
			})
			a.serve(reqs[250:320])
			b.serve(reqs[320:])
			converged(t, rjs, s, second, r, a, b)
			if st := second.Stats(); st.Restored != 2 || st.Resets != 0 {
				t.Errorf("standby %+v: want both workers restored from the snapshot, none reset", st)
			}
			if fs := r.f.Stats(); fs.Gaps != 0 || fs.BadMessages != 0 || fs.Runs != 1 {
				t.Errorf("router %+v: want one run, no gap", fs)
			}
		})
	}
}
