// Package supervisor holds Pipeline, which the root kvpipe package hands a
// router: it runs a subscriber and actor per worker as workers come and go,
// restarts a failed one with backoff (resynced), and drains on shutdown.
package supervisor
