#!/usr/bin/env bash
# The test command: every package under the race detector, after installing
# the Python peers the interop tests need (as root; otherwise they skip); then
# the allocation tests (names with "Allocat"), which the race detector's own allocations would
# make meaningless, without it.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-peers.sh
go test -race -count=1 -timeout 20m ./... "$@"
exec go test -count=1 -run 'Allocat' ./codec ./actor ./index ./supervisor ./snapshot
