package index

import "time"

// Sender is one worker's way into its shard's queue: it lends the batches
// to fill and queues them in order, and reuses each once the shard has
// applied it, so that a worker has at most the queue's capacity and two
// more, and a steady stream allocates nothing. Batches that a flood made
// and that then stay free go back to the heap (Trim); bursts more than a
// second apart that each need more than keepBatches make them again. One
// goroutine at a time uses a Sender.
type Sender struct {
	worker WorkerID
	queue  chan<- *Batch
	free   chan *Batch
	done   <-chan struct{}

	made  int       // batches made and not given back, lost ones too (a panic's)
	low   int       // the fewest free batches since the window began
	used  bool      // Batch was called since the window began
	since time.Time // when Trim's window began; zero: none open
}

// Trim's parameters: a Sender keeps keepBatches however idle it is (a
// worker's batches in flight in a steady stream), and gives back the
// others that stayed free through a window of trimWindow.
const (
	keepBatches = 8
	trimWindow  = time.Second
)

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
	s.used = true
	select {
	case b := <-s.free:
		s.low = min(s.low, len(s.free))
		return b
	default:
		s.made++
		s.low = 0
		return &Batch{Worker: s.worker, free: s.free}
	}
}

// Trim gives back to the heap the batches, beyond keepBatches, that no
// Batch call needed since the window that began at least trimWindow ago:
// after a flood, a worker would otherwise keep a full queue's batches for
// good (1.5 MiB at the default ShardQueue), and a worker in a steady
// stream keeps what it uses, so nothing is made again. It reports whether
// the Sender may have more than it keeps, to be asked again later; the
// caller calls it while idle (Actor.HandleIdle), with the time.
func (s *Sender) Trim(now time.Time) (more bool) {
	if s.made <= keepBatches && len(s.free) <= keepBatches {
		s.since = time.Time{}
		return false
	}
	if s.since.IsZero() {
		s.since, s.low, s.used = now, len(s.free), false
		return true
	}
	if now.Sub(s.since) < trimWindow {
		return true
	}
	for n := min(s.low, len(s.free)-keepBatches); n > 0; n-- {
		select {
		case <-s.free:
			s.made--
		default:
			n = 0
		}
	}
	if !s.used && len(s.free) <= keepBatches {
		// A whole window idle: a batch not back by now was lost (a panic
		// between Batch and Send), so stop counting it, and stop asking.
		s.made = len(s.free)
	}
	s.since, s.low, s.used = now, len(s.free), false
	return s.made > keepBatches || len(s.free) > keepBatches
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
