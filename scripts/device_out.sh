#!/usr/bin/env bash
# Sourced from the repository root by the GPU-machine scripts that write bench rows:
#   source scripts/device_out.sh DEFAULT_RESULTS_NAME
# makes OUT absolute (default ./out) and creates it, sets RESULTS=$OUT/${RESULTS_NAME:-DEFAULT_RESULTS_NAME}, and
# installs the decode wheels and gpufeed (scripts/device_setup.sh with WHEELS=.whl-decode) unless INSTALL=0 (a
# caller that installed them already).
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
RESULTS=$OUT/${RESULTS_NAME:-$1}
if [ "${INSTALL:-1}" = 1 ]; then WHEELS=.whl-decode source scripts/device_setup.sh; fi
