package snapshot

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// dirNames lists dir's entries.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func TestFileSaveLoad(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	f := File{Path: filepath.Join(dir, "index.snap")}

	if _, err := f.Load(ctx, nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Load before any Save: %v, want ErrNotFound", err)
	}
	for i, data := range [][]byte{
		[]byte("first snapshot, the longer of the two"),
		[]byte("second"), // over the first: nothing of it must remain
		{},
	} {
		if err := f.Save(ctx, data); err != nil {
			t.Fatalf("Save %d: %v", i, err)
		}
		got, err := f.Load(ctx, []byte("dst:"))
		if err != nil {
			t.Fatalf("Load %d: %v", i, err)
		}
		if want := append([]byte("dst:"), data...); !bytes.Equal(got, want) {
			t.Errorf("Load %d: %q, want %q", i, got, want)
		}
		if names := dirNames(t, dir); len(names) != 1 || names[0] != "index.snap" {
			t.Errorf("after Save %d the directory holds %q, want only index.snap", i, names)
		}
	}
}

func TestFileLoadReusesDst(t *testing.T) {
	f := File{Path: filepath.Join(t.TempDir(), "s")}
	data := bytes.Repeat([]byte("0123456789"), 1000)
	if err := f.Save(context.Background(), data); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, 0, len(data))
	got, err := f.Load(context.Background(), dst)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("Load returned other bytes")
	}
	if &got[0] != &dst[:1][0] {
		t.Error("Load did not read into dst, which had room")
	}
}

// A file past MaxSize is refused before anything is read or allocated;
// one at the limit loads.
func TestFileLoadRefusesAnOversizeFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s")
	data := bytes.Repeat([]byte("x"), 4096)
	if err := (File{Path: path}).Save(context.Background(), data); err != nil {
		t.Fatal(err)
	}
	dst := []byte("kept")
	got, err := File{Path: path, MaxSize: 4095}.Load(context.Background(), dst)
	if !errors.Is(err, ErrCorrupt) || string(got) != "kept" || cap(got) != cap(dst) {
		t.Errorf("Load of 4096 bytes with MaxSize 4095: %q (cap %d), %v; want ErrCorrupt and dst untouched", got, cap(got), err)
	}
	if got, err := (File{Path: path, MaxSize: 4096}).Load(context.Background(), nil); err != nil || len(got) != 4096 {
		t.Errorf("Load at the limit: %d bytes, %v", len(got), err)
	}
}

func TestFileSaveIntoMissingDirectory(t *testing.T) {
	dir := t.TempDir()
	f := File{Path: filepath.Join(dir, "missing", "index.snap")}
	err := f.Save(context.Background(), []byte("x"))
	if err == nil {
		t.Fatal("Save into a directory that does not exist succeeded")
	}
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("error %v does not say the directory is missing", err)
	}
	if names := dirNames(t, dir); len(names) != 0 {
		t.Errorf("failed Save left %q", names)
	}
}

func TestFileSaveOverADirectoryRemovesItsTempFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "index.snap")
	if err := os.Mkdir(path, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(path, "child"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// The rename fails: a file cannot replace a non-empty directory.
	if err := (File{Path: path}).Save(context.Background(), []byte("x")); err == nil {
		t.Fatal("Save over a directory succeeded")
	}
	if names := dirNames(t, dir); len(names) != 1 || names[0] != "index.snap" {
		t.Errorf("failed Save left %q", names)
	}
	if _, err := (File{Path: path}).Load(context.Background(), nil); err == nil || errors.Is(err, ErrNotFound) {
		t.Errorf("Load of a directory: %v, want an error other than ErrNotFound", err)
	}
}

func TestFileHonoursCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	dir := t.TempDir()
	f := File{Path: filepath.Join(dir, "index.snap")}
	if err := f.Save(ctx, []byte("x")); !errors.Is(err, context.Canceled) {
		t.Errorf("Save: %v, want context.Canceled", err)
	}
	if names := dirNames(t, dir); len(names) != 0 {
		t.Errorf("cancelled Save left %q", names)
	}
	if _, err := f.Load(ctx, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("Load: %v, want context.Canceled", err)
	}
}

func TestSaveLoadSnapshot(t *testing.T) {
	ctx := context.Background()
	st := File{Path: filepath.Join(t.TempDir(), "index.snap")}
	var s Snapshot
	if _, err := Load(ctx, st, &s, nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Load from an empty store: %v, want ErrNotFound", err)
	}

	want := sample()
	buf, err := Save(ctx, st, want, []byte("stale bytes"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf, mustAppend(t, want)) {
		t.Error("Save did not return the encoded snapshot")
	}
	buf, err = Load(ctx, st, &s, buf)
	if err != nil {
		t.Fatal(err)
	}
	if d := diff(want, &s); d != "" {
		t.Errorf("(-saved +loaded):\n%s", d)
	}

	bad := sample()
	bad.BlockSize = 0
	if _, err := Save(ctx, st, bad, buf); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Save of an invalid snapshot: %v, want ErrCorrupt", err)
	}
	if _, err := Load(ctx, st, &s, nil); err != nil {
		t.Errorf("the refused Save replaced the stored snapshot: %v", err)
	}

	if err := os.WriteFile(st.Path, []byte("not a snapshot"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(ctx, st, &s, buf); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Load of a damaged file: %v, want ErrCorrupt", err)
	}
}
