package snapshot

import (
	"errors"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvpipe/kvpipe/index"
)

// FuzzDecode feeds Decode arbitrary data, both as it is and framed with a
// valid checksum (else nearly every input would stop there). Decode must
// not panic, must fail with one of its sentinels, and what it accepts must
// encode back to itself; decoding into a used Snapshot must give what
// decoding into a fresh one does.
func FuzzDecode(f *testing.F) {
	f.Add(mustAppend(f, sample()))
	f.Add(mustAppend(f, &Snapshot{Version: Version, BlockSize: 1}))
	f.Add(body(f, sample()))
	bad := sample()
	bad.Workers[0].Split = bad.Workers[0].Split[:1]
	f.Add(body(f, bad))
	f.Add(frame(body(f, bad)))
	good := mustAppend(f, sample())
	f.Add(good[:len(good)/2])
	f.Add([]byte("KVPSNAP\x02"))
	// Labelled with the newest version and no worker absent: Append writes
	// it back as the oldest that holds it.
	f.Add(frame(body(f, &Snapshot{Version: Version, BlockSize: 1})))

	f.Fuzz(func(t *testing.T, data []byte) {
		decodeChecked(t, data)
		decodeChecked(t, frame(data))
	})
}

func decodeChecked(t *testing.T, data []byte) {
	var s Snapshot
	err := Decode(data, &s)
	used := sample()
	usedErr := Decode(data, used)
	if (err == nil) != (usedErr == nil) {
		t.Fatalf("into a fresh Snapshot: %v; into a used one: %v", err, usedErr)
	}
	if err != nil {
		if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrVersion) {
			t.Fatalf("error %q wraps neither ErrCorrupt nor ErrVersion", err)
		}
		return
	}
	if !same(&s, used) {
		t.Fatalf("decoded into a used Snapshot differs (-fresh +used):\n%s", diff(&s, used))
	}
	out, err := Append(nil, &s)
	if err != nil {
		t.Fatalf("Append of a decoded snapshot: %v", err)
	}
	var again Snapshot
	if err := Decode(out, &again); err != nil {
		t.Fatalf("Decode of a re-encoded snapshot: %v", err)
	}
	if !same(written(&s), &again) { // Append writes the oldest version that holds it
		t.Fatalf("round trip differs (-decoded +again):\n%s", diff(written(&s), &again))
	}
}

// FuzzRoundTrip builds a valid snapshot from a few fuzzed values: counts
// and split_k from the integers, each block's flags from flags (cycled),
// the rest from a generator seeded with seed.
func FuzzRoundTrip(f *testing.F) {
	f.Add(uint64(1), uint8(3), uint16(40), uint8(3), []byte{0x04, 0x0f, 0x01, 0x3e, 0x00, 0x16})
	f.Add(uint64(2), uint8(1), uint16(0), uint8(0), []byte{})
	f.Add(uint64(3), uint8(7), uint16(500), uint8(2), []byte{0x3f})
	f.Add(uint64(4), uint8(2), uint16(9), uint8(1), []byte{0x02, 0x06})

	f.Fuzz(func(t *testing.T, seed uint64, workers uint8, blocks uint16, splitK uint8, flags []byte) {
		rng := rand.New(rand.NewPCG(seed, 0))
		s := &Snapshot{Version: Version, BlockSize: 1 + rng.IntN(1024), Created: rng.Int64()}
		for i := range int(workers % 9) {
			w := Worker{
				Name:        []byte("w-" + strconv.Itoa(i)),
				HasSeq:      rng.IntN(2) == 0,
				Seq:         rng.Uint64(),
				Fingerprint: rng.Uint64(),
				StreamSeq:   rng.Uint64(),
				Partial:     rng.IntN(2) == 0,
				FullSeen:    rng.IntN(2) == 0,
				SplitK:      int(splitK % 6),
				UsedTiers:   uint8(rng.IntN(16)),
			}
			for range rng.IntN(4) {
				w.GroupIdx = append(w.GroupIdx, rng.Int64()-rng.Int64())
				w.GroupMain = append(w.GroupMain, rng.IntN(2) == 0)
			}
			for j := range int(blocks%600) >> i {
				var fl uint8
				if len(flags) > 0 {
					fl = flags[(i+j)%len(flags)] & (FlagParent | FlagSplit | 0xf<<TierShift)
				}
				if w.SplitK < 2 {
					fl &^= FlagSplit
				}
				var parent uint64
				if fl&FlagParent != 0 {
					parent = rng.Uint64()
				}
				w.Hashes = append(w.Hashes, rng.Uint64())
				w.Keys = append(w.Keys, rng.Uint64())
				w.Parents = append(w.Parents, parent)
				w.Flags = append(w.Flags, fl)
				if fl&FlagSplit != 0 {
					for range w.SplitK - 1 {
						w.Split = append(w.Split, rng.Uint64())
					}
				}
			}
			s.Workers = append(s.Workers, w)
		}

		out, err := Append(nil, s)
		if err != nil {
			t.Fatalf("Append of a valid snapshot: %v", err)
		}
		var got Snapshot
		if err := Decode(out, &got); err != nil {
			t.Fatalf("Decode: %v", err)
		}
		if !same(written(s), &got) {
			t.Fatalf("round trip differs (-appended +decoded):\n%s", diff(written(s), &got))
		}

		for i := range got.Workers {
			w := &got.Workers[i]
			ops := w.AppendOps(nil)
			if want, got := expectedOps(w), countOps(ops); !maps.Equal(want, got) {
				t.Fatalf("worker %d: (tier, key) stores (-want +got):\n%.2000s", i, cmp.Diff(want, got))
			}
			if len(ops) != w.OpCount() {
				t.Fatalf("worker %d: %d ops, OpCount %d", i, len(ops), w.OpCount())
			}
		}
	})
}

type tierKey struct {
	tier index.Tier
	key  uint64
}

func countOps(ops []index.Op) map[tierKey]int {
	n := map[tierKey]int{}
	for _, op := range ops {
		if op.Kind != index.OpStore {
			n[tierKey{255, 0}]++ // never expected
			continue
		}
		n[tierKey{op.Tier, op.Hash}]++
	}
	return n
}

// expectedOps counts the (tier, key) stores w's blocks call for, tier by
// tier: a different walk from AppendOps's block by block.
func expectedOps(w *Worker) map[tierKey]int {
	n := map[tierKey]int{}
	for t := range index.Tier(index.NumTiers) {
		next := 0 // w.Split's next block's keys
		for i, f := range w.Flags {
			var keys []uint64
			if f&FlagSplit != 0 {
				keys = w.Split[next : next+w.SplitK-1]
				next += w.SplitK - 1
			}
			if f>>(TierShift+t)&1 == 0 {
				continue
			}
			for _, k := range slices.Concat(keys, w.Keys[i:i+1]) {
				n[tierKey{t, k}]++
			}
		}
	}
	return n
}
