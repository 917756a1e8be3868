#!/usr/bin/env bash
# Installs the Python peers of the interop tests (the C libzmq through Debian's
# python3-zmq, msgpack, and the reference xxHash) when missing and run as root.
set -euo pipefail
if /usr/bin/python3 -c 'import zmq, msgpack, xxhash' 2>/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq python3-zmq python3-msgpack python3-xxhash >/dev/null
else
  echo "install-peers: python3-zmq, python3-msgpack or python3-xxhash missing: the interop tests will skip" >&2
fi
