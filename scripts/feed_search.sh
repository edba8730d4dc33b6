#!/usr/bin/env bash
# How many emulated H200s each disk keeps at >= 90% AU (gpufeed bench feed), on the 16-core GPU machine
# where the CPUs are not the limit: tfrecord as captured and at --resize 160, training and inference,
# on emulated ultra, ssd and ESSD PL1 of 2,000 GiB, ESSD PL2 of 1,000 GiB (this machine's disk does not
# outrun PL2's 100,000 IOPS at 2,000 GiB, so it cannot emulate it) and on the local disk. Every N reads cold;
# on the local disk N stops where the ranks would re-read records: 60,000 records give 18 training ranks
# (13 batches of 256 each) and 9 inference ranks (13 of 512).
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
  [ -f "$DATA/$size/bench_dataset.json" ] || python3 -m gpufeed bench dataset "$DATA/$size" -n "${N:-60000}" \
    --formats tfrecord --workers "$(nproc)" "${extra[@]}"
  for task in ${TASKS:-train infer}; do
    python3 -m gpufeed bench feed "$DATA/$size" --task "$task" --tier "local=$DATA/$size" --tier ultra@2000 \
      --tier ssd@2000 --tier essd-pl1@2000 --tier essd-pl2@1000 --max-gpus "${MAX_GPUS:-32}" \
      --steps "${STEPS:-20}" --results "$OUT/feed-h200.jsonl" || echo "bench feed ended with rc $?"
  done
done
