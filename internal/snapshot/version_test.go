package snapshot

import (
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/tinylib/msgp/msgp"
)

var writeGolden = flag.Bool("write-golden", false, "rewrite testdata/v1.snap (only to make it anew: it stands for the files older builds wrote)")

// bodyVersion reads the version key of an Append'ed frame's body.
func bodyVersion(t *testing.T, frame []byte) int64 {
	t.Helper()
	body := frame[magicLen : len(frame)-checksumLen]
	n, b, err := msgp.ReadMapHeaderBytes(body)
	if err != nil {
		t.Fatal(err)
	}
	for ; n > 0; n-- {
		var key []byte
		if key, b, err = msgp.ReadMapKeyZC(b); err != nil {
			t.Fatal(err)
		}
		if string(key) == "version" {
			v, _, err := msgp.ReadInt64Bytes(b)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
		if b, err = msgp.Skip(b); err != nil {
			t.Fatal(err)
		}
	}
	t.Fatal("no version key")
	return 0
}

// A snapshot is written in the oldest version that says what it holds: a
// build that reads version 1 alone loads one without absent workers, and
// refuses one with (it would take an absent worker for one with no blocks);
// one that reads up to 2 refuses one with an EAGLE worker (it would match
// it with plain keys); one that reads up to 3 refuses one with a rekeyed
// worker (it would trust its links).
func TestAppendWritesTheOldestVersionThatSaysIt(t *testing.T) {
	withAbsent := sample()
	without := sample()
	without.Workers = without.Workers[:3]
	if without.Workers[len(without.Workers)-1].Absent {
		t.Fatal("sample changed: its last worker is the absent one")
	}
	withEagle := sample()
	withEagle.Workers = withEagle.Workers[:3]
	withEagle.Workers[1].Eagle = true
	withBoth := sample()
	withBoth.Workers[0].Eagle = true
	withRekeyed := sample()
	withRekeyed.Workers[2].Rekeyed = true
	withRekeyed.Workers[0].Eagle = true
	for _, tc := range []struct {
		name string
		s    *Snapshot
		want int64
	}{
		{"no absent worker", without, 1},
		{"an absent worker", withAbsent, 2},
		{"an EAGLE worker", withEagle, 3},
		{"an EAGLE worker and an absent one", withBoth, 3},
		{"a rekeyed worker after an EAGLE one", withRekeyed, 4},
		{"a caller's newer version", &Snapshot{Version: Version + 5, BlockSize: 16}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := tc.s.Version
			data, err := Append(nil, tc.s)
			if err != nil {
				t.Fatal(err)
			}
			if tc.s.Version != before {
				t.Errorf("Append changed its argument's version from %d to %d", before, tc.s.Version)
			}
			if got := bodyVersion(t, data); got != tc.want {
				t.Fatalf("body version %d, want %d", got, tc.want)
			}
			var got Snapshot
			if err := Decode(data, &got); err != nil {
				t.Fatal(err)
			}
			want := *tc.s
			want.Version = int(tc.want)
			if d := diff(&want, &got); d != "" {
				t.Errorf("(-appended +decoded):\n%s", d)
			}
		})
	}
}

// testdata/v1.snap was written by a build of version 1 (the sample without
// its absent worker); every later build must load it as it was.
func TestVersion1FileStillLoads(t *testing.T) {
	path := filepath.Join("testdata", "v1.snap")
	want := sample()
	want.Workers = want.Workers[:3]
	want.Version = 1
	if *writeGolden {
		data, err := Append(nil, want)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := bodyVersion(t, data); got != 1 {
		t.Fatalf("%s is version %d, want 1", path, got)
	}
	var got Snapshot
	if err := Decode(data, &got); err != nil {
		t.Fatal(err)
	}
	if d := diff(want, &got); d != "" {
		t.Errorf("(-want +got):\n%s", d)
	}
}

// testdata/v1-absent.snap was written by a build that wrote an absent
// worker within version 1 (2026-12-05 to 2026-12-06, before version 2):
// it loads with the worker absent.
func TestVersion1WithAbsentWorkerStillLoads(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("testdata", "v1-absent.snap"))
	if err != nil {
		t.Fatal(err)
	}
	if got := bodyVersion(t, data); got != 1 {
		t.Fatalf("version %d, want 1", got)
	}
	var got Snapshot
	if err := Decode(data, &got); err != nil {
		t.Fatal(err)
	}
	want := sample()
	want.Version = 1
	if d := diff(want, &got); d != "" {
		t.Errorf("(-want +got):\n%s", d)
	}
	if !got.Workers[len(got.Workers)-1].Absent {
		t.Error("the absent worker loads as present")
	}
}
