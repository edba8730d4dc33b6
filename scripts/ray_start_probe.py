"""How long a local Ray runtime takes to be ready for gpufeed's first shard, by setting.

Each variant runs in a fresh process: ``import ray``, ``ray.init`` as gpufeed's engine calls it (with the
variant's changes), then one task per CPU that imports what a conversion worker imports, then a second
round (workers warm). Prints one JSON line per variant.

    python3 scripts/ray_start_probe.py [--cpus 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, logging, os, sys, time
t0 = time.perf_counter()
import ray
t_import = time.perf_counter() - t0
kw = json.loads(sys.argv[1])
t1 = time.perf_counter()
ray.init(address="local", num_cpus=int(sys.argv[2]), include_dashboard=False, logging_level=logging.ERROR,
         log_to_driver=False, object_store_memory=512 << 20, **kw)
t_init = time.perf_counter() - t1

@ray.remote(num_cpus=1)
def work():
    import cv2
    import gpufeed.convert.engine, gpufeed.pipelines.transforms, gpufeed.formats.lmdb  # noqa: F401
    cv2.setNumThreads(1)
    return os.getpid()

t2 = time.perf_counter()
pids = ray.get([work.remote() for _ in range(int(sys.argv[2]))])
t_first = time.perf_counter() - t2
t3 = time.perf_counter()
ray.get([work.remote() for _ in range(int(sys.argv[2]))])
t_second = time.perf_counter() - t3
ray.shutdown()
print(json.dumps({"import_s": round(t_import, 2), "init_s": round(t_init, 2), "first_tasks_s": round(t_first, 2),
                  "second_tasks_s": round(t_second, 3), "worker_processes": len(set(pids))}))
"""

VARIANTS = {
    "as gpufeed (runtime_env env_vars)": ({"runtime_env": {"env_vars": {"PYTHONHASHSEED": "0"}}}, {}),
    "no runtime_env": ({}, {}),
    "no runtime_env, usage stats off": ({}, {"RAY_USAGE_STATS_ENABLED": "0"}),
    "runtime_env, usage stats off": ({"runtime_env": {"env_vars": {"PYTHONHASHSEED": "0"}}},
                                     {"RAY_USAGE_STATS_ENABLED": "0"}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    for name, (kw, env) in VARIANTS.items():
        r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw), str(args.cpus)], capture_output=True,
                           text=True, env={**os.environ, **env}, timeout=300)
        line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None
        print(json.dumps({"variant": name, **(json.loads(line) if line else {"error": r.stderr[-500:]})}),
              flush=True)


if __name__ == "__main__":
    main()
