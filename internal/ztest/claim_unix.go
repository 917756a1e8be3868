//go:build unix

package ztest

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

const portLocks = true

// claimPort takes an exclusive lock on a file named for port in the
// temporary directory, which every test process of the machine that picks
// ports through FreeTCP tries first: a lock held by this process or another
// one fails at once, and the kernel drops it if the process dies. release
// gives it back.
func claimPort(port int) (release func(), ok bool) {
	name := filepath.Join(os.TempDir(), fmt.Sprintf("kvpipe-test-port-%d.lock", port))
	f, err := os.OpenFile(name, os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		return func() {}, true // no lock to be had: fall back to the listen check alone
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, false
	}
	return func() { f.Close() }, true
}
