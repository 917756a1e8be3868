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
	// Lora is the LoRA adapter the request runs on, "" for the base model.
	// LoadTrace assigns one (Adapter) unless the line names it; SyntheticTrace
	// assigns one per conversation. Only an engine WithLoRA honours it.
	Lora string `json:"lora,omitempty"`
}

// Adapters are the LoRA adapters the traces assign, about 1 conversation in
// 8 each (so about 1 in 4 runs on an adapter).
var Adapters = [...]string{"sql-lora", "chat-lora"}

// LoraID is the integer id vLLM publishes (lora_id, its lora_int_id) for an
// adapter: 1 + its index in Adapters, and for any other name a stable id
// above them; 0 for the base model.
func LoraID(name string) int64 {
	if name == "" {
		return 0
	}
	for i, a := range Adapters {
		if a == name {
			return int64(i + 1)
		}
	}
	return int64(len(Adapters)+1) + int64(loraRoot(name)>>40)
}

// Adapter is the adapter the trace assigns to a conversation: it is decided
// by the conversation's key, so every turn of a conversation gets the same.
// The key is the request's second hash id when it has one (in the Mooncake
// trace every request starts with the same system block, id 0, and the
// second names the conversation), else its first.
func Adapter(hashIDs []uint64) string {
	switch len(hashIDs) {
	case 0:
		return ""
	case 1:
		return adapterOf(hashIDs[0])
	}
	return adapterOf(hashIDs[1])
}

// adapterOf is the adapter of the conversation of key k: 2 in 8 keys run on
// one, the rest on the base model.
func adapterOf(k uint64) string {
	if i := fmix(k^0x4c6f5241) % 8; i < uint64(len(Adapters)) {
		return Adapters[i]
	}
	return ""
}

// PromptLen is the prompt's length in tokens: InputLength when it fits the
// request's trace blocks (more than all but the last, at most all), else
// every token of its blocks.
func PromptLen(r *Request) int {
	n := len(r.HashIDs) * TraceBlockTokens
	if r.InputLength > n-TraceBlockTokens && r.InputLength <= n {
		return r.InputLength
	}
	return n
}

// InputTokens appends the PromptLen tokens of a request: PromptTokens cut
// at the prompt's length, so its last block may be a prefix of its trace
// block's tokens.
func InputTokens(dst []uint32, r *Request) []uint32 {
	start := len(dst)
	dst = PromptTokens(dst, r)
	return dst[:start+PromptLen(r)]
}

// TraceFile is where the trace lives, relative to the module root's parent.
const TraceFile = "shared/traces/mooncake_conversation_trace.jsonl"

// TraceEnv names the environment variable that chooses the trace: unset or
// empty, FindTrace looks for ../shared/traces; "synthetic" hides the real
// trace, so that a run takes the path of a fresh clone without ../shared (CI
// runs the trace-driven packages both ways); anything else is the path of a
// trace file.
const TraceEnv = "KVPIPE_TRACE"

// FindTrace reports the trace file TraceEnv names, or else looks for
// ../shared/traces/... above the working directory (tests run in their
// package's directory).
func FindTrace() (string, bool) {
	switch env := os.Getenv(TraceEnv); env {
	case "":
	case "synthetic":
		return "", false
	default:
		return env, true // a file that is missing fails LoadTrace, clearly
	}
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
		if r.Lora == "" {
			r.Lora = Adapter(r.HashIDs)
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

// ShortTraceRequests is the part of the trace a benchmark replays under
// -short: CI runs every benchmark once that way, so that none rots, and the
// figures come from full runs.
const ShortTraceRequests = 2000

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
//
// A request's last block holds 1 to 512 tokens (InputLength), decided by its
// hash id, and a conversation runs on the adapter its first block after the
// system prefix decides (adapterOf), about 1 in 4 on one. Neither draws on
// the random source, so the hash ids and timestamps of a seed never change.
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
	var loras []string // per session
	reqs := make([]Request, 0, n)
	var ts int64
	for len(reqs) < n {
		ts += int64(rng.IntN(600))
		var ids []uint64
		var lora string
		if len(sessions) > 0 && rng.IntN(3) > 0 { // a follow-up turn of an open session
			i := rng.IntN(len(sessions))
			ids = append(append([]uint64{}, sessions[i]...), fresh(1+rng.IntN(3))...)
			if len(ids) > 60 {
				ids = ids[:60]
			}
			sessions[i], lora = ids, loras[i]
		} else {
			system := systems[rng.IntN(len(systems))]
			ids = append(append([]uint64{}, system...), fresh(1+rng.IntN(20))...)
			lora = adapterOf(ids[len(system)])
			sessions, loras = append(sessions, ids), append(loras, lora)
			if len(sessions) > 64 {
				sessions, loras = sessions[1:], loras[1:]
			}
		}
		last := 1 + int(fmix(ids[len(ids)-1]^0x7461696c)%TraceBlockTokens) // tokens in the last block
		reqs = append(reqs, Request{TimestampMs: ts, InputLength: (len(ids)-1)*TraceBlockTokens + last, OutputLength: 300,
			HashIDs: ids, Lora: lora})
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
