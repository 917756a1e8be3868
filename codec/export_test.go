package codec

// What the tests of package codec_test need of this package's internals.
// Those tests are external because they encode with internal/engineenc,
// which imports this package.

type DecodeLimits = decodeLimits

var DefaultLimits = defaultLimits

const (
	MaxSnapshotChunkRecords = maxSnapshotChunkRecords
	SnapshotChunkRecords    = snapshotChunkRecords
	EventUnknown            = eventUnknown

	RawUint  = rawUint
	RawStr   = rawStr
	RawBin   = rawBin
	RawArray = rawArray
	RawMap   = rawMap
)

// LimitedDecoder is a Decoder literal with only its limits set.
func LimitedDecoder(l DecodeLimits) *Decoder { return &Decoder{lim: l} }

// SetLimits replaces d's limits.
func (d *Decoder) SetLimits(l DecodeLimits) { d.lim = l }

// SlotNames names the slots of t's positional array, as the decoder reads
// them.
func SlotNames(t EventType) []string {
	var names []string
	for _, f := range slotsOf(t) {
		names = append(names, f.String())
	}
	return names
}
