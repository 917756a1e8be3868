package index

// Sender is one worker's way into its shard's queue: it lends the batches
// to fill and queues them in order, and reuses each once the shard has
// applied it, so that a worker has at most the queue's
// capacity and two more, and the steady state allocates nothing. One
// goroutine at a time uses a Sender.
type Sender struct {
	worker WorkerID
	queue  chan<- *Batch
	free   chan *Batch
	done   <-chan struct{}
}

// NewSender returns a Sender of w's batches into queue (Shards.Queue(w));
// closing done (nil: never) ends a Send waiting for room: the worker is
// stopping. It must stop sending before the queue's Shards is closed.
func NewSender(w WorkerID, queue chan<- *Batch, done <-chan struct{}) *Sender {
	// At most cap(free) batches exist: when Batch makes one, none is being
	// filled, at most cap(queue) are queued and one is being applied, and
	// the rest are free, so the shard's hand-back never blocks.
	return &Sender{worker: w, queue: queue, free: make(chan *Batch, cap(queue)+2), done: done}
}

// Batch returns an empty batch of the worker's to fill.
func (s *Sender) Batch() *Batch {
	select {
	case b := <-s.free:
		return b
	default:
		return &Batch{Worker: s.worker, free: s.free}
	}
}

// Send queues b if the shard has room, or else, with wait, once it has,
// unless the worker stops meanwhile. It reports whether b was queued; one
// that was not is the caller's again.
func (s *Sender) Send(b *Batch, wait bool) bool {
	select { // a shard with room takes the batch, even from a stopping worker
	case s.queue <- b:
		return true
	default:
	}
	if !wait {
		return false
	}
	select {
	case s.queue <- b:
		return true
	case <-s.done:
		return false
	}
}

// Stopping reports whether done is closed.
func (s *Sender) Stopping() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}
