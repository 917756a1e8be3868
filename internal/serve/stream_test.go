package serve

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
)

// A MatchStream reads ahead at most streamAheadBytes of decoded requests
// that wait to be answered: with none answered (a client that never reads
// its answers blocks the sends), the reader stops, and each request taken
// lets it read one more. Counted by requests only, 64 requests of up to
// MaxMessageBytes each were pinned a stream.
func TestMatchStreamReadAheadBoundedInBytes(t *testing.T) {
	const keys = 64 << 10 // 512 KiB a request: two fill the bound
	var reads, taken atomic.Int32
	read := make(chan int32, 8)
	recv := func() (*kvpipev1.MatchRequest, error) {
		n := reads.Add(1)
		if n > 2+taken.Load() {
			t.Errorf("read request %d with %d taken: past the bound", n, taken.Load())
		}
		read <- n
		return &kvpipev1.MatchRequest{Keys: make([]uint64, keys)}, nil
	}
	reqs, stop, ahead := make(chan *kvpipev1.MatchRequest, streamAhead), make(chan struct{}), newAheadBytes()
	var wg sync.WaitGroup
	var readErr error
	wg.Go(func() { readErr = readRequests(recv, reqs, ahead, stop) })
	for range 2 {
		<-read
	}
	for range 3 {
		// A reader past the bound would read now; one within it waits.
		time.Sleep(20 * time.Millisecond)
		taken.Add(1)
		ahead.take(<-reqs)
		<-read
	}
	close(stop)
	wg.Wait()
	if readErr != nil {
		t.Fatal(readErr)
	}
	if got := reads.Load(); got != 5 {
		t.Errorf("%d requests read, want 5 (2 and one a take)", got)
	}
}

// Small requests are read ahead by count, as many as streamAhead.
func TestMatchStreamReadAheadSmallRequests(t *testing.T) {
	var reads atomic.Int32
	errDone := errors.New("done")
	recv := func() (*kvpipev1.MatchRequest, error) {
		if reads.Add(1) > streamAhead {
			return nil, errDone
		}
		return &kvpipev1.MatchRequest{Keys: make([]uint64, 16)}, nil
	}
	reqs, stop := make(chan *kvpipev1.MatchRequest, streamAhead), make(chan struct{})
	defer close(stop)
	if err := readRequests(recv, reqs, newAheadBytes(), stop); err != errDone {
		t.Fatalf("read %d requests, then %v; want all %d read ahead", reads.Load(), err, streamAhead)
	}
}
