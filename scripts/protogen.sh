#!/usr/bin/env bash
# Regenerates the Go code of proto/kvpipe/v1/index.proto (go generate
# ./internal/serve runs it): protoc from Debian's protobuf-compiler, the
# plugins at the versions go.mod pins, built into a temporary directory.
#
# grpc-go's stubs serve only BenchmarkServe's comparison of the two gRPC
# servers: they go into a test file of ./bench (package bench, the messages
# qualified with kvpipev1), so that no package but that test imports grpc-go.
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
  --plugin=protoc-gen-go-grpc="$bin/protoc-gen-go-grpc" --go-grpc_out="$bin" --go-grpc_opt=paths=source_relative \
  kvpipe/v1/index.proto
messages=$(sed -n 's/^message \([A-Za-z0-9_]*\) .*/\1/p' proto/kvpipe/v1/index.proto | paste -sd '|')
sed -E -e 's/^package kvpipev1$/package bench/' \
  -e 's#^import \($#import (\n\tkvpipev1 "github.com/kvpipe/kvpipe/internal/serve/kvpipev1"#' \
  -e "s/([^A-Za-z0-9_.\"])($messages)\b/\1kvpipev1.\2/g" \
  "$bin/kvpipe/v1/index_grpc.pb.go" | gofmt >bench/index_grpc.pb_test.go
