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
//	byte 0     MessageVersion (2; version 1 is still read)
//	byte 1     flags: FlagPartial, FlagEagle; the other bits must be 0
//	then, per op:
//	  byte     the op's Kind in bits 0-3, its Tier in bits 4-5, its link
//	           code in bits 6-7
//	  8 bytes  its Hash, little-endian (0 for the kinds that have none)
//	  8 bytes  its Parent, little-endian: with link code linkParent only
//
// Link codes: 0 none, 1 a root, 2 a child of the Parent that follows
// (linkParent), 3 a child of the op before's Hash (linkPrev), which is
// how a chain of stores is sent, so that most ops stay 9 bytes.
//
// Version 1 has no FlagEagle and no links: its op byte is the Kind in the
// low nibble and the Tier in the high one, and every op is 9 bytes.
const (
	MessageVersion = 2
	FlagPartial    = 1 << 0 // the worker's entries may lack blocks its engine holds, after these ops
	FlagEagle      = 1 << 1 // the worker keys its blocks over EAGLE windows (FORMAT.md §10.5)
	headerLen      = 2
	opLen          = 9 // an op without a parent
	parentLen      = 8
)

const (
	linkParent = 2
	linkPrev   = 3
	linkShift  = 6
	tierBits   = 0x30
)

// A link code takes the top 2 bits, so tiers must fit in 2.
var _ [4 - index.NumTiers]struct{}

// Header is what a message says of its worker, besides the ops.
type Header struct {
	Partial bool // FlagPartial
	Eagle   bool // FlagEagle
}

func (h Header) flags() byte {
	var f byte
	if h.Partial {
		f |= FlagPartial
	}
	if h.Eagle {
		f |= FlagEagle
	}
	return f
}

// errMessage is what every message decoding error wraps.
var errMessage = errors.New("relay: bad message")

// AppendMessage appends the message of ops to dst. It allocates nothing
// when dst has room for 2+17·len(ops) bytes. An op's Parent is carried
// with LinkChild only (the index reads it nowhere else). An op of an unknown kind or
// link, or of a tier from index.NumTiers on, cannot be carried: the error
// names it.
func AppendMessage(dst []byte, h Header, ops []index.Op) ([]byte, error) {
	start := len(dst)
	dst = slices.Grow(dst, headerLen+(opLen+parentLen)*len(ops))
	dst = append(dst, MessageVersion, h.flags())
	for i, op := range ops {
		if op.Kind > index.OpClearTier || op.Tier >= index.NumTiers || op.Link > index.LinkChild {
			return dst[:start], fmt.Errorf("relay: op %d (kind %d, tier %d, link %d) cannot be encoded", i, op.Kind, op.Tier, op.Link)
		}
		code := byte(op.Link)
		if op.Link == index.LinkChild && i > 0 && ops[i-1].Hash == op.Parent {
			code = linkPrev
		}
		dst = append(dst, byte(op.Kind)|byte(op.Tier)<<4|code<<linkShift)
		dst = binary.LittleEndian.AppendUint64(dst, op.Hash)
		if code == linkParent {
			dst = binary.LittleEndian.AppendUint64(dst, op.Parent)
		}
	}
	return dst, nil
}

// DecodeMessage decodes data into dst[:0] and returns the ops and what the
// message says of its worker. It allocates nothing when dst has room for
// the ops. Errors wrap errMessage and say what is wrong: an empty or
// truncated message, an unknown version or flag, no ops, an unknown op
// kind, a tier out of range, a first op chained from the op before it;
// the ops returned with one are unspecified.
func DecodeMessage(data []byte, dst []index.Op) (ops []index.Op, h Header, err error) {
	dst = dst[:0]
	if len(data) < headerLen {
		return dst, h, fmt.Errorf("%w: %d bytes, shorter than the %d-byte header", errMessage, len(data), headerLen)
	}
	known := byte(FlagPartial | FlagEagle)
	switch data[0] {
	case 1:
		known = FlagPartial
	case MessageVersion:
	default:
		return dst, h, fmt.Errorf("%w: version %d, this build reads 1 and %d", errMessage, data[0], MessageVersion)
	}
	if data[1]&^known != 0 {
		return dst, h, fmt.Errorf("%w: unknown flags %#x for version %d", errMessage, data[1]&^known, data[0])
	}
	h = Header{Partial: data[1]&FlagPartial != 0, Eagle: data[1]&FlagEagle != 0}
	body := data[headerLen:]
	if len(body) == 0 {
		return dst, h, fmt.Errorf("%w: no ops", errMessage)
	}
	if data[0] == 1 {
		dst, err = decodeV1(body, dst)
	} else {
		dst, err = decodeV2(body, dst)
	}
	return dst, h, err
}

// decodeV1 decodes version 1's ops: 9 bytes each, no links.
func decodeV1(body []byte, dst []index.Op) ([]index.Op, error) {
	if len(body)%opLen != 0 {
		return dst, fmt.Errorf("%w: truncated: %d bytes of ops is not a whole number of %d-byte ops", errMessage, len(body), opLen)
	}
	n := len(body) / opLen
	dst = slices.Grow(dst, n)
	for i := range n {
		b := body[i*opLen : (i+1)*opLen]
		kind, tier := index.OpKind(b[0]&0x0f), index.Tier(b[0]>>4)
		if err := checkOp(i, kind, tier); err != nil {
			return dst, err
		}
		dst = append(dst, index.Op{Kind: kind, Tier: tier, Hash: binary.LittleEndian.Uint64(b[1:])})
	}
	return dst, nil
}

// decodeV2 decodes version 2's ops, 9 bytes each or 17 with a parent.
func decodeV2(body []byte, dst []index.Op) ([]index.Op, error) {
	dst = slices.Grow(dst, len(body)/opLen)
	for i := 0; len(body) > 0; i++ {
		if len(body) < opLen {
			return dst, fmt.Errorf("%w: op %d truncated: %d bytes, an op has %d", errMessage, i, len(body), opLen)
		}
		b0 := body[0]
		op := index.Op{Kind: index.OpKind(b0 & 0x0f), Tier: index.Tier(b0 & tierBits >> 4), Hash: binary.LittleEndian.Uint64(body[1:opLen])}
		if err := checkOp(i, op.Kind, op.Tier); err != nil {
			return dst, err
		}
		body = body[opLen:]
		switch code := b0 >> linkShift; code {
		case linkParent:
			if len(body) < parentLen {
				return dst, fmt.Errorf("%w: op %d truncated: its parent has %d of %d bytes", errMessage, i, len(body), parentLen)
			}
			op.Link, op.Parent = index.LinkChild, binary.LittleEndian.Uint64(body)
			body = body[parentLen:]
		case linkPrev:
			if i == 0 {
				return dst, fmt.Errorf("%w: op 0 is chained from the op before it, and there is none", errMessage)
			}
			op.Link, op.Parent = index.LinkChild, dst[i-1].Hash
		default:
			op.Link = index.Link(code)
		}
		dst = append(dst, op)
	}
	return dst, nil
}

func checkOp(i int, kind index.OpKind, tier index.Tier) error {
	if kind > index.OpClearTier {
		return fmt.Errorf("%w: op %d: unknown kind %d", errMessage, i, kind)
	}
	if tier >= index.NumTiers {
		return fmt.Errorf("%w: op %d: tier %d, there are %d", errMessage, i, tier, index.NumTiers)
	}
	return nil
}
