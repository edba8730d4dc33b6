#!/usr/bin/env bash
# Does a busy node alone slow the training step? (issue 29: several ranks lost their AU in their steps, not in
# waiting for batches.) ResNet-50 training on GPU 0 on a synthetic batch while K processes decode and crop the
# dataset's JPEGs as the loader's CPU workers do, for K from none to every core but one: as is (plain), with a
# pinned batch copied to the GPU before each step (copy), with one core (and its siblings) kept from the decode
# processes (reserve; pin: the loop's process also pinned to it), and with them at niceness 10 (nice); and the
# decoders as threads of the loop's own process, on the JPEG engines as the loader's decode threads (threads-hw) or
# on the CPU (threads-cpu), K from none to 2 and 4 (the interpreter lock's share, apart from the cores'); the engines
# without the crop (threads-hw-decode); and the engine decoders as processes of their own on the model's GPU
# (gpu-procs: the engines' and the crop's GPU work without the lock): python -m gpufeed.bench.experiments.step_beside_load.
# Carries nvImageCodec, lmdb and crc32c (.whl-decode); no Ray.
#
#   device run (any GPU kind), carry .whl-decode:  OUT=$OUT bash scripts/step_beside_load.sh
#   LOADS=0,16,32,48,63,0 WINDOW_S=5 VARIANTS="plain copy reserve pin nice threads-hw threads-cpu" ...
#   VARIANTS="threads-hw threads-hw-decode gpu-procs" THREAD_LOADS=0,2,4,0 ...
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/device_out.sh step-beside-load.jsonl
cd /tmp  # the checkout's gpufeed/ would shadow the installed package
DATA=${DATA:-/tmp/gpufeed-beside}
nvidia-smi --query-gpu=index,name --format=csv,noheader || true
echo "cores: $(nproc)"
[ -f "$DATA/bench_dataset.json" ] || python3 -m gpufeed bench dataset "$DATA" -n 2048 --formats recordio \
  --workers "$(nproc)"
for variant in ${VARIANTS:-plain copy reserve}; do
  case $variant in plain) flags= ;; copy) flags=--copy ;; reserve) flags="--reserve 1" ;;
    pin) flags="--reserve 1 --pin-loop" ;; nice) flags="--nice 10" ;; threads-hw) flags="--threads hw" ;;
    threads-cpu) flags="--threads cpu" ;; threads-hw-decode) flags="--threads hw-decode" ;;
    gpu-procs) flags=--gpu-procs ;; *) echo "unknown $variant"; continue ;; esac
  loads=${LOADS:-}; case $variant in threads-*|gpu-procs) loads=${THREAD_LOADS:-0,1,2,4,0} ;; esac
  echo "[$(date -u +%H:%M:%S)] step beside load: $variant"
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 "${STEP_S:-200}" python3 -m gpufeed.bench.experiments.step_beside_load "$DATA" \
    ${loads:+--loads "$loads"} --seconds "${WINDOW_S:-5}" $flags --results "$RESULTS" || echo "rc $?"
done
