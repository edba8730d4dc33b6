#!/usr/bin/env bash
# Conversion on storage tiers at the machine's core count (the published finding's preprocessing claims):
# `gpufeed bench convert` of one ImageNet-like corpus (bench/experiments/convert_node.py's: N files, copies of UNIQUE
# synthesised photo-like JPEGs) with `--resize 256`, WORKERS workers, on the local disk (measured) and on the
# emulated cloud tiers at their default 500 GiB size. Rows go to $OUT/$RESULTS_NAME for `gpufeed report`.
#
#   bash scripts/device_wheels.sh                          # here, once: .whl/ with Ray, lmdb, crc32c
#   device run, carry .whl:  OUT=$OUT bash scripts/convert_tiers.sh
#   N=600 UNIQUE=60 WORKERS=2 TIERS="local ultra" OUT=/tmp/o bash scripts/convert_tiers.sh   # a small dry run
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
[ "${INSTALL:-1}" = 1 ] && source scripts/device_setup.sh
WORK=${WORK:-/tmp/gpufeed-tiers}
N=${N:-20000}
UNIQUE=${UNIQUE:-2000}
WORKERS=${WORKERS:-$(nproc)}
cd /tmp  # the checkout's gpufeed/ would shadow the installed package
echo "[$(date -u +%H:%M:%S)] machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB; $(df -h /tmp | tail -1)"
if [ ! -d "$WORK/src" ]; then
  python3 -c "import sys, time; from gpufeed.bench.experiments.convert_node import build_corpus; t = time.time(); \
b, _ = build_corpus(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])); \
print(f'corpus: {sys.argv[2]} files, {b / 1e9:.2f} GB, {time.time() - t:.0f} s')" "$WORK/src" "$N" "$UNIQUE" "$WORKERS"
fi
TIER_ARGS=()
for t in ${TIERS:-local essd-pl1 ssd ultra}; do
  if [ "$t" = local ]; then TIER_ARGS+=(--tier "local=$WORK/local"); else TIER_ARGS+=(--tier "$t"); fi
done
mkdir -p "$WORK/local"
python3 -m gpufeed bench convert "$WORK/src" --dataset folder "${TIER_ARGS[@]}" --out "$WORK/scratch" \
  --formats "${FORMATS:-lmdb,recordio}" --workers "$WORKERS" --resize 256 --repeats "${REPEATS:-1}" \
  --warmup 0 --timeout 400 --results "$OUT/${RESULTS_NAME:-convert-tiers.jsonl}" 2>&1 | tee "$OUT/convert-tiers.log"
echo "[$(date -u +%H:%M:%S)] done"
