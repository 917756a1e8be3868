module github.com/kvpipe/kvpipe

go 1.26.8

require (
	github.com/google/go-cmp v0.7.0
	github.com/tinylib/msgp v1.6.5
	github.com/vmihailenco/msgpack/v5 v5.4.1
)

require (
	github.com/philhofer/fwd v1.2.0 // indirect
	github.com/stretchr/testify v1.8.0 // indirect
	github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
)
