// Package sim drives kvpipe with engines that do not exist: it reads the
// Mooncake request trace (or makes a synthetic one of the same shape), and
// models an engine's prefix block cache that stores, evicts and reports blocks.
package sim
