#!/usr/bin/env bash
# Proves that the real consumers read gpufeed's files unchanged: MXNet 1.9.1, TensorFlow, Caffe's Datum/BlobProto
# (protobuf module generated from the full upstream caffe.proto) and NVIDIA DALI (CPU pipelines). Each consumer
# lives in its own virtualenv under $CACHE, outside the repository (mxnet 1.9.1 needs numpy < 1.24, which the
# project cannot use). See docs/interop.md.
#
#   scripts/interop.sh [DATA_DIR]        (default: a fresh temporary directory, removed at the end)
#   INTEROP_CACHE=dir       where the consumer venvs and the generated caffe_pb2 live (~/.cache/gpufeed-interop)
#   CAFFE_PROTO=file        upstream caffe.proto to use instead of downloading it from GitHub
#   INTEROP_ONLY="mxnet tensorflow caffe dali"   run only these checks
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-$REPO/.venv/bin/python}
GPUFEED=${GPUFEED:-$REPO/.venv/bin/gpufeed}
CACHE=${INTEROP_CACHE:-$HOME/.cache/gpufeed-interop}
ONLY=${INTEROP_ONLY:-mxnet tensorflow caffe dali}
BASE_PYTHON=${BASE_PYTHON:-python3.11}
# BVLC/caffe master (last commit 9b89154): the file the generated module must come from, byte for byte.
CAFFE_PROTO_URL=https://raw.githubusercontent.com/BVLC/caffe/9b891540183ddc834a02b2bd81b31afae71b2153/src/caffe/proto/caffe.proto
CAFFE_PROTO_SHA256=ce91ef2dea9acc73d6bee6cd960604e47d2a3472339269b8709f0d2a2a0eda43

if [ $# -ge 1 ]; then
  DATA=$1
  mkdir -p "$DATA"
else
  DATA=$(mktemp -d "${TMPDIR:-/tmp}/gpufeed-interop.XXXXXX")
  trap 'rm -rf "$DATA"' EXIT
fi
mkdir -p "$CACHE"
# Without it, ray.init() inside `gpufeed convert` joins any cluster a `ray start` left recorded in
# /tmp/ray/ray_current_cluster (and then refuses num_cpus); "local" always starts a private one.
export RAY_ADDRESS=local

# venv NAME PACKAGES...: creates $CACHE/NAME with exactly these pins unless it already holds them.
venv() {
  local name=$1; shift
  local stamp="$CACHE/$name/.gpufeed-pins"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$*" ]; then
    echo "== building $CACHE/$name: $*"
    rm -rf "${CACHE:?}/$name"
    "$BASE_PYTHON" -m venv "$CACHE/$name"
    "$CACHE/$name/bin/python" -m pip install -q "$@"
    echo "$*" > "$stamp"
  fi
}

wants() { [[ " $ONLY " == *" $1 "* ]]; }

wants mxnet && venv mxnet "mxnet==1.9.1" "numpy<1.24" "opencv-python-headless<4.9"
wants tensorflow && venv tf "tensorflow-cpu==2.21.0"
wants dali && venv dali "nvidia-dali-cuda120==2.4.0" "numpy"
if wants caffe; then
  venv caffe "grpcio-tools==1.85.1" "protobuf" "lmdb" "numpy" "opencv-python-headless"
  PB2=$CACHE/caffe_pb2
  if [ ! -f "$PB2/caffe_pb2.py" ]; then
    mkdir -p "$PB2"
    if [ -n "${CAFFE_PROTO:-}" ]; then cp "$CAFFE_PROTO" "$PB2/caffe.proto"
    else curl -fsSL "$CAFFE_PROTO_URL" -o "$PB2/caffe.proto"; fi
    echo "$CAFFE_PROTO_SHA256  $PB2/caffe.proto" | sha256sum -c --quiet - \
      || { echo "caffe.proto is not upstream BVLC/caffe's (sha256 differs)"; rm -rf "$PB2"; exit 1; }
    (cd "$PB2" && "$CACHE/caffe/bin/python" -m grpc_tools.protoc -I. --python_out=. caffe.proto)
  fi
fi

# The data: a small synthetic ImageNet converted three times (re-encoded JPEGs in 2 shards; raw 32x32 pixels with
# the mean image; the original bytes, where the CMYK / grayscale / PNG-named-JPEG files become RGB JPEGs), CIFAR-10
# and CIFAR-100 with their defaults, then the edge cases written with the format writers, and expected.json over all.
if [ ! -f "$DATA/expected.json" ]; then
  echo "== data in $DATA"
  rm -rf "$DATA/src" "$DATA/jpeg" "$DATA/raw" "$DATA/pass" "$DATA/edge" "$DATA"/src-cifar* "$DATA"/cifar*
  "$GPUFEED" synth imagenet "$DATA/src" --classes 4 --per-class 6 --val-per-class 2
  "$GPUFEED" convert imagenet "$DATA/src" --to lmdb,recordio,tfrecord,webdataset --out "$DATA/jpeg" --resize 256 --shards 2 \
    --workers 1 --on-error skip --no-progress
  "$GPUFEED" convert imagenet "$DATA/src" --to lmdb,recordio,tfrecord,webdataset --out "$DATA/raw" --size 32x32 \
    --encode raw --normalize --split train --workers 1 --on-error skip --no-progress
  "$GPUFEED" convert imagenet "$DATA/src" --to lmdb,recordio,tfrecord,webdataset --out "$DATA/pass" --encode pass \
    --split train --workers 1 --on-error skip --no-progress
  # CIFAR with each format's default encoding (raw Datums, PNG in RecordIO and TFRecord), as users convert it.
  for c in cifar10 cifar100; do
    "$GPUFEED" synth "$c" "$DATA/src-$c" --forms python
    "$GPUFEED" convert "$c" "$DATA/src-$c" --to lmdb,recordio,tfrecord,webdataset --out "$DATA/$c" --workers 1 --no-progress
  done
  "$PY" tests/interop/make_cases.py "$DATA"
fi

declare -A RESULT
run_check() {
  local name=$1; shift
  echo "== $name"
  if "$@"; then RESULT[$name]=PASS; else RESULT[$name]=FAIL; fi
}
wants mxnet && run_check mxnet "$CACHE/mxnet/bin/python" tests/interop/check_mxnet.py "$DATA"
wants tensorflow && run_check tensorflow "$CACHE/tf/bin/python" tests/interop/check_tensorflow.py "$DATA"
wants caffe && run_check caffe "$CACHE/caffe/bin/python" tests/interop/check_caffe.py "$DATA" "$CACHE/caffe_pb2"
wants dali && run_check dali "$CACHE/dali/bin/python" tests/interop/check_dali.py "$DATA"

echo "== summary"
status=0
for name in "${!RESULT[@]}"; do
  echo "${RESULT[$name]} $name"
  [ "${RESULT[$name]}" = PASS ] || status=1
done
exit $status
