#!/usr/bin/env bash
# Sourced by the scripts that measure ImageNet's tars read in place (tar_listing.sh, tar_same_bytes.sh,
# tar_depth.sh):  source "$(dirname "$0")/tar_data.sh" DEFAULT_RESULTS_NAME
# goes to the repository root (R), sets up the device's results and installs gpufeed (device_out.sh, WHEELS=.whl),
# and gives DATA (default /tmp/gpufeed-tar), WORKERS (default: the cores), and
#   make_tars ARGS...     scripts/tar_index.py on DATA: the train tar of CLASSES x PER members (and a flat val tar of
#                         VAL), made once, then ARGS (--repeats 0: nothing measured)
#   install_compare       COMPARE (a `git archive` of another commit, carried) installed into /tmp/site-compare
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
R=$PWD
WHEELS=${WHEELS:-.whl}
source scripts/device_out.sh "$1"
DATA=${DATA:-/tmp/gpufeed-tar}
WORKERS=${WORKERS:-$(nproc)}

make_tars() {
  (cd /tmp && python3 "$R/scripts/tar_index.py" "$DATA" --classes "${CLASSES:-1000}" --per-class "${PER:-100}" \
    --val "${VAL:-0}" "$@")
}

install_compare() {
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-compare "$(realpath "$COMPARE")" >/dev/null
}
