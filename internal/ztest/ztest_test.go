package ztest

import (
	"strconv"
	"strings"
	"testing"
)

func TestClaimPortIsExclusiveUntilReleased(t *testing.T) {
	if !portLocks {
		t.Skip("no flock here")
	}
	addr := FreeTCP(t) // claimed until this test ends
	port, err := strconv.Atoi(addr[strings.LastIndexByte(addr, ':')+1:])
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := claimPort(port); ok {
		t.Fatalf("port %d claimed twice", port)
	}
	other := port + 1
	if other == lowPorts+numLowPorts {
		other = lowPorts
	}
	release, ok := claimPort(other)
	if !ok {
		t.Skipf("port %d held by another test process", other)
	}
	release()
	again, ok := claimPort(other)
	if !ok {
		t.Fatalf("port %d not claimable after its release", other)
	}
	again()
}
