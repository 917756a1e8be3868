#!/usr/bin/env bash
# Regenerates the Go code of proto/kvpipe/v1/index.proto (go generate
# ./internal/serve runs it): protoc from Debian's protobuf-compiler, the
# plugins at the versions go.mod pins (protoc-gen-go-grpc, a module of its
# own, at the version below), built into a temporary directory. The
# messages and grpc-go's stubs go into package kvpipev1, connect-go's into
# kvpipev1connect.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$bin/protoc-gen-connect-go" connectrpc.com/connect/cmd/protoc-gen-connect-go
GOBIN="$bin" go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
protoc -I proto \
  --plugin=protoc-gen-go="$bin/protoc-gen-go" --go_out=. --go_opt=module=github.com/kvpipe/kvpipe \
  --plugin=protoc-gen-connect-go="$bin/protoc-gen-connect-go" --connect-go_out=. --connect-go_opt=module=github.com/kvpipe/kvpipe \
  --plugin=protoc-gen-go-grpc="$bin/protoc-gen-go-grpc" --go-grpc_out=. --go-grpc_opt=module=github.com/kvpipe/kvpipe \
  kvpipe/v1/index.proto
