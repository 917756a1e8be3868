// Package relaypub is the publishing half of the relay, which `kvpipe
// relay` runs: a Relay subscribes to engines through a kvpipe.Pipeline and
// publishes each worker's normalised index ops to a JetStream stream, with
// its snapshot in the stream's object store, for relay.Follower to feed
// routers; a Lease lets a standby relay take over.
package relaypub
