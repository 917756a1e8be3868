package codec

// EventType is the tag of one KV-cache event.
type EventType uint8

const (
	// eventUnknown marks an event whose tag this version does not know;
	// Decode skips such events and counts them in Batch.Skipped.
	eventUnknown EventType = iota
	BlockStored
	BlockRemoved
	AllBlocksCleared
)

func (t EventType) String() string {
	switch t {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllBlocksCleared:
		return "AllBlocksCleared"
	}
	return "Unknown"
}

// Batch is one published batch. Decode overwrites it in place and reuses its
// slices, so the values it holds are valid until the next Decode into it.
type Batch struct {
	TS        float64
	Events    []Event
	DPRank    int64 // data_parallel_rank (SGLang: attn_dp_rank)
	HasDPRank bool
	// Skipped counts events with an unknown tag that Decode left out.
	Skipped int
	// Invalid holds the error of each event Decode could not read (a field
	// of the wrong type or out of range, a required field missing, an event
	// that is not an array or a map), in event order. Such an event is left
	// out of Events; the batch's other events are kept (docs/FORMAT.md §8.7).
	Invalid []*Error

	extra []byte // arena backing Event.ExtraKeys
}

// Event is the union of every event's fields; Type says which are meaningful.
// Optional scalars carry a Has flag because zero is a valid value.
type Event struct {
	Type        EventType
	BlockHashes []uint64 // engine hashes, 64 bits kept whatever their msgpack form
	ParentHash  uint64
	HasParent   bool
	// TokenIDs are the block's tokens. An SGLang engine with EAGLE-family
	// speculative decoding sends them as bigrams, [[1,2],[2,3],[3,4]]:
	// those are flattened back to [1,2,3,4] and Bigram is set, and each
	// block's tokens then run one past its end (index.Hasher.EagleKeys).
	TokenIDs  []uint32
	Bigram    bool
	BlockSize int
	LoraID    int64
	HasLoraID bool
	Medium    string // "" when absent or nil
	LoraName  string
	// CacheSalt is the request's cache salt: SGLang's cache_salt (a map key,
	// or the metadata map some versions put in the lora_name slot), else the
	// salt vLLM states in the extra keys of a root event's first block. ""
	// when none. With LoraName or LoraID it makes the block's namespace
	// (index.Namespace); see docs/FORMAT.md §10.2.
	CacheSalt string
	// ExtraKeys is the raw msgpack of extra_keys (one array per block), nil when absent.
	ExtraKeys []byte
	// BlockExtra holds one digest per block hash of that block's extra keys
	// (package extrakeys), 0 for a block without any; empty when the event
	// has no extra_keys. The adapter and the salt are left out of it (they
	// are in the namespace), so a block's digest depends only on its
	// multimodal inputs and other content keys (docs/FORMAT.md §10.3).
	BlockExtra       []uint64
	GroupIdx         int
	HasGroupIdx      bool
	SpecKind         string // kv_cache_spec_kind, "" when absent
	SlidingWindow    int
	HasSlidingWindow bool
}

// reset clears every field but keeps the slices' storage: a reused event must
// never show a field of the event decoded into it before.
func (e *Event) reset() {
	*e = Event{BlockHashes: e.BlockHashes[:0], TokenIDs: e.TokenIDs[:0], BlockExtra: e.BlockExtra[:0]}
}
