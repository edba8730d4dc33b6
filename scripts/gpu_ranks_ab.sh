#!/usr/bin/env bash
# Issue 29 item 1, A/B on one warm 4-GPU machine: the loader as it is now against the build in .whl-before
# (gpufeed's wheel from an earlier commit: `git worktree add /tmp/b REV && pip wheel --no-deps -w .whl-before
# /tmp/b`), alternating, 4 ranks training cold from 96,000 captured records (recordio, decode auto). First the
# one-GPU probe of the per-step synchronisation the normalisation statistics cost (scripts/stats_sync_probe.py).
# Each side's rows go to their own file: gpu-ranks-ab-now.jsonl and gpu-ranks-ab-before.jsonl.
#
#   device run (kind nvidia-h200-x4), carry .whl-decode and .whl-before:  OUT=$OUT bash scripts/gpu_ranks_ab.sh
#   ROUNDS=3 RANKS=4 ...
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=$(realpath -m "${OUT:-$PWD/out}") N=${N:-96000} FORMATS=${FORMATS:-recordio} DECODES=${DECODES:-auto}
export DEADLINE_AT=$(( $(date +%s) + ${DEADLINE_S:-575} ))
mkdir -p "$OUT"
WHEELS=.whl-decode source scripts/device_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-before \
  .whl-before/*.whl
export INSTALL=0
NOW=$PYTHONPATH BEFORE=/tmp/site-before:$PYTHONPATH
[ "${PROBE:-1}" = 1 ] && timeout 120 python3 scripts/stats_sync_probe.py 3 2>&1 | grep -v Warning || true
for round in $(seq "${ROUNDS:-3}"); do
  for side in now before; do
    [ $(( DEADLINE_AT - $(date +%s) )) -ge 75 ] || { echo "skipped: round $round $side (deadline)"; continue; }
    echo "=== round $round: $side"
    path=$NOW; [ "$side" = before ] && path=$BEFORE
    PYTHONPATH=$path RESULTS_NAME=gpu-ranks-ab-$side.jsonl RUNS="${RANKS:-4}:train" DATA=/tmp/gpufeed-ranks \
      bash scripts/gpu_ranks.sh 2>&1 | grep -E "^(train|infer) |rc |building|error" || true
  done
done
