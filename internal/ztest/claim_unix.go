//go:build linux || darwin || freebsd || netbsd || openbsd || dragonfly || illumos

package ztest

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

const portLocks = true

// claimPort takes an exclusive lock on a file named for port in /tmp (not
// os.TempDir: runners that give each job its own TMPDIR share the ports),
// which every test process of the machine that picks ports through FreeTCP
// tries first: a lock held by this process or another one fails at once,
// and the kernel drops it if the process dies. release gives it back. The
// files stay, for the next runs. Where no lock can be had (no /tmp, a file
// system without flock), it claims nothing, and FreeTCP relies on its
// listen check alone.
func claimPort(port int) (release func(), ok bool) {
	name := fmt.Sprintf("/tmp/kvpipe-test-port-%d.lock", port)
	f, err := os.Open(name) // flock needs no write access: another user's file will do
	if errors.Is(err, os.ErrNotExist) {
		f, err = os.OpenFile(name, os.O_CREATE|os.O_RDONLY, 0o666)
	}
	if err != nil {
		return func() {}, true
	}
	switch err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); {
	case errors.Is(err, syscall.EWOULDBLOCK):
		f.Close()
		return nil, false
	case err != nil:
		f.Close()
		return func() {}, true
	}
	return func() { f.Close() }, true
}
