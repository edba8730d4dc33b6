#!/usr/bin/env bash
# The GPU run of `gpufeed bench train` (issue 5): what runs on the H200 machine, without Ray.
#
#   OUT=/path/for/results bash scripts/gpu_bench.sh          # the full run (~6 min on one H200, 16 cores)
#   SMOKE=1 OUT=... bash scripts/gpu_bench.sh                # versions, install, a tiny run of every path
#   STAGES="local tiers" bash scripts/gpu_bench.sh           # a subset of: build local tiers resize read warm
#
# Builds an ImageNet-like JPEG dataset on the local disk (gpufeed bench dataset: multiprocessing, every
# format), then measures ResNet-50 training (batch 256) and inference (batch 512) fed from each format, with
# CPU decoding in 16 DataLoader workers and with GPU decoding (nvJPEG), against the synthetic-data baseline;
# then two emulated cloud disks (ultra, ssd) under the same loop, images stored at --resize 160, and the read
# benchmark's decode rate per worker (how many cores a GPU's demand needs). Every
# stage appends to $OUT/$RESULTS_NAME as it goes, so a run cut short keeps what it measured.
# Packages the machine lacks (lmdb, crc32c, tfrecord) travel as wheels in .whl/ (see docs/reports.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
DATA=$(realpath -m "${DATA:-/tmp/gpufeed-data}")
RESULTS=$(realpath -m "$OUT")/${RESULTS_NAME:-gpu-h200.jsonl}
STAGES=${STAGES:-build local tiers resize read}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$DATA"

if [ "${SMOKE:-0}" = 1 ]; then
  # A cold run reads each record once: 6,000 records hold inference's 2 + 2 steps of 512 and the 4 batches 2
  # workers read ahead (1,200 records and 16 workers were refused, before anything was measured).
  N=6000; N160=1200; TRAIN_STEPS=3; INFER_STEPS=2; WARM=2; REPEATS=1; TIER_REPEATS=1; READ_SAMPLES=200
  WORKERS=${WORKERS:-2}
else
  # 16 workers hand over their first batches in a burst: a warm-up of one step per worker and a timed window
  # of three bursts keep that start-up out of the figures. One run then stays within one epoch of N images.
  N=${N:-25000}; N160=${N160:-25000}; TRAIN_STEPS=${TRAIN_STEPS:-48}; INFER_STEPS=${INFER_STEPS:-32}
  WARM=${WARM:-16}; REPEATS=${REPEATS:-2}; TIER_REPEATS=${TIER_REPEATS:-1}; READ_SAMPLES=${READ_SAMPLES:-4000}
fi
WORKERS=${WORKERS:-16}
DECODES=${DECODES:-cpu,gpu}   # a dry run without a GPU sets DECODES=cpu
EXTRA=(${EXTRA:-})            # e.g. EXTRA="--batch-size 32" for a dry run on a small machine

stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

PY=${PY:-python3}
if [ "${INSTALL:-1}" = 1 ]; then
  stamp "installing the carried wheels and gpufeed into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
  if ! "$PY" -c "import google.protobuf.internal.builder" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/extra/protobuf-*.whl
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
    --target /tmp/site . >/dev/null
fi
# From here on, run outside the checkout: its gpufeed/ directory would shadow the installed package.
cd /tmp
GPUFEED=("$PY" -m gpufeed)

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
nproc; free -g | head -2; df -h "$DATA" | tail -1
"$PY" - <<'EOF'
import cv2, google.protobuf, lmdb, numpy, torch
import gpufeed.formats.proto.caffe_pb2  # noqa: F401  (its generated code must suit this protobuf)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "numpy", numpy.__version__, "cv2", cv2.__version__, "lmdb", lmdb.__version__,
      "protobuf", google.protobuf.__version__)
if torch.cuda.is_available():
    import torchvision
    print("torchvision", torchvision.__version__, "gpu", torch.cuda.get_device_name(0))
else:
    print("no CUDA GPU: the accelerator is emulated (a dry run)")
EOF

TRAIN=("${GPUFEED[@]}" bench train --results "$RESULTS" --warmup 0 --warmup-steps "$WARM" --workers "$WORKERS"
       "${EXTRA[@]}")

# run_grid DATASET REPEATS DECODES [extra args]: training and inference (their step counts differ), one
# `gpufeed bench train` call per task and decoding, so a failing configuration loses only its own rows.
run_grid() {
  local ds=$1 repeats=$2 decodes=$3; shift 3
  local decode
  for decode in ${decodes//,/ }; do
    "${TRAIN[@]}" "$ds" --task train --steps "$TRAIN_STEPS" --repeats "$repeats" --decode "$decode" "$@" \
      || stamp "FAILED: train, $decode decoding, $ds $*"
    "${TRAIN[@]}" "$ds" --task infer --steps "$INFER_STEPS" --repeats "$repeats" --decode "$decode" "$@" \
      || stamp "FAILED: infer, $decode decoding, $ds $*"
  done
}

for stage in $STAGES; do
  case $stage in
    build)
      stamp "building $N images (as captured) and $N160 stored at --resize 160 (kept if already there)"
      [ -f "$DATA/full/bench_dataset.json" ] || "${GPUFEED[@]}" bench dataset "$DATA/full" -n "$N" --workers "$WORKERS"
      [ -f "$DATA/r160/bench_dataset.json" ] \
        || "${GPUFEED[@]}" bench dataset "$DATA/r160" -n "$N160" --resize 160 --workers "$WORKERS"
      ;;
    local)
      stamp "local disk: every format, CPU and GPU decoding, training and inference"
      run_grid "$DATA/full" "$REPEATS" "${LOCAL_DECODES:-$DECODES}" --tier "local=$DATA/full"
      ;;
    tiers)
      stamp "emulated cloud disks (ultra, ssd) on the local disk: ${TIER_FORMATS:-tfrecord}, CPU decoding"
      run_grid "$DATA/full" "$TIER_REPEATS" cpu --tier ultra --tier ssd --formats "${TIER_FORMATS:-tfrecord}"
      ;;
    resize)
      stamp "images stored at --resize 160: tfrecord, CPU and GPU decoding"
      run_grid "$DATA/r160" "$TIER_REPEATS" "$DECODES" --tier "local=$DATA/r160" --formats tfrecord
      ;;
    warm)
      stamp "page-cached lmdb and recordio (cold vs warm: is it the disk or the format?)"
      cat "$DATA"/full/lmdb/train_lmdb/data.mdb "$DATA"/full/recordio/train.rec > /dev/null
      run_grid "$DATA/full" "$REPEATS" cpu --tier "local=$DATA/full" --formats lmdb,recordio --no-cold
      ;;
    read)
      stamp "read benchmark: decode + RandomResizedCrop + flip per worker, warm cache (CPU cores per img/s)"
      "${GPUFEED[@]}" bench read "$DATA/full" --grid full --results "$RESULTS" --tier "local=$DATA/full" --formats tfrecord \
        --modes decode --cache warm --workers "1,$WORKERS" --samples "$READ_SAMPLES" --repeats 2 --warmup 0 \
        || stamp "FAILED: read benchmark"
      ;;
    *) echo "unknown stage $stage (choose from: build local tiers resize read warm)" >&2; exit 2 ;;
  esac
done
stamp "done: $(wc -l < "$RESULTS") rows in $RESULTS"
