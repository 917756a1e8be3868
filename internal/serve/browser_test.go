package serve

import (
	"context"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
)

// The status page in a real browser (Debian's chromium, headless): it
// loads, refreshes itself, and names the workers with their state.
func TestStatusPageInChromium(t *testing.T) {
	chromium := ""
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			chromium = p
			break
		}
	}
	if chromium == "" {
		enginepeer.Missing(t, "chromium (apt-get install chromium)")
	}
	r := start(t, Config{Token: testToken, Allow: []string{"127.0.0.1"}})
	for _, name := range []string{"engine-a", "engine-b"} {
		e := newEngine(t, "")
		r.register(name, e.pub)
		r.subscribed(name, e)
	}
	eventually(t, "the page's sample of both workers", func() bool { return len(r.s.svc.mon.cur.Load().workers) == 2 })

	dom := dumpDOM(t, chromium, r.url+"/")
	for _, want := range []string{`http-equiv="refresh"`, "<td>engine-a</td>", "<td>engine-b</td>", "2 workers", "Recent resets"} {
		if !strings.Contains(dom, want) {
			t.Errorf("the page as chromium loaded it lacks %q:\n%.3000s", want, dom)
		}
	}
	if !strings.Contains(dom, ">CONNECTED<") && !strings.Contains(dom, ">PARTIAL<") {
		t.Errorf("no worker shown connected or partial:\n%.3000s", dom)
	}
}

// dumpDOM loads url in headless chromium and returns the DOM it built.
func dumpDOM(t *testing.T, chromium, url string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
		"--user-data-dir="+t.TempDir(), "--dump-dom", url)
	// Its own process group, so that a timeout ends chromium's helpers too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium --dump-dom %s: %v", url, err)
	}
	return string(out)
}
