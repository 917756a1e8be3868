// Package faultproxy sits between a ZMQ peer and an engine on loopback, so a
// fault test can cut, stall or refuse the link on cue, which a real engine cannot do.
package faultproxy
