// Package relay carries normalised index ops from the engines' side to any
// number of routers over NATS JetStream, with snapshots in its object store:
// a Relay publishes each worker's ops, and a Follower feeds a router's Pipeline.
package relay
