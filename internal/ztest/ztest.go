// Package ztest holds what the ZMQ tests of several packages share: free
// loopback endpoints, and the goroutine-leak check that knows zmq4's own leak.
package ztest

import (
	"net"
	"testing"

	"go.uber.org/goleak"
)

// FreeTCP returns a tcp:// endpoint on loopback that was free a moment ago.
func FreeTCP(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "tcp://" + l.Addr().String()
}

// VerifyNoLeaks runs the tests and fails if a goroutine outlives them. zmq4
// v0.17.0 never stops a PUB socket's writer goroutine (pubMWriter.run waits on
// a condition Close does not signal): a leak of the library's publisher side,
// not of the subscriber path a router embeds, so that one is let through.
func VerifyNoLeaks(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
