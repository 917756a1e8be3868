package wire

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"github.com/kvpipe/kvpipe/internal/enginepeer"
	"github.com/kvpipe/kvpipe/internal/wiretest"
	"github.com/kvpipe/kvpipe/internal/ztest"
)

// countingHandler counts batches and signals once it has seen want of
// them, or known the rest lost (lost, when set, is the subscriber's count).
type countingHandler struct {
	n, want atomic.Int64
	bytes   atomic.Int64
	lost    func() uint64
	done    chan struct{}
}

func (h *countingHandler) HandleBatch(seq uint64, payload []byte) {
	h.bytes.Add(int64(len(payload)))
	n := h.n.Add(1)
	if h.lost != nil {
		n += int64(h.lost())
	}
	if want := h.want.Load(); want >= 0 && n >= want {
		select {
		case h.done <- struct{}{}:
		default:
		}
	}
}
func (h *countingHandler) HandleReset(ResetReason)         {}
func (h *countingHandler) HandleResumed()                  {}
func (h *countingHandler) HandleEngineSnapshotBegin()      {}
func (h *countingHandler) HandleEngineSnapshot([]byte)     {}
func (h *countingHandler) HandleEngineSnapshotEnd(ok bool) {}
func (h *countingHandler) HandleIdle() bool                { return false }

// BenchmarkLoopbackTCP: a Go wiretest.Publisher to a Go Subscriber over loopback TCP,
// one engine step (9 events, about 2.8 KB) per batch. allocs/op counts both
// ends, since they share the process.
func BenchmarkLoopbackTCP(b *testing.B) {
	ep := "tcp://127.0.0.1:0"
	pub, err := wiretest.NewPublisher(wiretest.PublisherConfig{Endpoint: ep, BufferSteps: 16})
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	ep = "tcp://" + pub.Addr()
	sub, err := NewSubscriber(Config{Endpoint: ep, Options: Options{IdleTimeout: -1}})
	if err != nil {
		b.Fatal(err)
	}
	h := &countingHandler{done: make(chan struct{}, 1)}
	h.want.Store(-1)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { sub.Run(ctx, h); close(stopped) }()
	defer func() { cancel(); <-stopped }()

	var step codec.Batch
	payload := benchPayload(&step)
	for deadline := time.Now().Add(10 * time.Second); h.n.Load() == 0; { // subscription in place
		if time.Now().After(deadline) {
			b.Fatal("the subscriber received nothing")
		}
		pub.Publish(payload)
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)
	base := h.n.Load()
	h.want.Store(base + int64(b.N))
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		pub.Publish(payload)
	}
	select {
	case <-h.done:
	case <-time.After(time.Minute):
		b.Fatalf("received %d of %d batches", h.n.Load()-base, b.N)
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "batches/s")
	if lost := sub.Stats().Lost; lost != 0 {
		b.Errorf("lost %d batches", lost)
	}
}

func benchPayload(b *codec.Batch) []byte {
	b.TS = 1
	for i := range 8 {
		e := codec.Event{Type: codec.BlockStored, BlockSize: 16, Medium: "GPU"}
		for j := range 4 {
			e.BlockHashes = append(e.BlockHashes, uint64(i*4+j)*0x9e3779b97f4a7c15)
		}
		for t := range 64 {
			e.TokenIDs = append(e.TokenIDs, uint32(i*64+t))
		}
		b.Events = append(b.Events, e)
	}
	b.Events = append(b.Events, codec.Event{Type: codec.BlockRemoved, BlockHashes: []uint64{1, 2, 3, 4, 5, 6, 7, 8}})
	return engineenc.AppendBatch(nil, b, engineenc.CurrentVLLM)
}

// BenchmarkLibzmqPublisher: the receive path against the C libzmq, a
// python3-zmq engine publishing 2.6 KB steps as fast as Python can. Its PUB
// drops past libzmq's high-water mark, and so does its ROUTER when it answers
// a replay: gaps, replays and re-asked replays are part of it, and what could
// not be recovered is reported as lost/batch. The rate is Python's as much as
// kvpipe's.
func BenchmarkLibzmqPublisher(b *testing.B) {
	engine, eps := enginepeer.StartBound(b, ztest.FreeTCP, "testdata/engine_pub.py", []string{"--endpoint", "--replay"}, "--buffer", "100000")
	ep, replay := eps[0], eps[1]
	sub, err := NewSubscriber(Config{Endpoint: ep, ReplayEndpoint: replay, Options: Options{IdleTimeout: -1, TailCheck: 50 * time.Millisecond, ReplayTimeout: 5 * time.Second}}) // a Python ROUTER answering 100k replies is slow
	if err != nil {
		b.Fatal(err)
	}
	h := &countingHandler{done: make(chan struct{}, 1), lost: func() uint64 { return sub.Stats().Lost }}
	h.want.Store(-1)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { sub.Run(ctx, h); close(stopped) }()
	defer func() { cancel(); <-stopped }()
	for deadline := time.Now().Add(10 * time.Second); h.n.Load() == 0; { // a probe arrived: subscribed
		if time.Now().After(deadline) {
			b.Fatal("no probe from the libzmq engine")
		}
		time.Sleep(5 * time.Millisecond)
	}
	engine.Send("go")
	time.Sleep(50 * time.Millisecond) // the last probes arrive
	base := h.n.Load()
	h.want.Store(base + int64(b.N))
	b.ReportAllocs()
	b.ResetTimer()
	engine.Send(fmt.Sprintf("flood %d", b.N))
	select {
	case <-h.done:
	case <-time.After(time.Minute):
		st := sub.Stats()
		b.Fatalf("received %d of %d batches (gaps %d, replays %d, replayed %d, lost %d, tail checks %d, replay failures %d)",
			h.n.Load()-base, b.N, st.Gaps, st.Replays, st.Replayed, st.Lost, st.TailChecks, st.ReplayFailures)
	}
	b.StopTimer()
	engine.Expect("published")
	b.SetBytes(h.bytes.Load() / (h.n.Load()))
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "batches/s")
	st := sub.Stats()
	b.ReportMetric(float64(st.Replayed)/float64(b.N), "replayed/batch")
	b.ReportMetric(float64(st.Lost)/float64(b.N), "lost/batch")
	engine.Send("quit")
}
