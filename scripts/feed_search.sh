#!/usr/bin/env bash
# How many emulated H200s each disk keeps at >= 90% AU (gpufeed bench feed), on the 16-core GPU machine
# where the CPUs are not the limit: tfrecord as captured and at --resize 160, training and inference,
# on emulated ultra, ssd, ESSD PL1 and PL2 of 2,000 GiB and on the local disk.
#
#   device run, carry .whl-decode:  OUT=$OUT bash scripts/feed_search.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
[ "${INSTALL:-1}" = 1 ] && WHEELS=.whl-decode source scripts/device_setup.sh
cd /tmp
DATA=${DATA:-/tmp/gpufeed-feed}
for size in full 160; do
  extra=(); [ "$size" = 160 ] && extra=(--resize 160)
  [ -f "$DATA/$size/bench_dataset.json" ] || python3 -m gpufeed bench dataset "$DATA/$size" -n "${N:-20000}" \
    --formats tfrecord --workers "$(nproc)" "${extra[@]}"
  for task in train infer; do
    python3 -m gpufeed bench feed "$DATA/$size" --task "$task" --tier "local=$DATA/$size" --tier ultra@2000 \
      --tier ssd@2000 --tier essd-pl1@2000 --tier essd-pl2@2000 --max-gpus "${MAX_GPUS:-32}" \
      --steps "${STEPS:-10}" --results "$OUT/feed-h200.jsonl"
  done
done
