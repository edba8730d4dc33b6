#!/usr/bin/env bash
# Issue 29 item 1 in one call on the 4-GPU machine: what gives several ranks' steps back. First the node's
# layout (NUMA nodes, hyper-threads, which cores each GPU sits near), then scripts/step_beside_load.sh (one
# GPU's step beside K decoding processes: as is, with a core kept from them, with the loop pinned to it, with
# them at niceness 10), then scripts/gpu_ranks.sh training on RANKS ranks (cold, recordio, decode auto) with the
# loader's levers in turn, as many rounds as the deadline allows, so each lever stands beside the default on
# one warm machine: LEVERS is a list of LOOP_CORES:WORKER_NICE (default "0:0 1:0 0:10").
#
#   device run (kind nvidia-h200-x4), carry .whl-decode:  OUT=$OUT bash scripts/gpu_ranks_levers.sh
#   STEP=0 ...           # skip the step experiment
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out} N=${N:-96000} FORMATS=${FORMATS:-recordio} DECODES=${DECODES:-auto}
export DEADLINE_AT=$(( $(date +%s) + ${DEADLINE_S:-575} ))
WHEELS=.whl-decode source scripts/device_setup.sh
export INSTALL=0
lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA|Model name)" || true
nvidia-smi topo -m 2>/dev/null || true
if [ "${STEP:-1}" = 1 ]; then
  LOADS=${LOADS:-0,31,63,0} WINDOW_S=${WINDOW_S:-4} VARIANTS=${VARIANTS:-plain reserve pin nice} \
    RESULTS_NAME=step-beside-load-h200x4.jsonl bash scripts/step_beside_load.sh
fi
round=0
while [ $(( DEADLINE_AT - $(date +%s) )) -ge 90 ]; do
  round=$((round + 1))
  for lever in ${LEVERS:-0:0 1:0 0:10}; do
    echo "round $round: loop cores ${lever%%:*}, worker nice ${lever#*:}"
    LOOP_CORES=${lever%%:*} WORKER_NICE=${lever#*:} RUNS="${RANKS:-4}:train" DATA=/tmp/gpufeed-ranks \
      bash scripts/gpu_ranks.sh
  done
done
