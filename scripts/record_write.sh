#!/usr/bin/env bash
# What a worker pays to write one record of a .rec split into its memory spool, by part, with 1 process and with
# every core writing at once (bench/experiments/record_write.py says what each part is).
#
#   device run (nvidia-h200-x4), carry .whl:  OUT=$OUT bash scripts/record_write.sh
#   PROCESSES=1,2 OUT=/tmp/o INSTALL=0 bash scripts/record_write.sh     # a small dry run here
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
[ "${INSTALL:-1}" = 1 ] && source scripts/device_setup.sh
cd /tmp  # the checkout's gpufeed/ would shadow the installed package
python3 -m gpufeed.bench.experiments.record_write --processes "${PROCESSES:-1,16,32,$(nproc)}" \
  --shards "${SHARDS:-8}" --image-ms "${IMAGE_MS:-4.0}" --results "$OUT/record-write.jsonl"
