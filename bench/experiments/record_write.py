"""``python -m gpufeed.bench.experiments.record_write``: what a worker pays to write one record of a ``.rec`` split into
its memory spool, and where it goes, with 1 process and with every core writing at once (memory bandwidth and the
cores' shared units are divided; results/record-write-h200x4.txt). Each process writes shards of :data:`SHARD`
records of ``--record-kb`` KB (54.7 KB: the mean of ImageNet at ``--resize 256``, session 26) through the sink's own
spool writer (``record``: framing, the fragment's SHA-256 that the manifest keeps, the ``.rec``/``.idx``/``.lst``
writes), then each part alone on the same bytes: ``frame`` (:func:`~gpufeed.formats.recordio.frame_parts`),
``sha256``, ``write`` (the payload written to a new spool file), ``rewrite`` (the same into a spool file of the same
size written before: its pages kept, not allocated again). Spools are committed and removed shard by shard, as the
driver removes each once appended (``rewrite``'s are kept to be written again).

One JSON line per process count and part: microseconds a record (the median process's), the spread over the
processes, and what that is of ``--image-ms`` (the plain loop's CPU an image on the machine, 4.0 on 4x H200).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time

#: Records a shard: ImageNet's 300,000 train files at 64 workers come in shards of ~213-293.
SHARD = 256
PARTS = ("record", "frame", "sha256", "write", "rewrite")


def _payloads(record_kb: float, distinct: int = 64) -> list[bytes]:
    import numpy as np

    rng = np.random.default_rng(0)  # random bytes: no magic word to split at, like nearly every JPEG
    return [rng.integers(0, 256, int(record_kb * 1000), dtype=np.uint8).tobytes() for _ in range(distinct)]


def _one_part(part: str, folder: str, payloads: list[bytes], shards: int) -> float:
    """Seconds a record for ``part``, over ``shards`` shards written in ``folder``."""
    spent = 0.0
    for shard in range(shards):
        write, finish = _part(part, os.path.join(folder, f"{shard:05d}.rec"))
        t = time.perf_counter()
        for i in range(SHARD):
            write(i, payloads[i % len(payloads)])
        spent += time.perf_counter() - t
        for f in finish():
            os.remove(f)
    return spent / (shards * SHARD)


def _part(part: str, path: str):
    """``(write(index, value), finish())`` of ``part`` for one shard at ``path``: ``finish`` closes what it
    opened and names the files to remove (a ``rewrite`` file is kept to be written again)."""
    from gpufeed.formats import get_format
    from gpufeed.formats.base import EncodedRecord
    from gpufeed.formats.recordio import frame_parts

    if part == "record":
        fmt = get_format("recordio")
        writer = fmt.assembler().spool_writer(fmt, path)

        def finish():
            writer.close()
            return fmt.assembler().spool_files(path)

        return (lambda i, value: writer.write_encoded(EncodedRecord(str(i).encode(), value, i, f"n0/{i}.JPEG",
                                                                    (0.0,))), finish)
    if part == "frame":
        return lambda i, value: frame_parts(value), list
    if part == "sha256":
        return lambda i, value: hashlib.sha256().update(value), list
    raw = open(path, "wb" if part == "write" else "r+b")  # rewrite: made before (_process), its pages kept

    def close():
        raw.close()
        return [path] if part == "write" else []

    return lambda i, value: raw.write(value), close


def _rewritable(path: str, size: int) -> None:
    """``path`` made ``size`` bytes, for ``rewrite`` to write again."""
    with open(path, "wb") as f:
        f.write(bytes(size))


def _process(args) -> dict:
    root, index, record_kb, shards, start = args
    payloads = _payloads(record_kb)
    folder = os.path.join(root, f"p{index:03d}")
    os.makedirs(folder, exist_ok=True)
    out = {}
    for part in PARTS:
        if part == "rewrite":
            for shard in range(shards):  # the files to write again, made before the timed part
                _rewritable(os.path.join(folder, f"{shard:05d}.rec"), SHARD * len(payloads[0]))
        start.wait()  # every process on the same part at once
        out[part] = _one_part(part, folder, payloads, shards)
    return out


def run(processes: list[int], record_kb: float = 54.7, shards: int = 8, image_ms: float = 4.0,
        emit=print) -> list[dict]:
    from gpufeed.convert.sinks import MEMORY_ROOT

    root = tempfile.mkdtemp(dir=MEMORY_ROOT if os.path.isdir(MEMORY_ROOT) else None, prefix="gpufeed-record-write-")
    rows = []
    try:
        ctx = multiprocessing.get_context("forkserver")
        for p in processes:
            with ctx.Manager() as manager:
                start = manager.Barrier(p)
                with ctx.Pool(p) as pool:
                    per = pool.map(_process, [(root, i, record_kb, shards, start) for i in range(p)], chunksize=1)
            for part in PARTS:
                us = sorted(r[part] * 1e6 for r in per)
                row = {"bench": "record-write", "processes": p, "part": part, "record_kb": record_kb,
                       "records_per_process": shards * SHARD, "us_per_record": round(us[len(us) // 2], 1),
                       "us_min": round(us[0], 1), "us_max": round(us[-1], 1),
                       "of_image": round(us[len(us) // 2] / 1000 / image_ms, 4)}
                rows.append(row)
                emit(json.dumps(row))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", default=f"1,{os.cpu_count()}", help="comma-separated process counts")
    ap.add_argument("--record-kb", type=float, default=54.7)
    ap.add_argument("--shards", type=int, default=8, help="shards each process writes per part")
    ap.add_argument("--image-ms", type=float, default=4.0, help="the plain loop's CPU ms an image, for of_image")
    ap.add_argument("--results", help="append the JSON lines here too")
    a = ap.parse_args()
    rows = run([int(p) for p in a.processes.split(",")], a.record_kb, a.shards, a.image_ms)
    if a.results:
        with open(a.results, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
