package snapshot

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/tinylib/msgp/msgp"
	"github.com/zeebo/xxh3"

	"github.com/kvpipe/kvpipe/index"
)

func TestRoundTrip(t *testing.T) {
	manyWorkers := &Snapshot{Version: Version, BlockSize: 64}
	for i := range 300 {
		manyWorkers.Workers = append(manyWorkers.Workers, Worker{
			Name:    []byte{'w', byte(i), byte(i >> 8)},
			HasSeq:  i%2 == 0,
			Seq:     uint64(i),
			Hashes:  []uint64{uint64(i)},
			Keys:    []uint64{uint64(i) << 40},
			Parents: []uint64{0},
			Flags:   []uint8{in(index.Tier(i % index.NumTiers))},
		})
	}
	tests := []struct {
		name string
		s    *Snapshot
	}{
		{"sample", sample()},
		{"no workers", &Snapshot{Version: Version, BlockSize: 1}},
		{"negative created", &Snapshot{Version: Version, BlockSize: math.MaxInt, Created: math.MinInt64}},
		{"one empty worker", &Snapshot{Version: Version, BlockSize: 16, Workers: []Worker{{Name: []byte("x")}}}},
		{"many workers", manyWorkers},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			prefix := []byte("kept")
			out, err := Append(slices.Clone(prefix), tc.s)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.HasPrefix(out, prefix) {
				t.Fatalf("Append lost dst's bytes: %q", out[:len(prefix)])
			}
			var fresh Snapshot
			if err := Decode(out[len(prefix):], &fresh); err != nil {
				t.Fatal(err)
			}
			if d := diff(written(tc.s), &fresh); d != "" {
				t.Errorf("decoded snapshot differs (-appended +decoded):\n%s", d)
			}
			// A reused Snapshot that held something larger must not leak it.
			reused := sample()
			reused.Workers = append(reused.Workers, reused.Workers...)
			reused.Workers[0].Split = append(reused.Workers[0].Split, 7, 8, 9)
			if err := Decode(out[len(prefix):], reused); err != nil {
				t.Fatal(err)
			}
			if d := diff(written(tc.s), reused); d != "" {
				t.Errorf("snapshot decoded into a used one differs (-appended +decoded):\n%s", d)
			}
		})
	}
}

func TestLayout(t *testing.T) {
	s := sample()
	out := mustAppend(t, s)
	if got := string(out[:8]); got != "KVPSNAP\x01" {
		t.Errorf("magic %q", got)
	}
	b := out[8 : len(out)-8]
	if got, want := binary.LittleEndian.Uint64(out[len(out)-8:]), xxh3.Hash(b); got != want {
		t.Errorf("trailer %#x, want the body's xxh3 %#x", got, want)
	}
	if !bytes.Equal(b, body(t, s)) {
		t.Error("the framed body is not the snapshot's msgp encoding")
	}
}

func TestDecodeZeroesMissingFields(t *testing.T) {
	// A body with only some keys, as an older writer of the same version
	// might produce, decoded into a Snapshot that held other data.
	b := msgp.AppendMapHeader(nil, 3)
	b = msgp.AppendString(b, "version")
	b = msgp.AppendInt(b, Version)
	b = msgp.AppendString(b, "block_size")
	b = msgp.AppendInt(b, 32)
	b = msgp.AppendString(b, "workers")
	b = msgp.AppendArrayHeader(b, 1)
	b = msgp.AppendMapHeader(b, 1)
	b = msgp.AppendString(b, "name")
	b = msgp.AppendBytes(b, []byte("solo"))

	s := sample()
	if err := Decode(frame(b), s); err != nil {
		t.Fatal(err)
	}
	want := &Snapshot{Version: Version, BlockSize: 32, Workers: []Worker{{Name: []byte("solo")}}}
	if d := diff(want, s); d != "" {
		t.Errorf("(-want +got):\n%s", d)
	}
}

func TestDecodeSkipsUnknownKeys(t *testing.T) {
	want := sample()
	// The body of a newer writer of version 1: each map has a key this
	// build does not know, holding values of several types.
	extra := func(b []byte, key string) []byte {
		b = msgp.AppendString(b, key)
		b = msgp.AppendArrayHeader(b, 3)
		b = msgp.AppendMapHeader(b, 1)
		b = msgp.AppendString(b, "nested")
		b = msgp.AppendBytes(b, []byte{1, 2, 3})
		b = msgp.AppendFloat64(b, 1.5)
		return msgp.AppendNil(b)
	}
	b := msgp.AppendMapHeader(nil, 6)
	b = extra(b, "before")
	b = msgp.AppendString(b, "version")
	b = msgp.AppendInt(b, want.Version)
	b = msgp.AppendString(b, "block_size")
	b = msgp.AppendInt(b, want.BlockSize)
	b = msgp.AppendString(b, "workers")
	b = msgp.AppendArrayHeader(b, uint32(len(want.Workers)))
	for i := range want.Workers {
		w := body(t, &want.Workers[i])
		n, fields, err := msgp.ReadMapHeaderBytes(w)
		if err != nil {
			t.Fatal(err)
		}
		b = msgp.AppendMapHeader(b, n+1)
		b = append(b, fields...)
		b = extra(b, "x-new-worker-field")
	}
	b = msgp.AppendString(b, "created")
	b = msgp.AppendInt64(b, want.Created)
	b = extra(b, "after")

	var got Snapshot
	if err := Decode(frame(b), &got); err != nil {
		t.Fatal(err)
	}
	if d := diff(want, &got); d != "" {
		t.Errorf("(-want +got):\n%s", d)
	}
}

// checkDecodeError asserts err wraps sentinel and says what (each of
// them, in order).
func checkDecodeError(t *testing.T, err, sentinel error, what ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("no error, want %v", sentinel)
	}
	if !errors.Is(err, sentinel) {
		t.Errorf("error %q does not wrap %q", err, sentinel)
	}
	msg := err.Error()
	for _, w := range what {
		i := strings.Index(msg, w)
		if i < 0 {
			t.Errorf("error %q does not say %q", err, w)
			return
		}
		msg = msg[i+len(w):]
	}
}

func TestDecodeCatchesEveryFlippedByte(t *testing.T) {
	small := &Snapshot{Version: Version, BlockSize: 16, Workers: []Worker{{
		Name: []byte("w"), Hashes: []uint64{5}, Keys: []uint64{6}, Parents: []uint64{0}, Flags: []uint8{in(dev)},
	}}}
	good := mustAppend(t, small)
	for i := range good {
		for _, mask := range []byte{0x01, 0x10, 0x80, 0xff} {
			bad := slices.Clone(good)
			bad[i] ^= mask
			var s Snapshot
			err := Decode(bad, &s)
			switch {
			case i < 7:
				checkDecodeError(t, err, ErrCorrupt, "snapshot: corrupt: bad magic")
			case i == 7:
				checkDecodeError(t, err, ErrVersion, "frame version")
			default:
				checkDecodeError(t, err, ErrCorrupt, "snapshot: corrupt: checksum mismatch")
			}
		}
	}
}

func TestDecodeCatchesTruncation(t *testing.T) {
	good := mustAppend(t, sample())
	for n := range len(good) {
		var s Snapshot
		err := Decode(good[:n], &s)
		if n < 16 {
			checkDecodeError(t, err, ErrCorrupt, "truncated")
		} else {
			checkDecodeError(t, err, ErrCorrupt, "checksum mismatch")
		}
	}
}

func TestDecodeFrameErrors(t *testing.T) {
	good := mustAppend(t, sample())
	b := body(t, sample())
	tests := []struct {
		name     string
		data     []byte
		sentinel error
		what     []string
	}{
		{"empty", nil, ErrCorrupt, []string{"truncated: 0 bytes"}},
		{"wrong magic", append([]byte("KVPSNAQ\x01"), good[8:]...), ErrCorrupt, []string{"bad magic", "KVPSNAQ"}},
		{"another format", append([]byte("\x89PNG\r\n\x1a\n"), good[8:]...), ErrCorrupt, []string{"bad magic"}},
		{"newer frame", append([]byte("KVPSNAP\x02"), good[8:]...), ErrVersion, []string{"frame version 2"}},
		{"bytes after the frame", append(slices.Clone(good), 0), ErrCorrupt, []string{"checksum mismatch"}},
		{"two frames", append(slices.Clone(good), good...), ErrCorrupt, []string{"checksum mismatch"}},
		{"trailing value after the body", frame(msgp.AppendNil(slices.Clone(b))), ErrCorrupt, []string{"1 trailing bytes"}},
		{"empty body", frame(nil), ErrCorrupt, []string{"body"}},
		{"body not a map", frame(msgp.AppendArrayHeader(nil, 0)), ErrCorrupt, []string{"body"}},
		{"body cut short", frame(b[:len(b)-3]), ErrCorrupt, []string{"worker 3"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var s Snapshot
			checkDecodeError(t, Decode(tc.data, &s), tc.sentinel, tc.what...)
		})
	}
}

// TestDecodeBodyErrors: bodies with a valid frame and checksum that do not
// decode as a Snapshot.
func TestDecodeBodyErrors(t *testing.T) {
	header := func(n uint32) []byte {
		b := msgp.AppendMapHeader(nil, n)
		b = msgp.AppendString(b, "version")
		return msgp.AppendInt(b, Version)
	}
	worker := func(key string, value func([]byte) []byte) []byte {
		b := header(2)
		b = msgp.AppendString(b, "workers")
		b = msgp.AppendArrayHeader(b, 1)
		b = msgp.AppendMapHeader(b, 2)
		b = msgp.AppendString(b, "name")
		b = msgp.AppendBytes(b, []byte("w"))
		b = msgp.AppendString(b, key)
		return value(b)
	}
	tests := []struct {
		name     string
		body     []byte
		sentinel error
		what     []string
	}{
		{"a newer version", msgp.AppendInt(msgp.AppendString(msgp.AppendMapHeader(nil, 1), "version"), Version+1), ErrVersion, []string{fmt.Sprintf("version %d", Version+1)}},
		// A newer version is refused as one even if its body changed shape.
		{"a newer version then an unknown layout", append(msgp.AppendInt(msgp.AppendString(msgp.AppendMapHeader(nil, 2), "version"), Version+1), 0xc1), ErrVersion, []string{fmt.Sprintf("version %d", Version+1)}},
		{"no version", msgp.AppendMapHeader(nil, 0), ErrVersion, []string{"version 0"}},
		{"version a string", msgp.AppendString(msgp.AppendString(msgp.AppendMapHeader(nil, 1), "version"), "1"), ErrCorrupt, []string{"version"}},
		{"workers a string", msgp.AppendString(msgp.AppendString(header(2), "workers"), "w"), ErrCorrupt, []string{"workers"}},
		{"name a string", worker("name", func(b []byte) []byte { return msgp.AppendString(b, "w") }), ErrCorrupt, []string{"Name"}},
		{"hashes of strings", worker("hashes", func(b []byte) []byte {
			return msgp.AppendString(msgp.AppendArrayHeader(b, 1), "h")
		}), ErrCorrupt, []string{"Hashes"}},
		{"negative hash", worker("hashes", func(b []byte) []byte {
			return msgp.AppendInt64(msgp.AppendArrayHeader(b, 1), -1)
		}), ErrCorrupt, []string{"-1", "Workers/0"}},
		{"flag over 255", worker("flags", func(b []byte) []byte {
			return msgp.AppendUint(msgp.AppendArrayHeader(b, 1), 256)
		}), ErrCorrupt, []string{"Flags"}},
		{"invalid byte in unknown key", msgp.AppendString(header(2), "future") /* then nothing */, ErrCorrupt, []string{"future"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var s Snapshot
			checkDecodeError(t, Decode(frame(tc.body), &s), tc.sentinel, tc.what...)
		})
	}
}

// TestForgedLengthsAreRefusedCheaply: array headers that claim far more
// elements than the body holds must not make Decode allocate for them.
func TestForgedLengthsAreRefusedCheaply(t *testing.T) {
	const huge = math.MaxUint32
	withWorkers := func(n uint32, rest func([]byte) []byte) []byte {
		b := msgp.AppendMapHeader(nil, 3)
		b = msgp.AppendString(b, "version")
		b = msgp.AppendInt(b, Version)
		b = msgp.AppendString(b, "block_size")
		b = msgp.AppendInt(b, 16)
		b = msgp.AppendString(b, "workers")
		return rest(msgp.AppendArrayHeader(b, n))
	}
	column := func(key string) func([]byte) []byte {
		return func(b []byte) []byte {
			b = msgp.AppendMapHeader(b, 2)
			b = msgp.AppendString(b, "name")
			b = msgp.AppendBytes(b, []byte("w"))
			b = msgp.AppendString(b, key)
			return msgp.AppendUint64(msgp.AppendArrayHeader(b, huge), 1)
		}
	}
	// Empty maps are valid workers to the decoder, 1 byte each.
	emptyWorkers := func(b []byte) []byte { return append(b, bytes.Repeat([]byte{0x80}, 8192)...) }
	tests := []struct {
		name string
		body []byte
		what string
	}{
		{"workers", withWorkers(huge, func(b []byte) []byte { return b }), "workers cannot fit"},
		{"workers of empty maps", withWorkers(8192, emptyWorkers), "8192 workers cannot fit in 8192 bytes"},
		{"hashes", withWorkers(1, column("hashes")), "worker 0"},
		{"group_main", withWorkers(1, column("group_main")), "worker 0"},
		{"split", withWorkers(1, column("split")), "worker 0"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			data := frame(tc.body)
			var s Snapshot
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			err := Decode(data, &s)
			runtime.ReadMemStats(&after)
			checkDecodeError(t, err, ErrCorrupt, tc.what)
			if n := after.TotalAlloc - before.TotalAlloc; n > 1<<20 {
				t.Errorf("Decode of %d bytes allocated %d bytes", len(data), n)
			}
		})
	}
}

func TestCheck(t *testing.T) {
	tests := []struct {
		name     string
		mutate   func(s *Snapshot)
		sentinel error
		what     []string
	}{
		{"a newer version", func(s *Snapshot) { s.Version = Version + 1 }, ErrVersion, []string{fmt.Sprintf("version %d, this build reads 1 to %d", Version+1, Version)}},
		{"version 0", func(s *Snapshot) { s.Version = 0 }, ErrVersion, []string{"version 0"}},
		{"block size 0", func(s *Snapshot) { s.BlockSize = 0 }, ErrCorrupt, []string{"block size 0"}},
		{"block size negative", func(s *Snapshot) { s.BlockSize = -16 }, ErrCorrupt, []string{"block size -16"}},
		{"empty name", func(s *Snapshot) { s.Workers[1].Name = []byte{} }, ErrCorrupt, []string{"worker 1: empty name"}},
		{"nil name", func(s *Snapshot) { s.Workers[2].Name = nil }, ErrCorrupt, []string{"worker 2: empty name"}},
		{"same name", func(s *Snapshot) { s.Workers[2].Name = []byte("w-a") }, ErrCorrupt, []string{`worker 2 ("w-a"): same name as worker 0`}},
		{"keys short", func(s *Snapshot) { s.Workers[0].Keys = s.Workers[0].Keys[:3] }, ErrCorrupt, []string{`worker 0 ("w-a"): 4 hashes but 3 keys`}},
		{"keys without hashes", func(s *Snapshot) { s.Workers[1].Keys = []uint64{1} }, ErrCorrupt, []string{`worker 1 ("w-b"): 0 hashes but 1 keys`}},
		{"parents long", func(s *Snapshot) { s.Workers[2].Parents = append(s.Workers[2].Parents, 0) }, ErrCorrupt, []string{`worker 2`, "2 hashes but 3 parents"}},
		{"flags short", func(s *Snapshot) { s.Workers[2].Flags = s.Workers[2].Flags[:1] }, ErrCorrupt, []string{"2 hashes but 1 flags"}},
		{"unknown flag bit 6", func(s *Snapshot) { s.Workers[0].Flags[2] |= 1 << 6 }, ErrCorrupt, []string{`worker 0 ("w-a"): block 2: unknown flags 0x40`}},
		{"unknown flag bit 7", func(s *Snapshot) { s.Workers[2].Flags[0] |= 1 << 7 }, ErrCorrupt, []string{"block 0: unknown flags 0x80"}},
		{"used tiers beyond 4", func(s *Snapshot) { s.Workers[1].UsedTiers = 1 << 4 }, ErrCorrupt, []string{`worker 1 ("w-b"): used tiers 0x10`}},
		{"groups mismatched", func(s *Snapshot) { s.Workers[0].GroupMain = s.Workers[0].GroupMain[:2] }, ErrCorrupt, []string{"3 group indices but 2 group_main"}},
		{"split_k negative", func(s *Snapshot) { s.Workers[1].SplitK = -1 }, ErrCorrupt, []string{`worker 1 ("w-b"): split_k -1`}},
		{"split_k 1 with split blocks", func(s *Snapshot) { s.Workers[0].SplitK = 1 }, ErrCorrupt, []string{"2 split blocks but split_k 1"}},
		{"split_k 0 with split blocks", func(s *Snapshot) { s.Workers[0].SplitK = 0 }, ErrCorrupt, []string{"2 split blocks but split_k 0"}},
		{"a split key missing", func(s *Snapshot) { s.Workers[0].Split = s.Workers[0].Split[:3] }, ErrCorrupt, []string{"2 split blocks of split_k 3 need 2×2 split keys, have 3"}},
		{"a split key extra", func(s *Snapshot) { s.Workers[0].Split = append(s.Workers[0].Split, 1) }, ErrCorrupt, []string{"have 5"}},
		{"split keys for a split_k of 2", func(s *Snapshot) { s.Workers[0].SplitK = 2 }, ErrCorrupt, []string{"need 2×1 split keys, have 4"}},
		{"split_k so large the count overflows", func(s *Snapshot) { s.Workers[0].SplitK = math.MaxInt }, ErrCorrupt, []string{"have 4"}},
		{"split keys without split blocks", func(s *Snapshot) { s.Workers[2].Split = []uint64{1} }, ErrCorrupt, []string{`worker 2`, "no split blocks but 1 split keys"}},
		{"a split block unflagged", func(s *Snapshot) { s.Workers[0].Flags[1] &^= FlagSplit }, ErrCorrupt, []string{"1 split blocks", "have 4"}},
		{"absent with blocks", func(s *Snapshot) { s.Workers[0].Absent = true }, ErrCorrupt, []string{`worker 0 ("w-a"): absent, but holds state`}},
		{"absent with a seq", func(s *Snapshot) { s.Workers[1] = Worker{Name: []byte("w-b"), Absent: true, HasSeq: true} }, ErrCorrupt, []string{"absent, but holds state"}},
		{"absent with a stream seq", func(s *Snapshot) { s.Workers[1] = Worker{Name: []byte("w-b"), Absent: true, StreamSeq: 9} }, ErrCorrupt, []string{"absent, but holds state"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := sample()
			tc.mutate(s)
			checkDecodeError(t, s.Check(), tc.sentinel, tc.what...)

			var got Snapshot
			checkDecodeError(t, Decode(frame(body(t, s)), &got), tc.sentinel, tc.what...)

			if tc.sentinel == ErrVersion {
				return // Append writes a version of its own (TestAppendWritesTheOldestVersionThatSaysIt)
			}
			out, err := Append([]byte("x"), s)
			checkDecodeError(t, err, tc.sentinel, tc.what...)
			if string(out) != "x" {
				t.Errorf("Append of an invalid snapshot changed dst to %q", out)
			}
		})
	}
	if err := sample().Check(); err != nil {
		t.Errorf("sample: %v", err)
	}
}

func TestAppendOps(t *testing.T) {
	root := func(t index.Tier, h uint64) index.Op {
		return index.Op{Kind: index.OpStore, Tier: t, Hash: h, Link: index.LinkRoot}
	}
	child := func(t index.Tier, h, parent uint64) index.Op {
		return index.Op{Kind: index.OpStore, Tier: t, Hash: h, Link: index.LinkChild, Parent: parent}
	}
	orphan := func(t index.Tier, h uint64) index.Op { return index.Op{Kind: index.OpStore, Tier: t, Hash: h} }
	tests := []struct {
		name    string
		w       Worker // Hashes are 1000+i; Parents, where set, name them
		parents []uint64
		want    []index.Op
	}{
		{"no blocks", Worker{}, nil, nil},
		{"device", Worker{Keys: []uint64{10, 20}, Flags: []uint8{in(dev), in(dev)}}, nil,
			[]index.Op{root(dev, 10), root(dev, 20)}},
		{"each tier, linked", Worker{Keys: []uint64{1, 2, 3, 4}, Flags: []uint8{in(remote), in(disk), in(host), in(dev)}}, nil,
			[]index.Op{root(remote, 1), root(disk, 2), root(host, 3), root(dev, 4)}},
		{"tiers ascending, a parent it lacks", Worker{Keys: []uint64{7}, Flags: []uint8{FlagParent | in(remote, dev, disk, host)}}, []uint64{5},
			[]index.Op{orphan(dev, 7), orphan(host, 7), orphan(disk, 7), orphan(remote, 7)}},
		{"a parent it holds, in every tier", Worker{Keys: []uint64{1, 2}, Flags: []uint8{in(dev), FlagParent | in(dev, host)}}, []uint64{0, 1000},
			[]index.Op{root(dev, 1), child(dev, 2, 1), child(host, 2, 1)}},
		{"rekeyed: no child link", Worker{Rekeyed: true, Keys: []uint64{1, 2}, Flags: []uint8{in(dev), FlagParent | in(dev)}}, []uint64{0, 1000},
			[]index.Op{root(dev, 1), orphan(dev, 2)}},
		{"a parent in no tier still links", Worker{Keys: []uint64{1, 2, 3}, Flags: []uint8{in(host), FlagParent, FlagParent | in(dev)}}, []uint64{0, 1000, 1001},
			[]index.Op{root(host, 1), child(dev, 3, 2)}},
		{"a parent after its child", Worker{Keys: []uint64{1, 2}, Flags: []uint8{FlagParent | in(dev), in(dev)}}, []uint64{1001, 0},
			[]index.Op{child(dev, 1, 2), root(dev, 2)}},
		{"split", Worker{SplitK: 3, Keys: []uint64{9, 19}, Split: []uint64{17, 18}, Flags: []uint8{in(dev), FlagSplit | FlagParent | in(dev, disk)}}, []uint64{0, 1000},
			[]index.Op{root(dev, 9), child(dev, 17, 9), child(dev, 18, 17), child(dev, 19, 18), child(disk, 17, 9), child(disk, 18, 17), child(disk, 19, 18)}},
		{"split in no tier still takes its keys", Worker{
			SplitK: 2, Keys: []uint64{100, 200, 300}, Split: []uint64{91, 92, 93},
			Flags: []uint8{FlagSplit, FlagSplit | in(host), FlagSplit | FlagParent | in(dev)},
		}, []uint64{0, 0, 1000}, []index.Op{root(host, 92), child(host, 200, 92), child(dev, 93, 100), child(dev, 300, 93)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := tc.w
			w.Hashes = make([]uint64, len(w.Keys))
			for i := range w.Hashes {
				w.Hashes[i] = 1000 + uint64(i)
			}
			w.Parents = make([]uint64, len(w.Keys))
			copy(w.Parents, tc.parents)
			w.Name = []byte("w")
			if p := w.problem(); p != "" {
				t.Fatalf("test worker inconsistent: %s", p)
			}
			prefix := []index.Op{{Kind: index.OpClearWorker}}
			got := w.AppendOps(slices.Clone(prefix))
			if d := cmp.Diff(append(prefix, tc.want...), got); d != "" {
				t.Errorf("(-want +got):\n%s", d)
			}
			if n := w.OpCount(); n != len(tc.want) {
				t.Errorf("OpCount %d, AppendOps appended %d", n, len(tc.want))
			}
		})
	}
}

func TestAppendOpsOfAnInconsistentWorkerDoesNotPanic(t *testing.T) {
	for _, w := range []Worker{
		{SplitK: 3, Keys: []uint64{1}, Flags: []uint8{FlagSplit | in(dev)}, Split: []uint64{5}},
		{SplitK: 3, Hashes: []uint64{1, 2}, Keys: []uint64{1}, Flags: []uint8{in(dev), in(dev), in(dev)}},
		{SplitK: -4, Hashes: []uint64{1}, Keys: []uint64{1}, Flags: []uint8{0xff}},
	} {
		w.AppendOps(nil)
		w.OpCount()
	}
}

func TestBlocks(t *testing.T) {
	s := sample()
	if got := s.Workers[0].Blocks(); got != 4 {
		t.Errorf("w-a: %d blocks, want 4", got)
	}
	if got := s.Blocks(); got != 6 {
		t.Errorf("%d blocks, want 6", got)
	}
}

func TestDecodeIntoReusedSnapshotAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	data := mustAppend(t, sample())
	var s Snapshot
	if err := Decode(data, &s); err != nil {
		t.Fatal(err)
	}
	if allocs := testing.AllocsPerRun(100, func() {
		if err := Decode(data, &s); err != nil {
			t.Fatal(err)
		}
	}); allocs != 0 {
		t.Errorf("Decode allocates %.1f times into a reused Snapshot, want 0", allocs)
	}
}

func TestAppendAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	s := sample()
	buf := mustAppend(t, s)
	if allocs := testing.AllocsPerRun(100, func() {
		var err error
		if buf, err = Append(buf[:0], s); err != nil {
			t.Fatal(err)
		}
	}); allocs != 0 {
		t.Errorf("Append allocates %.1f times into a buffer with room, want 0", allocs)
	}
}

// A worker without parents needs no map of its keys: AppendOps allocates
// nothing with room in dst.
func TestAppendOpsAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	w := sample().Workers[0].Clone()
	for i := range w.Flags {
		w.Flags[i] &^= FlagParent
	}
	ops := make([]index.Op, 0, w.OpCount())
	if allocs := testing.AllocsPerRun(100, func() { ops = w.AppendOps(ops[:0]) }); allocs != 0 {
		t.Errorf("AppendOps allocates %.1f times with room in dst, want 0", allocs)
	}
	if len(ops) != w.OpCount() {
		t.Errorf("%d ops, want %d", len(ops), w.OpCount())
	}
}

func TestCheckAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	s := sample()
	if allocs := testing.AllocsPerRun(100, func() {
		if err := s.Check(); err != nil {
			t.Fatal(err)
		}
	}); allocs != 0 {
		t.Errorf("Check allocates %.1f times, want 0", allocs)
	}
}
