#!/usr/bin/env bash
# The loader's decode paths on the GPU machine (issue 10), in one call, without Ray:
#  1. an ImageNet-like benchmark dataset on the local disk (gpufeed bench dataset, every format);
#  2. decode rates side by side: one CPU core, nvJPEG on the SMs, the JPEG engines (python -m
#     gpufeed.bench.decode_rates), with the engines' pixels checked against the CPU's;
#  3. gpufeed bench train, cold cache, ResNet-50 training and inference fed by gpufeed.loader with
#     decode cpu, hw and hybrid, from every format.
#
#   device run, carry .whl-decode (bash scripts/device_wheels.sh):  OUT=$OUT bash scripts/gpu_decode.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
RESULTS=$OUT/${RESULTS_NAME:-gpu-decode-h200.jsonl}
[ "${INSTALL:-1}" = 1 ] && WHEELS=.whl-decode source scripts/device_setup.sh
cd /tmp
DATA=${DATA:-/tmp/gpufeed-decode}
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc
python3 -c "import torch, torchvision; from nvidia import nvimgcodec; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchvision', torchvision.__version__, 'nvimgcodec', nvimgcodec.__version__ if hasattr(nvimgcodec, '__version__') else '?')" 2>&1 | grep -v "nvjpeg2k\|nvtiff\|nvTIFF\|nvJPEG2000"

if [ ! -f "$DATA/bench_dataset.json" ]; then
  stamp "dataset: ${N:-20000} ImageNet-like JPEGs in every format"
  python3 -m gpufeed bench dataset "$DATA" -n "${N:-20000}" --workers "$(nproc)"
fi
du -sh "$DATA"

stamp "decode rates: one CPU core, nvJPEG, the JPEG engines"
python3 -m gpufeed.bench.decode_rates "$DATA" --results "$RESULTS" 2>&1 | grep -v "nvjpeg2k\|nvtiff\|nvTIFF\|nvJPEG2000"

stamp "bench train: cold, decode ${DECODES:-cpu,hw,hybrid}, formats ${FORMATS:-tfrecord,recordio,lmdb}"
python3 -m gpufeed bench train "$DATA" --tier "local=$DATA" --formats "${FORMATS:-tfrecord,recordio,lmdb}" \
  --task "${TASKS:-train,infer}" --decode "${DECODES:-cpu,hw,hybrid}" --accelerator cuda --repeats 1 \
  --steps "${STEPS:-40}" --warmup-steps "${WARMUP_STEPS:-12}" --results "$RESULTS" 2>&1 \
  | grep -v "nvjpeg2k\|nvtiff\|nvTIFF\|nvJPEG2000"
stamp "done"
