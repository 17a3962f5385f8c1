#!/usr/bin/env bash
# Runs CI's command (.ci/run, i.e. the README's `make test`, with CI=true) N times in a row, each
# on a fresh clone of one commit, and stops at the first failure: the flakiness check of
# docs/development.md. Runs must not overlap (tests/lab uses fixed namespace names).
#
#   tests/support/repeat_ci.sh [RUNS=5] [COMMIT=HEAD]
#
# Each clone is made beside this checkout (<parent>/ci-run-N), so that tests reading ../shared
# find it there as in CI; logs and <parent>/ci-runs.log (one line a run) stay beside it too.
set -uo pipefail
RUNS=${1:-5}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PARENT=$(dirname "$REPO")
COMMIT=$(git -C "$REPO" rev-parse "${2:-HEAD}")
echo "commit $COMMIT" > "$PARENT/ci-runs.log"
for i in $(seq 1 "$RUNS"); do
  clone="$PARENT/ci-run-$i"
  rm -rf "$clone" && git clone -q "$REPO" "$clone" && git -C "$clone" checkout -q "$COMMIT"
  start=$(date +%s)
  (cd "$clone" && CI=true PYTEST_ADDOPTS="--durations=10" bash .ci/run > "$clone.log" 2>&1)
  rc=$?
  echo "run $i: exit $rc, $(( $(date +%s) - start )) s; $(grep -E '(passed|failed|error)' "$clone.log" | tail -1); load $(cut -d' ' -f1-3 /proc/loadavg)" \
    | tee -a "$PARENT/ci-runs.log"
  [ "$rc" -ne 0 ] && exit "$rc"
  rm -rf "$clone"
done
