#!/usr/bin/env bash
# CIFAR-10 into a CIFAR ResNet-18 on the GPU machine (issue 11): from every format, with 2 and 16 DataLoader
# workers, CIFAR's augmentation (pad 4, random crop, flip) in the workers vs on the GPU. No Ray, no nvImageCodec:
# carry only lmdb and crc32c (.whl-small: the two wheels of .whl, made by scripts/device_wheels.sh).
#
#   device run, carry .whl-small:  OUT=$OUT bash scripts/gpu_cifar.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
RESULTS=$OUT/${RESULTS_NAME:-gpu-cifar-h200.jsonl}
[ "${INSTALL:-1}" = 1 ] && WHEELS=.whl-small source scripts/device_setup.sh
cd /tmp
DATA=${DATA:-/tmp/gpufeed-cifar}
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }
[ -f "$DATA/bench_dataset.json" ] || python3 -m gpufeed bench dataset "$DATA" --image cifar -n "${N:-50000}" \
  --workers "$(nproc)"
train() {  # WORKERS FORMATS AUGMENT_ON
  stamp "cifar-resnet18, $1 workers, augmentation on $3"
  timeout -k 5 "${STEP_S:-60}" python3 -m gpufeed bench train "$DATA" --tier "local=$DATA" --model cifar-resnet18 \
    --task train --formats "$2" --augment-on "$3" --workers "$1" --batch-size "${BATCH:-512}" --accelerator cuda \
    --repeats 1 --steps "${STEPS:-40}" --warmup-steps "${WARMUP_STEPS:-10}" --results "$RESULTS" 2>&1 \
    | grep -v "UserWarning\|return collate" || stamp "step ended with rc $?"
}
train 2 "${FORMATS:-tfrecord,recordio,lmdb}" cpu,gpu
[ "${WIDE:-1}" = 1 ] && train 16 tfrecord cpu,gpu
stamp done
