package main

import (
	"bytes"
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvpipe/kvpipe/codec"
)

func TestDecodePrintsEveryGoldenVector(t *testing.T) {
	wantEvents := map[string]int{"vllm_map.hex": 2, "vllm_array_v025.hex": 2, "sglang_signed.hex": 1, "vllm_bin_map_batch.hex": 1,
		"vllm_array_12_slots.hex": 1, "vllm_array_removed.hex": 4, "sglang_cache_salt.hex": 2, "sglang_array_salt.hex": 1,
		"sglang_map_salt.hex": 1, "vllm_extra_keys_wide.hex": 1, "vllm_tuple_extra_keys.hex": 1, "vllm_typed_extra_keys.hex": 1,
		"sglang_eagle_map.hex": 1, "sglang_eagle_array.hex": 2}
	files, _ := filepath.Glob("../../codec/testdata/golden/*.hex")
	if len(files) != len(wantEvents) {
		t.Fatalf("found %d golden files, want %d", len(files), len(wantEvents))
	}
	for _, f := range files {
		var out, errOut bytes.Buffer
		code := run(context.Background(), []string{"decode", "--hex", f}, nil, &out, &errOut)
		if unreadable := filepath.Base(f) == "sglang_eagle_array.hex"; unreadable {
			// Its event 1 cannot be read: the others are printed, its error said.
			if code != 1 || !strings.Contains(errOut.String(), "event 1: token_ids: [1]: bigram starts with 9") {
				t.Errorf("%s: exit %d, stderr %q; want 1 and event 1's error", f, code, errOut.String())
			}
		} else if code != 0 {
			t.Fatalf("%s: exit %d: %s", f, code, errOut.String())
		}
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		if len(lines) != wantEvents[filepath.Base(f)] {
			t.Errorf("%s: %d lines, want %d", f, len(lines), wantEvents[filepath.Base(f)])
		}
		for _, l := range lines {
			var ev map[string]any
			if err := json.Unmarshal([]byte(l), &ev); err != nil {
				t.Errorf("%s: not JSON: %q: %v", f, l, err)
			}
			if ev["type"] == nil {
				t.Errorf("%s: no type in %q", f, l)
			}
		}
	}
}

func TestDecodeHashesAreUnsignedDecimal(t *testing.T) {
	var out bytes.Buffer
	if code := run(context.Background(), []string{"decode", "--hex", "../../codec/testdata/golden/sglang_signed.hex"}, nil, &out, &bytes.Buffer{}); code != 0 {
		t.Fatal("exit", code)
	}
	if !strings.Contains(out.String(), `"block_hashes":[18446744073709551614,18446744073709551615]`) {
		t.Errorf("signed hashes not printed as their unsigned 64 bits: %s", out.String())
	}
}

func TestDecodeBadPayloadExitsOne(t *testing.T) {
	for _, in := range []string{"c0", "93 cb 00", "zz"} {
		var out, errOut bytes.Buffer
		code := run(context.Background(), []string{"decode", "--hex"}, strings.NewReader(in), &out, &errOut)
		if code != 1 || errOut.Len() == 0 || out.Len() != 0 {
			t.Errorf("input %q: exit %d, stderr %q, stdout %q; want 1, a message, nothing", in, code, errOut.String(), out.String())
		}
	}
}

// Engines send arbitrary bytes in string fields; every line must still be
// valid JSON and read back as encoding/json reads the same bytes.
func TestEventJSONIsValidForEveryString(t *testing.T) {
	for _, s := range []string{"GPU", "a\x01b", "tab\tquote\"back\\slash", "\xff\xfe", "日本\x00", "\u2028", string([]byte{0xe6, 0x97})} {
		e := codec.Event{Type: codec.BlockStored, BlockHashes: []uint64{1}, Medium: s, LoraName: s, SpecKind: s}
		line := appendEventJSON(nil, &e)
		if !json.Valid(line) {
			t.Errorf("%q: invalid JSON %s", s, line)
			continue
		}
		var got struct {
			Medium string `json:"medium"`
		}
		if err := json.Unmarshal(line, &got); err != nil {
			t.Fatal(err)
		}
		ref, _ := json.Marshal(s) // encoding/json's reading of the same bytes
		var want string
		json.Unmarshal(ref, &want)
		if got.Medium != want {
			t.Errorf("%q: medium reads back %q, want %q", s, got.Medium, want)
		}
	}
}
