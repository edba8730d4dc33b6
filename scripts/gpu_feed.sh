#!/usr/bin/env bash
# The loader in the benchmark's process (threads) against the loader in a child process (process=True), side
# by side on one GPU machine, cold local disk, recordio as captured (issue 10), in three passes of
# scripts/gpu_decode.sh over one dataset:
#  A. ResNet-50 inference, eager model: hw decoding, thread vs process;
#  B. the same with the model as one CUDA graph (the loop's thread launches one graph per batch), hw and
#     hybrid, thread vs process;
#  C. training (eager), hw decoding, thread vs process.
# PASSES picks some of them (default "A B C").
#
#   device run, carry .whl-decode:  OUT=$OUT bash scripts/gpu_feed.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out} N=${N:-24000} STEPS=${STEPS:-30} WARMUP_STEPS=${WARMUP_STEPS:-8} RATES=${RATES:-0}
export DATASET_FORMATS=${DATASET_FORMATS:-recordio} FORMATS=${FORMATS:-recordio} FEEDS=${FEEDS:-thread,process}
export RESULTS_NAME=${RESULTS_NAME:-gpu-feed-h200.jsonl}
WHEELS=.whl-decode source scripts/device_setup.sh  # exports PYTHONPATH for the passes
export INSTALL=0
for pass in ${PASSES:-A B C}; do
  case $pass in
    A) TASKS=infer DECODES=hw GRAPH=0 bash scripts/gpu_decode.sh ;;
    B) TASKS=infer DECODES=${GRAPH_DECODES:-hw,hybrid} GRAPH=1 bash scripts/gpu_decode.sh ;;
    C) TASKS=train DECODES=hw GRAPH=0 bash scripts/gpu_decode.sh ;;
  esac
done
