// Package supervisor is what a router embeds: Pipeline starts a subscriber and
// actor per worker as workers come and go, restarts a failed one with backoff
// (resynced), answers FindMatches, and drains everything cleanly on shutdown.
package supervisor
