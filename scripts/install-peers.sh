#!/usr/bin/env bash
# Installs the peers of the interop tests when missing and run as root: the
# C libzmq through Debian's python3-zmq, msgpack, the reference xxHash, grpcio
# and grpc_tools (kvpipe serve's Python client), and chromium (the status
# page's browser check).
set -euo pipefail
if /usr/bin/python3 -c 'import zmq, msgpack, xxhash, grpc, grpc_tools' 2>/dev/null && command -v chromium >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq python3-zmq python3-msgpack python3-xxhash \
    python3-grpcio python3-grpc-tools chromium >/dev/null
else
  echo "install-peers: python3-zmq, python3-msgpack, python3-xxhash, python3-grpcio, python3-grpc-tools or chromium missing: the interop tests will skip" >&2
fi
