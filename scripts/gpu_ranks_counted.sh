#!/usr/bin/env bash
# The configurations whose figures so far were the rate the loop took, measured again with what the loader's
# workers made counted (bench train from 2026-11-27, session 14: docs/loader.md, "What a run's rate counts"),
# in one call: recordio, 96,000 captured records, cold, each step a scripts/gpu_ranks.sh invocation against one
# deadline. STEPS is a list of RANKS:TASK:DECODES[:RUN_AHEAD[:REGION[:FORMATS[:IN_ORDER]]]] (RUN_AHEAD, REGION,
# IN_ORDER "-" or left out: the loader's default; REGION on or off: the CPU workers decode each crop's box alone, or
# whole JPEGs; FORMATS separated by "+", of those FORMATS built, default all of them; IN_ORDER off: each batch
# handed out as soon as a worker has made it). CEILINGS=1 first
# measures what every core decodes at once, whole JPEGs and boxes alone, from the dataset's records.
#
#   device run (kind nvidia-h200-x4), carry .whl-decode:  OUT=$OUT bash scripts/gpu_ranks_counted.sh
#     default STEPS: one rank training from the CPU path and hybrid (its 32 workers), four ranks training by
#     default, one rank of inference from hybrid and the engines alone
#   device run (kind nvidia-h200-x2), carry .whl-decode:
#     STEPS="2:train:auto 2:train:auto:0 1:train:cpu,hybrid" OUT=$OUT bash scripts/gpu_ranks_counted.sh
#     (two ranks of 15 workers by default and paced to their GPUs, then one rank of 32)
#   CEILINGS=1 STEPS="2:train:cpu:-:off 2:train:cpu:-:on 2:train:auto" N=40000 OUT=$OUT bash scripts/gpu_ranks_counted.sh
#     (kind nvidia-h200-x2: the CPU path with and without region decode, then the default)
#   N=300000 DATA=/tmp/gpufeed-ranks300 TRAIN_STEPS=200 WARMUP_STEPS=40 STEPS="4:train:auto" ...
#     (kind nvidia-h200-x4: 4 ranks further from the start; from 96,000 records over 10 + 50 steps each of 60 workers
#     makes about 6 batches in the whole run, 2 before the first step: results/gpu-ranks-h200x4.txt, session 17.
#     The build takes ~80 s.)
#   DATA=/tmp/gpufeed-ranks-r256 DATASET_ARGS="--resize 256" N=300000 TRAIN_STEPS=200 WARMUP_STEPS=40 \
#     STEPS="4:train:auto 4:train:hybrid" ...   (training from records stored as ImageNet is usually prepared:
#     shorter side 256, JPEG q95: 52 KB a photo against 118 KB captured, under half the pixels to decode; session
#     18: auto (the CPU path for 4 ranks) 0.979-0.999 from the three formats, hybrid 0.871; the build ~90 s a format)
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out} N=${N:-96000} FORMATS=${FORMATS:-recordio}
export DEADLINE_AT=${DEADLINE_AT:-$(( $(date +%s) + ${DEADLINE_S:-570} ))}
WHEELS=.whl-decode source scripts/device_setup.sh
export INSTALL=0
DATA=${DATA:-/tmp/gpufeed-ranks}
# Every format of FORMATS built once, before the steps (a step naming fewer would otherwise build only those). From
# /tmp: the checkout's gpufeed/ would shadow the installed package.
[ -f "$DATA/bench_dataset.json" ] || (cd /tmp && python3 -m gpufeed bench dataset "$DATA" -n "$N" \
  --formats "$FORMATS" --workers "$(nproc)" ${DATASET_ARGS:-})
if [ "${CEILINGS:-0}" = 1 ]; then
  (cd /tmp && python3 -m gpufeed.bench.cpuceiling "$DATA" --format "${FORMATS%%,*}" --results "$OUT/cpu-ceilings.jsonl")
fi
for step in ${STEPS:-1:train:cpu,hybrid 4:train:auto 1:infer:hybrid,hw}; do
  IFS=: read -r ranks task decodes ahead region formats in_order <<< "$step"
  if [ -n "${ahead:-}" ] && [ "$ahead" != - ]; then export RUN_AHEAD=$ahead; else unset RUN_AHEAD; fi
  if [ -n "${region:-}" ] && [ "$region" != - ]; then export REGION_DECODE=$region; else unset REGION_DECODE; fi
  if [ -n "${in_order:-}" ] && [ "$in_order" != - ]; then export IN_ORDER=$in_order; else unset IN_ORDER; fi
  step_formats=${formats:-$FORMATS}; [ "$step_formats" = - ] && step_formats=$FORMATS
  RUNS="$ranks:$task" DECODES=$decodes FORMATS=${step_formats//+/,} bash scripts/gpu_ranks.sh
done
