#!/usr/bin/env bash
# The configurations whose figures so far were the rate the loop took, measured again with what the loader's
# workers made counted (bench train from 2026-11-27, session 14: docs/loader.md, "What a run's rate counts"),
# in one call: recordio, 96,000 captured records, cold, each step a scripts/gpu_ranks.sh invocation against one
# deadline. STEPS is a list of RANKS:TASK:DECODES[:RUN_AHEAD] (RUN_AHEAD "-" or left out: the loader's default).
#
#   device run (kind nvidia-h200-x4), carry .whl-decode:  OUT=$OUT bash scripts/gpu_ranks_counted.sh
#     default STEPS: one rank training from the CPU path and hybrid (its 32 workers), four ranks training by
#     default, one rank of inference from hybrid and the engines alone
#   device run (kind nvidia-h200-x2), carry .whl-decode:
#     STEPS="2:train:auto 2:train:auto:0 1:train:cpu,hybrid" OUT=$OUT bash scripts/gpu_ranks_counted.sh
#     (two ranks of 15 workers by default and paced to their GPUs, then one rank of 32)
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out} N=${N:-96000} FORMATS=${FORMATS:-recordio}
export DEADLINE_AT=${DEADLINE_AT:-$(( $(date +%s) + ${DEADLINE_S:-570} ))}
WHEELS=.whl-decode source scripts/device_setup.sh
export INSTALL=0
for step in ${STEPS:-1:train:cpu,hybrid 4:train:auto 1:infer:hybrid,hw}; do
  IFS=: read -r ranks task decodes ahead <<< "$step"
  if [ -n "${ahead:-}" ] && [ "$ahead" != - ]; then export RUN_AHEAD=$ahead; else unset RUN_AHEAD; fi
  RUNS="$ranks:$task" DECODES=$decodes bash scripts/gpu_ranks.sh
done
