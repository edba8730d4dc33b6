#!/usr/bin/env bash
# Cold LMDB reads against cold RecordIO reads (stored bytes, no decode), with and without the per-value
# offsets list (gpufeed.offsets: one pread per value instead of a page fault per 4 KiB), on the local disk
# and on the emulated ssd tier, side by side in one run.
#
#   device run, carry .whl:  OUT=$OUT bash scripts/lmdb_cold.sh
#   N=2000 WORKERS=0,2 OUT=/tmp/o INSTALL=0 bash scripts/lmdb_cold.sh      # a small run anywhere
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
[ "${INSTALL:-1}" = 1 ] && source scripts/device_setup.sh
cd /tmp
DATA=${DATA:-/tmp/gpufeed-lmdb-cold}
rm -rf "$DATA" "$DATA-no-offsets"
python3 -m gpufeed bench dataset "$DATA/with-offsets" -n "${N:-8000}" --formats lmdb,recordio --workers "$(nproc)"
cp -r "$DATA/with-offsets" "$DATA/no-offsets"
rm "$DATA/no-offsets/lmdb/train_lmdb/gpufeed.offsets"
python3 - "$DATA/no-offsets/lmdb/train_lmdb/gpufeed.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); d.pop("offsets"); json.dump(d, open(sys.argv[1], "w"))
PY
for d in no-offsets with-offsets; do
  python3 -m gpufeed bench read "$DATA/$d" --grid full --tier "local=$DATA/$d" --tier ssd --allow-invalid --formats lmdb,recordio \
    --modes raw --cache cold --workers "${WORKERS:-0,4}" --samples "${SAMPLES:-2000}" --repeats 3 --warmup 0 \
    --results "$OUT/lmdb-cold.jsonl" 2>&1 | grep -E "^\s*(local|ssd)" | sed "s/^/$d /"
done
