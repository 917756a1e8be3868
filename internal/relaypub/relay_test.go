package relaypub

import (
	"testing"
)

// Engines → relay → stream → two routers: both routers' indexes equal the
// engines' caches (every prompt's score per worker, on device and with the
// host tier) and hold per worker and tier as many blocks as the relay's.
func TestEndToEndTwoRouters(t *testing.T) {
	t.Parallel()
	_, js := startServer(t)
	s := testSettings()
	a, b := newEngine(t, "engine-a"), newEngine(t, "engine.b") // a name that needs encoding
	reqs := trace(400, 1)
	a.serve(reqs[:200])
	rr := startRelay(t, js, relayConfig(s), a, b)
	r1 := startRouter(t, js, s)
	b.serve(reqs[200:])
	a.serve(reqs[:50])
	relayed(t, rr, a, b)
	r2 := startRouter(t, js, s)
	caughtUp(t, js, s, r1, r2)
	for i, r := range []*router{r1, r2} {
		if err := exact(r.p, a, b); err != nil {
			t.Errorf("router %d: %v", i+1, err)
		}
	}
	if err := sameBlocks(rr.Pipeline(), r1, r2); err != nil {
		t.Error(err)
	}
	st := rr.Stats()
	if st.Published == 0 || st.Duplicates != 0 || st.Retries != 0 {
		t.Errorf("relay stats %+v: want publishes, no duplicates or retries", st)
	}
	if fs := r1.f.Stats(); fs.Applied != st.Published || fs.BadMessages != 0 || fs.Lag != 0 {
		t.Errorf("router stats %+v: want every one of %d messages applied, no bad ones, no lag", fs, st.Published)
	}
}
