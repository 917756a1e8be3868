#!/usr/bin/env bash
# Regenerates the Go code of proto/kvpipe/v1/index.proto (go generate
# ./internal/serve runs it): protoc from Debian's protobuf-compiler, the
# plugins at the versions go.mod pins, built into a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$bin/protoc-gen-connect-go" connectrpc.com/connect/cmd/protoc-gen-connect-go
protoc -I proto \
  --plugin=protoc-gen-go="$bin/protoc-gen-go" --go_out=. --go_opt=module=github.com/kvpipe/kvpipe \
  --plugin=protoc-gen-connect-go="$bin/protoc-gen-connect-go" --connect-go_out=. --connect-go_opt=module=github.com/kvpipe/kvpipe \
  kvpipe/v1/index.proto
