package wire

import (
	"context"
	"encoding/binary"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/kvpipe/kvpipe/internal/zmtp"
	"github.com/kvpipe/kvpipe/internal/ztest"
)

// zmtpPUB is a valid ZMTP 3.0 NULL greeting and a READY for a PUB socket.
func zmtpPUB() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	body := append([]byte("\x05READY\x0bSocket-Type"), 0, 0, 0, 3)
	body = append(body, "PUB"...)
	return append(append(g, 0x04, byte(len(body))), body...)
}

// A peer that completes the handshake and then announces a 64 GiB frame
// costs its connection, counted, and nothing near that in memory; the
// subscriber keeps trying with backoff (three counts: three connections)
// and Run ends on cancel.
func TestOversizeFrameCostsOneConnection(t *testing.T) {
	header := binary.BigEndian.AppendUint64([]byte{0x02}, 64<<30) // a long frame of 64 GiB
	ep := ztest.RawPeer(t, append(zmtpPUB(), header...))
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	s, _ := startSubscriber(t, Config{Endpoint: ep})
	deadline := time.Now().Add(10 * time.Second)
	for s.Stats().ProtocolErrors[kindIndex(zmtp.KindOversize)] < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("protocol errors %v, want 3 oversize", s.Stats().ProtocolErrors[kindIndex(zmtp.KindOversize)])
		}
		time.Sleep(10 * time.Millisecond)
	}
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 32<<20 {
		t.Errorf("allocated %d MiB against a peer announcing 64 GiB frames", grew>>20)
	}
	if st := s.Stats(); st.Batches != 0 {
		t.Errorf("batches %d; want 0", st.Batches)
	}
}

// A port that accepts and never speaks ZMTP, as a PUB endpoint and as a
// replay endpoint: each handshake gives up after HandshakeTimeout, counted,
// and cancelling Run returns at once.
func TestSilentPeersAreBoundedInTime(t *testing.T) {
	silent := ztest.RawPeer(t, nil)
	t.Run("pub", func(t *testing.T) {
		s, err := NewSubscriber(Config{Endpoint: silent, Options: Options{HandshakeTimeout: 100 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx, newRecorder()) }()
		for s.Stats().ProtocolErrors[kindIndex(zmtp.KindHandshakeTimeout)] < 2 {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(30 * time.Millisecond) // likely inside a handshake again
		start := time.Now()
		cancel()
		<-done
		if d := time.Since(start); d > time.Second {
			t.Errorf("Run took %v to return after cancel", d)
		}
	})
	t.Run("replay", func(t *testing.T) {
		ep := freeTCP(t)
		pub := newPublisher(t, wiretest.PublisherConfig{Endpoint: ep})
		defer pub.Close()
		s, rec := startSubscriber(t, Config{Endpoint: ep, ReplayEndpoint: silent, Options: Options{HandshakeTimeout: 100 * time.Millisecond, ReplayPatience: 400 * time.Millisecond, TailCheck: -1}})
		last := syncUp(t, pub, rec)
		pub.Drop(body(0))
		pub.Publish(body(1))
		if c := rec.next(t); !c.reset || c.why != ResetGapLost {
			t.Fatalf("got %+v, want a gap_lost reset after the patience", c)
		}
		expectBatches(t, rec, last+2, string(body(1)))
		if st := s.Stats(); st.ProtocolErrors[kindIndex(zmtp.KindHandshakeTimeout)] < 1 || st.ReplayUnreachable < 1 || st.Lost != 1 {
			t.Errorf("handshake timeouts %d, unreachable %d, lost %d; want >= 1, >= 1, 1",
				st.ProtocolErrors[kindIndex(zmtp.KindHandshakeTimeout)], st.ReplayUnreachable, st.Lost)
		}
	})
}

// kindIndex is where Stats.ProtocolErrors counts the kind named kind.
func kindIndex(kind string) int { return slices.Index(ProtocolErrorKinds[:], kind) }
