package codec_test

import (
	"encoding/hex"
	. "github.com/kvpipe/kvpipe/codec"
	"github.com/kvpipe/kvpipe/internal/engineenc"
	"strings"
	"testing"

	gocmp "github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/tinylib/msgp/msgp"
)

func testHeader() EngineSnapshotHeader {
	return EngineSnapshotHeader{Version: 1, Epoch: "0123456789abcdef0123456789abcdef", ReplicaRank: 2,
		ResumeSeq: 42, BarrierSeq: 41, BarrierID: "fedcba9876543210fedcba9876543210", RecordCount: 3}
}

// headerOf builds a header array from already-encoded elements.
func headerOf(elems ...[]byte) []byte {
	p := msgp.AppendArrayHeader(nil, uint32(len(elems)))
	for _, e := range elems {
		p = append(p, e...)
	}
	return p
}

// headerElems is testHeader encoded element by element, for cases to alter one.
func headerElems() [][]byte {
	h := testHeader()
	return [][]byte{
		msgp.AppendInt(nil, h.Version),
		msgp.AppendString(nil, h.Epoch),
		msgp.AppendInt(nil, h.ReplicaRank),
		msgp.AppendUint64(nil, h.ResumeSeq),
		msgp.AppendUint64(nil, h.BarrierSeq),
		msgp.AppendString(nil, h.BarrierID),
		msgp.AppendInt(nil, h.RecordCount),
	}
}

// withElem is headerElems with element i replaced by v (appended past the end when i == len).
func withElem(i int, v []byte) []byte {
	e := headerElems()
	if i == len(e) {
		e = append(e, v)
	} else {
		e[i] = v
	}
	return headerOf(e...)
}

func mustHex(t testing.TB, s string) []byte {
	t.Helper()
	p, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDecodeSnapshotHeader(t *testing.T) {
	want := testHeader()
	cases := []struct {
		name    string
		payload []byte
		want    EngineSnapshotHeader
	}{
		{"encoder", engineenc.AppendEngineSnapshotHeader(nil, &want), want},
		// Python msgpack.packb([1, epoch, 0, 6, 5, barrier_id, 3]), as msgspec writes it.
		{"python-packed", mustHex(t, "9701d9203031323334353637383961626364656630313233343536373839616263646566000605d920666564636261393837363534333231306665646362613938373635343332313003"),
			EngineSnapshotHeader{Version: 1, Epoch: "0123456789abcdef0123456789abcdef", ResumeSeq: 6, BarrierSeq: 5,
				BarrierID: "fedcba9876543210fedcba9876543210", RecordCount: 3}},
		{"version as uint64", withElem(0, []byte{0xcf, 0, 0, 0, 0, 0, 0, 0, 1}), want},
		{"version as int8", withElem(0, []byte{0xd0, 1}), want},
		{"epoch as bin", withElem(1, msgp.AppendBytes(nil, []byte(want.Epoch))), want},
		{"barrier_id as bin", withElem(5, msgp.AppendBytes(nil, []byte(want.BarrierID))), want},
		{"replica_rank as int32", withElem(2, []byte{0xd2, 0, 0, 0, 2}), want},
		{"resume_seq as int64", withElem(3, msgp.AppendInt64(nil, 42)), want},
		{"barrier_seq as uint16", withElem(4, []byte{0xcd, 0, 41}), want},
		{"record_count as uint32", withElem(6, []byte{0xce, 0, 0, 0, 3}), want},
		{"an eighth field from a newer version", withElem(7, msgp.AppendMapHeader(msgp.AppendArrayHeader(nil, 1), 0)), want},
		{"two newer fields", headerOf(append(headerElems(), msgp.AppendString(nil, "x"), msgp.AppendNil(nil))...), want},
		{"largest seqs", headerOf(append(headerElems()[:3], msgp.AppendUint64(nil, 1<<64-1), msgp.AppendUint64(nil, 1<<64-2),
			headerElems()[5], headerElems()[6])...),
			func() EngineSnapshotHeader { h := want; h.ResumeSeq, h.BarrierSeq = 1<<64-1, 1<<64-2; return h }()},
		{"empty epoch and no records", engineenc.AppendEngineSnapshotHeader(nil, &EngineSnapshotHeader{Version: 1}), EngineSnapshotHeader{Version: 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeEngineSnapshotHeader(tc.payload)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestDecodeSnapshotHeaderErrors(t *testing.T) {
	h := testHeader()
	valid := engineenc.AppendEngineSnapshotHeader(nil, &h)
	cases := []struct {
		name    string
		payload []byte
		want    string
	}{
		{"empty", nil, "batch: snapshot header: truncated payload"},
		{"not an array", msgp.AppendString(nil, "header"), "batch: snapshot header: expected array, got str"},
		{"a map", msgp.AppendMapHeader(nil, 0), "batch: snapshot header: expected array, got map"},
		{"six elements", headerOf(headerElems()[:6]...),
			"batch: snapshot header: array of 6 elements, want at least 7 (version, epoch, replica_rank, resume_seq, barrier_seq, barrier_id, record_count)"},
		{"empty array", headerOf(), "batch: snapshot header: array of 0 elements, want at least 7"},
		{"version 2", withElem(0, msgp.AppendInt(nil, 2)), "batch: snapshot version: version 2, want 1: only snapshot-v1 is known"},
		{"version 0", withElem(0, msgp.AppendInt(nil, 0)), "batch: snapshot version: version 0, want 1"},
		{"version -1", withElem(0, msgp.AppendInt(nil, -1)), "batch: snapshot version: version -1, want 1"},
		{"version as string", withElem(0, msgp.AppendString(nil, "1")), "batch: snapshot version: expected int, got str"},
		{"version as float", withElem(0, msgp.AppendFloat64(nil, 1)), "batch: snapshot version: expected int, got float64"},
		{"epoch as int", withElem(1, msgp.AppendInt(nil, 7)), "batch: snapshot epoch: expected str or bin, got int"},
		{"epoch nil", withElem(1, msgp.AppendNil(nil)), "batch: snapshot epoch: expected str or bin, got nil"},
		{"replica_rank negative", withElem(2, msgp.AppendInt(nil, -1)), "batch: snapshot replica_rank: -1 out of range"},
		{"replica_rank huge", withElem(2, msgp.AppendInt64(nil, 1<<40)), "batch: snapshot replica_rank: 1099511627776 out of range"},
		{"replica_rank nil", withElem(2, msgp.AppendNil(nil)), "batch: snapshot replica_rank: expected int, got nil"},
		{"resume_seq negative", withElem(3, msgp.AppendInt(nil, -5)), "batch: snapshot resume_seq: -5 is negative"},
		{"barrier_seq as string", withElem(4, msgp.AppendString(nil, "5")), "batch: snapshot barrier_seq: expected int, got str"},
		{"barrier_id as array", withElem(5, msgp.AppendArrayHeader(nil, 0)), "batch: snapshot barrier_id: expected str or bin, got array"},
		{"record_count negative", withElem(6, msgp.AppendInt(nil, -3)), "batch: snapshot record_count: -3 out of range"},
		{"record_count past int64", withElem(6, msgp.AppendUint64(nil, 1<<63)), "batch: snapshot record_count: 9223372036854775808 overflows int64"},
		{"truncated by one byte", valid[:len(valid)-1], "batch: snapshot record_count: truncated payload"},
		{"truncated in the epoch", valid[:10], "batch: snapshot epoch: truncated payload"},
		{"truncated newer field", withElem(7, []byte{0x92, 0x01}), "batch: snapshot header: truncated payload"},
		{"trailing garbage", append(append([]byte{}, valid...), 0xc0), "batch: snapshot header: 1 trailing bytes after the header"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeEngineSnapshotHeader(tc.payload)
			if err == nil {
				t.Fatalf("no error; decoded %+v", got)
			}
			if _, ok := err.(*Error); !ok {
				t.Errorf("error %T is not a *codec.Error", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q, want it to contain %q", err, tc.want)
			}
			if got != (EngineSnapshotHeader{}) {
				t.Errorf("returned %+v with the error, want the zero header", got)
			}
		})
	}
	// Every cut of a valid header fails cleanly.
	for i := range valid {
		if _, err := DecodeEngineSnapshotHeader(valid[:i]); err == nil {
			t.Errorf("header cut at %d of %d bytes decoded", i, len(valid))
		} else if _, ok := err.(*Error); !ok {
			t.Errorf("cut at %d: error %T is not a *codec.Error", i, err)
		}
	}
}

// record builds one encoded record from its already-encoded slots.
func record(slots ...[]byte) []byte { return headerOf(slots...) }

func chunkOf(records ...[]byte) []byte { return headerOf(records...) }

func hashesOf(hashes ...[]byte) []byte { return headerOf(hashes...) }

// digest is a 32-byte bin whose last 8 bytes are h, as vLLM sends raw digests.
func digest(h uint64) []byte {
	var d [32]byte
	for i := range 24 {
		d[i] = byte(0xa0 + i)
	}
	for i := range 8 {
		d[31-i] = byte(h >> (8 * i))
	}
	return msgp.AppendBytes(nil, d[:])
}

// sameBlock compares records as decoding defines them (a nil and an empty Hashes are the same).
func sameBlock(a, b EngineSnapshotBlock) bool {
	if a.HasParent != b.HasParent || a.Parent != b.Parent || len(a.Hashes) != len(b.Hashes) {
		return false
	}
	for i := range a.Hashes {
		if a.Hashes[i] != b.Hashes[i] {
			return false
		}
	}
	return true
}

var blockCmp = gocmp.Options{gocmp.Comparer(sameBlock), cmpopts.EquateEmpty()}

func TestDecodeSnapshotChunk(t *testing.T) {
	nilp := msgp.AppendNil(nil)
	cases := []struct {
		name    string
		payload []byte
		want    []EngineSnapshotBlock
	}{
		{"empty chunk", chunkOf(), nil},
		{"nil parent", chunkOf(record(nilp, hashesOf(msgp.AppendInt(nil, 7)))), []EngineSnapshotBlock{{Hashes: []uint64{7}}}},
		{"parent and child", chunkOf(record(nilp, hashesOf(msgp.AppendInt(nil, 7))), record(msgp.AppendInt(nil, 7), hashesOf(msgp.AppendInt(nil, 8)))),
			[]EngineSnapshotBlock{{Hashes: []uint64{7}}, {Parent: 7, HasParent: true, Hashes: []uint64{8}}}},
		// Python msgpack.packb of SGLang-style signed hashes (the first 8 bytes of a SHA-256 as int64).
		{"python-packed", mustHex(t, "9392c091d3a00000000000000092d3a00000000000000091cd303992cd303991ff"),
			[]EngineSnapshotBlock{{Hashes: []uint64{0xa000000000000000}}, {Parent: 0xa000000000000000, HasParent: true, Hashes: []uint64{12345}},
				{Parent: 12345, HasParent: true, Hashes: []uint64{1<<64 - 1}}}},
		{"hash widths and signs", chunkOf(record(msgp.AppendInt8(nil, -1), hashesOf(
			msgp.AppendInt8(nil, -1), msgp.AppendUint8(nil, 200), msgp.AppendInt16(nil, -300), []byte{0xcd, 0xea, 0x60},
			msgp.AppendInt32(nil, -70000), []byte{0xce, 0xee, 0x6b, 0x28, 0x00}, msgp.AppendInt64(nil, -5e12), msgp.AppendUint64(nil, 1<<63),
			[]byte{0xd3, 0, 0, 0, 0, 0, 0, 0, 5}, []byte{0xcf, 0, 0, 0, 0, 0, 0, 0, 6}, []byte{0xd0, 0x05}, []byte{0xcc, 0x05}))),
			[]EngineSnapshotBlock{{Parent: 1<<64 - 1, HasParent: true, Hashes: []uint64{1<<64 - 1, 200, 1<<64 - 300, 60000, 1<<64 - 70000, 4e9,
				1<<64 - 5e12, 1 << 63, 5, 6, 5, 5}}}},
		{"bin digests", chunkOf(record(digest(0x0102030405060708), hashesOf(digest(1<<63|9), digest(0)))),
			[]EngineSnapshotBlock{{Parent: 0x0102030405060708, HasParent: true, Hashes: []uint64{1<<63 | 9, 0}}}},
		{"short bin hash", chunkOf(record(nilp, hashesOf(msgp.AppendBytes(nil, []byte{1, 2})))), []EngineSnapshotBlock{{Hashes: []uint64{0x0102}}}},
		{"coalesced chain of hashes", chunkOf(record(msgp.AppendInt(nil, 1), hashesOf(msgp.AppendInt(nil, 2), msgp.AppendInt(nil, 3), msgp.AppendInt(nil, 4)))),
			[]EngineSnapshotBlock{{Parent: 1, HasParent: true, Hashes: []uint64{2, 3, 4}}}},
		{"no hashes", chunkOf(record(nilp, hashesOf())), []EngineSnapshotBlock{{}}},
		{"newer record slots", chunkOf(record(nilp, hashesOf(msgp.AppendInt(nil, 7)), msgp.AppendString(nil, "GPU"), msgp.AppendMapHeader(nil, 0))),
			[]EngineSnapshotBlock{{Hashes: []uint64{7}}}},
	}
	d := NewDecoder()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := d.DecodeEngineSnapshotChunk(tc.payload, nil)
			if err != nil {
				t.Fatal(err)
			}
			if diff := gocmp.Diff(tc.want, got, blockCmp); diff != "" {
				t.Errorf("records (-want +got):\n%s", diff)
			}
		})
	}
}

func TestDecodeSnapshotChunkReusesStorage(t *testing.T) {
	d := NewDecoder()
	big := []EngineSnapshotBlock{{Parent: 1, HasParent: true, Hashes: []uint64{2, 3, 4, 5}}, {Parent: 2, HasParent: true, Hashes: []uint64{6}}}
	dst, err := d.DecodeEngineSnapshotChunk(engineenc.AppendEngineSnapshotChunk(nil, big), nil)
	if err != nil {
		t.Fatal(err)
	}
	first := &dst[0].Hashes[0]
	small := []EngineSnapshotBlock{{Hashes: []uint64{9}}}
	dst, err = d.DecodeEngineSnapshotChunk(engineenc.AppendEngineSnapshotChunk(nil, small), dst)
	if err != nil {
		t.Fatal(err)
	}
	if diff := gocmp.Diff(small, dst, blockCmp); diff != "" {
		t.Errorf("a smaller chunk into used storage (-want +got):\n%s", diff)
	}
	if &dst[0].Hashes[0] != first {
		t.Error("the element's Hashes storage was not reused")
	}
	// Growing past the capacity keeps the old elements' Hashes.
	many := make([]EngineSnapshotBlock, 10)
	for i := range many {
		many[i] = EngineSnapshotBlock{Parent: uint64(i), HasParent: i > 0, Hashes: []uint64{uint64(100 + i)}}
	}
	dst, err = d.DecodeEngineSnapshotChunk(engineenc.AppendEngineSnapshotChunk(nil, many), dst)
	if err != nil {
		t.Fatal(err)
	}
	if diff := gocmp.Diff(many, dst, blockCmp); diff != "" {
		t.Errorf("a larger chunk (-want +got):\n%s", diff)
	}
	if &dst[0].Hashes[0] != first {
		t.Error("growing dropped the first element's Hashes storage")
	}
	// An error leaves no records.
	dst, err = d.DecodeEngineSnapshotChunk([]byte{0x91, 0x05}, dst)
	if err == nil || len(dst) != 0 {
		t.Errorf("bad chunk: %d records, error %v; want 0 records and an error", len(dst), err)
	}
}

func TestDecodeSnapshotChunkErrors(t *testing.T) {
	nilp := msgp.AppendNil(nil)
	one := hashesOf(msgp.AppendInt(nil, 1))
	valid := engineenc.AppendEngineSnapshotChunk(nil, []EngineSnapshotBlock{{Hashes: []uint64{1 << 62}}, {Parent: 1 << 62, HasParent: true, Hashes: []uint64{5, 6}}})
	oversize := []byte{0xdd, 0x00, 0x01, 0x00, 0x01} // 65,537 records
	for range MaxSnapshotChunkRecords + 1 {
		oversize = append(oversize, 0x92, 0xc0, 0x90)
	}
	cases := []struct {
		name    string
		payload []byte
		limits  DecodeLimits
		want    string
	}{
		{"empty", nil, DefaultLimits, "batch: snapshot chunk: truncated payload"},
		{"nil", nilp, DefaultLimits, "batch: snapshot chunk: expected array, got nil"},
		{"a map", msgp.AppendMapHeader(nil, 0), DefaultLimits, "batch: snapshot chunk: expected array, got map"},
		{"record as int", chunkOf(msgp.AppendInt(nil, 5)), DefaultLimits, "event 0: expected array (parent_block_hash, block_hashes), got int"},
		{"record as map", chunkOf(record(nilp, one), msgp.AppendMapHeader(nil, 0)), DefaultLimits, "event 1: expected array (parent_block_hash, block_hashes), got map"},
		{"record of one slot", chunkOf(record(nilp)), DefaultLimits, "event 0: record array of 1 elements, want at least 2 (parent_block_hash, block_hashes)"},
		{"empty record", chunkOf(record()), DefaultLimits, "event 0: record array of 0 elements, want at least 2"},
		{"parent as string", chunkOf(record(msgp.AppendString(nil, "p"), one)), DefaultLimits, "event 0: snapshot parent_block_hash: expected int, got str"},
		{"parent as float", chunkOf(record(msgp.AppendFloat64(nil, 1), one)), DefaultLimits, "event 0: snapshot parent_block_hash: expected int, got float64"},
		{"hashes nil", chunkOf(record(nilp, nilp)), DefaultLimits, "event 0: snapshot block_hashes: expected array, got nil"},
		{"hashes as int", chunkOf(record(nilp, msgp.AppendInt(nil, 1))), DefaultLimits, "event 0: snapshot block_hashes: expected array, got int"},
		{"hash as string", chunkOf(record(nilp, one), record(nilp, hashesOf(msgp.AppendInt(nil, 1), msgp.AppendString(nil, "h")))), DefaultLimits,
			"event 1: snapshot block_hashes: [1]: expected int, got str"},
		{"hash nil", chunkOf(record(nilp, hashesOf(nilp))), DefaultLimits, "event 0: snapshot block_hashes: [0]: expected int, got nil"},
		{"oversize chunk", oversize, DefaultLimits, "batch: snapshot chunk: array of 65537 elements exceeds the limit of 65536"},
		{"chunk header past the payload", []byte{0xdc, 0x01, 0x00, 0x92}, DefaultLimits, "batch: snapshot chunk: array of 256 elements in 1 remaining bytes"},
		{"huge chunk header", []byte{0xdd, 0xff, 0xff, 0xff, 0xff}, DefaultLimits, "batch: snapshot chunk: array of 4294967295 elements exceeds the limit of 65536"},
		{"hashes over the limit", chunkOf(record(nilp, hashesOf(msgp.AppendInt(nil, 1), msgp.AppendInt(nil, 2), msgp.AppendInt(nil, 3)))),
			DecodeLimits{MaxBlocks: 2}, "event 0: snapshot block_hashes: array of 3 elements exceeds the limit of 2"},
		{"hashes header past the payload", chunkOf(append(msgp.AppendArrayHeader(nil, 2), 0xc0, 0xdc, 0x10, 0x00)), DefaultLimits,
			"event 0: snapshot block_hashes: array of 4096 elements in 0 remaining bytes"},
		{"truncated by one byte", valid[:len(valid)-1], DefaultLimits, "event 1: snapshot block_hashes: array of 2 elements in 1 remaining bytes"},
		{"truncated before a record", valid[:1], DefaultLimits, "batch: snapshot chunk: array of 2 elements in 0 remaining bytes"},
		{"truncated newer slot", chunkOf(record(nilp, one, []byte{0x92, 0x01})), DefaultLimits, "event 0: truncated payload"},
		{"truncated in a hash", []byte{0x91, 0x92, 0xc0, 0x92, 0x01, 0xd3, 0x01, 0x02}, DefaultLimits,
			"event 0: snapshot block_hashes: [1]: truncated payload"},
		{"trailing garbage", append(append([]byte{}, valid...), 0x01), DefaultLimits, "batch: snapshot chunk: 1 trailing bytes after the chunk"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := NewDecoder()
			d.SetLimits(tc.limits)
			got, err := d.DecodeEngineSnapshotChunk(tc.payload, nil)
			if err == nil {
				t.Fatalf("no error; decoded %d records", len(got))
			}
			if _, ok := err.(*Error); !ok {
				t.Errorf("error %T is not a *codec.Error", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q, want it to contain %q", err, tc.want)
			}
			if len(got) != 0 {
				t.Errorf("returned %d records with the error", len(got))
			}
		})
	}
	d := NewDecoder()
	var dst []EngineSnapshotBlock
	for i := range valid {
		var err error
		if dst, err = d.DecodeEngineSnapshotChunk(valid[:i], dst); err == nil {
			t.Errorf("chunk cut at %d of %d bytes decoded", i, len(valid))
		} else if _, ok := err.(*Error); !ok {
			t.Errorf("cut at %d: error %T is not a *codec.Error", i, err)
		}
	}
	// The bound is on records per chunk: exactly the limit decodes.
	atLimit := append([]byte{0xdd, 0x00, 0x01, 0x00, 0x00}, oversize[5:len(oversize)-3]...)
	if got, err := d.DecodeEngineSnapshotChunk(atLimit, nil); err != nil || len(got) != MaxSnapshotChunkRecords {
		t.Errorf("chunk of %d records: %d records, error %v", MaxSnapshotChunkRecords, len(got), err)
	}
}

// snapshotBlocks is a chunk as SGLang's provider sends it: one hash per
// record, chains of 8 under a root, hashes spread over all 64 bits (half negative).
func snapshotBlocks(n int) []EngineSnapshotBlock {
	blocks := make([]EngineSnapshotBlock, n)
	h := uint64(0x9e3779b97f4a7c15)
	var prev uint64
	for i := range blocks {
		h = h*6364136223846793005 + 1442695040888963407
		blocks[i] = EngineSnapshotBlock{Parent: prev, HasParent: i%8 != 0, Hashes: []uint64{h}}
		if !blocks[i].HasParent {
			blocks[i].Parent = 0
		}
		prev = h
	}
	return blocks
}

func TestSnapshotRoundTrip(t *testing.T) {
	h := testHeader()
	for _, hh := range []EngineSnapshotHeader{h, {Version: 1}, {Version: 1, Epoch: "e", ReplicaRank: 1<<31 - 1, ResumeSeq: 1<<64 - 1, BarrierSeq: 1 << 63,
		BarrierID: "\x00\xff", RecordCount: 1 << 40}} {
		got, err := DecodeEngineSnapshotHeader(engineenc.AppendEngineSnapshotHeader(nil, &hh))
		if err != nil {
			t.Fatalf("%+v: %v", hh, err)
		}
		if got != hh {
			t.Errorf("round trip: got %+v, want %+v", got, hh)
		}
	}
	d := NewDecoder()
	var dst []EngineSnapshotBlock
	for _, blocks := range [][]EngineSnapshotBlock{nil, snapshotBlocks(1), snapshotBlocks(SnapshotChunkRecords),
		{{Parent: 1<<64 - 1, HasParent: true, Hashes: []uint64{0, 1 << 63, 1<<63 - 1, 1<<64 - 1}}, {}}} {
		var err error
		if dst, err = d.DecodeEngineSnapshotChunk(engineenc.AppendEngineSnapshotChunk(nil, blocks), dst); err != nil {
			t.Fatalf("%d records: %v", len(blocks), err)
		}
		if diff := gocmp.Diff(blocks, dst, blockCmp); diff != "" {
			t.Errorf("%d records (-want +got):\n%s", len(blocks), diff)
		}
	}
}

func TestSteadyStateSnapshotDecodeAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	payload := engineenc.AppendEngineSnapshotChunk(nil, snapshotBlocks(SnapshotChunkRecords))
	d := NewDecoder()
	dst, err := d.DecodeEngineSnapshotChunk(payload, nil)
	if err != nil {
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(20, func() {
		if dst, err = d.DecodeEngineSnapshotChunk(payload, dst); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("steady-state DecodeSnapshotChunk allocates %.1f times per chunk, want 0", allocs)
	}
}

func BenchmarkDecodeSnapshotChunk(b *testing.B) {
	payload := engineenc.AppendEngineSnapshotChunk(nil, snapshotBlocks(SnapshotChunkRecords))
	d := NewDecoder()
	dst, err := d.DecodeEngineSnapshotChunk(payload, nil) // steady state: storage already grown
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	for b.Loop() {
		if dst, err = d.DecodeEngineSnapshotChunk(payload, dst); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*SnapshotChunkRecords)/b.Elapsed().Seconds(), "records/s")
}

// FuzzSnapshot: no input panics, errors are *Error, and whatever decodes (as
// a header or as a chunk) decodes the same after a re-encode.
func FuzzSnapshot(f *testing.F) {
	h := testHeader()
	f.Add(engineenc.AppendEngineSnapshotHeader(nil, &h))
	f.Add(withElem(7, msgp.AppendArrayHeader(nil, 0)))
	f.Add(withElem(1, msgp.AppendBytes(nil, []byte(h.Epoch))))
	f.Add(engineenc.AppendEngineSnapshotChunk(nil, snapshotBlocks(9)))
	f.Add(chunkOf(record(digest(3), hashesOf(digest(4), msgp.AppendInt8(nil, -2))), record(msgp.AppendNil(nil), hashesOf(), msgp.AppendNil(nil))))
	f.Add([]byte("kv\x00sgl-kv-epoch=0123\x00sgl-kv-snapshot=ab"))
	d := NewDecoder()
	var first, second []EngineSnapshotBlock
	f.Fuzz(func(t *testing.T, p []byte) {
		if hdr, err := DecodeEngineSnapshotHeader(p); err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("header error %T is not a *codec.Error: %v", err, err)
			}
		} else {
			again, err := DecodeEngineSnapshotHeader(engineenc.AppendEngineSnapshotHeader(nil, &hdr))
			if err != nil {
				t.Fatalf("re-encoded header %+v does not decode: %v", hdr, err)
			}
			if again != hdr {
				t.Fatalf("re-encode changed the header: %+v, then %+v", hdr, again)
			}
		}
		var err error
		if first, err = d.DecodeEngineSnapshotChunk(p, first); err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("chunk error %T is not a *codec.Error: %v", err, err)
			}
		} else {
			if second, err = d.DecodeEngineSnapshotChunk(engineenc.AppendEngineSnapshotChunk(nil, first), second); err != nil {
				t.Fatalf("re-encoded chunk does not decode: %v", err)
			}
			if len(first) != len(second) {
				t.Fatalf("re-encode changed the record count: %d, then %d", len(first), len(second))
			}
			for i := range first {
				if !sameBlock(first[i], second[i]) {
					t.Fatalf("re-encode changed record %d: %+v, then %+v", i, first[i], second[i])
				}
			}
		}
	})
}
