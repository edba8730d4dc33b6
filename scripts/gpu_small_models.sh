#!/usr/bin/env bash
# The mission's other two datasets, trained on the GPU machine (issue 11), no Ray, no nvImageCodec:
# - CIFAR-10 into a CIFAR ResNet-18: from every format, with 2 and 16 DataLoader workers, CIFAR's augmentation
#   (pad 4, random crop, flip) in the workers vs on the GPU;
# - Penn Treebank windows (35 tokens + 1) into a 2-layer 650-unit LSTM language model: from every format, with
#   1, 2 and 16 workers, training and inference, with the CPU cores and worker memory each run used.
# Carry only lmdb and crc32c (.whl-small: the two wheels of .whl, made by scripts/device_wheels.sh).
#
#   device run, carry .whl-small:  OUT=$OUT bash scripts/gpu_small_models.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
RESULTS=$OUT/${RESULTS_NAME:-gpu-small-models-h200.jsonl}
[ "${INSTALL:-1}" = 1 ] && WHEELS=${WHEELS:-.whl-small} source scripts/device_setup.sh
cd /tmp
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }
train() {  # DATA MODEL WORKERS FORMATS TASKS AUGMENT_ON STEPS REPEATS
  stamp "$2, $3 workers, $5, augmentation on $6"
  timeout -k 5 "${STEP_S:-90}" python3 -m gpufeed bench train "$1" --tier "local=$1" --model "$2" --task "$5" \
    --formats "$4" --workers "$3" --accelerator cuda --repeats "$8" --steps "$7" \
    --warmup-steps "${WARMUP_STEPS:-10}" --results "$RESULTS" ${6:+--augment-on "$6"} ${BATCH:+--batch-size "$BATCH"} \
    2>&1 | grep -v "UserWarning\|return collate" || stamp "step ended with rc $?"
}
FORMATS=${FORMATS:-tfrecord,recordio,lmdb}
if [ "${CIFAR:-1}" = 1 ]; then
  CIFAR_DATA=/tmp/gpufeed-cifar
  [ -f "$CIFAR_DATA/bench_dataset.json" ] || python3 -m gpufeed bench dataset "$CIFAR_DATA" --image cifar \
    -n "${CIFAR_N:-50000}" --workers "$(nproc)"
  for w in ${CIFAR_WORKERS:-2 16}; do
    BATCH=${CIFAR_BATCH:-512} train "$CIFAR_DATA" cifar-resnet18 "$w" "$FORMATS" train "${AUGMENT_ON:-cpu,gpu}" \
      "${STEPS:-40}" "${CIFAR_REPEATS:-1}"
  done
fi
if [ "${PTB:-1}" = 1 ]; then
  PTB_DATA=/tmp/gpufeed-ptb  # 26,000 windows: Penn Treebank's 929k training tokens
  [ -f "$PTB_DATA/bench_dataset.json" ] || python3 -m gpufeed bench dataset "$PTB_DATA" --image ptb \
    -n "${PTB_N:-26000}" --workers "$(nproc)"
  for w in ${PTB_WORKERS:-1 2 16}; do
    train "$PTB_DATA" ptb-lstm "$w" "$FORMATS" train,infer "" "${PTB_STEPS:-300}" 2
  done
fi
stamp done
