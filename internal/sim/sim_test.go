package sim

import (
	"slices"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
)

// Trace gives the Mooncake trace where ../shared has it and the synthetic
// one otherwise: the same number of requests, of the same shape.
func TestTraceIsTheRealOneOrItsStandIn(t *testing.T) {
	reqs, source, err := Trace(0)
	if err != nil {
		t.Fatal(err)
	}
	if _, present := FindTrace(); (source == "mooncake") != present {
		t.Errorf("source %q with the trace present: %v", source, present)
	}
	if len(reqs) != TraceRequests {
		t.Errorf("%s: %d requests, want %d (the trace's README)", source, len(reqs), TraceRequests)
	}
	if few, _, _ := Trace(10); len(few) != 10 {
		t.Errorf("Trace(10) gave %d requests", len(few))
	}
	t.Setenv(TraceEnv, "synthetic")
	if _, source, _ := Trace(10); source != "synthetic" {
		t.Errorf("%s=synthetic: the trace is %s", TraceEnv, source)
	}
	t.Setenv(TraceEnv, t.TempDir()+"/missing.jsonl")
	if _, _, err := Trace(10); err == nil {
		t.Errorf("%s names a missing file: no error", TraceEnv)
	}
	for i, r := range reqs[:100] {
		if len(r.HashIDs) == 0 || (r.InputLength+TraceBlockTokens-1)/TraceBlockTokens != len(r.HashIDs) {
			t.Fatalf("request %d: %d tokens in %d blocks", i, r.InputLength, len(r.HashIDs))
		}
	}
}

func TestTokensAreDeterministicPerBlock(t *testing.T) {
	a, b, c := Tokens(nil, 7), Tokens(nil, 7), Tokens(nil, 8)
	if len(a) != TraceBlockTokens || !slices.Equal(a, b) || slices.Equal(a, c) {
		t.Error("tokens must depend on the hash id alone")
	}
}

func TestEngineStoresWhatItLacksAndEvictsLRU(t *testing.T) {
	e := NewEngine(16, 64) // two trace blocks of 32 engine blocks
	serve := func(ids ...uint64) ([]codec.Event, int) {
		r := &Request{HashIDs: ids}
		return e.Serve(nil, r, PromptTokens(nil, r))
	}
	evs, hit := serve(1)
	if hit != 0 || len(evs) != 1 || len(evs[0].BlockHashes) != 32 || evs[0].HasParent || len(evs[0].TokenIDs) != 32*16 {
		t.Fatalf("first request: hit %d, events %+v", hit, evs)
	}
	first := evs[0].BlockHashes
	evs, hit = serve(1, 2)
	if hit != 32 || len(evs) != 1 || !evs[0].HasParent || evs[0].ParentHash != first[31] {
		t.Fatalf("second request: hit %d, events %d, parent %x", hit, len(evs), evs[0].ParentHash)
	}
	evs, hit = serve(3) // over capacity: the least recently used go, leaves first
	if hit != 0 || len(evs) != 2 || evs[1].Type != codec.BlockRemoved || len(evs[1].BlockHashes) != 32 || e.Len() != 64 {
		t.Fatalf("third request: hit %d, %d events, cached %d", hit, len(evs), e.Len())
	}
	if _, hit = serve(1); hit != 32 {
		t.Errorf("the shared prefix should have survived (touched last), hit %d", hit)
	}
}

func TestSyntheticTraceSharesPrefixes(t *testing.T) {
	reqs := SyntheticTrace(200, 1)
	shared := 0
	for i := 1; i < len(reqs); i++ {
		if reqs[i].HashIDs[0] == reqs[i-1].HashIDs[0] {
			shared++
		}
	}
	if len(reqs) != 200 || shared == 0 {
		t.Errorf("%d requests, %d share a first block with their predecessor", len(reqs), shared)
	}
}
