package opstream

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/kvpipe/kvpipe/index"
)

// A message carries one batch of one worker's ops, in order:
//
//	byte 0     MessageVersion
//	byte 1     flags: FlagPartial; the other bits must be 0
//	then, per op, 9 bytes:
//	  byte     the op's Kind in the low nibble, its Tier in the high one
//	  8 bytes  its Hash, little-endian (0 for the kinds that have none)
//
// Fixed-size ops keep the decoder a bounds check and a loop: a message of
// n ops is 2+9n bytes, and anything else is refused whole.
const (
	MessageVersion = 1
	FlagPartial    = 1 << 0 // the worker's entries may lack blocks its engine holds, after these ops
	headerLen      = 2
	opLen          = 9
)

// errMessage is what every message decoding error wraps.
var errMessage = errors.New("relay: bad message")

// AppendMessage appends the message of ops to dst. It allocates nothing
// when dst has room for 2+9·len(ops) bytes. An op of an unknown kind or of
// a tier from index.NumTiers on cannot be carried: the error names it.
func AppendMessage(dst []byte, partial bool, ops []index.Op) ([]byte, error) {
	var flags byte
	if partial {
		flags = FlagPartial
	}
	start := len(dst)
	dst = slices.Grow(dst, headerLen+opLen*len(ops))
	dst = append(dst, MessageVersion, flags)
	for i, op := range ops {
		if op.Kind > index.OpClearTier || op.Tier >= index.NumTiers {
			return dst[:start], fmt.Errorf("relay: op %d (kind %d, tier %d) cannot be encoded", i, op.Kind, op.Tier)
		}
		dst = append(dst, byte(op.Kind)|byte(op.Tier)<<4)
		dst = binary.LittleEndian.AppendUint64(dst, op.Hash)
	}
	return dst, nil
}

// DecodeMessage decodes data into dst[:0] and returns the ops and whether
// the worker is partial after them. It allocates nothing when dst has room
// for the ops. Errors wrap errMessage and say what is wrong: an empty or
// truncated message, an unknown version or flag, no ops, an unknown op
// kind or a tier out of range; the ops returned with one are unspecified.
func DecodeMessage(data []byte, dst []index.Op) (ops []index.Op, partial bool, err error) {
	dst = dst[:0]
	switch {
	case len(data) < headerLen:
		return dst, false, fmt.Errorf("%w: %d bytes, shorter than the %d-byte header", errMessage, len(data), headerLen)
	case data[0] != MessageVersion:
		return dst, false, fmt.Errorf("%w: version %d, this build reads %d", errMessage, data[0], MessageVersion)
	case data[1]&^FlagPartial != 0:
		return dst, false, fmt.Errorf("%w: unknown flags %#x", errMessage, data[1]&^FlagPartial)
	}
	body := data[headerLen:]
	if len(body)%opLen != 0 {
		return dst, false, fmt.Errorf("%w: truncated: %d bytes of ops is not a whole number of %d-byte ops", errMessage, len(body), opLen)
	}
	n := len(body) / opLen
	if n == 0 {
		return dst, false, fmt.Errorf("%w: no ops", errMessage)
	}
	dst = slices.Grow(dst, n)
	for i := range n {
		b := body[i*opLen : (i+1)*opLen]
		kind, tier := index.OpKind(b[0]&0x0f), index.Tier(b[0]>>4)
		if kind > index.OpClearTier {
			return dst, false, fmt.Errorf("%w: op %d: unknown kind %d", errMessage, i, kind)
		}
		if tier >= index.NumTiers {
			return dst, false, fmt.Errorf("%w: op %d: tier %d, there are %d", errMessage, i, tier, index.NumTiers)
		}
		dst = append(dst, index.Op{Kind: kind, Tier: tier, Hash: binary.LittleEndian.Uint64(b[1:])})
	}
	return dst, data[1]&FlagPartial != 0, nil
}
