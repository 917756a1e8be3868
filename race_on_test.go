//go:build race

package kvpipe

const raceEnabled = true
