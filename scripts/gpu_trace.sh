#!/usr/bin/env bash
# Issue 29 item 1: what the GPU does while ranks train fed. `gpufeed bench train --trace`: after each timed window
# (the model alone, then fed by each decode path), 8 more steps of every rank under torch's profiler; then each
# rank's fed trace compared with its trace alone (python -m gpufeed.bench.trace): the model's kernels, and its
# stream's idle time split into time other streams ran (the all-reduce waiting for a late rank) and time nothing
# ran (waiting for this process's launches or the engines), and every run's ranks together (--ranks: which rank came
# last to the all-reduce each step). RUNS as in gpu_ranks.sh, one trace folder each; the
# summaries as trace-summary.txt, the traces of the first run of rank 0 and the last rank (RANKS_LAST, default 3)
# as one archive (traces.tar.gz).
#
#   device run (kind nvidia-h200-x4), carry .whl-decode:  OUT=$OUT bash scripts/gpu_trace.sh
#   RUNS="4:train 1:train" DECODES=hybrid,cpu WARM=1 ...
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=$(realpath -m "${OUT:-$PWD/out}") N=${N:-96000} FORMATS=${FORMATS:-recordio} DECODES=${DECODES:-hybrid,cpu}
export DEADLINE_AT=$(( $(date +%s) + ${DEADLINE_S:-560} ))
mkdir -p "$OUT/trace"
WHEELS=.whl-decode source scripts/device_setup.sh
for run in ${RUNS:-4:train}; do
  INSTALL=0 TRACE=$OUT/trace/${run%%:*}gpu RUNS=$run DATA=/tmp/gpufeed-ranks RESULTS_NAME=gpu-trace.jsonl \
    bash scripts/gpu_ranks.sh 2>&1 | grep -v Warning || true
done
cd "$OUT/trace"
for dir in */; do
  for alone in "$dir"train-synthetic-run0-rank*.json; do
    [ -f "$alone" ] || continue
    for fed in $(ls ${alone/synthetic/*} | grep -v synthetic); do
      echo "=== $fed against $alone"
      python3 -m gpufeed.bench.trace "$alone" "$fed"
    done
  done
  # One run's ranks together: which rank came last to the all-reduce each step, and how long the others waited.
  for first in "$dir"*-run*-rank0.json; do
    [ -f "$first" ] || continue
    ranks=$(ls "${first%-rank0.json}"-rank*.json)
    [ "$(echo "$ranks" | wc -l)" -gt 1 ] || continue
    echo "=== ranks of ${first%-rank0.json}"
    python3 -m gpufeed.bench.trace --ranks $ranks
  done
done 2>&1 | tee "$OUT/trace-summary.txt"
# Back: the first run's traces of rank 0 and the last rank of each run (the summaries above cover every rank).
for f in $(find . -name '*.json'); do
  case $f in *-run0-rank0.json|*-run0-rank${RANKS_LAST:-3}.json) ;; *) rm -f "$f" ;; esac
done
cd "$OUT" && tar -czf traces.tar.gz trace && rm -r trace && ls -la
