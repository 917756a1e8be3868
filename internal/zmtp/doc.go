// Package zmtp guards zmq4's dialled connections against hostile or broken peers:
// it checks the inbound ZMTP stream before zmq4 sizes a buffer from it and bounds
// the handshake in time, so a peer can neither exhaust memory nor hang Dial.
package zmtp
