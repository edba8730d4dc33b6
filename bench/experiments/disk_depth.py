"""Cold random reads of whole files at several queue depths: what a disk gives a loader that reads records.

Each run reads files of a corpus (``--files``: a folder, walked) that no earlier run read, each once, with
``T`` threads (queue depth ``T``: ``os.read`` / ``os.preadv`` release the GIL), for about ``--seconds``,
after evicting the page cache (``drop_caches`` where permitted, else ``posix_fadvise`` on each file). Two
ways of reading: ``buffered`` (open and read, as a DataLoader worker reads a record's bytes; the kernel's
readahead applies) and ``direct`` (``O_DIRECT``, whole 4 KiB blocks into an aligned buffer: no page cache and
no readahead). Each row records GB/s of file bytes and what the block device read meanwhile (from /sys), so
a figure served from a host-side cache or inflated by readahead shows itself.

    python -m gpufeed.bench.experiments.disk_depth --files /tmp/gpufeed-node/src --depths 4,16,64,256 \\
        --results results/disk-depth.jsonl
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import threading
import time

MODES = ("buffered", "direct")
_BLOCK = 4096


def _read_buffered(path: str, _buf) -> int:
    with open(path, "rb", buffering=0) as f:
        return len(f.read())


def _read_direct(path: str, buf) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        want = -(-size // _BLOCK) * _BLOCK
        if want > len(buf):
            raise ValueError(f"{path}: {size} bytes, more than the {len(buf)}-byte buffer")
        return min(os.preadv(fd, [memoryview(buf)[:want]], 0), size)
    finally:
        os.close(fd)


def read_run(paths: list[str], threads: int, mode: str, seconds: float, buffer_bytes: int = 64 << 20) -> dict:
    """``threads`` threads reading ``paths`` (each at most once) for about ``seconds``."""
    from gpufeed.bench.results import disk_counters, disk_delta

    read = _read_direct if mode == "direct" else _read_buffered
    todo = iter(paths)
    lock = threading.Lock()
    counts = [[0, 0] for _ in range(threads)]
    stop = threading.Event()
    barrier = threading.Barrier(threads + 1)

    errors = []

    def worker(i: int) -> None:
        buf = mmap.mmap(-1, buffer_bytes)  # page-aligned, as O_DIRECT needs
        barrier.wait()
        try:
            while not stop.is_set():
                with lock:
                    path = next(todo, None)
                if path is None:
                    break
                counts[i][1] += read(path, buf)
                counts[i][0] += 1
        except (OSError, ValueError) as e:
            errors.append(f"{mode} read of {path}: {e}")
            stop.set()
        finally:
            buf.close()

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    disk0 = disk_counters(paths[0])
    barrier.wait()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds and any(t.is_alive() for t in pool):
        time.sleep(0.01)
    stop.set()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    files, nbytes = sum(c[0] for c in counts), sum(c[1] for c in counts)
    disk = disk_delta(disk0, disk_counters(paths[0]), elapsed)
    return {"mode": mode, "threads": threads, "files": files, "bytes": nbytes, "seconds": round(elapsed, 3),
            "mean_file_bytes": round(nbytes / max(files, 1)), "gb_per_s": round(nbytes / elapsed / 1e9, 3),
            **disk, "device_per_file_byte": round(disk.get("disk_read_bytes", 0) / max(nbytes, 1), 3)}


def run(folder: str, depths=(4, 16, 64, 256), modes=MODES, seconds: float = 3.0, seed: int = 0,
        results: str | None = None) -> list[dict]:
    from gpufeed.bench.experiments.convert_node import drop_caches

    paths = sorted(os.path.join(d, n) for d, _, names in os.walk(folder) for n in names)
    if not paths:
        raise SystemExit(f"{folder}: no files to read")
    random.Random(seed).shuffle(paths)
    rows, at = [], 0
    for mode in modes:
        for threads in depths:
            cache = drop_caches(folder)
            row = read_run(paths[at:], threads, mode, seconds)
            at += row["files"]
            row = {"bench": "disk-depth", "folder": os.path.realpath(folder), "cache": cache, **row}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if results:
                with open(results, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if at >= len(paths):
                return rows
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| read | threads | files | mean file KB | GB/s of files | device GB/s read (busy) | device bytes per file byte |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['threads']} | {r['files']:,} | {r['mean_file_bytes'] / 1e3:.0f} | "
                     f"{r['gb_per_s']} | {r.get('disk_mb_per_second', 0) / 1e3:.2f} ({r.get('disk_busy', 0):.0%}) | "
                     f"{r['device_per_file_byte']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m gpufeed.bench.experiments.disk_depth",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--files", required=True, help="a folder of files to read (each read at most once)")
    p.add_argument("--depths", default="4,16,64,256", help="thread counts (queue depths)")
    p.add_argument("--modes", default=",".join(MODES), help="buffered, direct or both")
    p.add_argument("--seconds", type=float, default=3.0, help="per run")
    p.add_argument("--results", help="append JSON rows here")
    args = p.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    if set(modes) - set(MODES):
        p.error(f"--modes: choose from {','.join(MODES)}")
    rows = run(args.files, tuple(int(d) for d in args.depths.split(",")), modes, args.seconds, results=args.results)
    print(table(rows))


if __name__ == "__main__":
    main()
