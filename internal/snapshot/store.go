package snapshot

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
)

// Store keeps the newest snapshot's bytes.
type Store interface {
	// Save replaces the kept snapshot with data, whole or not at all.
	Save(ctx context.Context, data []byte) error
	// Load appends the kept snapshot's bytes to dst and returns the result;
	// its error wraps ErrNotFound when none has been saved.
	Load(ctx context.Context, dst []byte) ([]byte, error)
}

// ErrNotFound: the Store holds no snapshot.
var ErrNotFound = errors.New("snapshot: not found")

// File is a Store in one file at Path. Save writes a temporary file beside
// it and renames it over Path, so a crash leaves either the old snapshot or
// the new one there, never a part; a crash can leave the temporary file
// (Path's name with ".tmp" and a random suffix) behind. The file is private
// to its owner (mode 0600).
type File struct {
	Path string
	// MaxSize bounds the file Load reads (default DefaultMaxSize): a wrong
	// path must fail with an error, not take the process's memory.
	MaxSize int64
}

// DefaultMaxSize is File's MaxSize when unset: some 600 M blocks.
const DefaultMaxSize = 16 << 30

var _ Store = File{}

// Save writes data to f.Path atomically and durably: it returns once both
// the file and its directory entry are on disk.
func (f File) Save(ctx context.Context, data []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	dir, base := filepath.Split(f.Path)
	if dir == "" {
		dir = "."
	}
	tmp, err := os.CreateTemp(dir, base+".tmp*")
	if err != nil {
		return fmt.Errorf("snapshot: save: %w", err)
	}
	if err := writeSync(tmp, data); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("snapshot: save: %w", err)
	}
	// The last point at which giving up leaves the old snapshot in place.
	if err := ctx.Err(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	if err := os.Rename(tmp.Name(), f.Path); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("snapshot: save: %w", err)
	}
	// Without this a crash could undo the rename, losing the new snapshot
	// though Save returned nil.
	if err := syncDir(dir); err != nil {
		return fmt.Errorf("snapshot: save: %w", err)
	}
	return nil
}

// writeSync writes data to file, flushes it to disk and closes it.
func writeSync(file *os.File, data []byte) error {
	_, err := file.Write(data)
	if err == nil {
		err = file.Sync()
	}
	return errors.Join(err, file.Close())
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	return errors.Join(d.Sync(), d.Close())
}

// Load appends the contents of f.Path to dst, grown once to the file's
// size rather than doubled as it is read (os.ReadFile's way): a dst reused
// from the last Load usually has room, and then nothing is grown.
func (f File) Load(ctx context.Context, dst []byte) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return dst, err
	}
	file, err := os.Open(f.Path)
	if errors.Is(err, fs.ErrNotExist) {
		return dst, fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	if err != nil {
		return dst, fmt.Errorf("snapshot: load: %w", err)
	}
	defer file.Close()
	// The size of the open file holds while it is read: Save never writes
	// to Path's file, it replaces it.
	info, err := file.Stat()
	if err != nil {
		return dst, fmt.Errorf("snapshot: load: %w", err)
	}
	if !info.Mode().IsRegular() {
		return dst, fmt.Errorf("snapshot: load: %s is not a regular file", f.Path)
	}
	limit := f.MaxSize
	if limit <= 0 {
		limit = DefaultMaxSize
	}
	size := int(info.Size())
	if int64(size) != info.Size() || size < 0 || info.Size() > limit {
		return dst, fmt.Errorf("%w: %s: %d bytes, more than the %d a snapshot may have", ErrCorrupt, f.Path, info.Size(), limit)
	}
	start := len(dst)
	dst = slices.Grow(dst, size)[:start+size]
	if _, err := io.ReadFull(file, dst[start:]); err != nil {
		return dst[:start], fmt.Errorf("snapshot: load: %s: %w", f.Path, err)
	}
	return dst, nil
}

// Save writes s to st, encoded into buf (whose contents it replaces), and
// returns buf for the next Save to reuse.
func Save(ctx context.Context, st Store, s *Snapshot, buf []byte) ([]byte, error) {
	buf, err := Append(buf[:0], s)
	if err != nil {
		return buf, err
	}
	return buf, st.Save(ctx, buf)
}

// Load reads st's snapshot into buf (whose contents it replaces) and
// decodes it into s, returning buf for the next Load to reuse. Its error
// wraps ErrNotFound when st holds none, and Decode's errors otherwise.
func Load(ctx context.Context, st Store, s *Snapshot, buf []byte) ([]byte, error) {
	buf, err := st.Load(ctx, buf[:0])
	if err != nil {
		return buf, err
	}
	return buf, Decode(buf, s)
}
