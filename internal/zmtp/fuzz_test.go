package zmtp

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/go-zeromq/zmq4"
)

// Small limits, so that the fuzzer reaches both sides of them.
const (
	fuzzMaxMsg = 1 << 12
	fuzzMaxCmd = 1 << 10
)

// FuzzGuard feeds byte streams through the parser, whole and in chunks of
// the given size, and checks the accepted prefix with a plain non-incremental
// decoder: no panic, the same verdict however the stream is cut, and no
// frame header over a limit (nor a READY zmq4 cannot parse) ever accepted.
// With handshake set the stream follows a valid greeting and READY.
func FuzzGuard(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte, chunk uint8, handshake bool) {
		if handshake {
			data = append(append(greeting(), ready("PUB")...), data...)
		}
		whole := newParser(fuzzMaxMsg, fuzzMaxCmd)
		n, v := whole.feed(data)
		if (v == nil) != (n == len(data)) {
			t.Fatalf("accepted %d of %d with violation %v", n, len(data), v)
		}

		step := int(chunk)%64 + 1
		cut := newParser(fuzzMaxMsg, fuzzMaxCmd)
		m := 0
		for i := 0; i < len(data); i += step {
			k, cv := cut.feed(data[i:min(i+step, len(data))])
			m += k
			if cv != nil {
				if v == nil || cv.Kind != v.Kind {
					t.Fatalf("in chunks of %d: %v, whole: %v", step, cv, v)
				}
				break
			}
		}
		if m != n {
			t.Fatalf("in chunks of %d accepted %d, whole %d", step, m, n)
		}
		checkAccepted(t, data[:n])
	})
}

// checkAccepted decodes what the parser let through, the way zmq4 would,
// and fails on anything zmq4 must not see.
func checkAccepted(t *testing.T, b []byte) {
	if len(b) < greetingLen {
		return
	}
	g := b[:greetingLen]
	if g[0] != 0xff || g[9] != 0x7f || g[10] < 3 || !bytes.Equal(g[12:32], append([]byte("NULL"), make([]byte, 16)...)) || g[32] > 1 {
		t.Fatalf("bad greeting accepted: % x", g)
	}
	b = b[greetingLen:]
	var total int64
	more, first := false, true
	for len(b) > 0 {
		f := b[0]
		hlen := 2
		if f&flagLong != 0 {
			hlen = 9
		}
		if len(b) < hlen {
			return // zmq4 is still reading the header: it knows no size yet
		}
		size := uint64(b[1])
		if hlen == 9 {
			size = binary.BigEndian.Uint64(b[1:9])
		}
		cmd := f&flagCommand != 0
		switch {
		case f&flagReserved != 0:
			t.Fatalf("flags %#x accepted", f)
		case cmd && (f&flagMore != 0 || more):
			t.Fatalf("command flags %#x accepted in or as part of a message", f)
		case cmd && size > fuzzMaxCmd:
			t.Fatalf("command of %d accepted", size)
		case !cmd && first:
			t.Fatal("message accepted before READY")
		case !cmd:
			if !more {
				total = 0
			}
			if size > fuzzMaxMsg || total+frameOverhead+int64(size) > fuzzMaxMsg {
				t.Fatalf("frame of %d accepted after %d in its message", size, total)
			}
			total += frameOverhead + int64(size)
		}
		more = f&flagMore != 0
		b = b[hlen:]
		if uint64(len(b)) < size {
			return
		}
		if first {
			// The whole READY is in: zmq4's parse of it must succeed.
			body := b[:size]
			if !bytes.HasPrefix(body, []byte(readyPrefix)) {
				t.Fatalf("first command %q accepted", body)
			}
			md := zmq4.Metadata{}
			if err := md.UnmarshalZMTP(body[len(readyPrefix):]); err != nil {
				t.Fatalf("READY %q accepted: %v", body, err)
			}
			first = false
		}
		b = b[size:]
	}
}
