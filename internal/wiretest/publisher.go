// Package wiretest provides an engine-identical ZMQ publisher for tests and
// simulations, with fault hooks (a batch dropped as a PUB past its high-water
// mark drops it, a seq consumed by a failed publish), as net/http/httptest does.
package wiretest

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpipe/kvpipe/internal/zsock"
)

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	Endpoint       string // PUB bind address, e.g. tcp://127.0.0.1:5557
	ReplayEndpoint string // ROUTER bind address; "" for none
	Topic          string
	// BufferSteps is how many batches the replay buffer keeps (default 10,000).
	BufferSteps int
	// ReplyWithTopic sends replay replies as [empty, topic, seq, payload]
	// (vLLM 0.26 and later) rather than [empty, seq, payload].
	ReplyWithTopic bool
}

// Publisher behaves as an engine's KV-event publisher: a PUB socket sending
// [topic, seq, payload] and a ROUTER answering replay requests from a buffer
// of the last BufferSteps batches. Its loop goroutine owns the sockets and the
// buffer; Publish is meant for one goroutine, the engine's step loop.
type Publisher struct {
	cfg      PublisherConfig
	pub      zmq4.Socket
	router   *zsock.Receiver
	nextSeq  uint64 // owned by the goroutine calling Publish
	in       chan published
	done     chan struct{}
	cancel   context.CancelFunc
	closing  sync.Once
	closeErr error
}

type published struct {
	seq     uint64
	payload []byte
	send    bool // false: kept for replay but never sent, as a PUB past its high-water mark
	// flushed, when set, marks no batch: the loop closes it once every
	// batch before it is sent.
	flushed chan struct{}
}

// NewPublisher binds the sockets and starts the publisher's loop.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.BufferSteps <= 0 {
		cfg.BufferSteps = 10_000
	}
	ctx, cancel := context.WithCancel(context.Background())
	quiet := zmq4.WithLogger(log.New(io.Discard, "", 0))
	p := &Publisher{cfg: cfg, cancel: cancel, in: make(chan published, 256), done: make(chan struct{})}
	p.pub = zmq4.NewPub(ctx, quiet)
	if err := p.pub.Listen(cfg.Endpoint); err != nil {
		cancel()
		p.pub.Close()
		return nil, fmt.Errorf("wiretest: publisher: %w", err)
	}
	if cfg.ReplayEndpoint != "" {
		router := zmq4.NewRouter(ctx, quiet)
		if err := router.Listen(cfg.ReplayEndpoint); err != nil {
			cancel()
			p.pub.Close()
			router.Close()
			return nil, fmt.Errorf("wiretest: publisher replay: %w", err)
		}
		p.router = zsock.Start(router, 64)
	}
	go p.loop()
	return p, nil
}

// Addr is the PUB socket's bound address (useful after binding port 0).
func (p *Publisher) Addr() string { return p.pub.Addr().String() }

// ReplayAddr is the ROUTER socket's bound address, "" without one.
func (p *Publisher) ReplayAddr() string {
	if p.router == nil {
		return ""
	}
	return p.router.Sock.Addr().String()
}

// Publish sends one batch and returns its seq. The publisher keeps payload
// for replay: the caller must not change it afterwards.
func (p *Publisher) Publish(payload []byte) uint64 { return p.publish(payload, true) }

// Drop takes a seq and keeps the batch for replay without sending it, as a
// PUB past its high-water mark does: subscribers see a gap replay can fill.
func (p *Publisher) Drop(payload []byte) uint64 { return p.publish(payload, false) }

// Published is how many seqs the publisher has handed out. Call it from the
// goroutine that publishes, or after that goroutine stopped.
func (p *Publisher) Published() uint64 { return p.nextSeq }

// SkipSeq consumes a seq with nothing behind it, as a failed publish does: a
// gap that replay cannot fill.
func (p *Publisher) SkipSeq() { p.nextSeq++ }

func (p *Publisher) publish(payload []byte, send bool) uint64 {
	seq := p.nextSeq
	p.nextSeq++
	p.in <- published{seq: seq, payload: payload, send: send}
	return seq
}

// Flush returns once every batch published before it has been handed to
// the PUB socket, which sends it to the subscribers connected then: one
// that connects after Flush cannot receive those batches live. Call it from
// the goroutine that publishes.
func (p *Publisher) Flush() {
	done := make(chan struct{})
	p.in <- published{flushed: done}
	<-done
}

// Close stops the loop and closes the sockets; later calls do nothing. A
// later Publisher on the same endpoints starts again at seq 0, as a
// restarted engine does.
func (p *Publisher) Close() error {
	p.closing.Do(func() {
		close(p.in)
		<-p.done
		p.cancel()
		if p.router != nil {
			p.router.Close()
		}
		p.closeErr = p.pub.Close()
	})
	return p.closeErr
}

func (p *Publisher) loop() {
	defer close(p.done)
	ring := make([]published, 0, p.cfg.BufferSteps)
	head := 0 // index of the oldest batch once the ring is full
	var requests <-chan zmq4.Msg
	if p.router != nil {
		requests = p.router.Msgs
	}
	topic := []byte(p.cfg.Topic)
	for {
		select {
		case b, ok := <-p.in:
			if !ok {
				return
			}
			if b.flushed != nil {
				close(b.flushed)
				continue
			}
			if b.send {
				// zmq4 queues the frames themselves: each message gets its own seq frame.
				p.pub.Send(zmq4.NewMsgFrom(topic, binary.BigEndian.AppendUint64(nil, b.seq), b.payload))
			}
			if len(ring) < cap(ring) {
				ring = append(ring, b)
			} else {
				ring[head] = b
				head = (head + 1) % len(ring)
			}
		case req, ok := <-requests:
			if !ok {
				requests = nil
				continue
			}
			p.answer(req, ring, head)
		}
	}
}

// answer replies to [identity, empty, start] with every buffered batch from
// start on, then the end marker (seq -1, empty payload).
func (p *Publisher) answer(req zmq4.Msg, ring []published, head int) {
	if len(req.Frames) != 3 || len(req.Frames[2]) != 8 {
		return
	}
	id, start := req.Frames[0], binary.BigEndian.Uint64(req.Frames[2])
	reply := func(seq, payload []byte) {
		frames := [][]byte{id, nil}
		if p.cfg.ReplyWithTopic {
			frames = append(frames, []byte(p.cfg.Topic))
		}
		p.router.Sock.Send(zmq4.NewMsgFrom(append(frames, seq, payload)...))
	}
	for i := range ring {
		b := ring[(head+i)%len(ring)]
		if b.seq >= start {
			reply(binary.BigEndian.AppendUint64(nil, b.seq), b.payload)
		}
	}
	reply([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, nil)
}
