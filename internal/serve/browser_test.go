package serve

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvpipe/kvpipe/internal/enginepeer"
	"github.com/kvpipe/kvpipe/internal/wiretest"
)

// The status page in a real browser (Debian's chromium, headless): it
// loads, refreshes itself, and shows the workers with their state and
// blocks, the events/s and index size, and a reset (an engine restarted).
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
	engines := map[string]*engine{}
	for _, name := range []string{"engine-a", "engine-b"} {
		e := newEngine(t, "")
		r.register(name, e.pub)
		r.subscribed(name, e)
		engines[name] = e
	}
	engines["engine-a"].store(1, 5)
	// engine-b restarts on its addresses: its sequence starts over, behind
	// where it was.
	old := engines["engine-b"].pub
	for range 20 {
		engines["engine-b"].probe()
	}
	eventually(t, "engine-b's batches before its restart", func() bool {
		b, _ := r.p.Stats().Worker("engine-b")
		return b.Wire.Batches >= 20
	})
	cfg := wiretest.PublisherConfig{Endpoint: "tcp://" + old.Addr(), ReplayEndpoint: "tcp://" + old.ReplayAddr()}
	old.Close()
	pub, err := wiretest.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	restarted := &engine{t: t, pub: pub}
	eventually(t, "engine-b's restart seen and engine-a's blocks indexed", func() bool {
		restarted.probe()
		a, _ := r.p.Stats().Worker("engine-a")
		b, _ := r.p.Stats().Worker("engine-b")
		return a.Actor.IndexedBlocks == 5 && b.Wire.Restarts > 0 && r.matchGRPC(chainTokens(1, 5))["engine-a"] == 5
	})
	eventually(t, "the page's sample of both workers, the blocks and the reset", func() bool {
		cur := r.s.svc.mon.cur.Load()
		return len(cur.workers) == 2 && len(r.s.svc.mon.recentResets()) > 0 && cur.workers["engine-a"].status.IndexedBlocks == 5
	})

	// The page through a counter of its loads. Refreshing itself, it loads
	// twice in a frame of a page whose own load an image holds until then,
	// or a minute (headless chromium dumps the DOM once a page has loaded).
	var loads atomic.Int32
	reloaded := make(chan struct{})
	counted := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		switch req.URL.Path {
		case "/":
			if loads.Add(1) == 2 {
				close(reloaded)
			}
			r.s.Handler().ServeHTTP(w, req)
		case "/framed":
			fmt.Fprint(w, `<!doctype html><iframe src="/"></iframe><img src="/slow">`)
		case "/slow":
			select {
			case <-reloaded:
			case <-time.After(time.Minute):
			case <-req.Context().Done():
			}
			http.NotFound(w, req)
		default:
			r.s.Handler().ServeHTTP(w, req)
		}
	}))
	defer counted.Close()
	dom := dumpDOM(t, chromium, counted.URL+"/")
	for _, want := range []string{`http-equiv="refresh"`, "<td>engine-a</td>", "<td>engine-b</td>", "2 workers",
		"index: 5 nodes, 5 blocks on device", `<td class="n">5</td>`, "events/s", "Recent resets", "engine-b: engine restart"} {
		if !strings.Contains(dom, want) {
			t.Errorf("the page as chromium loaded it lacks %q:\n%.3000s", want, dom)
		}
	}
	if !strings.Contains(dom, ">CONNECTED<") && !strings.Contains(dom, ">PARTIAL<") {
		t.Errorf("no worker shown connected or partial:\n%.3000s", dom)
	}
	loads.Store(0) // the frame's load is the first, its refresh the second
	dumpDOM(t, chromium, counted.URL+"/framed")
	if n := loads.Load(); n < 2 {
		t.Errorf("chromium loaded the page in the frame %d times in a minute: it did not refresh itself", n)
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
