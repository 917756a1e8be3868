package codec

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/tinylib/msgp/msgp"
)

// decodeLimits bound what one payload may ask the decoder to hold, so that a
// corrupt length cannot make it allocate without end.
type decodeLimits struct {
	MaxEvents int // events in one batch
	MaxBlocks int // block hashes in one event
	MaxTokens int // token ids in one event
}

// defaultLimits are far above what any engine sends in one batch.
var defaultLimits = decodeLimits{MaxEvents: 1 << 16, MaxBlocks: 1 << 16, MaxTokens: 1 << 22}

// Error is a decode failure: which event (-1 for the batch itself), which
// field, and what was found. Decode returns the batch's; an event's is in
// Batch.Invalid.
type Error struct {
	Event int
	Field string
	Msg   string
	Err   error // the msgpack reader's error behind Msg, if any (e.g. msgp.ErrShortBytes)
}

// Unwrap returns the msgpack reader's error behind e, for errors.Is and As.
func (e *Error) Unwrap() error { return e.Err }

func (e *Error) Error() string {
	where := "batch"
	if e.Event >= 0 {
		where = fmt.Sprintf("event %d", e.Event)
	}
	if e.Field == "" {
		return where + ": " + e.Msg
	}
	return where + ": " + e.Field + ": " + e.Msg
}

// Decoder decodes payloads. It keeps an intern table for the strings that
// repeat across events (medium, kind, lora name), so it is not safe for
// concurrent use: give each goroutine its own. The zero value is ready to
// use; a zero field of its limits takes defaultLimits' value.
type Decoder struct {
	lim  decodeLimits
	strs interner
}

// interner keeps one copy of each string that repeats across events, so
// that decoding them allocates nothing once seen.
type interner struct{ m map[string]string }

// limits is d.lim with defaultLimits in its zero fields.
func (d *Decoder) limits() decodeLimits {
	l := d.lim
	if l.MaxEvents <= 0 {
		l.MaxEvents = defaultLimits.MaxEvents
	}
	if l.MaxBlocks <= 0 {
		l.MaxBlocks = defaultLimits.MaxBlocks
	}
	if l.MaxTokens <= 0 {
		l.MaxTokens = defaultLimits.MaxTokens
	}
	return l
}

// maxInterned bounds the intern table against payloads full of distinct strings.
const maxInterned = 1024

// NewDecoder returns a Decoder with the default limits (docs/FORMAT.md §8).
func NewDecoder() *Decoder {
	d := &Decoder{lim: defaultLimits, strs: interner{m: make(map[string]string)}}
	for _, s := range []string{"GPU", "CPU", "CPU_PINNED", "DISK", "NVME", "STORAGE",
		"full_attention", "mla_attention", "sink_full_attention", "sliding_window",
		"mamba", "chunked_local_attention"} {
		d.strs.m[s] = s
	}
	return d
}

func (in *interner) intern(b []byte) string {
	if s, ok := in.m[string(b)]; ok { // the compiler does not allocate for this lookup
		return s
	}
	s := string(b)
	if in.m == nil {
		in.m = make(map[string]string)
	}
	if len(in.m) < maxInterned {
		in.m[s] = s
	}
	return s
}

// Decode decodes one payload into b, reusing b's storage. An event it cannot
// read costs only itself: it is left out of b.Events, its error in
// b.Invalid. A payload whose batch cannot be read (truncated, corrupt, not
// a batch, a limit of the batch exceeded, trailing bytes) is an error, an
// *Error, and b then holds no usable events.
func (d *Decoder) Decode(p []byte, b *Batch) error {
	b.TS, b.DPRank, b.HasDPRank, b.Skipped = 0, 0, false, 0
	b.Events, b.Invalid = b.Events[:0], b.Invalid[:0]
	b.extra = b.extra[:0]
	rest, err := d.decodeBatch(p, b)
	if err == nil && len(rest) != 0 {
		err = &Error{Event: -1, Msg: fmt.Sprintf("%d trailing bytes after the batch", len(rest))}
	}
	if err != nil {
		b.Events, b.Invalid = b.Events[:0], b.Invalid[:0]
		return err
	}
	return nil
}

func (d *Decoder) decodeBatch(p []byte, b *Batch) ([]byte, error) {
	switch msgp.NextType(p) {
	case msgp.ArrayType:
		return d.decodeArrayBatch(p, b)
	case msgp.MapType:
		return d.decodeMapBatch(p, b)
	}
	return p, &Error{Event: -1, Msg: "expected array or map, got " + typeName(p)}
}

// decodeArrayBatch decodes [ts, events, rank], any slot past them skipped.
func (d *Decoder) decodeArrayBatch(p []byte, b *Batch) ([]byte, error) {
	n, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return p, fieldErr("", err, p)
	}
	if n < 2 {
		return p, &Error{Event: -1, Msg: fmt.Sprintf("array of %d elements, want at least 2 (ts, events)", n)}
	}
	if b.TS, p, err = readFloat(p); err != nil {
		return p, fieldErr("ts", err, p)
	}
	if p, err = d.decodeEvents(p, b); err != nil {
		return p, err
	}
	if n > 2 {
		if p, err = readOptInt(p, &b.DPRank, &b.HasDPRank); err != nil {
			return p, fieldErr("data_parallel_rank", err, p)
		}
	}
	for i := uint32(3); i < n; i++ {
		if p, err = msgp.Skip(p); err != nil {
			return p, fieldErr("", err, p)
		}
	}
	return p, nil
}

// decodeMapBatch decodes the batch of the one vLLM build that wrote a map.
func (d *Decoder) decodeMapBatch(p []byte, b *Batch) ([]byte, error) {
	n, p, err := msgp.ReadMapHeaderBytes(p)
	if err != nil {
		return p, fieldErr("", err, p)
	}
	var key []byte
	sawEvents := false
	for ; n > 0; n-- {
		if key, p, err = msgp.ReadStringZC(p); err != nil {
			return p, fieldErr("key", err, p)
		}
		switch string(key) {
		case "ts":
			b.TS, p, err = readFloat(p)
		case "events":
			sawEvents = true
			if p, err = d.decodeEvents(p, b); err != nil {
				return p, err
			}
		case "data_parallel_rank", "attn_dp_rank":
			p, err = readOptInt(p, &b.DPRank, &b.HasDPRank)
		default:
			p, err = msgp.Skip(p)
		}
		if err != nil {
			return p, fieldErr(string(key), err, p)
		}
	}
	if !sawEvents {
		return p, &Error{Event: -1, Field: "events", Msg: "missing"}
	}
	return p, nil
}

func (d *Decoder) decodeEvents(p []byte, b *Batch) ([]byte, error) {
	n, p, err := readArrayHeader(p, d.limits().MaxEvents)
	if err != nil {
		return p, fieldErr("events", err, p)
	}
	for i := 0; i < int(n); i++ {
		if len(b.Events) < cap(b.Events) {
			b.Events = b.Events[:len(b.Events)+1]
		} else {
			b.Events = append(b.Events, Event{})
		}
		e := &b.Events[len(b.Events)-1]
		e.reset()
		rest, known, err := d.decodeEvent(p, e, b)
		if err != nil {
			fe := eventErr(i, err, rest)
			// An event whose extent can still be read costs only itself;
			// one that cannot (truncated, corrupt) leaves nothing after it
			// to trust.
			if rest, err = msgp.Skip(p); err != nil {
				return rest, fe
			}
			b.Invalid = append(b.Invalid, fe)
			known = false
		} else if !known {
			b.Skipped++
		}
		if !known {
			b.Events = b.Events[:len(b.Events)-1]
		}
		p = rest
	}
	return p, nil
}

// decodeEvent decodes one event of either form into e; known is false for
// a tag this version does not know.
func (d *Decoder) decodeEvent(p []byte, e *Event, b *Batch) ([]byte, bool, error) {
	switch msgp.NextType(p) {
	case msgp.ArrayType:
		return d.decodeArrayEvent(p, e, b)
	case msgp.MapType:
		return d.decodeMapEvent(p, e, b)
	}
	return p, false, &Error{Msg: "expected array or map, got " + typeName(p)}
}

// eventErr is err, at p, as the *Error of event i.
func eventErr(i int, err error, p []byte) *Error {
	if fe, ok := err.(*Error); ok {
		fe.Event = i
		return fe
	}
	return &Error{Event: i, Msg: describe(err, p), Err: err}
}

func parseTag(tag []byte) EventType {
	switch string(tag) {
	case "BlockStored":
		return BlockStored
	case "BlockRemoved":
		return BlockRemoved
	case "AllBlocksCleared":
		return AllBlocksCleared
	}
	return eventUnknown
}

// field names an event field; decoding switches on it rather than on the
// key's string, which would escape and allocate.
type field uint8

const (
	fieldUnknown field = iota
	fieldType
	fieldBlockHashes
	fieldParent
	fieldTokenIDs
	fieldBlockSize
	fieldLoraID
	fieldMedium
	fieldLoraName
	fieldExtraKeys
	fieldGroupIdx
	fieldSpecKind
	fieldSlidingWindow
	fieldCacheSalt // map form only (SGLang); the array form has no slot for it
)

var fieldNames = [...]string{"", "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
	"medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "cache_salt"}

func (f field) String() string { return fieldNames[f] }

func fieldOf(key []byte) field {
	switch string(key) {
	case "type":
		return fieldType
	case "block_hashes":
		return fieldBlockHashes
	case "parent_block_hash":
		return fieldParent
	case "token_ids":
		return fieldTokenIDs
	case "block_size":
		return fieldBlockSize
	case "lora_id":
		return fieldLoraID
	case "medium":
		return fieldMedium
	case "lora_name":
		return fieldLoraName
	case "extra_keys":
		return fieldExtraKeys
	case "group_idx":
		return fieldGroupIdx
	case "kv_cache_spec_kind":
		return fieldSpecKind
	case "kv_cache_spec_sliding_window":
		return fieldSlidingWindow
	case "cache_salt":
		return fieldCacheSalt
	}
	return fieldUnknown
}

// Array slots per tag (docs/FORMAT.md §8.2); slot 0 is the tag.
var (
	storedSlots = [...]field{fieldType, fieldBlockHashes, fieldParent, fieldTokenIDs, fieldBlockSize, fieldLoraID,
		fieldMedium, fieldLoraName, fieldExtraKeys, fieldGroupIdx, fieldSpecKind, fieldSlidingWindow}
	removedSlots = [...]field{fieldType, fieldBlockHashes, fieldMedium, fieldGroupIdx, fieldSpecKind, fieldSlidingWindow}
	clearedSlots = [...]field{fieldType, fieldMedium}
)

// minSlots is the shortest array each tag was ever sent with, tag included.
var minSlots = [...]uint32{BlockStored: 5, BlockRemoved: 2, AllBlocksCleared: 1}

// slotsOf is the array slot table of t, nil for a tag without one. The
// decoder (past the tag, which picks the table) takes positions from it
// alone; internal/engineenc writes by a table of its own, and
// TestSlotTablesAgree holds the two together.
func slotsOf(t EventType) []field {
	switch t {
	case BlockStored:
		return storedSlots[:]
	case BlockRemoved:
		return removedSlots[:]
	case AllBlocksCleared:
		return clearedSlots[:]
	}
	return nil
}

func (d *Decoder) decodeArrayEvent(p []byte, e *Event, b *Batch) ([]byte, bool, error) {
	n, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return p, false, err
	}
	if n == 0 {
		return p, false, &Error{Field: "type", Msg: "empty event array"}
	}
	tag, p, err := msgp.ReadStringZC(p)
	if err != nil {
		return p, false, fieldErr("type", err, p)
	}
	e.Type = parseTag(tag)
	slots := slotsOf(e.Type)
	if slots == nil {
		for i := uint32(1); i < n; i++ {
			if p, err = msgp.Skip(p); err != nil {
				return p, false, err
			}
		}
		return p, false, nil
	}
	if n < minSlots[e.Type] {
		return p, false, &Error{Msg: fmt.Sprintf("%s array of %d elements, want at least %d", e.Type, n, minSlots[e.Type])}
	}
	for i := uint32(1); i < n; i++ {
		if int(i) >= len(slots) { // a field from a newer engine
			if p, err = msgp.Skip(p); err != nil {
				return p, false, err
			}
			continue
		}
		if p, err = d.decodeField(slots[i], p, e, b); err != nil {
			return p, false, err
		}
	}
	return p, true, d.finish(e)
}

func (d *Decoder) decodeMapEvent(p []byte, e *Event, b *Batch) ([]byte, bool, error) {
	n, body, err := msgp.ReadMapHeaderBytes(p)
	if err != nil {
		return body, false, err
	}
	// msgspec writes the tag first; look further only when it did not.
	tag, err := findTag(body, n)
	if err != nil {
		return body, false, err
	}
	e.Type = parseTag(tag)
	if e.Type == eventUnknown {
		rest, err := msgp.Skip(p)
		return rest, false, err
	}
	var key []byte
	var seen fieldSet
	for ; n > 0; n-- {
		if key, body, err = msgp.ReadStringZC(body); err != nil {
			return body, false, fieldErr("key", err, body)
		}
		f := fieldOf(key)
		if f == fieldType {
			body, err = msgp.Skip(body)
		} else {
			seen.add(f)
			body, err = d.decodeField(f, body, e, b)
		}
		if err != nil {
			return body, false, err
		}
	}
	if missing := seen.missing(e.Type); missing != "" {
		return body, false, &Error{Field: missing, Msg: "missing"}
	}
	return body, true, d.finish(e)
}

// finish derives what needs the whole event: the extra-key digests, which
// depend on the lora name, the salt and the parent, in whatever order a map
// event brought them.
func (d *Decoder) finish(e *Event) error {
	if e.Type != BlockStored || e.ExtraKeys == nil {
		return nil
	}
	return d.digestExtraKeys(e)
}

// findTag returns the "type" value of a map event body of n pairs.
func findTag(body []byte, n uint32) ([]byte, error) {
	for ; n > 0; n-- {
		key, rest, err := msgp.ReadStringZC(body)
		if err != nil {
			return nil, fieldErr("key", err, body)
		}
		if string(key) == "type" {
			tag, _, err := msgp.ReadStringZC(rest)
			if err != nil {
				return nil, fieldErr("type", err, rest)
			}
			return tag, nil
		}
		if body, err = msgp.Skip(rest); err != nil {
			return nil, err
		}
	}
	return nil, &Error{Field: "type", Msg: "missing"}
}

// fieldSet records which required map fields an event carried.
type fieldSet uint8

const (
	hasHashes fieldSet = 1 << iota
	hasTokens
	hasBlockSize
)

func (s *fieldSet) add(f field) {
	switch f {
	case fieldBlockHashes:
		*s |= hasHashes
	case fieldTokenIDs:
		*s |= hasTokens
	case fieldBlockSize:
		*s |= hasBlockSize
	}
}

func (s fieldSet) missing(t EventType) string {
	switch {
	case t == AllBlocksCleared:
	case s&hasHashes == 0:
		return "block_hashes"
	case t == BlockStored && s&hasTokens == 0:
		return "token_ids"
	case t == BlockStored && s&hasBlockSize == 0:
		return "block_size"
	}
	return ""
}

// decodeField decodes the value of field f into e. The fields every
// BlockStored carries are decoded here, the others by decodeOptField.
func (d *Decoder) decodeField(f field, p []byte, e *Event, b *Batch) ([]byte, error) {
	var err error
	start := p
	switch f {
	case fieldBlockHashes:
		p, err = d.readHashes(p, e)
	case fieldParent:
		if msgp.IsNil(p) {
			p = p[1:]
		} else {
			e.HasParent = true
			e.ParentHash, p, err = readHash(p)
		}
	case fieldTokenIDs:
		p, err = d.readTokens(p, e)
	case fieldBlockSize:
		var v int64
		if v, p, err = readInt(p); err == nil && (v < 0 || v > 1<<30) {
			err = fmt.Errorf("%d out of range", v)
		}
		e.BlockSize = int(v)
	case fieldLoraID:
		p, err = readOptInt(p, &e.LoraID, &e.HasLoraID)
	case fieldMedium:
		e.Medium, p, err = d.strs.readOptString(p)
	default:
		p, err = decodeOptField(&d.strs, f, p, e, b)
	}
	if err != nil {
		return p, fieldErr(f.String(), err, start)
	}
	return p, nil
}

// decodeOptField decodes the value of one of the fields newer or other
// engines add; unknown fields are skipped.
func decodeOptField(in *interner, f field, p []byte, e *Event, b *Batch) ([]byte, error) {
	var err error
	switch f {
	case fieldLoraName:
		p, err = readLoraName(in, p, e)
	case fieldCacheSalt:
		e.CacheSalt, p, err = in.readOptString(p)
	case fieldExtraKeys:
		p, err = readExtraKeys(p, e, b)
	case fieldGroupIdx:
		p, err = readGroupIdx(in, p, e)
	case fieldSpecKind:
		var kind string
		if kind, p, err = in.readOptString(p); kind != "" {
			e.SpecKind = kind // nil keeps a kind read from the group_idx slot
		}
	case fieldSlidingWindow:
		var v int64
		p, err = readOptInt(p, &v, &e.HasSlidingWindow)
		e.SlidingWindow = int(v)
	default:
		p, err = msgp.Skip(p)
	}
	return p, err
}

// readLoraName reads the lora_name slot. SGLang versions with cache salts
// put a metadata map there (BlockStoredWithMetadata): its cache_salt is
// read, the rest skipped. Any other type is not a name and not an error
// either.
func readLoraName(in *interner, p []byte, e *Event) ([]byte, error) {
	switch msgp.NextType(p) {
	case msgp.StrType, msgp.NilType:
		var err error
		e.LoraName, p, err = in.readOptString(p)
		return p, err
	case msgp.MapType:
		return readMetadata(in, p, e)
	}
	return msgp.Skip(p)
}

// readExtraKeys keeps extra_keys' raw msgpack in b's arena; finish digests it.
func readExtraKeys(p []byte, e *Event, b *Batch) ([]byte, error) {
	if msgp.IsNil(p) {
		return p[1:], nil
	}
	rest, err := msgp.Skip(p)
	if err == nil {
		n := len(b.extra)
		b.extra = append(b.extra, p[:len(p)-len(rest)]...)
		e.ExtraKeys = b.extra[n:len(b.extra):len(b.extra)]
	}
	return rest, err
}

// readGroupIdx reads group_idx: nil, an int, or, as some engines put in
// that slot, the spec kind as a string.
func readGroupIdx(in *interner, p []byte, e *Event) ([]byte, error) {
	if msgp.NextType(p) == msgp.StrType {
		var err error
		e.SpecKind, p, err = in.readOptString(p)
		return p, err
	}
	var v int64
	p, err := readOptInt(p, &v, &e.HasGroupIdx)
	if err == nil && (v < 0 || v > 1<<20) {
		err = fmt.Errorf("%d out of range", v)
	}
	e.GroupIdx = int(v)
	return p, err
}

func (d *Decoder) readHashes(p []byte, e *Event) ([]byte, error) {
	n, p, err := readArrayHeader(p, d.limits().MaxBlocks)
	if err != nil {
		return p, err
	}
	e.BlockHashes = e.BlockHashes[:0] // a repeated key replaces, never appends
	for i := 0; i < int(n); i++ {
		var h uint64
		if h, p, err = readHash(p); err != nil {
			return p, detail(fmt.Sprintf("[%d]: %s", i, describe(err, p)))
		}
		e.BlockHashes = append(e.BlockHashes, h)
	}
	return p, nil
}

// readTokens reads token_ids: an array of ints, or of bigrams [a, b] whose
// chain it flattens (SGLang with EAGLE, docs/FORMAT.md §8.8).
func (d *Decoder) readTokens(p []byte, e *Event) ([]byte, error) {
	n, p, err := readArrayHeader(p, d.limits().MaxTokens)
	if err != nil {
		return p, err
	}
	if cap(e.TokenIDs) <= int(n) {
		e.TokenIDs = make([]uint32, 0, n+1) // room for a bigram chain's last token
	}
	e.TokenIDs, e.Bigram = e.TokenIDs[:0], false
	if n > 0 && msgp.NextType(p) == msgp.ArrayType {
		e.Bigram = true
		return readBigrams(p, n, e)
	}
	for i := 0; i < int(n); i++ { // readToken's work inline: the hottest loop
		var v int64
		if v, p, err = readInt(p); err != nil {
			return p, detail(fmt.Sprintf("[%d]: %s", i, describe(err, p)))
		}
		if v < 0 || v > 1<<32-1 {
			return p, detail(fmt.Sprintf("[%d]: token id %d out of range", i, v))
		}
		e.TokenIDs = append(e.TokenIDs, uint32(v))
	}
	return p, nil
}

// readBigrams reads n bigrams into e.TokenIDs: each pair's first token, then
// the last pair's second. Each pair must start with the one before's second
// token, or the flat form would not be the pairs' chain.
func readBigrams(p []byte, n uint32, e *Event) ([]byte, error) {
	var last uint32
	for i := 0; i < int(n); i++ {
		k, rest, err := msgp.ReadArrayHeaderBytes(p)
		if err != nil {
			return p, detail(fmt.Sprintf("[%d]: %s", i, describe(err, p)))
		}
		if k != 2 {
			return p, detail(fmt.Sprintf("[%d]: bigram of %d elements, want 2", i, k))
		}
		var a, b uint32
		if a, rest, err = readToken(rest, i); err != nil {
			return rest, err
		}
		if b, rest, err = readToken(rest, i); err != nil {
			return rest, err
		}
		if i > 0 && a != last {
			return p, detail(fmt.Sprintf("[%d]: bigram starts with %d, not %d, the second token of the one before", i, a, last))
		}
		e.TokenIDs = append(e.TokenIDs, a)
		last, p = b, rest
	}
	e.TokenIDs = append(e.TokenIDs, last)
	return p, nil
}

// readToken reads the token id of element i of token_ids.
func readToken(p []byte, i int) (uint32, []byte, error) {
	v, rest, err := readInt(p)
	if err != nil {
		return 0, p, detail(fmt.Sprintf("[%d]: %s", i, describe(err, p)))
	}
	if v < 0 || v > 1<<32-1 {
		return 0, p, detail(fmt.Sprintf("[%d]: token id %d out of range", i, v))
	}
	return uint32(v), rest, nil
}

func (in *interner) readOptString(p []byte) (string, []byte, error) {
	if msgp.IsNil(p) {
		return "", p[1:], nil
	}
	s, rest, err := msgp.ReadStringZC(p)
	if err != nil {
		return "", p, err
	}
	return in.intern(s), rest, nil
}

var errNotInt = errors.New("not an int")

// readIntBits reads a msgpack integer of any width and sign as its 64-bit
// two's-complement pattern; neg reports a negative value.
func readIntBits(p []byte) (v uint64, neg bool, rest []byte, err error) {
	if len(p) == 0 {
		return 0, false, p, msgp.ErrShortBytes
	}
	c := p[0]
	switch {
	case c <= 0x7f:
		return uint64(c), false, p[1:], nil
	case c >= 0xe0:
		return uint64(int64(int8(c))), true, p[1:], nil
	}
	var size int
	switch c {
	case 0xcc, 0xd0:
		size = 1
	case 0xcd, 0xd1:
		size = 2
	case 0xce, 0xd2:
		size = 4
	case 0xcf, 0xd3:
		size = 8
	default:
		return 0, false, p, errNotInt
	}
	if len(p) < 1+size {
		return 0, false, p, msgp.ErrShortBytes
	}
	b := p[1 : 1+size]
	signed := c >= 0xd0
	switch size {
	case 1:
		v = uint64(b[0])
		if signed {
			v = uint64(int64(int8(b[0])))
		}
	case 2:
		v = uint64(binary.BigEndian.Uint16(b))
		if signed {
			v = uint64(int64(int16(v)))
		}
	case 4:
		v = uint64(binary.BigEndian.Uint32(b))
		if signed {
			v = uint64(int64(int32(v)))
		}
	case 8:
		v = binary.BigEndian.Uint64(b)
	}
	return v, signed && int64(v) < 0, p[1+size:], nil
}

// readInt reads an integer that must fit an int64.
func readInt(p []byte) (int64, []byte, error) {
	v, neg, rest, err := readIntBits(p)
	if err != nil {
		return 0, p, err
	}
	if !neg && v > 1<<63-1 {
		return 0, p, fmt.Errorf("%d overflows int64", v)
	}
	return int64(v), rest, nil
}

func readOptInt(p []byte, v *int64, has *bool) ([]byte, error) {
	if msgp.IsNil(p) {
		*v, *has = 0, false
		return p[1:], nil
	}
	x, rest, err := readInt(p)
	if err != nil {
		return p, err
	}
	*v, *has = x, true
	return rest, nil
}

// readHash reads an engine block hash: an int of any width and sign (its 64
// bits kept), or a bin digest whose last 8 bytes are the hash, big-endian,
// as vLLM takes them for its int form.
func readHash(p []byte) (uint64, []byte, error) {
	if msgp.NextType(p) == msgp.BinType {
		raw, rest, err := msgp.ReadBytesZC(p)
		if err != nil {
			return 0, p, err
		}
		var h uint64
		if len(raw) > 8 {
			raw = raw[len(raw)-8:]
		}
		for _, c := range raw {
			h = h<<8 | uint64(c)
		}
		return h, rest, nil
	}
	v, _, rest, err := readIntBits(p)
	return v, rest, err
}

func readFloat(p []byte) (float64, []byte, error) {
	switch msgp.NextType(p) {
	case msgp.IntType, msgp.UintType:
		v, rest, err := readInt(p)
		return float64(v), rest, err
	case msgp.Float64Type, msgp.Float32Type:
		return msgp.ReadFloat64Bytes(p)
	}
	return 0, p, detail("expected float64, got " + typeName(p))
}

// readArrayHeader reads an array header and checks its length against max and
// against the bytes left (every element takes at least one byte).
func readArrayHeader(p []byte, max int) (uint32, []byte, error) {
	n, rest, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return 0, p, err
	}
	if int(n) > max {
		return 0, p, fmt.Errorf("array of %d elements exceeds the limit of %d", n, max)
	}
	if int(n) > len(rest) {
		return 0, p, fmt.Errorf("array of %d elements in %d remaining bytes", n, len(rest))
	}
	return n, rest, nil
}

func typeName(p []byte) string {
	if len(p) == 0 {
		return "end of payload"
	}
	return msgp.NextType(p).String()
}

// detail is a finished message about a value inside a field (an element of an array).
type detail string

func (d detail) Error() string { return string(d) }

// describe turns a low-level failure at p into words a user can act on.
func describe(err error, p []byte) string {
	var d detail
	var typeErr msgp.TypeError
	switch {
	case errors.As(err, &d):
		return string(d)
	case errors.Is(err, msgp.ErrShortBytes) || len(p) == 0:
		return "truncated payload"
	case errors.Is(err, errNotInt):
		return "expected int, got " + typeName(p)
	case errors.As(err, &typeErr):
		return fmt.Sprintf("expected %s, got %s", typeErr.Method, typeName(p))
	}
	return err.Error()
}

// fieldErr wraps a failure while reading field (at p) as an *Error.
func fieldErr(field string, err error, p []byte) error {
	if fe, ok := err.(*Error); ok {
		return fe
	}
	return &Error{Event: -1, Field: field, Msg: describe(err, p), Err: err}
}
