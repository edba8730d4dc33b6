#!/usr/bin/env bash
# A conversion with every core's worker killed outright on the GPU machine: what its memory spools hold
# afterwards, the next run of another destination freeing them, the killed run's rerun and verify
# (scripts/killed_spools.py; results/killed-spools-KIND.txt).
#   device run, carry .whl:  OUT=$OUT bash scripts/killed_spools.sh
#   SIG=term: stopped with SIGTERM instead, its advice to free the spools followed, then its rerun
#   THEN=clean: the stopped run given up with `gpufeed clean` (timed), then a fresh run into the same destination
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl source scripts/device_out.sh killed-spools-KIND.jsonl
REPO=$PWD
cd /tmp  # the checkout's gpufeed/ would shadow the installed package
echo "[$(date -u +%H:%M:%S)] machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB"
python3 "$REPO/scripts/killed_spools.py" --n "${N:-100000}" --workers "${WORKERS:-$(nproc)}" \
  --formats "${FORMATS:-recordio,lmdb}" --signal "${SIG:-kill}" --then "${THEN:-rerun}" --results "$RESULTS" 2>&1 | tee "$OUT/killed-spools.log"
echo "[$(date -u +%H:%M:%S)] done"
