package snapshot

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/tinylib/msgp/msgp"
	"github.com/zeebo/xxh3"

	"github.com/kvpipe/kvpipe/index"
)

// in is the flag bits of a block held in tiers ts.
func in(ts ...index.Tier) uint8 {
	var f uint8
	for _, t := range ts {
		f |= 1 << (2 + t)
	}
	return f
}

const (
	dev    = index.TierDevice
	host   = index.TierHost
	disk   = index.TierDisk
	remote = index.TierRemote
)

// written is s as Append writes it: in the oldest version that says what
// it holds.
func written(s *Snapshot) *Snapshot {
	c := *s
	c.Version = s.minVersion()
	return &c
}

// sample is a small snapshot with each kind of block and worker: split
// blocks held and held in no tier, a block with no tier, parents and none,
// groups, a worker with no blocks and no sequence, an absent one.
func sample() *Snapshot {
	return &Snapshot{
		Version:   2, // what Append writes for it: an absent worker, no EAGLE one
		BlockSize: 16,
		Created:   1_754_000_000_123_456_789,
		Workers: []Worker{
			{
				Name:        []byte("w-a"),
				HasSeq:      true,
				Seq:         42,
				Fingerprint: 0xdeadbeefcafef00d,
				StreamSeq:   9001,
				FullSeen:    true,
				SplitK:      3,
				UsedTiers:   0b0011,
				GroupIdx:    []int64{0, 2, -1},
				GroupMain:   []bool{true, false, true},
				Hashes:      []uint64{0x1111, 0x2222, 0x3333, 0x4444},
				Keys:        []uint64{0xa1, 0xa2, 0xa3, 0xa4},
				Parents:     []uint64{0, 0x1111, 0x2222, 0},
				Flags: []uint8{
					in(dev),
					FlagParent | FlagSplit | in(dev, host),
					FlagParent, // known, not indexed
					FlagSplit,  // split, in no tier
				},
				Split: []uint64{0xb1, 0xb2, 0xc1, 0xc2},
			},
			{Name: []byte("w-b"), Partial: true},
			{
				Name:      []byte("w-c \x00\xff"),
				HasSeq:    true,
				Seq:       ^uint64(0),
				UsedTiers: 0b1100,
				Hashes:    []uint64{^uint64(0), 1},
				Keys:      []uint64{1 << 63, 0},
				Parents:   []uint64{0, ^uint64(0)},
				Flags:     []uint8{in(disk, remote), FlagParent | in(dev, host, disk, remote)},
			},
			{Name: []byte("w-d"), Absent: true, Partial: true},
		},
	}
}

// frame frames body as the package documents its format, so that tests
// can write bodies Append would refuse.
func frame(body []byte) []byte {
	out := append([]byte("KVPSNAP\x01"), body...)
	return binary.LittleEndian.AppendUint64(out, xxh3.Hash(body))
}

// body is m's msgp encoding, consistent or not.
func body(t testing.TB, m msgp.Marshaler) []byte {
	t.Helper()
	b, err := m.MarshalMsg(nil)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// equal compares snapshots, a nil slice equal to an empty one: a reused
// Snapshot keeps empty non-nil slices where a fresh one has nil.
var equal = cmpopts.EquateEmpty()

func mustAppend(t testing.TB, s *Snapshot) []byte {
	t.Helper()
	out, err := Append(nil, s)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func diff(a, b *Snapshot) string { return cmp.Diff(a, b, equal) }

// same is diff(a, b) == "", without cmp's reflection: the fuzzers compare
// snapshots of thousands of blocks on every input.
func same(a, b *Snapshot) bool {
	if a.Version != b.Version || a.BlockSize != b.BlockSize || a.KeySeed != b.KeySeed || a.Created != b.Created || len(a.Workers) != len(b.Workers) {
		return false
	}
	for i := range a.Workers {
		x, y := &a.Workers[i], &b.Workers[i]
		if !bytes.Equal(x.Name, y.Name) || x.HasSeq != y.HasSeq || x.Seq != y.Seq || x.Fingerprint != y.Fingerprint ||
			x.Absent != y.Absent || x.StreamSeq != y.StreamSeq || x.Partial != y.Partial || x.FullSeen != y.FullSeen ||
			x.SplitK != y.SplitK || x.Eagle != y.Eagle || x.UsedTiers != y.UsedTiers || x.Rekeyed != y.Rekeyed ||
			!slices.Equal(x.GroupIdx, y.GroupIdx) || !slices.Equal(x.GroupMain, y.GroupMain) ||
			!slices.Equal(x.Hashes, y.Hashes) || !slices.Equal(x.Keys, y.Keys) || !slices.Equal(x.Parents, y.Parents) ||
			!slices.Equal(x.Flags, y.Flags) || !slices.Equal(x.Split, y.Split) {
			return false
		}
	}
	return true
}

func TestSameAgreesWithDiff(t *testing.T) {
	a := sample()
	if !same(a, sample()) {
		t.Error("same(sample, sample) is false")
	}
	// Each field changed in turn: same must see it as diff does. Found by
	// reflection so that a field added to Worker is not silently skipped.
	wt := reflect.TypeFor[Worker]()
	for i := range wt.NumField() {
		b := sample()
		f := reflect.ValueOf(&b.Workers[0]).Elem().Field(i)
		switch f.Kind() {
		case reflect.Bool:
			f.SetBool(!f.Bool())
		case reflect.Int, reflect.Int64:
			f.SetInt(f.Int() + 1)
		case reflect.Uint8, reflect.Uint64:
			f.SetUint(f.Uint() + 1)
		case reflect.Slice:
			f.Set(reflect.Append(f, reflect.Zero(f.Type().Elem())))
		default:
			t.Fatalf("field %s of kind %s not handled", wt.Field(i).Name, f.Kind())
		}
		if same(a, b) || diff(a, b) == "" {
			t.Errorf("changing %s: same %v, diff empty %v", wt.Field(i).Name, same(a, b), diff(a, b) == "")
		}
	}
	for _, mutate := range []func(*Snapshot){
		func(s *Snapshot) { s.Version++ },
		func(s *Snapshot) { s.BlockSize++ },
		func(s *Snapshot) { s.Created++ },
		func(s *Snapshot) { s.Workers = s.Workers[:2] },
	} {
		b := sample()
		mutate(b)
		if same(a, b) {
			t.Error("same misses a change of a Snapshot field")
		}
	}
	empty := &Snapshot{Workers: []Worker{{Name: []byte{}, Hashes: []uint64{}}}}
	if !same(empty, &Snapshot{Workers: []Worker{{}}}) {
		t.Error("same tells nil from empty")
	}
}
