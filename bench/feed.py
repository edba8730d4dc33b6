"""``gpufeed bench feed DST``: how many emulated accelerators one disk keeps busy, as MLPerf Storage counts them.

Each emulated accelerator is a process that reads its rank's share of a format in shuffled order (the stored bytes,
as MLPerf Storage's clients read: no decoding, which is the CPU's question, not the disk's), a batch at a time with
``--threads`` reads in flight (in ``--readers`` processes), and "computes" each batch by sleeping the step time of
an accelerator profile (:mod:`gpufeed.bench.accelerator`), the next batch being read meanwhile. Its AU is compute
time / wall time over the timed steps. N accelerators run at once on one tier (an emulated profile throttles all of
them through one shared token bucket, or a real mount serves them), and the search doubles N while every rank keeps
AU >= 0.90, then bisects between the last N that passed and the first that failed. The row says the largest N fed,
the disk (profile and size) and each N tried with its lowest AU.

The processes share this machine's cores: when its CPUs were busier than 90% during a failing N, the row says
the machine, not the disk, may have been the limit (``cpu_limited``), as MLPerf Storage warns of its clients.

Every N reads cold, as MLPerf Storage's rule (a dataset several times the host's memory) makes its reads: the
file is evicted from the page cache before each N. On an emulated tier every read is charged to the disk
(``requests`` accounting), so a rank that comes round its share again, or a record the page cache still holds,
costs what a read of a dataset larger than memory would. A real mount is only as cold as the file is large, so
there N stops where the ranks together would read more records than the file holds (``cold_max_gpus``): the
row says so, and a larger dataset tests further.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import numpy as np

from gpufeed.bench import AU_TARGET
from gpufeed.errors import ConfigError

#: A failing N on an emulated disk that drew less than this share of its MB/s and of its IOPS did not fail on the
#: disk: the readers (this machine, the emulator's per-request cost) were the limit.
CAPS_REACHED = 0.80


#: Records per second one reader process serves (measured on the H200 machine: ~12,000 small records/s from the
#: local disk, ~6,500/s through the emulator, a Python request each). An accelerator gets one reader process per
#: this many records/s of its demand by default: training an H200 one, inference three.
READS_PER_PROCESS = 6_000

_reading: dict = {}


def _start_reading(cfg: dict) -> None:
    """In a reader process (or the rank itself): ``cfg['threads'] // cfg['readers']`` reads in flight, a reader
    per thread (readers keep a file position, so threads must not share one)."""
    import threading

    from gpufeed.formats import get_format
    from gpufeed.formats.torch import ConcatIndex

    local = threading.local()
    paths, index = cfg["paths"], ConcatIndex(cfg["counts"])

    def read(i: int) -> int:
        if not hasattr(local, "readers"):
            local.readers = [None] * len(paths)
        j, k = index.locate(i)
        if local.readers[j] is None:
            local.readers[j] = get_format(cfg["format"]).reader(paths[j])
        return len(local.readers[j].read_raw(k))

    _reading["read"] = read
    _reading["pool"] = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, cfg["threads"] // cfg["readers"]))


def _read_part(idx: list[int]) -> int:
    """Bytes of the records ``idx``, read by this process's threads."""
    return sum(_reading["pool"].map(_reading["read"], idx))


def _rank(cfg: dict, rank: int, world: int, conn) -> None:
    """One emulated accelerator (a child process): AU over the timed steps, sent back through ``conn``. Its
    batches are read by ``cfg['readers']`` processes (itself when 1), each a part of every batch, as a
    DataLoader's workers are."""
    from gpufeed.machine import default_sigterm, fork_pool

    default_sigterm()  # this process ends when terminated, as the reader processes it forks do
    parts = ahead = None
    try:
        records = cfg["records"]
        order = np.random.default_rng((cfg["seed"], 0)).permutation(records)[rank::world]
        batch, step_s, k = cfg["batch"], cfg["step_s"], cfg["readers"]
        steps = cfg["warmup"] + cfg["steps"]
        if len(order) < batch:
            raise ConfigError(f"{cfg['paths'][0]}: {records} records give rank {rank} of {world} fewer than one "
                              f"batch of {batch}; build a larger dataset or pass a smaller --batch-size")
        if k > 1:  # all started here, before this process has threads to fork with
            parts = fork_pool(k, initializer=_start_reading, initargs=(cfg,))
        else:
            _start_reading(cfg)

        read = []  # the batches read, in order

        def read_batch(b: int) -> int:
            read.append(b)
            idx = [int(order[(b * batch + j) % len(order)]) for j in range(batch)]
            if parts is None:
                return _read_part(idx)
            return sum(parts.map(_read_part, [idx[i::k] for i in range(k)]))

        ahead = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        pending = ahead.submit(read_batch, 0)
        waits, nbytes, t_start = [], 0, None
        for b in range(steps):
            if b == cfg["warmup"]:
                t_start = time.perf_counter()
            t0 = time.perf_counter()
            got = pending.result()
            if b >= cfg["warmup"]:
                nbytes += got
                waits.append(time.perf_counter() - t0)
            # No read is started past the last step: its bytes would be read (and, on an emulated tier,
            # charged) for a step that never comes.
            pending = ahead.submit(read_batch, b + 1) if b + 1 < steps else None
            time.sleep(step_s)
        wall = time.perf_counter() - t_start
        conn.send(("ok", {"au": cfg["steps"] * step_s / wall, "mb_per_s": nbytes / wall / 1e6,
                          "wait_p99_ms": float(np.percentile(waits, 99) * 1e3), "batches_read": len(read)}))
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it
        conn.send(("error", e))
    finally:
        conn.close()
        if ahead is not None:
            ahead.shutdown(wait=True, cancel_futures=True)  # after an error: a read in flight ends first
        if parts is not None:
            parts.terminate()
        os._exit(0)


def readers_for(step_s: float, batch: int) -> int:
    """Default reader processes of an accelerator: one per :data:`READS_PER_PROCESS` records/s it consumes."""
    return max(1, -(-int(batch / step_s) // READS_PER_PROCESS))


def run_n(cfg: dict, n: int) -> dict:
    """``n`` emulated accelerators at once: per rank AU, their lowest, the total MB/s and the machine's CPU use."""
    import multiprocessing

    from gpufeed.bench.cache import evict
    from gpufeed.bench.results import cpu_ticks
    from gpufeed.machine import sigterm_held

    ctx = multiprocessing.get_context("fork")
    for path in cfg["paths"]:
        evict(path)
    busy0, total0 = cpu_ticks()
    procs, conns = [], []
    for r in range(n):
        parent, child = ctx.Pipe(duplex=False)
        # Not daemonic: a rank starts its own reader processes.
        p = ctx.Process(target=_rank, args=(cfg, r, n, child))
        with sigterm_held():  # until the rank has SIGTERM's default (machine.sigterm_held)
            p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results = []
    for p, c in zip(procs, conns):
        try:
            status, value = c.recv()
        except EOFError:
            raise ConfigError(f"an emulated accelerator process died (exit code {p.exitcode}) with {n} at once; "
                              "look for an out-of-memory kill") from None
        p.join()
        if status == "error":
            raise value
        results.append(value)
    busy1, total1 = cpu_ticks()
    return {"gpus": n, "min_au": min(r["au"] for r in results), "au": [round(r["au"], 4) for r in results],
            "mb_per_s": sum(r["mb_per_s"] for r in results), "batches_read": [r["batches_read"] for r in results],
            "cpu_busy": (busy1 - busy0) / max(1e-9, total1 - total0)}


def search(cfg: dict, max_gpus: int, log=print, run=run_n) -> dict:
    """The largest N at which every rank keeps AU >= 0.90: doubling (up to ``max_gpus``), then bisection.
    ``run(cfg, n)`` measures one N (:func:`run_n`)."""
    tried: dict[int, dict] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            tried[n] = run(cfg, n)
            t = tried[n]
            log(f"  {n:>3} accelerators: lowest AU {t['min_au']:.3f}, {t['mb_per_s']:,.0f} MB/s read, "
                f"CPUs {t['cpu_busy']:.0%} busy")
        return tried[n]["min_au"] >= AU_TARGET

    good, bad = 0, None
    n = 1
    while n <= max_gpus:
        if ok(n):
            good = n
            if n == max_gpus:
                break
            n = min(n * 2, max_gpus)  # the top itself is tried when doubling would pass it
        else:
            bad = n
            break
    if bad is not None:
        while bad - good > 1:
            mid = (good + bad) // 2
            if ok(mid):
                good = mid
            else:
                bad = mid
    first_fail = tried.get(bad) if bad is not None else None
    return {"gpus_fed": good, "first_failing": bad, "capped_at_max": bad is None,
            "cpu_limited": bool(first_fail and first_fail["cpu_busy"] > 0.9),
            "tried": [tried[k] for k in sorted(tried)]}


def caps_shortfall(row: dict) -> str | None:
    """For a feed row on an emulated disk whose first failing N drew well under the disk's caps: a sentence
    saying so (the disk may feed more than the row says); else ``None``."""
    lim, fail = row.get("tier_limits") or {}, None
    for t in row.get("tried") or []:
        if t["gpus"] == row.get("first_failing"):
            fail = t
    size = row.get("record_bytes")
    if not lim or fail is None or not size:
        return None
    mb_share = fail["mb_per_s"] / lim["mb_per_s"]
    iops_share = fail["mb_per_s"] * 1e6 / size / lim["iops"]
    if max(mb_share, iops_share) >= CAPS_REACHED:
        return None
    return (f"at {fail['gpus']} the emulated disk served {fail['mb_per_s']:,.0f} of its {lim['mb_per_s']:,.0f} MB/s "
            f"and {iops_share:.0%} of its IOPS: the readers, not the disk, were the limit, and the disk may feed more")


def cold_max_gpus(cfg: dict, records: int, dst: str) -> int:
    """On a real mount, the most accelerators that can read cold at once out of ``records``: each reads
    ``warmup + steps`` batches of its own records, and a record read twice in one N would come from the page
    cache."""
    per_rank = (cfg["warmup"] + cfg["steps"]) * cfg["batch"]
    if records < per_rank:
        raise ConfigError(f"{dst}: {records} records are fewer than one accelerator's {per_rank} cold reads "
                          f"({cfg['warmup']} + {cfg['steps']} steps of {cfg['batch']}) on a real mount; build a "
                          "larger dataset or pass fewer --steps")
    return records // per_rank


def files_config(fmt: str, paths: list[str]) -> dict:
    """What the ranks read: ``fmt``'s files ``paths`` as one run of records (each file's record count, and
    how many in all), counted once here (a TFRecord without ``.idx`` is scanned)."""
    counts = [_records(fmt, path) for path in paths]
    return {"format": fmt, "paths": list(paths), "counts": counts, "records": sum(counts)}


def _records(fmt: str, path: str) -> int:
    from gpufeed.formats import get_format

    with get_format(fmt).reader(path) as reader:  # closed: eviction refuses a file this process maps
        return len(reader)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gpufeed.bench.cli import add_tier_arguments
    from gpufeed.formats import FORMATS

    parser.add_argument("dst", help="benchmark dataset (gpufeed bench dataset DST, or a gpufeed convert output)")
    add_tier_arguments(parser)
    parser.add_argument("--formats", default=None,
                        help=f"comma-separated, of {', '.join(FORMATS)} (default: every format DST holds)")
    parser.add_argument("--task", choices=("train", "infer"), default="train")
    parser.add_argument("--profile", default="h200", help="accelerator profile whose step time is emulated")
    parser.add_argument("--batch-size", type=int, default=None, help="images per step (the profile's by default)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per accelerator")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=32,
                        help="reads in flight per accelerator (requests/s <= threads / latency: enough that the "
                             "disk, not the reader, is the limit)")
    parser.add_argument("--readers", type=int, default=None,
                        help="reader processes per accelerator, sharing its --threads (default: one per "
                             f"{READS_PER_PROCESS:,} records/s the accelerator consumes, as a DataLoader has workers)")
    parser.add_argument("--max-gpus", type=int, default=64, help="stop the search here")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample order")


def run(args) -> int:
    from gpufeed.bench.accelerator import get_profile
    from gpufeed.bench.cli import tiers_from_args
    from gpufeed.bench.dataset import formats_of, load_dataset_info
    from gpufeed.bench.read import dataset_paths, tier_dataset
    from gpufeed.bench.results import ResultWriter, summarize
    from gpufeed.bench.train import tier_scope

    profile = get_profile(args.profile).task(args.task)
    batch = args.batch_size or profile.batch
    readers = args.readers or readers_for(profile.step_time(batch), batch)
    if min(batch, args.steps, args.threads, args.max_gpus, readers) < 1 or args.warmup_steps < 0:
        raise ConfigError("--batch-size, --steps, --threads, --readers and --max-gpus must be at least 1")
    if readers > args.threads:
        raise ConfigError(f"--readers {readers} share --threads {args.threads} reads in flight: pass at least as "
                          "many threads as readers")
    info = load_dataset_info(args.dst)
    writer = ResultWriter(args.results, data_path=args.dst)
    for tier in tiers_from_args(args, os.path.abspath(args.dst)):
        directory = tier_dataset(tier, os.path.abspath(args.dst))
        for fmt in formats_of(info, args.formats, args.dst):
            paths = dataset_paths(info, directory, fmt)
            cfg = {**files_config(fmt, paths), "batch": batch, "step_s": profile.step_time(batch),
                   "steps": args.steps, "warmup": args.warmup_steps, "threads": args.threads, "readers": readers,
                   "seed": args.seed}
            records = cfg["records"]
            cold_max = None if tier.limits is not None else cold_max_gpus(cfg, records, args.dst)
            record_bytes = round(info["formats"][fmt]["data_bytes"] / records)
            top = args.max_gpus if cold_max is None else min(args.max_gpus, cold_max)
            print(f"{tier.name} {fmt} {args.task}: emulated {args.profile} accelerators, "
                  f"{batch / cfg['step_s']:,.0f} img/s each", file=sys.stderr, flush=True)
            with tier_scope(tier, directory, args.allow_invalid, accounting="requests") as validity:
                found = search(cfg, top, log=lambda line: print(line, file=sys.stderr, flush=True))
            row = {"bench": "feed", **tier.row_fields(), "format": fmt, **validity,
                   "params": {"task": args.task, "accelerator": args.profile, "batch_size": batch,
                              "steps": args.steps, "warmup_steps": args.warmup_steps, "threads": args.threads,
                              "readers": readers, "max_gpus": args.max_gpus, "cold": True},
                   **summarize("gpus_fed", "accelerators", [found["gpus_fed"]]), **found,
                   "cold_max_gpus": cold_max, "record_bytes": record_bytes}
            shortfall = caps_shortfall(row)
            # Only a failing N on an emulated disk says whether the disk was the limit.
            row["disk_limited"] = (None if tier.limits is None or found["first_failing"] is None
                                   else shortfall is None)
            writer.write(row)
            limit = " (the machine's CPUs, not only the disk, may have been the limit)" if found["cpu_limited"] else ""
            more = ""
            if found["capped_at_max"]:
                more = (f" (the search stopped at --max-gpus {args.max_gpus})" if top == args.max_gpus else
                        f" (the search stopped at {top}: {args.dst} holds records for {top} accelerators to read "
                        "once each, cold; a larger dataset tests further)")
            print(f"{tier.name:<12}{fmt:<9} feeds {found['gpus_fed']} emulated {args.profile} ({args.task}) at AU >= "
                  f"{AU_TARGET:.0%}{more}{limit}" + (f" ({shortfall})" if shortfall else ""))
    return 0
