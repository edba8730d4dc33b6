#!/usr/bin/env bash
# A train tar's inner tars indexed cold by a pool of processes, each task's tars one after another or side by side
# in threads (scripts/tar_depth.py): whether more reads in flight list ImageNet's tars sooner.
#
#   device run, carry .whl:  PER=100 OUT=$OUT bash scripts/tar_depth.sh
source "$(dirname "$0")/tar_data.sh" tar-index-KIND.jsonl
make_tars --repeats 0
(cd /tmp && python3 "$R/scripts/tar_depth.py" "$DATA" --processes "$WORKERS" --threads "${THREADS:-1,2,4}" \
  --per-task "${PER_TASK:-4,8}" --repeats "${REPEATS:-2}" --results "$RESULTS")
