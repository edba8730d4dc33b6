#!/usr/bin/env bash
# Feeding the GPU from cold storage with and without the loader's batch read-ahead, and issue 10's bars, in one
# call on the GPU machine (ResNet-50, cold local disk, 16 DataLoader workers), in passes of scripts/gpu_decode.sh
# over one ImageNet-like dataset (N records, every format):
#  infer     inference as captured, recordio: hw and hybrid, read-ahead on and off, side by side;
#  train     training as captured from every format: cpu and hw decoding, read-ahead on;
#  recipe    the inference recipe (224x224 centre crops, JPEG): cpu and hw, tfrecord and recordio;
#  infer2    inference as captured, tfrecord and lmdb, hybrid;
#  train-off training from lmdb with hw decoding and read-ahead off (against the train pass's on);
#  hybrid    hybrid against hw, inference (recordio, tfrecord) and training (recordio), the loader's defaults;
#  share     hybrid from SHARE_FORMATS (default recordio) with the split from measured rates against fixed CPU shares (SHARES), inference
#            and training (the engines' work serialises with the inference model's: bench.decode_contention).
#  nice      training from NICE_FORMATS (default every format) with the DataLoader workers at each niceness of
#            NICES (default "0 10"), decode cpu and hybrid at a fixed CPU share of NICE_SHARE (default 0.8), the
#            niceness alternating first from format to format: does the training loop's process lose its cores
#            to the workers (the step's time rose from the model's ~55 ms to 58-70 ms with the loop barely
#            waiting for data)?
# PASSES picks some of them, in order (default: the first five, as run on 2026-11-25).
#
#   device run, carry .whl-decode:  OUT=$OUT bash scripts/gpu_feed.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out} N=${N:-24000} STEPS=${STEPS:-30} WARMUP_STEPS=${WARMUP_STEPS:-8} RATES=${RATES:-0}
export RESULTS_NAME=${RESULTS_NAME:-gpu-feed-h200.jsonl}
WHEELS=.whl-decode source scripts/device_setup.sh  # exports PYTHONPATH for the passes
export INSTALL=0
for pass in ${PASSES:-infer train recipe infer2 train-off}; do
  case $pass in
    infer) TASKS=infer DECODES=hw,hybrid FORMATS=recordio READ_AHEAD=on,off bash scripts/gpu_decode.sh ;;
    train) TASKS=train DECODES=cpu,hw FORMATS=recordio,tfrecord,lmdb READ_AHEAD=on bash scripts/gpu_decode.sh ;;
    recipe) DECODES= RECIPES=1 RECIPE_ENCODES=jpeg RECIPE_DECODES=cpu,hw READ_AHEAD=on bash scripts/gpu_decode.sh ;;
    infer2) TASKS=infer DECODES=hybrid FORMATS=tfrecord,lmdb READ_AHEAD=on bash scripts/gpu_decode.sh ;;
    train-off) TASKS=train DECODES=hw FORMATS=lmdb READ_AHEAD=off bash scripts/gpu_decode.sh ;;
    hybrid) TASKS=infer DECODES=hw,hybrid FORMATS=recordio,tfrecord bash scripts/gpu_decode.sh
            TASKS=train DECODES=hw,hybrid FORMATS=recordio bash scripts/gpu_decode.sh ;;
    share) for task in ${SHARE_TASKS:-infer train}; do
             for share in ${SHARES:-auto 0.6 0.7 0.8}; do
               CPU_SHARE=$([ "$share" = auto ] || echo "$share") TASKS=$task DECODES=hybrid FORMATS=${SHARE_FORMATS:-recordio} \
                 bash scripts/gpu_decode.sh
             done
           done ;;
    nice) k=0
          for fmt in $(echo "${NICE_FORMATS:-recordio,tfrecord,lmdb}" | tr , ' '); do
            nices=${NICES:-0 10}
            [ $((k % 2)) = 1 ] && nices=$(echo "$nices" | tr ' ' '\n' | tac | tr '\n' ' ')
            for nice in $nices; do
              WORKER_NICE=$nice CPU_SHARE=${NICE_SHARE:-0.8} TASKS=train DECODES=${NICE_DECODES:-cpu,hybrid} \
                FORMATS=$fmt bash scripts/gpu_decode.sh
            done
            k=$((k + 1))
          done ;;
  esac
done
