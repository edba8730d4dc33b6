#!/usr/bin/env bash
# Issue 29 item 4 in one call on the 4-GPU machine: ResNet-50 inference on 4 ranks against 1 GPU on the same
# host, cold local disk, recordio, in passes of scripts/gpu_ranks.sh over datasets stored three ways:
#   captured   as captured (118 KB photos): decode auto (the loader's choice) and hw;
#   r224       `--size 224x224 --center-crop` (the 1-GPU inference recipe, ~31 KB JPEGs): decode cpu;
#   r160       `--resize 160` (~18 KB JPEGs, the eval crop upscaled to 224): decode cpu, 4 ranks;
#   q75        `--size 224x224 --center-crop --quality 75` (~11 KB JPEGs, a third of r224's bytes): decode cpu and
#              hybrid (paced by default on 4 ranks: the engines work in each step's gap), 4 ranks and 1;
#   q75x       the q75 dataset, 4 ranks and 1, the model as one CUDA graph (its launches no longer wait for a core
#              the workers hold): cpu and hybrid cold, cpu with the workers niced (WORKER_NICE=10), then both warm
#              (the disk out of the way); INFER_STEPS 60;
#   r160q75    `--resize 160 --quality 75` (~5.9 KB JPEGs: 4 ranks at AU 0.9 need ~0.34 GB/s where q75's 11.4 KB need
#              0.65, beyond the 0.61-0.64 GB/s these disks read cold), 384,000 records (N_R160Q75) so each rank's
#              timed window lasts ~3 s (INFER_STEPS 100; at 30 steps one 0.3 s stall moved a rank's AU by 0.3):
#              decode cpu, 4 ranks twice and 1 rank;
#   warm       training on 4 ranks with the captured dataset in the page cache (WARM=1): what the loader feeds
#              when the disk is out of the way, decode auto, hw and cpu;
#   share      the same, hybrid at fixed CPU shares (SHARES, default "0.7 0.8") (not in the default passes);
#   confirm    training with the loader's default split: 4 ranks warm (auto), then 2 and 4 ranks cold (auto, cpu,
#              hw) (not in the default passes).
# PASSES picks some, in order (default: captured r224 warm r160). One deadline for the whole call (DEADLINE_S, default 570).
#
#   device run (kind nvidia-h200-x4), carry .whl-decode:  OUT=$OUT bash scripts/gpu_ranks_infer.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# 192,000 records: 48,000 per rank of 4, 93 inference batches of 512, 30 of them held ahead by 15 workers.
export OUT=${OUT:-$PWD/out} N=${N:-192000} FORMATS=${FORMATS:-recordio} INFER_STEPS=${INFER_STEPS:-30}
export DEADLINE_AT=$(( $(date +%s) + ${DEADLINE_S:-570} ))
WHEELS=.whl-decode source scripts/device_setup.sh
export INSTALL=0
for pass in ${PASSES:-captured r224 warm r160}; do
  case $pass in
    captured) DATA=/tmp/gpufeed-ranks RUNS="4:infer 1:infer" DECODES=auto,hw bash scripts/gpu_ranks.sh ;;
    r224) DATA=/tmp/gpufeed-ranks-224 DATASET_ARGS="--size 224x224 --center-crop" RUNS="4:infer 1:infer" DECODES=cpu \
            bash scripts/gpu_ranks.sh ;;
    q75) DATA=/tmp/gpufeed-ranks-224q75 DATASET_ARGS="--size 224x224 --center-crop --quality 75" RUNS="4:infer 1:infer" \
           DECODES=${Q75_DECODES:-cpu,hybrid} bash scripts/gpu_ranks.sh ;;
    q75x) q75=(DATA=/tmp/gpufeed-ranks-224q75 DATASET_ARGS="--size 224x224 --center-crop --quality 75" GRAPH=1
               INFER_STEPS=${Q75X_STEPS:-60})
          env "${q75[@]}" RUNS="4:infer" DECODES=cpu,hybrid bash scripts/gpu_ranks.sh
          env "${q75[@]}" RUNS="4:infer" DECODES=cpu WORKER_NICE=10 bash scripts/gpu_ranks.sh
          env "${q75[@]}" RUNS="1:infer" DECODES=cpu,hybrid bash scripts/gpu_ranks.sh
          env "${q75[@]}" RUNS="4:infer" DECODES=cpu,hybrid WARM=1 bash scripts/gpu_ranks.sh ;;
    r160q75) r160q75=(DATA=/tmp/gpufeed-ranks-160q75 DATASET_ARGS="--resize 160 --quality 75" N=${N_R160Q75:-384000}
                      INFER_STEPS=${R160Q75_STEPS:-100} DECODES=${R160Q75_DECODES:-cpu})
             env "${r160q75[@]}" RUNS="4:infer 1:infer 4:infer" bash scripts/gpu_ranks.sh ;;
    r160) DATA=/tmp/gpufeed-ranks-160 DATASET_ARGS="--resize 160" RUNS="4:infer" DECODES=cpu \
            bash scripts/gpu_ranks.sh ;;
    warm) DATA=/tmp/gpufeed-ranks WARM=1 RUNS="4:train" DECODES=${WARM_DECODES:-auto,hw,cpu} bash scripts/gpu_ranks.sh ;;
    confirm) # the loader's default hybrid share, warm and cold, against cpu and hw in the same call
             DATA=/tmp/gpufeed-ranks WARM=1 RUNS="4:train" DECODES=auto bash scripts/gpu_ranks.sh
             DATA=/tmp/gpufeed-ranks RUNS="2:train 4:train" DECODES=auto,cpu,hw bash scripts/gpu_ranks.sh ;;
    share) for share in ${SHARES:-0.7 0.8}; do
             DATA=/tmp/gpufeed-ranks WARM=1 RUNS="4:train" DECODES=hybrid CPU_SHARE=$share bash scripts/gpu_ranks.sh
           done ;;
  esac
done
