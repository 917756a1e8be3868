package opstream

import (
	"bytes"
	"testing"

	"github.com/kvpipe/kvpipe/index"
)

// FuzzMessage: any bytes either decode, and then encode back to exactly
// themselves, or fail with errMessage; nothing panics.
func FuzzMessage(f *testing.F) {
	good, _ := AppendMessage(nil, true, everyOp())
	f.Add(good)
	f.Add(good[:len(good)-3])
	f.Add([]byte{MessageVersion, 0})
	f.Add([]byte{MessageVersion, 0, byte(index.OpClearWorker), 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	var dst []index.Op
	f.Fuzz(func(t *testing.T, data []byte) {
		ops, partial, err := DecodeMessage(data, dst)
		dst = ops
		if err != nil {
			return
		}
		again, err := AppendMessage(nil, partial, ops)
		if err != nil {
			t.Fatalf("decoded ops do not encode: %v", err)
		}
		if !bytes.Equal(again, data) {
			t.Fatalf("re-encoded %x, decoded from %x", again, data)
		}
	})
}
