package zmtp

import "fmt"

// ZMTP 3.x frame flags (RFC 23). Only the low three bits are defined.
const (
	flagMore     = 0x01
	flagLong     = 0x02
	flagCommand  = 0x04
	flagReserved = 0xf8
)

const greetingLen = 64

// readyPrefix is how the body of a READY command starts: name length, name.
const readyPrefix = "\x05READY"

type phase uint8

const (
	inGreeting phase = iota
	inFlags
	inSize
	inBody
)

// READY property parse positions: key length, key, 4-byte value length, value.
type propPhase uint8

const (
	propKeyLen propPhase = iota
	propKey
	propValLen
	propVal
)

// parser follows the inbound ZMTP stream byte by byte, in O(1) state and
// without keeping any of it: it only needs to know where the stream is (in
// the greeting, a frame header or a body) to judge the next header before
// zmq4 sees it. feed returns how many of the bytes given may be passed on;
// the byte that breaks a rule is never among them.
type parser struct {
	maxMsg int64 // bound on a message: its frames plus frameOverhead each
	maxCmd int64 // bound on a command frame

	ph    phase
	n     int        // greeting: bytes seen; size: size bytes still to come
	flags byte       // of the current frame
	size  uint64     // of the current frame, accumulated big-endian
	left  int64      // body bytes still to come
	total int64      // cost of the message so far
	more  bool       // the last frame had MORE: a message is in progress
	ready bool       // the peer's READY command has been received whole
	err   *Violation // once set, the stream is dead

	// The first command, which must be READY, is parsed to the end so that
	// zmq4's Metadata.UnmarshalZMTP, which indexes past the end of a
	// truncated property, only ever sees well-formed properties.
	rpos  int       // bytes of readyPrefix matched
	prop  propPhase // where in a property
	pleft uint32    // bytes left of the key, the value length or the value
	vlen  uint32    // value length being accumulated
}

func newParser(maxMsg, maxCmd int64) parser {
	return parser{maxMsg: maxMsg, maxCmd: maxCmd}
}

// feed judges b, the next bytes of the stream. It returns how many of them
// are fine and, if one is not, the violation; the parser then stays failed.
func (p *parser) feed(b []byte) (int, *Violation) {
	if p.err != nil {
		return 0, p.err
	}
	for i := 0; i < len(b); {
		var v *Violation
		switch p.ph {
		case inGreeting:
			v = p.greeting(b[i])
		case inFlags:
			v = p.header(b[i])
		case inSize:
			p.size = p.size<<8 | uint64(b[i])
			if p.n--; p.n == 0 {
				v = p.frameStart()
			}
		case inBody:
			if !p.ready {
				// The READY body: at most maxCmd bytes, judged one by one.
				v = p.readyByte(b[i])
				p.left--
				if v == nil && p.left == 0 {
					v = p.frameEnd()
				}
				break
			}
			// Any other body is skipped whole: nothing in it matters.
			k := min(p.left, int64(len(b)-i))
			p.left -= k
			i += int(k)
			if p.left == 0 {
				p.frameEnd()
			}
			continue
		}
		if v != nil {
			p.err = v
			return i, v
		}
		i++
	}
	return len(b), nil
}

func (p *parser) greeting(c byte) *Violation {
	i := p.n
	p.n++
	var bad string
	switch {
	case i == 0 && c != 0xff, i == 9 && c != 0x7f:
		bad = "signature"
	case i == 10 && c < 3:
		bad = "version (want ZMTP 3.x)"
	case i >= 12 && i < 16 && c != "NULL"[i-12], i >= 16 && i < 32 && c != 0:
		bad = "mechanism (want NULL)"
	case i == 32 && c > 1:
		bad = "as-server flag"
	}
	if bad != "" {
		return &Violation{Kind: KindGreeting, Err: fmt.Errorf("greeting byte %d is %#02x: bad %s", i, c, bad)}
	}
	if p.n == greetingLen {
		p.ph = inFlags
	}
	return nil
}

func (p *parser) header(f byte) *Violation {
	cmd := f&flagCommand != 0
	bad, kind := "", KindBadFlags
	switch {
	case f&flagReserved != 0:
		bad = "reserved flag bits set"
	case cmd && f&flagMore != 0:
		bad = "command with MORE"
	case cmd && p.more:
		bad = "command inside a multipart message"
	case !cmd && !p.ready:
		bad, kind = "message before the peer's READY", KindBadCommand
	}
	if bad != "" {
		return &Violation{Kind: kind, Err: fmt.Errorf("frame flags %#02x: %s", f, bad)}
	}
	if !p.more {
		p.total = 0 // a new message starts
	}
	p.flags, p.size, p.n, p.ph = f, 0, 1, inSize
	if f&flagLong != 0 {
		p.n = 8
	}
	return nil
}

// frameStart judges a frame once its size is known: this runs on the last
// header byte, which is withheld if the frame is too big, so zmq4 never
// learns the size and never allocates for it.
func (p *parser) frameStart() *Violation {
	if p.flags&flagCommand != 0 {
		if p.size > uint64(p.maxCmd) {
			return &Violation{Kind: KindOversize, Err: fmt.Errorf("command of %d bytes, over the limit of %d", p.size, p.maxCmd)}
		}
	} else {
		// total <= maxMsg always holds, so neither side can overflow.
		if p.size > uint64(p.maxMsg) || int64(p.size) > p.maxMsg-p.total-frameOverhead {
			return &Violation{Kind: KindOversize, Err: fmt.Errorf("frame of %d bytes after %d in its message, over the limit of %d (%d per frame counted)",
				p.size, p.total, p.maxMsg, frameOverhead)}
		}
		p.total += frameOverhead + int64(p.size)
	}
	p.more = p.flags&flagMore != 0
	p.left, p.ph = int64(p.size), inBody
	if p.left == 0 {
		return p.frameEnd()
	}
	return nil
}

func (p *parser) frameEnd() *Violation {
	p.ph = inFlags
	if p.ready || p.flags&flagCommand == 0 {
		return nil
	}
	if p.rpos < len(readyPrefix) || p.prop != propKeyLen {
		return &Violation{Kind: KindBadCommand, Err: fmt.Errorf("READY command truncated or a property overruns it")}
	}
	p.ready = true
	return nil
}

func (p *parser) readyByte(c byte) *Violation {
	if p.rpos < len(readyPrefix) {
		if c != readyPrefix[p.rpos] {
			return &Violation{Kind: KindBadCommand, Err: fmt.Errorf("first command is not READY")}
		}
		p.rpos++
		return nil
	}
	switch p.prop {
	case propKeyLen:
		p.prop, p.pleft = propKey, uint32(c)
		if c == 0 {
			p.prop, p.pleft = propValLen, 4
		}
	case propKey:
		if p.pleft--; p.pleft == 0 {
			p.prop, p.pleft, p.vlen = propValLen, 4, 0
		}
	case propValLen:
		p.vlen = p.vlen<<8 | uint32(c)
		if p.pleft--; p.pleft == 0 {
			p.prop, p.pleft = propVal, p.vlen
			if p.vlen == 0 {
				p.prop = propKeyLen
			}
		}
	case propVal:
		if p.pleft--; p.pleft == 0 {
			p.prop = propKeyLen
		}
	}
	return nil
}
