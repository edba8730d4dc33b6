#!/usr/bin/env bash
# Issue 29 item 1: are the 4 ranks' late steps the cyclic garbage collector's pauses? Traces (scripts/gpu_trace.sh)
# show every rank's model stream idle ~30 ms a step waiting in the gradients' all-reduce for whichever rank came
# late, a different one each step. Here 4 ranks train cold from 96,000 captured records (recordio, decode auto),
# alternating: the interpreter's default collector against none (GPUFEED_PROBE_GC=off through
# scripts/gc_probe/sitecustomize.py, in the ranks and their workers). A variant VAR-switch also sets the thread
# switch interval to 0.5 ms (GPUFEED_PROBE_SWITCH). Rows: gpu-gc-VARIANT.jsonl.
#
#   device run (kind nvidia-h200-x4), carry .whl-decode:  OUT=$OUT bash scripts/gpu_gc_probe.sh
#   ORDER="off off-switch" ROUNDS=2 ...
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=$(realpath -m "${OUT:-$PWD/out}") N=${N:-96000} FORMATS=${FORMATS:-recordio} DECODES=${DECODES:-auto}
export DEADLINE_AT=$(( $(date +%s) + ${DEADLINE_S:-560} ))
mkdir -p "$OUT"
WHEELS=.whl-decode source scripts/device_setup.sh
export INSTALL=0 PYTHONPATH=$PWD/scripts/gc_probe:$PYTHONPATH
for round in $(seq "${ROUNDS:-2}"); do
  for variant in ${ORDER:-default off}; do
    [ $(( DEADLINE_AT - $(date +%s) )) -ge 75 ] || { echo "skipped: round $round $variant (deadline)"; continue; }
    echo "=== round $round: $variant"
    switch=; case $variant in *-switch) switch=0.0005 ;; esac
    GPUFEED_PROBE_GC=${variant%-switch} GPUFEED_PROBE_SWITCH=$switch RESULTS_NAME=gpu-gc-$variant.jsonl RUNS="${RANKS:-4}:train" DATA=/tmp/gpufeed-ranks \
      bash scripts/gpu_ranks.sh 2>&1 | grep -E "^(train|infer) |rc |building|error" || true
  done
done
