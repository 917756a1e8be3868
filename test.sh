#!/usr/bin/env bash
# The test command: every package under the race detector. The interop tests
# need the C libzmq through Debian's python3-zmq; as root this installs it.
set -euo pipefail
cd "$(dirname "$0")"
if ! /usr/bin/python3 -c 'import zmq, msgpack, xxhash' 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq python3-zmq python3-msgpack python3-xxhash >/dev/null
  else
    echo "test.sh: python3-zmq not installed: the libzmq interop tests will skip" >&2
  fi
fi
exec go test -race -count=1 -timeout 20m ./... "$@"
