#!/usr/bin/env bash
# Issue 29: where do several ranks' steps go? With every batch in time and the loop's main thread never waiting
# for a core, 4 ranks' steps still ran 5-44% over the model's alone; one GPU's step beside 63 decoding processes
# lost under 1% (step-beside-load-h200x4.jsonl). This samples what each GPU did (nvidia-smi every 200 ms: the
# share of time a kernel ran, SM clock, power) through 4-rank runs from the page cache (no disk), so a run
# whose GPUs sat idle between kernels (the rank's process launched late: its Python threads share one GIL) stands
# apart from one whose kernels ran slower; and runs each variant beside the default on one warm machine:
#   default   as the loader is;
#   switch    every process with a 0.5 ms GIL switch interval (sitecustomize.py), so a thread that wants the
#             GIL waits at most that long for a thread holding it (CPython's default is 5 ms);
#   threads1  one decode thread in the rank's process (--decode-threads 1).
# TASKS: infer (on a dataset stored at --resize 160, 64,000 records, built if missing) and train (as captured,
# 32,000 records): from the page cache, the epochs repeat.
#
#   device run (kind nvidia-h200-x4), carry .whl-decode:  OUT=$OUT bash scripts/gpu_step_probe.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=$(realpath -m "${OUT:-$PWD/out}") FORMATS=${FORMATS:-recordio} RESULTS_NAME=${RESULTS_NAME:-gpu-ranks-h200x4.jsonl}
export DEADLINE_AT=$(( $(date +%s) + ${DEADLINE_S:-560} )) WARM=1 INSTALL=0 DECODES=${DECODES:-auto}
mkdir -p "$OUT"
WHEELS=.whl-decode source scripts/device_setup.sh
mkdir -p /tmp/gil05 && echo 'import sys; sys.setswitchinterval(0.0005)' > /tmp/gil05/sitecustomize.py
for task in ${TASKS:-infer train}; do
  if [ "$task" = infer ]; then data=/tmp/gpufeed-ranks-160 n=64000 args="--resize 160"; else data=/tmp/gpufeed-ranks n=32000 args=; fi
  for variant in ${VARIANTS:-default switch threads1 default}; do
    [ $(( DEADLINE_AT - $(date +%s) )) -ge 75 ] || { echo "skipped: $task $variant (deadline)"; continue; }
    echo "=== $task $variant"
    nvidia-smi --query-gpu=index,utilization.gpu,clocks.sm,power.draw --format=csv,noheader,nounits -lms 200 \
      > "$OUT/smi-$task-$variant.csv" 2>/dev/null & smi=$!
    case $variant in
      switch) PYTHONPATH=/tmp/gil05:$PYTHONPATH DATA=$data N=$n DATASET_ARGS=$args RUNS="4:$task" bash scripts/gpu_ranks.sh ;;
      threads1) DECODE_THREADS=1 DATA=$data N=$n DATASET_ARGS=$args RUNS="4:$task" bash scripts/gpu_ranks.sh ;;
      *) DATA=$data N=$n DATASET_ARGS=$args RUNS="4:$task" bash scripts/gpu_ranks.sh ;;
    esac 2>&1 | grep -E "^(train|infer) |rc |skipped|building|error" || true
    kill $smi 2>/dev/null || true
    # Each GPU's samples while it was busy at all (the timed steps and their warm-up): mean kernel-time share,
    # SM clock and power.
    python3 - "$OUT/smi-$task-$variant.csv" <<'PY'
import collections, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    try:
        i, util, clock, power = (float(v) for v in line.split(","))
    except ValueError:
        continue
    if util > 0:
        rows[int(i)].append((util, clock, power))
for i, v in sorted(rows.items()):
    top = sorted(v)[len(v) // 4:]  # the busiest three quarters: the timed window, not its ramp
    print(f"  GPU{i}: {len(v)} busy samples, kernel-time {sum(u for u, _, _ in top) / len(top):.0f}%, "
          f"SM {sum(c for _, c, _ in top) / len(top):.0f} MHz, {sum(p for _, _, p in top) / len(top):.0f} W")
PY
  done
done
