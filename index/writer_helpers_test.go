package index

// The writer's single ops, as the tests make them.

func (w *writer) Store(id WorkerID, k uint64)  { w.StoreTier(id, TierDevice, k) }
func (w *writer) Remove(id WorkerID, k uint64) { w.RemoveTier(id, TierDevice, k) }

func (w *writer) StoreTier(id WorkerID, tier Tier, k uint64) {
	w.apply(id, Op{Kind: OpStore, Tier: tier, Hash: k})
}

func (w *writer) RemoveTier(id WorkerID, tier Tier, k uint64) {
	w.apply(id, Op{Kind: OpRemove, Tier: tier, Hash: k})
}
