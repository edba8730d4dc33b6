#!/usr/bin/env bash
# The loader's decode paths on the GPU machine (issue 10), in one call, without Ray:
#  1. an ImageNet-like benchmark dataset on the local disk (gpufeed bench dataset, every format; 40,000 images:
#     a cold inference run of 12 warm-up + 40 timed batches of 512 reads each record once);
#  2. decode rates side by side: one CPU core, nvJPEG on the SMs, the JPEG engines (python -m
#     gpufeed.bench.experiments.decode_rates), with the engines' pixels checked against the CPU's;
#  3. gpufeed bench train, cold cache, ResNet-50 training and inference fed by gpufeed.loader with
#     decode cpu, hw and hybrid, from every format;
#  (PROBE=1) before 3: scripts/loader_probe.py, the loader's ceilings without the model (warm cache): the
#     DataLoader alone, then hw decoding with 1-3 decoder threads, for eval and train augmentation;
#  4. (RECIPES=1) the inference recipes: the same images stored as a 224x224 centre crop (JPEG q95, then raw
#     uint8), inference fed from tfrecord and recordio with RECIPE_DECODES (raw: cpu only, it is not decoded).
# READ_AHEAD=on,off measures each loader configuration with and without the workers' batch read-ahead;
# GRAPH=1 runs the inference model as one CUDA graph (--cuda-graph); CPU_SHARE fixes hybrid's CPU share (--cpu-share);
# WORKER_NICE sets the DataLoader workers' niceness (--worker-nice);
# RATES=0 skips step 2; DATASET_FORMATS / RECIPE_FORMATS narrow the formats built and fed in 1 and 4.
# Every bench step runs under `timeout STEP_S` (default 240 s) so one stuck step cannot eat the call.
#
#   device run, carry .whl-decode (bash scripts/device_wheels.sh):  OUT=$OUT bash scripts/gpu_decode.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/device_out.sh gpu-decode-h200.jsonl
REPO=$PWD
cd /tmp
DATA=${DATA:-/tmp/gpufeed-decode}
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc
python3 -c "import torch, torchvision; from nvidia import nvimgcodec; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchvision', torchvision.__version__, 'nvimgcodec', nvimgcodec.__version__ if hasattr(nvimgcodec, '__version__') else '?')" 2>&1 | grep -v "nvjpeg2k\|nvtiff\|nvTIFF\|nvJPEG2000"

if [ ! -f "$DATA/bench_dataset.json" ]; then
  stamp "dataset: ${N:-40000} ImageNet-like JPEGs in every format"
  python3 -m gpufeed bench dataset "$DATA" -n "${N:-40000}" --workers "$(nproc)" \
    --formats "${DATASET_FORMATS:-tfrecord,recordio,lmdb}"
fi
du -sh "$DATA"

if [ "${RATES:-1}" = 1 ]; then
  stamp "decode rates: one CPU core, nvJPEG, the JPEG engines"
  python3 -m gpufeed.bench.experiments.decode_rates "$DATA" --results "$RESULTS" 2>&1 | grep -v "nvjpeg2k\|nvtiff\|nvTIFF\|nvJPEG2000"
fi

if [ "${PROBE:-0}" = 1 ]; then
  for aug in ${PROBE_AUGMENTS:-eval train}; do
    stamp "loader probe: tfrecord as captured, $aug"
    timeout -k 10 150 python3 "$REPO/scripts/loader_probe.py" "$DATA" --format tfrecord --augment "$aug" --threads "${PROBE_THREADS:-1,2,3}" \
      --results "$RESULTS" 2>&1 | grep -v "nvjpeg2k\|nvtiff\|nvTIFF\|nvJPEG2000\|UserWarning\|return collate" \
      || stamp "probe ended with rc $?"
  done
fi

stamp "bench train: cold, decode ${DECODES:-cpu,hw,hybrid}, formats ${FORMATS:-tfrecord,recordio,lmdb}"
train() {  # DATASET FORMATS TASKS DECODES [WORKERS]
  timeout -k 10 "${STEP_S:-240}" python3 -m gpufeed bench train "$1" --tier "local=$1" --formats "$2" --task "$3" \
    --decode "$4" --read-ahead "${READ_AHEAD:-off}" $([ "${GRAPH:-0}" = 1 ] && echo --cuda-graph) ${CPU_SHARE:+--cpu-share "$CPU_SHARE"} ${WORKER_NICE:+--worker-nice "$WORKER_NICE"} --decode-threads "${DECODE_THREADS:-2}" --accelerator cuda --repeats 1 --steps "${STEPS:-40}" --warmup-steps "${WARMUP_STEPS:-12}" \
    ${5:+--workers "$5"} --results "$RESULTS" 2>&1 | grep -v "nvjpeg2k\|nvtiff\|nvTIFF\|nvJPEG2000\|UserWarning\|return collate" \
    || stamp "step ended with rc $?"
}
# WORKERS_LIST="12 14 16": the same runs with each DataLoader worker count (default: one per core, at most 16).
for workers in ${WORKERS_LIST:-""}; do
  [ -n "${DECODES-x}" ] && train "$DATA" "${FORMATS:-tfrecord,recordio,lmdb}" "${TASKS:-train,infer}" "${DECODES:-cpu,hw,hybrid}" "$workers"
done

if [ "${RECIPES:-0}" = 1 ]; then
  for encode in ${RECIPE_ENCODES:-jpeg raw}; do
    dir=$DATA-crop224-$encode
    stamp "recipe: --size 224x224 --center-crop --encode $encode"
    [ -f "$dir/bench_dataset.json" ] || python3 -m gpufeed bench dataset "$dir" -n "${N:-40000}" \
      --formats "${RECIPE_FORMATS:-tfrecord,recordio}" --size 224x224 --center-crop --encode "$encode" --workers "$(nproc)"
    du -sh "$dir"
    [ "${PROBE:-0}" = 1 ] && [ "$encode" = jpeg ] && { timeout -k 10 120 python3 "$REPO/scripts/loader_probe.py" \
      "$dir" --format tfrecord --augment eval --threads 1,2 --results "$RESULTS" 2>&1 \
      | grep -v "nvjpeg2k\|nvtiff\|nvTIFF\|nvJPEG2000\|UserWarning\|return collate" || stamp "probe ended"; }
    decodes=${RECIPE_DECODES:-cpu,hw,hybrid}
    [ "$encode" = raw ] && decodes=cpu
    train "$dir" "${RECIPE_FORMATS:-tfrecord,recordio}" infer "$decodes"
    rm -rf "$dir"
  done
fi
stamp "done"
