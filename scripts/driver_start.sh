#!/usr/bin/env bash
# Where a conversion's driver spends the time before convert()'s clock starts (in the node benchmark, its
# first_shard_started_s less the timeline's first_shard_started): the interpreter's start, the imports of the
# command line and the engine, the fork server's start, each measured REPEATS times; the slowest imports of
# one run; then real conversions of a small corpus, the command's start to convert()'s clock.
#
#   device run, carry .whl:  OUT=$OUT bash scripts/driver_start.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
[ "${INSTALL:-1}" = 1 ] && source scripts/device_setup.sh
REPO=$PWD
cd /tmp  # the checkout's gpufeed/ would shadow the installed package
python3 "$REPO/scripts/driver_start.py" --repeats "${REPEATS:-5}" --work "${WORK:-/tmp/gpufeed-start}" 2>&1 \
  | tee "$OUT/driver-start.txt"
