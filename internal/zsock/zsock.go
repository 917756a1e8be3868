// Package zsock owns a zmq4 socket together with the goroutine that reads it,
// so a caller can select on its messages and close it without leaking zmq4's
// reader goroutines. wire's subscriber and wiretest's publisher both use it.
package zsock

import "github.com/go-zeromq/zmq4"

// Receiver owns one zmq4 socket and the goroutine that reads it. zmq4's Recv
// has no timeout, and a socket closed while nobody reads leaks zmq4's own
// reader goroutine, so the receiver always drains, and Close drains again.
type Receiver struct {
	Sock zmq4.Socket
	Msgs chan zmq4.Msg // closed when Recv fails; Err then says why
	err  error
	stop chan struct{}
	done chan struct{}
}

// Start reads sock into a channel of depth messages until it fails or Close.
func Start(sock zmq4.Socket, depth int) *Receiver {
	r := &Receiver{Sock: sock, Msgs: make(chan zmq4.Msg, depth), stop: make(chan struct{}), done: make(chan struct{})}
	go r.loop()
	return r
}

func (r *Receiver) loop() {
	defer close(r.done)
	defer close(r.Msgs)
	for {
		m, err := r.Sock.Recv()
		if err != nil {
			r.err = err
			return
		}
		select {
		case r.Msgs <- m:
		case <-r.stop:
			return
		}
	}
}

// Err is why the socket failed; valid once Msgs is closed.
func (r *Receiver) Err() error { return r.err }

// Dead reports whether the socket has failed (its peer went away).
func (r *Receiver) Dead() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// Close closes the socket and waits for the reader. It must be called once,
// by the receiver's owner.
func (r *Receiver) Close() {
	close(r.stop)
	r.Sock.Close()
	<-r.done
	// zmq4 connection readers may be blocked handing over a last message;
	// once the socket's context is done each Recv returns at once, taking one
	// queued message or none.
	for range 256 {
		r.Sock.Recv()
	}
}
