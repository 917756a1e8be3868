package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// kvpipe serve with a worker from a --config file: it answers, and SIGTERM
// drains it (exit 0) with its snapshot saved.
func TestServeDrainsOnSIGTERM(t *testing.T) {
	dir := t.TempDir()
	config := filepath.Join(dir, "workers.json")
	os.WriteFile(config, []byte(`{"workers":[{"name":"e0","endpoint":"`+freeTCP(t)+`"}]}`), 0o600)
	token := filepath.Join(dir, "token")
	os.WriteFile(token, []byte("t0k3n\n"), 0o600)
	snap := filepath.Join(dir, "index.snap")
	stderrR, stderrW := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- run(context.Background(), []string{"serve", "--listen", "127.0.0.1:0", "--config", config,
			"--token-file", token, "--snapshot", snap}, nil, io.Discard, stderrW)
		stderrW.Close()
	}()
	lines := bufio.NewScanner(stderrR)
	if !lines.Scan() || !strings.Contains(lines.Text(), "listening on") {
		t.Fatalf("stderr %q, want the listening line", lines.Text())
	}
	addr := strings.Fields(lines.Text())[4]
	client := &http.Client{Timeout: time.Minute}
	defer client.CloseIdleConnections()
	resp, err := client.Get("http://" + addr + "/v1/workers")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `"e0"`) {
		t.Errorf("GET /v1/workers: %s, want e0", body)
	}
	// Our own process: serve's handler takes the signal, as in production.
	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	var rest strings.Builder
	for lines.Scan() {
		rest.WriteString(lines.Text() + "\n")
	}
	if code := <-done; code != 0 || !strings.Contains(rest.String(), "drained") {
		t.Errorf("exit %d, stderr %q: want 0 and drained", code, rest.String())
	}
	if _, err := os.Stat(snap); err != nil {
		t.Errorf("snapshot not saved: %v", err)
	}
}

func TestServeFlagErrors(t *testing.T) {
	empty := filepath.Join(t.TempDir(), "empty")
	os.WriteFile(empty, nil, 0o600)
	for _, args := range [][]string{
		{"--tls-cert", "x.pem"}, {"--token-file", empty}, {"--token-file", "/no/such/file"},
		{"--config", empty}, {"--block-size", "0"}, {"--allow", "not a host name!"},
	} {
		var errOut strings.Builder
		if code := run(context.Background(), append([]string{"serve", "--listen", "127.0.0.1:0"}, args...), nil, io.Discard, &errOut); code != 2 || errOut.Len() == 0 {
			t.Errorf("serve %v: exit %d, stderr %q; want 2 and a message", args, code, errOut.String())
		}
	}
}
