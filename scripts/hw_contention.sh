#!/usr/bin/env bash
# The hw decode path beside ResNet-50 inference on the GPU (issue 10): python -m gpufeed.bench.experiments.decode_contention
# on a small ImageNet-like dataset held in memory (no disk, no DataLoader). It tells whether the GPU side of the
# loader (engines, crop, the model's stream waiting for each batch) or its host side limits inference, which
# variants of the decoders change that, and whether the pipeline's pixels equal the same images decoded alone.
# THREADS_LIST: decoder-thread counts, the first with VARIANTS (default: all), the others with VARIANTS_REST
# (default: base).
#
#   device run, carry .whl-decode:  OUT=$OUT bash scripts/hw_contention.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
RESULTS=$OUT/${RESULTS_NAME:-decode-contention-h200.jsonl}
WHEELS=.whl-decode source scripts/device_setup.sh
DATA=${DATA:-/tmp/gpufeed-contention}
cd /tmp
quiet() { grep -v "nvjpeg2k\|nvtiff\|nvTIFF\|nvJPEG2000\|UserWarning"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc
[ -f "$DATA/bench_dataset.json" ] || python3 -m gpufeed bench dataset "$DATA" -n "${N:-4096}" \
  --workers "$(nproc)" --formats recordio
first=1
for threads in ${THREADS_LIST:-2 1 4}; do
  variants=${VARIANTS:-base,priority,barrier,switch,graph,pool}
  [ $first = 1 ] || variants=${VARIANTS_REST:-base}
  first=0
  echo "[$(date -u +%H:%M:%S)] decode contention: $threads decoder threads, variants $variants"
  timeout -k 10 "${STEP_S:-200}" python3 -m gpufeed.bench.experiments.decode_contention "$DATA" --threads "$threads" \
    --variants "$variants" --seconds "${WINDOW_S:-5}" --results "$RESULTS" 2>&1 | quiet || echo "rc $?"
done
