#!/usr/bin/env bash
# Issue 29 item 1, A/B on one warm 4-GPU machine, alternating, 4 ranks training cold from 96,000 captured records
# (recordio, decode auto). Each side in SIDES is one build and its settings:
#   now           this checkout
#   now-nosample  this checkout, no nvidia-smi beside the timed windows (--no-gpu-sample)
#   now-aheadN    this checkout, each rank's loop at most N steps ahead of its GPU (--run-ahead N; now-aheadoff: no
#                 limit, the loader's only way before 961eb43; "now" paces at 0 where 4 ranks or more decode on their GPUs)
#   NAME          the wheel in .whl-NAME (gpufeed built from another commit: `git worktree add /tmp/b REV && pip
#                 wheel --no-deps -w .whl-NAME /tmp/b`), e.g. .whl-before (ec6f452), .whl-fresh (this code with the
#                 normalisation statistics made each step again)
# First the one-GPU probe of the per-step synchronisation those statistics cost (scripts/stats_sync_probe.py).
# Each side's rows go to gpu-ranks-ab-SIDE.jsonl.
#
#   device run (kind nvidia-h200-x4), carry .whl-decode and each .whl-NAME:  OUT=$OUT bash scripts/gpu_ranks_ab.sh
#   SIDES="now now-nosample fresh before" ROUNDS=2 PROBE=0 ...
#   TASK=infer DATA=/tmp/gpufeed-ranks-224q75 N=192000 DATASET_ARGS="--size 224x224 --center-crop --quality 75" \
#     DECODES=cpu SIDES="now before11" PROBE=0 ...   # inference from another stored dataset (.whl-before11: d1a9b72,
#                                                    # the CPU path before CpuBatch and the pooled blocks)
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=$(realpath -m "${OUT:-$PWD/out}") N=${N:-96000} FORMATS=${FORMATS:-recordio} DECODES=${DECODES:-auto}
export DEADLINE_AT=$(( $(date +%s) + ${DEADLINE_S:-575} ))
SIDES=${SIDES:-now before}
mkdir -p "$OUT"
WHEELS=.whl-decode source scripts/device_setup.sh
export INSTALL=0
NOW=$PYTHONPATH
for side in $SIDES; do
  case $side in now|now-nosample|now-ahead*) ;; *)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "/tmp/site-$side" \
      ".whl-$side"/*.whl ;;
  esac
done
[ "${PROBE:-1}" = 1 ] && timeout 120 python3 scripts/stats_sync_probe.py 3 2>&1 | grep -v Warning || true
for round in $(seq "${ROUNDS:-3}"); do
  for side in $SIDES; do
    [ $(( DEADLINE_AT - $(date +%s) )) -ge 75 ] || { echo "skipped: round $round $side (deadline)"; continue; }
    echo "=== round $round: $side"
    path=/tmp/site-$side:$NOW sample=1 ahead=
    case $side in now) path=$NOW ;; now-nosample) path=$NOW sample=0 ;; now-ahead*) path=$NOW ahead=${side#now-ahead} ;; esac
    PYTHONPATH=$path GPU_SAMPLE=$sample RUN_AHEAD=$ahead RESULTS_NAME=gpu-ranks-ab-$side.jsonl \
      RUNS="${RANKS:-4}:${TASK:-train}" DATA=${DATA:-/tmp/gpufeed-ranks} bash scripts/gpu_ranks.sh 2>&1 \
      | grep -E "^(train|infer) |rc |building|error" || true
  done
done
