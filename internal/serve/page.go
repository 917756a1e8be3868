package serve

import (
	"fmt"
	"html/template"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func promHandler(reg *prometheus.Registry) http.Handler {
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

// ready reports whether every registered worker has connected (and so is
// whole, or flagged partial) or has been waited for ReadyTimeout (and so
// counts as partial: missing), and at least one has connected: an index
// of no engine at all is no use to a router. It says why not, or names
// the workers given up on.
func (s *Server) ready() (ok bool, why string, missing []string) {
	st := s.cfg.Pipeline.Stats()
	regs := s.svc.registrations()
	for _, r := range regs {
		if ws, ok := st.Worker(r.spec.Name); ok && connected(ws) {
			continue
		}
		if s.cfg.ReadyTimeout < 0 || time.Since(r.since) < s.cfg.ReadyTimeout {
			return false, fmt.Sprintf("worker %s has not connected yet", r.spec.Name), nil
		}
		missing = append(missing, r.spec.Name)
	}
	if len(regs) > 0 && len(missing) == len(regs) {
		return false, fmt.Sprintf("no worker has connected in %v", s.cfg.ReadyTimeout), nil
	}
	return true, "", missing
}

func (s *Server) readyz(w http.ResponseWriter, r *http.Request) {
	ok, why, missing := s.ready()
	switch {
	case !ok:
		http.Error(w, "not ready: "+why, http.StatusServiceUnavailable)
	case len(missing) > 0:
		fmt.Fprintf(w, "ready; partial: not connected after %v: %s\n", s.cfg.ReadyTimeout, strings.Join(missing, ", "))
	default:
		fmt.Fprintln(w, "ready")
	}
}

// pageData is what the status page shows.
type pageData struct {
	Refresh int
	Now     string
	Ready   bool
	Missing []string // workers given up on: the index lacks their blocks
	Workers []pageWorker
	Events  string // per second, all workers
	Nodes   int64
	Blocks  int64
	Resets  []reset
}

type pageWorker struct {
	Name, State, Endpoint, Events, LastEvent string
	Blocks                                   int64
	Gaps, Lost, Restarts, Resyncs            uint64
}

var pageTemplate = template.Must(template.New("page").Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{{.Refresh}}">
<title>kvpipe serve</title>
<style>
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse}td,th{padding:.3em .8em;border-bottom:1px solid #ddd;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.PARTIAL{color:#b60}.CONNECTING{color:#a00}.CONNECTED{color:#070}.FOLLOWED{color:#047}
</style></head><body>
<h1>kvpipe serve</h1>
<p id="summary">{{len .Workers}} workers &middot; {{.Events}} events/s &middot; index: {{.Nodes}} nodes, {{.Blocks}} blocks on device &middot;
{{if .Ready}}ready{{with .Missing}} (partial: never connected:{{range .}} {{.}}{{end}}){{end}}{{else}}not ready{{end}} &middot; as of {{.Now}}</p>
<table id="workers"><tr><th>worker</th><th>state</th><th>endpoint</th><th>events/s</th><th>blocks</th><th>last event</th><th>gaps</th><th>lost</th><th>restarts</th><th>resyncs</th></tr>
{{range .Workers}}<tr class="worker"><td>{{.Name}}</td><td class="{{.State}}">{{.State}}</td><td>{{.Endpoint}}</td><td class="n">{{.Events}}</td><td class="n">{{.Blocks}}</td><td class="n">{{.LastEvent}}</td><td class="n">{{.Gaps}}</td><td class="n">{{.Lost}}</td><td class="n">{{.Restarts}}</td><td class="n">{{.Resyncs}}</td></tr>
{{else}}<tr><td colspan="10">no workers</td></tr>{{end}}
</table>
<h2>Recent resets</h2>
<ul id="resets">{{range .Resets}}<li>{{.At.Format "15:04:05.000"}} {{.Worker}}: {{.What}}</li>{{else}}<li>none</li>{{end}}</ul>
<p><a href="/metrics">metrics</a> &middot; <a href="/v1/workers">workers as JSON</a> &middot; <a href="/readyz">readyz</a></p>
</body></html>
`))

// page is the status page: server-rendered, refreshing itself.
func (s *Server) page(w http.ResponseWriter, r *http.Request) {
	list := s.svc.list(s.svc.guard.holds(r.Header))
	ready, _, missing := s.ready()
	cur := s.svc.mon.cur.Load()
	d := pageData{Refresh: max(int(s.cfg.Poll.Seconds()*4), 2), Now: time.Now().Format(time.RFC3339), Ready: ready, Missing: missing,
		Events: fmt.Sprintf("%.0f", cur.events), Nodes: int64(list.IndexNodes), Resets: s.svc.mon.recentResets()}
	for _, ws := range list.Workers {
		pw := pageWorker{Name: ws.Name, State: strings.TrimPrefix(ws.State.String(), "WORKER_STATE_"), Endpoint: "(relay stream)",
			Events: fmt.Sprintf("%.0f", ws.EventsPerSecond), LastEvent: "never", Blocks: ws.IndexedBlocks,
			Gaps: ws.Gaps, Lost: ws.Lost, Restarts: ws.Restarts, Resyncs: ws.Resyncs}
		switch {
		case ws.Spec.GetEndpointsRedacted():
			pw.Endpoint = "(hidden: needs the token)"
		case ws.Spec != nil:
			pw.Endpoint = ws.Spec.Endpoint
		}
		if ws.LastEventAgeMs >= 0 {
			pw.LastEvent = (time.Duration(ws.LastEventAgeMs) * time.Millisecond).String() + " ago"
		}
		d.Blocks += ws.IndexedBlocks
		d.Workers = append(d.Workers, pw)
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := pageTemplate.Execute(w, d); err != nil {
		s.cfg.Logger.Warn("serve: status page", "err", err)
	}
}
