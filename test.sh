#!/usr/bin/env bash
# The test command: every package under the race detector, after installing
# the Python peers the interop tests need (as root; otherwise they skip); then
# the allocation tests (names with "Allocat"), which the race detector's own
# allocations would make meaningless, without it, in every package that has
# one (derived from the sources; TestAllocationTestsRunWithoutRace checks it).
set -euo pipefail
cd "$(dirname "$0")"
alloc_packages() {
  grep -rlE --include='*_test.go' 'AllocsPerRun|AllocsPerOp|func Test[A-Za-z0-9_]*Allocat' . |
    xargs -n1 dirname | sort -u
}
if [ "${1:-}" = --alloc-packages ]; then alloc_packages; exit 0; fi
scripts/install-peers.sh
go test -race -count=1 -timeout 20m ./... "$@"
mapfile -t pkgs < <(alloc_packages)
exec go test -count=1 -run 'Allocat' "${pkgs[@]}"
