package sim

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
)

// TraceBlockTokens is the tokens behind one hash id of the Mooncake trace.
const TraceBlockTokens = 512

// Request is one line of the trace.
type Request struct {
	TimestampMs  int64    `json:"timestamp"`
	InputLength  int      `json:"input_length"`
	OutputLength int      `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
}

// TraceFile is where the trace lives, relative to the module root's parent.
const TraceFile = "shared/traces/mooncake_conversation_trace.jsonl"

// FindTrace looks for ../shared/traces/... above the working directory (tests
// run in their package's directory) and reports its path.
func FindTrace() (string, bool) {
	dir, err := os.Getwd()
	if err != nil {
		return "", false
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			p := filepath.Join(filepath.Dir(dir), TraceFile)
			_, err := os.Stat(p)
			return p, err == nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", false
		}
		dir = parent
	}
}

// LoadTrace reads a JSON-lines trace; limit > 0 stops after that many requests.
func LoadTrace(path string, limit int) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var reqs []Request
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for line := 1; sc.Scan() && (limit <= 0 || len(reqs) < limit); line++ {
		var r Request
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("%s:%d: %w", path, line, err)
		}
		reqs = append(reqs, r)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, errors.New(path + ": no requests")
	}
	return reqs, nil
}

// TraceRequests is how many requests the Mooncake conversation trace holds,
// and so how many the synthetic one stands in with.
const TraceRequests = 12031

// Trace returns the Mooncake trace when ../shared/traces has it, and the
// synthetic trace of its shape otherwise, so that no test or benchmark
// skips on a fresh clone; source says which ("mooncake" or "synthetic").
// limit > 0 stops after that many requests.
func Trace(limit int) (reqs []Request, source string, err error) {
	if path, ok := FindTrace(); ok {
		reqs, err = LoadTrace(path, limit)
		return reqs, "mooncake", err
	}
	n := TraceRequests
	if limit > 0 {
		n = min(n, limit)
	}
	return SyntheticTrace(n, 1), "synthetic", nil
}

// SyntheticTrace makes n requests shaped like Mooncake's conversations:
// sessions that grow their prompt turn by turn over a shared system prefix.
// It stands in when the real trace is absent; no line of it is copied.
func SyntheticTrace(n int, seed uint64) []Request {
	rng := rand.New(rand.NewPCG(seed, 0x6d6f6f6e))
	next := uint64(1000)
	fresh := func(k int) []uint64 {
		ids := make([]uint64, k)
		for i := range ids {
			ids[i], next = next, next+1
		}
		return ids
	}
	systems := [][]uint64{fresh(4), fresh(6), fresh(2)}
	var sessions [][]uint64
	reqs := make([]Request, 0, n)
	var ts int64
	for len(reqs) < n {
		ts += int64(rng.IntN(600))
		var ids []uint64
		if len(sessions) > 0 && rng.IntN(3) > 0 { // a follow-up turn of an open session
			i := rng.IntN(len(sessions))
			ids = append(append([]uint64{}, sessions[i]...), fresh(1+rng.IntN(3))...)
			if len(ids) > 60 {
				ids = ids[:60]
			}
			sessions[i] = ids
		} else {
			ids = append(append([]uint64{}, systems[rng.IntN(len(systems))]...), fresh(1+rng.IntN(20))...)
			sessions = append(sessions, ids)
			if len(sessions) > 64 {
				sessions = sessions[1:]
			}
		}
		reqs = append(reqs, Request{TimestampMs: ts, InputLength: len(ids) * TraceBlockTokens, OutputLength: 300, HashIDs: ids})
	}
	return reqs
}

// Tokens appends the token ids behind one trace block: token i of block h is
// a mix of h and i, so every router derives the same tokens, and so the same
// router hashes, from the trace alone.
func Tokens(dst []uint32, hashID uint64) []uint32 {
	for i := range uint64(TraceBlockTokens) {
		x := hashID*0x9e3779b97f4a7c15 + i*0xbf58476d1ce4e5b9
		x ^= x >> 31
		x *= 0x94d049bb133111eb
		x ^= x >> 29
		dst = append(dst, uint32(x%151936)) // a Qwen-sized vocabulary
	}
	return dst
}

// PromptTokens appends the tokens of a whole request.
func PromptTokens(dst []uint32, r *Request) []uint32 {
	for _, h := range r.HashIDs {
		dst = Tokens(dst, h)
	}
	return dst
}
