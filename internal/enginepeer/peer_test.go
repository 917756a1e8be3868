package enginepeer

import (
	"net"
	"testing"

	"github.com/kvpipe/kvpipe/internal/ztest"
)

// A peer that cannot bind the endpoint it was given (another process has
// the port) is started again on a new one.
func TestStartBoundRetriesOnATakenPort(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	taken := "tcp://" + l.Addr().String()
	picks := 0
	free := func(tb testing.TB) string {
		if picks++; picks == 1 {
			return taken
		}
		return ztest.FreeTCP(tb)
	}
	p, eps := StartBound(t, free, "../../wire/testdata/engine_pub.py", []string{"--endpoint", "--replay"})
	if eps[0] == taken || picks != 4 {
		t.Fatalf("endpoints %v after %d picks, want new ones after 4 (the first taken)", eps, picks)
	}
	p.Send("quit")
}
