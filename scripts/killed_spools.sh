#!/usr/bin/env bash
# A 64-worker conversion killed outright on the GPU machine: what its memory spools hold afterwards, the next
# run freeing them, the killed run's rerun and verify (scripts/killed_spools.py).
#   device run, carry .whl:  OUT=$OUT bash scripts/killed_spools.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
[ "${INSTALL:-1}" = 1 ] && source scripts/device_setup.sh
REPO=$PWD
cd /tmp
echo "[$(date -u +%H:%M:%S)] machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB"
python3 "$REPO/scripts/killed_spools.py" --n "${N:-100000}" --workers "${WORKERS:-$(nproc)}" \
  --formats "${FORMATS:-recordio,lmdb}" --results "$OUT/killed-spools.jsonl" 2>&1 | tee "$OUT/killed-spools.log"
echo "[$(date -u +%H:%M:%S)] done"
