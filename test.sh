#!/usr/bin/env bash
# The test command: every package under the race detector, after installing
# the Python peers the interop tests need (as root; otherwise they skip).
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-peers.sh
exec go test -race -count=1 -timeout 20m ./... "$@"
