#!/usr/bin/env bash
# Sourced from the repository root by the GPU-machine scripts that write bench rows:
#   source scripts/device_out.sh DEFAULT_RESULTS_NAME      (e.g. gpu-ranks-KIND.jsonl)
# makes OUT absolute (default ./out) and creates it, sets RESULTS=$OUT/${RESULTS_NAME:-DEFAULT_RESULTS_NAME}, and
# installs the decode wheels and gpufeed (scripts/device_setup.sh with WHEELS=.whl-decode, or the WHEELS given:
# .whl for a conversion) unless INSTALL=0 (a caller that installed them already).
# KIND in DEFAULT_RESULTS_NAME stands for the machine's GPUs as the results files name them: h200x4 for four
# H200s, h100x2 for two H100s, h200 for one (cpu where nvidia-smi lists none).
gpu_kind() {
  local names n model
  names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep . || true)
  [ -n "$names" ] || { echo cpu; return; }
  n=$(printf '%s\n' "$names" | wc -l)
  model=$(printf '%s\n' "$names" | head -1 | grep -o -E '[ABHL][0-9]{2,3}' | head -1 | tr 'A-Z' 'a-z' || true)
  echo "${model:-gpu}$([ "$n" -gt 1 ] && echo "x$n")"
}
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
DEFAULT_NAME=$1
[[ $DEFAULT_NAME == *KIND* ]] && DEFAULT_NAME=${DEFAULT_NAME//KIND/$(gpu_kind)}
RESULTS=$OUT/${RESULTS_NAME:-$DEFAULT_NAME}
if [ "${INSTALL:-1}" = 1 ]; then WHEELS=${WHEELS:-.whl-decode} source scripts/device_setup.sh; fi
