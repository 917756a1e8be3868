// Package supervisor runs a pipeline's long-lived parts: named members (a
// worker per engine, a Source) each in a goroutine of its own, a panic or an
// early return isolated and answered by a restart with jittered backoff, one
// member removable at any time, and every member stopped and waited for,
// with the errors they stopped with, before the shards they feed close.
package supervisor
