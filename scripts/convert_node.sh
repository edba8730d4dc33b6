#!/usr/bin/env bash
# Conversion at node scale on the GPU machine (16 cores): the plain-multiprocessing limit loop against
# `gpufeed convert --workers 16` for each format alone and all three, and pass-through against cp, on
# 120,000 ImageNet-like JPEGs, cold cache for every run (bench/experiments/convert_node.py says what each run is).
#
#   bash scripts/device_wheels.sh                         # here, once: .whl/ with Ray, lmdb, crc32c
#   device run, carry .whl:  OUT=$OUT bash scripts/convert_node.sh
#   N=2000 UNIQUE=200 PASS_N=1000 WORKERS=2 OUT=/tmp/o bash scripts/convert_node.sh   # a small dry run
#   RUNS=limit,limit-write3,all,limit-write3,limit ...   # all three formats against the limit loop writing
#                                                         # three copies: what the CPUs and the disk allow
#   RUNS=all@450000,limit@300000+warm ...    # a run on the corpus's first K files; with them in the page cache
#   LAYOUT=imagenet MIX=imagenet N=1281167 ... # ImageNet-1k: its train tree (convert imagenet) and size mix
#   DEPTHS=4,16,64,256 ...                   # then cold random reads of the corpus's files at those queue depths
#                                            # (bench/experiments/disk_depth.py), buffered and O_DIRECT
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-$PWD/out}")
mkdir -p "$OUT"
[ "${INSTALL:-1}" = 1 ] && source scripts/device_setup.sh
# COMPARE=<folder holding another gpufeed checkout> (e.g. `git archive <commit> | tar -x -C compare-build`,
# carried as an ignored path): its build runs each conversion back to back with this one, the build going
# first alternating from one conversion to the next.
COMPARE_ARGS=()
if [ -n "${COMPARE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-compare "$(realpath "$COMPARE")" >/dev/null
  # its bytecode written once too, as for this build (scripts/device_setup.sh)
  ! declare -F warm_bytecode >/dev/null || PYTHONPATH=/tmp/site-compare:/tmp/site warm_bytecode
  COMPARE_ARGS=(--compare /tmp/site-compare)
fi
# EXECUTORS=pool,ray: each conversion runs with each `convert --executor`, side by side (not with COMPARE).
[ -n "${EXECUTORS:-}" ] && COMPARE_ARGS+=(--executors "$EXECUTORS")
REPO=$PWD
cd /tmp  # the checkout's gpufeed/ would shadow the installed package
echo "[$(date -u +%H:%M:%S)] machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB"
# what the kernel does with memory the workers allocate: huge pages, and the stalls compacting for them
vm_state() {
  echo "THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null) defrag" \
    "$(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null);" \
    $(grep -E '^(compact_stall|allocstall_normal|thp_fault_alloc|thp_fault_fallback|pgmajfault) ' /proc/vmstat 2>/dev/null)
}
vm_state
df -h "${WORK:-/tmp/gpufeed-node}" 2>/dev/null | tail -1 || df -h /tmp | tail -1
# APPEND=1: first what the single .rec's commit thread pays to append fragments from the memory spools to this
# disk, in the kernel against streamed through Python (bench/experiments/append_copy.py)
if [ "${APPEND:-0}" = 1 ]; then
  mkdir -p "${WORK:-/tmp/gpufeed-node}"
  python3 -m gpufeed.bench.experiments.append_copy "${WORK:-/tmp/gpufeed-node}" 2>&1 | tee "$OUT/append-copy.jsonl"
fi
python3 -m gpufeed.bench.experiments.convert_node --n "${N:-120000}" --unique "${UNIQUE:-3000}" --workers "${WORKERS:-16}" \
  --pass-n "${PASS_N:-40000}" --layout "${LAYOUT:-folder}" --mix "${MIX:-default}" --runs "${RUNS:-limit,recordio,tfrecord,lmdb,all,pass,pass-recordio,cp}" \
  --work "${WORK:-/tmp/gpufeed-node}" "${COMPARE_ARGS[@]}" --results "$OUT/${RESULTS_NAME:-convert-node.jsonl}" 2>&1 | tee "$OUT/convert-node.log"
if [ -n "${DEPTHS:-}" ]; then
  python3 -m gpufeed.bench.experiments.disk_depth --files "${WORK:-/tmp/gpufeed-node}/src" --depths "$DEPTHS" \
    --seconds "${DEPTH_S:-3}" --results "$OUT/disk-depth.jsonl" 2>&1 | tee "$OUT/disk-depth.log"
fi
df -h "${WORK:-/tmp/gpufeed-node}" | tail -1
# WORKER_COST=1: then one process's CPU per image per format against the limit loop (scripts/worker_cost.py),
# for this build and, with COMPARE, the other one.
if [ "${WORKER_COST:-0}" = 1 ]; then
  for build in current ${COMPARE:+compare}; do
    site=/tmp/site; [ "$build" = compare ] && site=/tmp/site-compare:/tmp/site
    echo "== worker cost, $build build"
    PYTHONPATH=$site python3 "$REPO/scripts/worker_cost.py" --n 600 --repeats 3 --profile ""
  done 2>&1 | tee "$OUT/worker-cost.txt"
fi
vm_state
echo "[$(date -u +%H:%M:%S)] done"
