#!/usr/bin/env bash
# Several real GPUs fed at once (issues 11, 29): `gpufeed bench train --gpus N` on a multi-GPU machine: N
# DistributedDataParallel ranks, NCCL gradients, each rank with its own loader (by default its share of the
# cores as DataLoader workers, `--decode auto` plus the paths named) reading its share of every format, cold
# cache, ResNet-50 training (and inference); then the same grid with fewer ranks on the same machine, so each
# rank's AU stands beside one GPU's alone. Every row says what each resource did (the disk's MB/s against its
# measured cold ceiling, the cores, the JPEG engines) and, below AU 0.90, which one limited it.
# Carries nvImageCodec, lmdb and crc32c (.whl-decode, made by scripts/device_wheels.sh); no Ray.
#
#   device run (kind nvidia-h200-x2), carry .whl-decode:  OUT=$OUT bash scripts/gpu_ranks.sh
#   RUNS="2:train" DECODES=auto,hw OUT=$OUT bash scripts/gpu_ranks.sh   # a subset (RUNS: GPUS:TASK ...)
#   WORKERS=16 ...                                                       # workers per rank (default: the loader's)
#   EMULATED=essd-pl1 ...      # also an emulated cloud tier on the same disk, one device shared by every rank
#   DATA=/tmp/r224 DATASET_ARGS="--size 224x224 --center-crop" ...   # a dataset stored another way (built once)
#   WARM=1 ...                 # the dataset read into the page cache first and never evicted (--no-cold): what
#                              # the loader feeds when the disk is out of the way
#   CPU_SHARE=0.8 ...          # hybrid: a fixed share of each batch decoded by the CPU workers
#   READ_AHEAD=on,off ...      # each worker starts every record of its batch reading at once, and not
#   WORKER_NICE=10 ...         # the DataLoader workers' added niceness (--worker-nice)
#   LOOP_CORES=1 ...           # physical cores each rank keeps from every worker for its own process (--loop-cores)
#   DEADLINE_AT=<epoch s> ...  # one deadline for several invocations (scripts/gpu_ranks_infer.sh)
#   TRACE=$OUT/trace ...       # each timed window's next steps as profiler traces (--trace; scripts/gpu_trace.sh)
#   GPU_SAMPLE=0 ...           # no nvidia-smi beside the timed windows (--no-gpu-sample)
#   RUN_AHEAD=0 ...            # steps each rank's loop may queue ahead of its GPU (--run-ahead)
#   REGION_DECODE=off ...      # the CPU workers decode whole JPEGs, not each crop's box (--region-decode)
#   IN_ORDER=off ...           # each batch handed out as soon as a worker has made it (--in-order)
#   GRAPH=1 ...                # inference: the model's step as one CUDA graph (--cuda-graph; the baseline too)
# A step that could not finish inside the call's DEADLINE_S (seconds from the start) is skipped and said so.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/device_out.sh gpu-ranks-KIND.jsonl
cd /tmp  # the checkout's gpufeed/ would shadow the installed package
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }
NOW=$(date +%s)
DEADLINE_AT=${DEADLINE_AT:-$(( NOW + ${DEADLINE_S:-570} ))}
stamp "machine: $(nproc) cores; NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}" \
  "TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST-unset}"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
nvidia-smi topo -m 2>/dev/null | head -4 || true
DATA=${DATA:-/tmp/gpufeed-ranks}
# Each rank reads N/2 records: enough for the warm-up (>= 2 s at ~4,600 img/s) and the timed steps, cold.
[ -f "$DATA/bench_dataset.json" ] || { stamp "building ${N:-48000} images ${DATASET_ARGS:-as captured}"; \
  python3 -m gpufeed bench dataset "$DATA" -n "${N:-48000}" --formats "${FORMATS:-tfrecord,recordio,lmdb}" \
    --workers "$(nproc)" ${DATASET_ARGS:-}; }
COLD=--cold
if [ "${WARM:-0}" = 1 ]; then
  stamp "reading $DATA into the page cache"
  python3 -c "import sys; from gpufeed.bench.cache import warm; print(warm(sys.argv[1], threads=64) >> 20, 'MiB read')" "$DATA"
  COLD=--no-cold
fi
for run in ${RUNS:-2:train 2:infer 1:train 1:infer}; do
  gpus=${run%%:*} task=${run#*:}
  # Timed steps: TRAIN_STEPS / INFER_STEPS (with WARMUP_STEPS, default 10) where given, else bench train's own
  # (10 warm-up and 50 timed, or as many as each rank's cold share of the dataset holds beyond the batches its
  # workers make ahead): a longer window leaves less to the batches made before it.
  steps=${TRAIN_STEPS:-}; [ "$task" = infer ] && steps=${INFER_STEPS:-}
  if [ -n "$steps" ] || [ -n "${WARMUP_STEPS:-}" ]; then
    steps_args=(--steps "${steps:-50}" --warmup-steps "${WARMUP_STEPS:-10}")
  else
    steps_args=()
  fi
  left=$(( DEADLINE_AT - $(date +%s) ))
  if [ "$left" -lt 60 ]; then stamp "skipped: --gpus $gpus $task ($left s left)"; continue; fi
  limit=$(( left < ${STEP_S:-240} ? left : ${STEP_S:-240} ))
  stamp "--gpus $gpus, $task, decode ${DECODES:-auto,hw,cpu} (at most $limit s)"
  timeout -k 10 "$limit" python3 -m gpufeed bench train "$DATA" --tier "local=$DATA" ${EMULATED:+--tier "$EMULATED"} --gpus "$gpus" --task "$task" "$COLD" \
    --decode "${DECODES:-auto,hw,cpu}" --formats "${FORMATS:-tfrecord,recordio,lmdb}" ${WORKERS:+--workers "$WORKERS"} \
    ${DECODE_THREADS:+--decode-threads "$DECODE_THREADS"} ${CPU_SHARE:+--cpu-share "$CPU_SHARE"} ${READ_AHEAD:+--read-ahead "$READ_AHEAD"} \
    ${WORKER_NICE:+--worker-nice "$WORKER_NICE"} ${LOOP_CORES:+--loop-cores "$LOOP_CORES"} ${RUN_AHEAD:+--run-ahead "$RUN_AHEAD"} ${REGION_DECODE:+--region-decode "$REGION_DECODE"} ${IN_ORDER:+--in-order "$IN_ORDER"} $([ "${GRAPH:-0}" = 1 ] && echo --cuda-graph) \
    ${TRACE:+--trace "$TRACE"} $([ "${GPU_SAMPLE:-1}" = 0 ] && echo --no-gpu-sample) "${steps_args[@]}" --repeats "${REPEATS:-1}" --accelerator cuda \
    --results "$RESULTS" 2>&1 | grep -v "UserWarning\|warnings.warn" || stamp "step ended with rc $?"
done
stamp "done: $(wc -l < "$RESULTS" 2>/dev/null || echo 0) rows in $RESULTS"
