"""What the node's cores decode when all of them decode at once: the ceiling a training row's CPU path is
measured against.

A row's share of busy cores says little on its own: on the 4-GPU machine 64 vCPUs were the hyper-threads of 32
cores, and the CPU path that fed 4 ranks at AU 0.890 kept only 79% of them busy, which read as "no resource at
90%, the loader itself" (results/gpu-ranks-h100x4.txt). :func:`decode_ceiling` measures instead how many images
per second every usable core decodes and crops at once, as the DataLoader workers do (the same
:class:`~gpufeed.pipelines.batches_cpu.CpuDecode`, the dataset's own records held in memory: no disk), and
:mod:`gpufeed.bench.bottleneck` sets the CPU path's decodes beside it. Measured once per machine (CPU model and
cores), task, crop size and record size, and kept in the user cache, as the disk's ceilings are
(:mod:`gpufeed.bench.hostdisk`).
"""

from __future__ import annotations

import dataclasses
import time

#: Where measured ceilings are kept (beside the disk's, :data:`gpufeed.bench.hostdisk.CEILINGS_FILE`).
CEILINGS_FILE = "cpu-decode-ceilings.json"
#: Records read once into memory and decoded over and over (each time as another sample index: another crop).
SAMPLE_RECORDS = 64
#: Records' mean size is kept to this granularity in the key: a ceiling holds for records of about that size.
SIZE_STEP = 8 << 10


def _decode_for(args) -> int:
    """One process: decode ``samples`` in turn until ``end`` (wall clock), starting with the others at
    ``start``; the images decoded."""
    from gpufeed.pipelines.batches_cpu import CpuDecode

    samples, train, size, start, end = args
    decode = CpuDecode(train, size)
    decode(samples[0])  # imports and first-call costs before the clock
    while time.time() < start:
        time.sleep(0.001)
    n = 0
    while time.time() < end:
        decode(dataclasses.replace(samples[n % len(samples)], index=n))
        n += 1
    return n


def _read_samples(fmt: str, path: str, count: int) -> list:
    from gpufeed.formats import get_format

    with get_format(fmt).reader(path) as r:
        n = min(count, len(r))
        step = max(1, len(r) // max(n, 1))  # spread over the file: the size mix, not the first records only
        out = []
        for i in range(0, step * n, step):
            s = r[i]  # its bytes owned (not a view of the reader's map), to outlive the reader
            out.append(dataclasses.replace(s, payload=bytes(s.payload) if s.kind != "raw" else s.payload.copy()))
        return out


def _mean_bytes(samples: list) -> float:
    return sum(len(s.payload) if isinstance(s.payload, bytes) else s.payload.nbytes for s in samples) / len(samples)


def decode_ceiling(fmt: str, path: str, train: bool, size: int = 224, seconds: float = 2.0,
                   processes: int | None = None, record_bytes: float | None = None) -> dict | None:
    """Images per second every usable core decodes and crops at once (``img_per_s``; with ``processes``,
    ``per_process``, ``record_bytes``, ``measured``), as the DataLoader workers do for ``train`` (random
    resized crops) or evaluation (centre crops) at ``size``, from the records of the output at ``path``
    (``fmt``). Measured once per machine, task, size and record size and kept (:data:`CEILINGS_FILE`); None
    where the output holds no records. ``record_bytes``: the output's mean record size where the caller knows
    it (a benchmark dataset's description), so a kept ceiling is found without reading a record."""
    from gpufeed.bench.kept import keep, kept
    from gpufeed.bench.results import cpu_model
    from gpufeed.machine import fork_pool, usable_cores

    processes = processes or usable_cores()

    def key_for(record: float) -> str:
        bucket = max(1, round(record / SIZE_STEP))
        return (f"{cpu_model()}|{processes} processes|{'train' if train else 'eval'}|{size}|"
                f"~{bucket * SIZE_STEP // 1024} KiB")

    samples = None if record_bytes else _read_samples(fmt, path, SAMPLE_RECORDS)
    if samples == []:
        return None
    key = key_for(record_bytes or _mean_bytes(samples))
    found = kept(CEILINGS_FILE, key)
    if found is not None:
        return found
    samples = samples or _read_samples(fmt, path, SAMPLE_RECORDS)
    if not samples:
        return None
    # Every process forks before the clock starts, then all decode over the same wall-clock window.
    start = time.time() + 1.0 + 0.02 * processes
    end = start + seconds
    pool = fork_pool(processes)
    try:
        counts = pool.map(_decode_for, [(samples, train, size, start, end)] * processes)
        # Told to finish, then joined: every worker's count is in. (Terminating a plain forked pool in a process
        # with Ray up once left a worker waiting for good; fork_pool's workers end when terminated.)
        pool.close()
        pool.join()
    finally:
        pool.terminate()  # after an error; nothing left to stop after the join
    found = {"img_per_s": sum(counts) / seconds, "processes": processes,
             "per_process": sum(counts) / seconds / processes, "record_bytes": round(_mean_bytes(samples)),
             "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    keep(CEILINGS_FILE, key, found)
    return found
