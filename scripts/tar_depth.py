"""Whether more reads in flight index a train tar sooner on a cold disk: its inner tars walked in a pool of
processes as a conversion does (TARS_PER_TASK a task, one after another in each), or each task's tars walked side
by side by THREADS threads of the process (so processes x threads chains in flight), page cache dropped before
each run. Uses the train tar scripts/tar_index.py makes (``--per-class``, ``--classes``); root for drop_caches.

    python3 scripts/tar_depth.py /tmp/gpufeed-tar --processes 16 --threads 1,2,4,8 --results OUT/x.jsonl
"""

from __future__ import annotations

import argparse
import io
import os
import time


def _walk(url: str, span: tuple) -> int:
    from gpufeed.pipelines.archive import ArchiveLimits, _Budget, _index, _open

    start, end, where = span
    with _open(url, buffering=0) as f:
        return sum(1 for _ in _index(f, start, end, where, _Budget(ArchiveLimits(), url), None))


def _task(url: str, spans: list, threads: int) -> int:
    import gpufeed.pipelines.archive  # noqa: F401  (imported before any run is timed: the warm-up task)

    if threads <= 1:
        return sum(_walk(url, s) for s in spans)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda s: _walk(url, s), spans))


def main() -> None:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from listing_probe import drop_caches, emit  # (scripts/, this script's folder)

    from gpufeed.pipelines.archive import ArchiveLimits, _Budget, _index, _open

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--processes", type=int, default=16)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--per-task", default="4,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--results")
    a = p.parse_args()
    url = os.path.join(a.folder, "ILSVRC2012_img_train.tar")
    with _open(url) as f:
        size = f.seek(0, io.SEEK_END)
        spans = [(e.offset, e.offset + e.size, f"{url}::{e.name}")
                 for e in _index(f, 0, size, url, _Budget(ArchiveLimits(), url), None) if e.name.endswith(".tar")]
    with ProcessPoolExecutor(a.processes, mp_context=get_context("forkserver")) as pool:
        list(pool.map(_task, [url] * a.processes, [[]] * a.processes, [1] * a.processes))  # all up
        for _ in range(a.repeats):
            for per in [int(x) for x in a.per_task.split(",")]:
                for threads in [int(x) for x in a.threads.split(",")]:
                    if threads > per:
                        continue
                    drop_caches()
                    chunks = [spans[i:i + per] for i in range(0, len(spans), per)]
                    t = time.perf_counter()
                    members = sum(pool.map(_task, [url] * len(chunks), chunks, [threads] * len(chunks)))
                    s = time.perf_counter() - t
                    emit({"bench": "tar-depth", "cache": "cold", "processes": a.processes, "tars_per_task": per,
                          "threads": threads, "members": members, "seconds": round(s, 3),
                          "members_per_s": round(members / s), "cores": os.cpu_count()}, a.results)


if __name__ == "__main__":
    main()
