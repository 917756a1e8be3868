// Package ztest holds what the ZMQ tests of several packages share: free
// loopback endpoints, and the goroutine-leak check that knows zmq4's own leak.
package ztest

import (
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"testing"

	"go.uber.org/goleak"
)

// FreeTCP returns a tcp:// endpoint on loopback that was free a moment ago.
// Its port is below Linux's ephemeral range (32768 on), which the kernel
// hands out as the local port of every outgoing connection: a port taken
// from that range (a listen on :0) could become some other test's
// connection's before its peer binds it, and stay taken for that
// connection's life. (Peers that bind still retry on new ports:
// enginepeer.StartBound.)
//
// The port is also claimed for the test's life (claimPort): `go test ./...`
// runs packages' test processes at once, and two of them used to pick the
// same free port before either bound it ("address already in use").
func FreeTCP(t testing.TB) string {
	t.Helper()
	for range 1000 {
		port := lowPorts + rand.IntN(numLowPorts)
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		release, ok := claimPort(port)
		if !ok {
			continue // another test, in this process or another, has it
		}
		if l, err := net.Listen("tcp", addr); err == nil {
			l.Close()
			t.Cleanup(release)
			return "tcp://" + addr
		}
		release()
	}
	t.Fatal("no free port below the ephemeral range")
	return ""
}

// The ports FreeTCP picks from.
const lowPorts, numLowPorts = 20000, 12000

// VerifyNoLeaks runs the tests and fails if a goroutine outlives them. zmq4
// v0.17.0 never stops a PUB socket's writer goroutine (pubMWriter.run waits on
// a condition Close does not signal): a leak of the library's publisher side,
// not of the subscriber path a router embeds, so that one is let through.
func VerifyNoLeaks(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// RawPeer is a TCP peer that speaks as much ZMTP as script holds: it writes
// script to every connection it accepts and then neither reads nor writes,
// holding the connection until the test ends (a wrong port, a hung process, a
// peer that stops mid-handshake, or a hostile one). It returns a tcp:// endpoint.
func RawPeer(t testing.TB, script []byte) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	done := make(chan struct{})
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				c.Write(script)
				<-done
				c.Close()
			})
		}
	})
	t.Cleanup(func() {
		close(done)
		l.Close()
		wg.Wait()
	})
	return "tcp://" + l.Addr().String()
}
