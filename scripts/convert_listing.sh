#!/usr/bin/env bash
# Planning on a cold disk (issue 9): listing a 120,000-file tree and taking its inputs' identities
# (scripts/listing_probe.py), then the node-scale conversion runs on the same tree.
#
#   device run, carry .whl:  OUT=$OUT bash scripts/convert_listing.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
[ "${INSTALL:-1}" = 1 ] && source scripts/device_setup.sh
PROBE=$(realpath scripts/listing_probe.py)
WORK=${WORK:-/tmp/gpufeed-node}
cd /tmp
if [ ! -f "$WORK/corpus.json" ]; then
  python3 -c "
import json, os, sys, time
from gpufeed.bench.experiments.convert_node import build_corpus
t = time.perf_counter(); nbytes, _ = build_corpus('$WORK/src', ${N:-120000}, ${UNIQUE:-3000}, os.cpu_count())
json.dump({'n': ${N:-120000}, 'unique': ${UNIQUE:-3000}, 'bytes': nbytes, 'seconds': round(time.perf_counter() - t, 1)},
          open('$WORK/corpus.json', 'w'))"
fi
echo "[$(date -u +%H:%M:%S)] listing probe"
timeout -k 5 "${PROBE_S:-120}" python3 "$PROBE" "$WORK/src" --repeats 2 \
  --results "$OUT/listing-probe.jsonl" || echo "probe rc $?"
[ "${NODE:-1}" = 1 ] && WORK=$WORK INSTALL=0 OUT=$OUT bash "$OLDPWD/scripts/convert_node.sh"
echo "[$(date -u +%H:%M:%S)] done"
