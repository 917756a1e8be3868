// Package relay lets a router follow a kvpipe relay instead of the engines:
// the relay (`kvpipe relay`) publishes each worker's normalised index ops
// to a NATS JetStream stream, with snapshots in its object store, and a
// Follower, set as the router's Config.Source, feeds its Pipeline from
// them. Settings name the stream and the bucket, the same for the relay
// and every follower of it.
package relay
