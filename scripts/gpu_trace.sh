#!/usr/bin/env bash
# Issue 29 item 1: what the GPU does while 4 ranks train fed. `gpufeed bench train --trace`: after each timed
# window (the model alone, then fed by each decode path), 8 more steps of every rank under torch's profiler; then
# each rank's fed trace compared kernel by kernel with its trace alone (python -m gpufeed.bench.trace). Rank 0's
# and the last rank's traces come back gzipped.
#
#   device run (kind nvidia-h200-x4), carry .whl-decode:  OUT=$OUT bash scripts/gpu_trace.sh
#   DECODES=hybrid,cpu RANKS=4 WARM=1 ...
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=$(realpath -m "${OUT:-$PWD/out}") N=${N:-96000} FORMATS=${FORMATS:-recordio} DECODES=${DECODES:-hybrid,cpu}
mkdir -p "$OUT/trace"
WHEELS=.whl-decode source scripts/device_setup.sh
INSTALL=0 TRACE=$OUT/trace RUNS="${RANKS:-4}:train" DATA=/tmp/gpufeed-ranks RESULTS_NAME=gpu-trace.jsonl \
  bash scripts/gpu_ranks.sh 2>&1 | grep -v Warning || true
cd "$OUT/trace"
last=$(( ${RANKS:-4} - 1 ))
for rank in 0 $last; do
  alone=$(ls train-synthetic-run0-rank$rank.json 2>/dev/null) || continue
  for fed in $(ls train-*-run0-rank$rank.json | grep -v synthetic); do
    echo "=== rank $rank: $fed against $alone"
    python3 -m gpufeed.bench.trace "$alone" "$fed"
  done
done 2>&1 | tee "$OUT/trace-summary.txt"
for f in *.json; do case $f in *-rank0.json|*-rank$last.json) gzip -9 "$f" ;; *) rm "$f" ;; esac; done
ls -la
