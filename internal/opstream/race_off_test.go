//go:build !race

package opstream

const raceEnabled = false
