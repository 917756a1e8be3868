// Package predict keeps one worker's predicted blocks: the keys a router
// said it sent there, until the engine's events confirm or end them or their
// TTL passes. One writer at a time (its index shard's lock) changes a Set;
// readers read it without locks.
package predict
