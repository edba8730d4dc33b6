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

    samples, train, size, region, start, end = args
    decode = CpuDecode(train, size, region=region)
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
                   processes: int | None = None, record_bytes: float | None = None,
                   region: bool = False, remeasure: bool = False) -> dict | None:
    """Images per second every usable core decodes and crops at once (``img_per_s``; with ``processes``,
    ``per_process``, ``record_bytes``, ``measured``), as the DataLoader workers do for ``train`` (random
    resized crops) or evaluation (centre crops) at ``size``, from the records of the output at ``path``
    (``fmt``). Measured once per machine, task, size and record size and kept (:data:`CEILINGS_FILE`); None
    where the output holds no records. ``record_bytes``: the output's mean record size where the caller knows
    it (a benchmark dataset's description), so a kept ceiling is found without reading a record. ``region``: the
    workers decode only each crop's box (:func:`~gpufeed.pipelines.imageio.decode_region`), a ceiling of its own.
    ``remeasure``: measured again even where one is kept (and the new figure kept)."""
    from gpufeed.bench.kept import keep, kept
    from gpufeed.bench.results import cpu_model
    from gpufeed.machine import fork_pool, usable_cores

    processes = processes or usable_cores()

    def key_for(record: float) -> str:
        bucket = max(1, round(record / SIZE_STEP))
        return (f"{cpu_model()}|{processes} processes|{'train' if train else 'eval'}|{size}|"
                f"~{bucket * SIZE_STEP // 1024} KiB" + ("|region" if region else ""))

    samples = None if record_bytes else _read_samples(fmt, path, SAMPLE_RECORDS)
    if samples == []:
        return None
    key = key_for(record_bytes or _mean_bytes(samples))
    found = None if remeasure else kept(CEILINGS_FILE, key)
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
        counts = pool.map(_decode_for, [(samples, train, size, region, start, end)] * processes)
        # Told to finish, then joined: every worker's count is in. (Terminating a plain forked pool in a process
        # with Ray up once left a worker waiting for good; fork_pool's workers end when terminated.)
        pool.close()
        pool.join()
    finally:
        pool.terminate()  # after an error; nothing left to stop after the join
    found = {"img_per_s": sum(counts) / seconds, "processes": processes,
             "per_process": sum(counts) / seconds / processes, "record_bytes": round(_mean_bytes(samples)),
             "region_decode": region,
             "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    keep(CEILINGS_FILE, key, found)
    return found


def main(argv=None) -> int:
    """``python -m gpufeed.bench.cpuceiling DST``: what every core decodes and crops at once from a benchmark
    dataset's records, for training and evaluation crops, decoding whole JPEGs and each crop's box alone (where
    nvImageCodec is installed), measured side by side now; each figure printed and appended to ``--results``."""
    import argparse
    import json
    import os

    from gpufeed.bench.dataset import load_dataset_info
    from gpufeed.pipelines.loader import region_decode_on

    parser = argparse.ArgumentParser(prog="python -m gpufeed.bench.cpuceiling", description=main.__doc__)
    parser.add_argument("dst", help="a benchmark dataset (gpufeed bench dataset)")
    parser.add_argument("--format", default="recordio")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--processes", type=int, default=None, help="default: every usable core")
    parser.add_argument("--results", help="a JSON-lines file the figures are appended to")
    args = parser.parse_args(argv)
    described = load_dataset_info(args.dst)["formats"][args.format]
    regions = (False, True) if region_decode_on(None) else (False,)
    for train in (True, False):
        for region in regions:
            found = decode_ceiling(args.format, described["paths"][0], train, seconds=args.seconds,
                                   processes=args.processes, region=region, remeasure=True)
            row = {"what": "cpu decode ceiling", "format": args.format, "task": "train" if train else "eval",
                   **found}
            print(f"{row['task']:5s} {'box alone' if region else 'whole JPEG':10s} {found['img_per_s']:9.0f} img/s "
                  f"({found['processes']} processes, {found['per_process']:.0f} each, "
                  f"{found['record_bytes'] / 1e3:.0f} KB records)", flush=True)
            if args.results:
                os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
                with open(args.results, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
