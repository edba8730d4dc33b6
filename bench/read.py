"""``gpufeed bench read DST``: how fast each format feeds a training loop from each storage tier.

For every tier x format x (raw bytes | decode + RandomResizedCrop + flip) x DataLoader workers x (cold | warm)
it reads a random sample of the dataset the way training does (shuffled indices through
:class:`gpufeed.formats.torch.MapDataset` and a torch ``DataLoader``; a process pool where torch is absent) and
records samples/s, MB/s, per-read latency p50/p99, device IOPS and mean request size, and the bytes that came
from the device versus the page cache.

Every run happens in a fresh child process, so no reader (and no LMDB map) survives in the parent and the
page cache can be evicted between runs (:func:`gpufeed.bench.cache.evict`). Each read is timed and its
device bytes counted (``/proc/thread-self/io``) in whichever process performs it, so "cold" is proven, not
assumed: a cold run whose reads were served from cache is flagged ``cold_verified: false``.

Device requests: for an emulated tier, the emulator's own counters (the requests the emulated disk served);
for a measured tier, ``/proc/diskstats`` of the disk holding the data (other processes on the machine count
too: compare within one run).
"""

from __future__ import annotations

import os
import statistics
import time

from gpufeed.bench.cache import pread_read_bytes
from gpufeed.errors import ConfigError, GpufeedError

DECODE_MODES = ("raw", "decode")
CACHE_STATES = ("cold", "warm")
ACCESS = ("random", "sequential")

#: A cold run must have read at least this share of its payload from the device (page rounding and readahead
#: push it above 1; anything far below means the cache served it).
COLD_MIN_FRACTION = 0.9
#: A warm run may read at most this share from the device.
WARM_MAX_FRACTION = 0.05


class TimedDataset:
    """A map-style dataset over one format that returns, per sample, what the benchmark needs: ``(label,
    stored bytes, read seconds, device bytes, data)``, where data is the stored bytes or, with ``decode``, the
    augmented HWC uint8 image. Reads go through :class:`gpufeed.formats.torch.MapDataset` when torch is there.
    """

    def __init__(self, format_name: str, paths: list[str], decode: bool, crop: int, seed: int = 0):
        self.format_name, self.paths, self.decode, self.crop, self.seed = format_name, paths, decode, crop, seed
        self._inner = None
        self._pid = None
        self._io_fd = None
        self._first = True

    def _open(self):
        if self._pid == os.getpid():
            return
        try:
            from gpufeed.formats.torch import MapDataset

            self._inner = MapDataset(self.format_name, self.paths, rank=0, world_size=1)
        except ImportError:
            self._inner = _Flat(self.format_name, self.paths)
        self._io_fd = os.open("/proc/thread-self/io", os.O_RDONLY)
        self._pid = os.getpid()
        self._first = True

    def __getstate__(self):
        return {**self.__dict__, "_inner": None, "_pid": None, "_io_fd": None, "_first": True}

    def __len__(self):
        self._open()
        return len(self._inner)

    def _read_bytes(self) -> int:
        # The fd was opened by this process's thread that first used the dataset; DataLoader workers and pool
        # workers read from one thread, so it names the thread doing the reads.
        return pread_read_bytes(self._io_fd)

    def __getitem__(self, i: int):
        from gpufeed.formats.torch import relayed

        with relayed():  # a damaged record or image reaches the benchmark's process as one gpufeed error
            return self._item(i)

    def _item(self, i: int):
        self._open()
        rb0 = self._read_bytes()
        t0 = time.perf_counter()
        sample = self._inner[i]
        seconds = time.perf_counter() - t0
        if self._first:
            # A process's first read also opens its readers (LMDB env, index): not a storage latency.
            self._first, seconds = False, None
        device = self._read_bytes() - rb0
        payload = sample.payload
        if isinstance(payload, memoryview):
            payload = bytes(payload)
        size = payload.nbytes if hasattr(payload, "nbytes") else len(payload)
        data = payload
        if self.decode:
            import numpy as np

            from gpufeed.pipelines.transforms import decode_crop, random_resized_crop_choice, random_resized_crop_flip

            rng = np.random.default_rng([self.seed, i])
            if sample.kind == "raw":
                data = random_resized_crop_flip(payload, self.crop, rng)
            else:
                data = decode_crop(payload, f"{self.paths[0]}[{i}]", self.crop, random_resized_crop_choice(rng))
        return sample.labels[0], size, seconds, device, data


class _Flat:
    """Global index over several outputs of one format, for machines without torch."""

    def __init__(self, format_name: str, paths: list[str]):
        from gpufeed.formats import get_format

        fmt = get_format(format_name)
        self._readers = [fmt.reader(p) for p in paths]
        self._starts = [0]
        for r in self._readers:
            self._starts.append(self._starts[-1] + len(r))

    def __len__(self):
        return self._starts[-1]

    def __getitem__(self, i):
        import bisect

        j = bisect.bisect_right(self._starts, i) - 1
        return self._readers[j][i - self._starts[j]]


def _collate(batch):
    labels, sizes, seconds, device, data = zip(*batch)
    first = data[0]
    if hasattr(first, "shape") and all(getattr(d, "shape", None) == first.shape for d in data):
        import numpy as np

        stacked = np.stack(data)
        try:
            import torch

            stacked = torch.from_numpy(stacked)
        except ImportError:
            pass
        data = stacked
    return list(labels), list(sizes), list(seconds), list(device), data


def _pool_batch(args):
    ds, idx = args
    return _collate([ds[i] for i in idx])


def _disk_counters(device: str | None) -> tuple[int, int] | None:
    """(reads completed, bytes read) of a block device from /proc/diskstats."""
    if not device:
        return None
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                parts = line.split()
                if parts[2] == device:
                    return int(parts[3]), int(parts[5]) * 512
    except OSError:
        pass
    return None


def measure_once(cfg: dict) -> dict:
    """One timed pass (runs in a child process): read ``cfg['samples']`` samples and return the figures."""
    import numpy as np

    from gpufeed import io as gio

    ds = TimedDataset(cfg["format"], cfg["paths"], cfg["decode"], cfg["crop"], cfg["seed"])
    total = len(ds)
    count = min(cfg["samples"], total)
    if cfg["access"] == "random":
        indices = np.random.default_rng(cfg["seed"]).permutation(total)[:count].tolist()
    else:
        indices = list(range(count))
    thr = gio.throttle()
    thr_before = thr.stats() if thr is not None else None
    disk_before = _disk_counters(cfg.get("disk"))
    sizes, seconds, device = [], [], []
    workers, bs = cfg["workers"], cfg["batch_size"]
    t0 = time.perf_counter()
    if cfg["loader"] == "torch":
        import torch.utils.data

        loader = torch.utils.data.DataLoader(ds, batch_size=bs, sampler=indices, num_workers=workers,
                                             collate_fn=_collate, prefetch_factor=2 if workers else None)
        batches = iter(loader)
    else:
        chunks = [(ds, indices[k:k + bs]) for k in range(0, count, bs)]
        if workers:
            from gpufeed.machine import fork_pool

            pool = fork_pool(workers)
            batches = pool.imap(_pool_batch, chunks)
        else:
            pool = None
            batches = map(_pool_batch, chunks)
    deadline = t0 + cfg["max_seconds"] if cfg.get("max_seconds") else None
    for _labels, s, sec, dev, _data in batches:
        sizes.extend(s)
        seconds.extend(sec)
        device.extend(dev)
        if deadline is not None and time.perf_counter() >= deadline:
            break  # a slow tier: the samples read so far make the figures
    wall = time.perf_counter() - t0
    count = len(sizes)
    if cfg["loader"] == "torch":
        del batches  # stops the DataLoader's workers
    elif pool is not None:
        pool.terminate()
        pool.join()
    nbytes = sum(sizes)
    lat = sorted(s for s in seconds if s is not None) or [0.0]
    out = {"samples_per_s": count / wall, "mb_per_s": nbytes / wall / 1e6, "wall_s": wall, "samples": count,
           "read_p50_ms": statistics.median(lat) * 1e3, "read_p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))]
           * 1e3, "payload_bytes": nbytes, "device_bytes": sum(device),
           "device_fraction": sum(device) / nbytes if nbytes else 0.0}
    out["cache_bytes"] = max(0, nbytes - out["device_bytes"])
    if thr is not None:
        after = thr.stats()
        req = after["requests"] - thr_before["requests"]
        rd = after["bytes_read"] - thr_before["bytes_read"]
        out.update(iops=req / wall, mean_request_kib=rd / req / 1024 if req else None, device_requests=req,
                   emulator_slept_s=after["slept_s"] - thr_before["slept_s"])
    disk_after = _disk_counters(cfg.get("disk"))
    if thr is None and disk_before and disk_after:
        req = disk_after[0] - disk_before[0]
        rd = disk_after[1] - disk_before[1]
        out.update(iops=req / wall, mean_request_kib=rd / req / 1024 if req else None, device_requests=req)
    return out


def _child(cfg, conn):
    try:
        conn.send(("ok", measure_once(cfg)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent, which re-raises
        try:
            conn.send(("error", e))
        except Exception:  # noqa: BLE001 - unpicklable error: send its text
            conn.send(("error", GpufeedError(f"read benchmark run failed: {e!r}")))
    finally:
        conn.close()


def run_in_child(cfg: dict) -> dict:
    """:func:`measure_once` in a fresh (non-daemon, so it may start DataLoader workers) child process."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(cfg, child), daemon=False)
    p.start()
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        p.join()
        raise GpufeedError(f"read benchmark child for {cfg['format']} died with exit code {p.exitcode} before "
                           "reporting; rerun with fewer --workers or look for an out-of-memory kill") from None
    p.join()
    if status == "error":
        raise value
    return value


def tier_dataset(tier, dst: str) -> str:
    """The dataset directory for ``tier``: ``dst`` on the host disk, or a copy of it on a measured mount."""
    from gpufeed.bench.dataset import MANIFEST
    from gpufeed.bench.tiers import copy_to_mount

    def described(d):
        return os.path.exists(os.path.join(d, MANIFEST)) or os.path.exists(os.path.join(d, "manifest.json"))

    if tier.path is None:
        return dst
    if described(tier.path):
        return tier.path
    target = os.path.join(tier.path, "gpufeed-bench", os.path.basename(os.path.abspath(dst)))
    if not described(target):
        copy_to_mount(dst, target)
    return target


def dataset_paths(info: dict, directory: str, fmt: str) -> list[str]:
    """The reader paths of ``fmt`` in ``info``'s dataset, as it lies in ``directory`` (itself or a copy)."""
    rel = info["formats"][fmt].get("relpaths")
    if rel is None:
        raise ConfigError(f"{info['out']} was built by an older gpufeed bench dataset, which did not record its "
                          "files' paths: build it again")
    return [os.path.join(directory, r) for r in rel]


#: ``--grid``: what a run measures unless an option says otherwise. ``quick`` answers "how fast does each
#: format read from each tier" in a couple of minutes (cold, one worker count, one run of at most
#: QUICK_RUN_SECONDS per configuration); ``full`` is the whole grid with repeats, for reports.
GRIDS = {
    "quick": {"modes": "raw,decode", "workers": None, "cache": "cold", "repeats": 1, "warmup": 0,
              "max_seconds": 10.0},
    "full": {"modes": "raw,decode", "workers": [0, 2], "cache": "cold,warm", "repeats": 3, "warmup": 1,
             "max_seconds": None},
}


def _quick_workers() -> list[int]:
    from gpufeed.machine import usable_cores

    return [min(8, usable_cores())]


def add_arguments(parser) -> None:
    from gpufeed.bench.cli import add_tier_arguments, int_list

    parser.add_argument("dst", metavar="DST", help="benchmark dataset directory (gpufeed bench dataset DST)")
    add_tier_arguments(parser)
    parser.set_defaults(repeats=None, warmup=None)  # from --grid unless given
    parser.add_argument("--grid", choices=tuple(GRIDS), default="quick",
                        help="quick: cold reads, one worker count (the cores, at most 8), one run of at most "
                             "10 s per configuration, a couple of minutes in all; full: raw and decode x workers "
                             "0,2 x cold and warm, 3 runs each after a warm-up. The options below override either")
    parser.add_argument("--formats", default=None, help="comma-separated formats (default: all in DST)")
    parser.add_argument("--workers", type=int_list, default=None, help="DataLoader worker counts, e.g. 0,2,8")
    parser.add_argument("--modes", default=None,
                        help="raw: read stored bytes only; decode: + decode, RandomResizedCrop and flip "
                             "(default: both)")
    parser.add_argument("--cache", default=None, help="page-cache states to run: cold, warm or both")
    parser.add_argument("--max-seconds", type=float, default=None, metavar="S",
                        help="end a run after S seconds (or --samples), whichever comes first")
    parser.add_argument("--access", choices=ACCESS, default="random", help="shuffled (training) or file order")
    parser.add_argument("--samples", type=int, default=1000, help="samples read per run")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per DataLoader batch")
    parser.add_argument("--crop", type=int, default=None, help="RandomResizedCrop size (224; 32 for cifar)")
    parser.add_argument("--host-seconds", type=float, default=0.5,
                        help="seconds per pattern when measuring the host disk before emulating")
    parser.add_argument("--loader", choices=("auto", "torch", "pool"), default="auto",
                        help="torch DataLoader (auto when torch is installed) or a multiprocessing pool")


def _csv(text: str, allowed, what: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ConfigError(f"--{what} {text!r}: choose from {', '.join(allowed)}")
    return values


def format_row(r: dict) -> str:
    m = r["metrics"]
    flag = "" if r["valid"] else "  INVALID"
    return (f"{r['tier']:<9}{r['format']:<9}{r['params']['mode']:<7}w={r['params']['workers']:<3}"
            f"{r['params']['cache']:<5}{r['median']:>9.1f} samples/s  {m['mb_per_s']['median']:>8.1f} MB/s  "
            f"p50 {m['read_p50_ms']['median']:6.2f} ms  p99 {m['read_p99_ms']['median']:7.2f} ms  "
            f"from device {m['device_fraction']['median']:5.0%}{flag}")


def run(args) -> int:
    import sys

    rows = bench_read(args, progress=lambda line: print(line, file=sys.stderr, flush=True))
    for r in rows:
        print(format_row(r))
    return 0


def resolve_grid(args) -> dict:
    """The grid a run measures: ``--grid``'s settings, each overridden by its option when given."""
    grid = dict(GRIDS[args.grid])
    if grid["workers"] is None:
        grid["workers"] = _quick_workers()
    for key in ("modes", "workers", "cache", "repeats", "warmup", "max_seconds"):
        if getattr(args, key, None) is not None:
            grid[key] = getattr(args, key)
    if grid["max_seconds"] is not None and grid["max_seconds"] <= 0:
        raise ConfigError(f"--max-seconds must be positive, not {grid['max_seconds']}")
    return grid


_UNITS = {"samples_per_s": "samples/s", "samples": "samples", "mb_per_s": "MB/s", "read_p50_ms": "ms",
          "read_p99_ms": "ms", "iops": "requests/s", "mean_request_kib": "KiB", "device_bytes": "bytes", "cache_bytes": "bytes",
          "device_fraction": "ratio", "payload_bytes": "bytes", "wall_s": "s", "emulator_slept_s": "s"}


def bench_read(args, progress=None) -> list[dict]:
    """The grid of ``gpufeed bench read`` (:func:`resolve_grid`); returns the rows it wrote. ``progress``
    gets one line per configuration as it starts, with the time spent and an estimate of what is left."""
    from gpufeed.bench.cache import evict, warm
    from gpufeed.bench.cli import tiers_from_args
    from gpufeed.bench.dataset import dataset_fields, formats_of, load_dataset_info
    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.hostdisk import measure_host, require_valid, row_figures
    from gpufeed.bench.results import ResultWriter, disk_info, metrics_block, repeat, summarize

    info = load_dataset_info(args.dst)
    grid = resolve_grid(args)
    formats = formats_of(info, args.formats, args.dst)
    modes = _csv(grid["modes"], DECODE_MODES, "modes")
    caches = _csv(grid["cache"], CACHE_STATES, "cache")
    if args.samples < 1 or args.batch_size < 1:
        raise ConfigError("--samples and --batch-size must be >= 1")
    loader = args.loader
    if loader == "auto":
        try:
            import torch  # noqa: F401

            loader = "torch"
        except ImportError:
            loader = "pool"
    crop = args.crop or (32 if info["image"] == "cifar" else 224)
    tiers = tiers_from_args(args, os.path.abspath(args.dst))
    writer = ResultWriter(args.results, data_path=args.dst)
    rows = []
    total = len(tiers) * len(formats) * len(modes) * len(grid["workers"]) * len(caches)
    # Every emulated tier is checked against the host disk before the first run (its figures are known then):
    # one the host cannot emulate stops the command before it has measured anything, not after the others.
    checked = {}
    for tier in tiers:
        if tier.mode == "emulated":
            directory = tier_dataset(tier, os.path.abspath(args.dst))
            host = measure_host(directory, seconds=args.host_seconds)
            checked[tier.name] = (host, require_valid(tier, host, args.allow_invalid))
    clock = Eta(total, progress)
    for tier in tiers:
        directory = tier_dataset(tier, os.path.abspath(args.dst))
        disk = disk_info(directory).get("disk")
        host, invalid = checked.get(tier.name, (None, None))
        for fmt in formats:
            paths = dataset_paths(info, directory, fmt)
            fmt_fields = dataset_fields(info, fmt)
            for mode in modes:
                for workers in grid["workers"]:
                    for cache in caches:
                        clock.next(f"{tier.name} {fmt} {mode} w={workers} {cache}")
                        cfg = {"format": fmt, "paths": paths, "decode": mode == "decode", "crop": crop,
                               "workers": workers, "batch_size": args.batch_size, "samples": args.samples,
                               "access": args.access, "loader": loader, "disk": disk, "seed": 0,
                               "max_seconds": grid["max_seconds"]}

                        def prepare(paths=paths, cache=cache):
                            if cache == "cold":
                                evict(*paths)
                            else:
                                warm(*paths)

                        def once(i, cfg=cfg):
                            cfg = {**cfg, "seed": i}
                            if tier.mode == "emulated":
                                with Throttle.emulate(tier.limits, state_dir=directory):
                                    return run_in_child(cfg)
                            return run_in_child(cfg)

                        runs = repeat(once, grid["repeats"], grid["warmup"], before_each=prepare)
                        fractions = [r["device_fraction"] for r in runs]
                        verified = (min(fractions) >= COLD_MIN_FRACTION if cache == "cold"
                                    else max(fractions) <= WARM_MAX_FRACTION)
                        row = {"bench": "read", **tier.row_fields(), "format": fmt,
                               "params": {"mode": mode, "decode": mode == "decode", "workers": workers,
                                          "cache": cache, "access": args.access, "batch_size": args.batch_size,
                                          "samples": cfg["samples"], "crop": crop if mode == "decode" else None,
                                          "loader": loader, "warmup": grid["warmup"], "grid": args.grid,
                                          "max_seconds": grid["max_seconds"]},
                               **fmt_fields,
                               f"{cache}_verified": verified,
                               "valid": invalid is None, "invalid_reason": invalid,
                               **summarize("samples_per_s", "samples/s", [r["samples_per_s"] for r in runs]),
                               "metrics": metrics_block(runs, _UNITS)}
                        if host is not None:
                            row["host_disk"] = row_figures(host)
                        rows.append(writer.write(row))
    return rows


class Eta:
    """``[3/12] ssd tfrecord raw w=2 cold (41 s so far, about 1.6 min left)``: one line per configuration."""

    def __init__(self, total: int, out):
        self.total, self.out, self.done, self.t0 = total, out, 0, time.perf_counter()

    def next(self, what: str) -> None:
        if self.out is None:
            return
        spent = time.perf_counter() - self.t0
        left = ""
        if self.done:
            rest = spent / self.done * (self.total - self.done)
            left = f", about {rest / 60:.1f} min left" if rest >= 90 else f", about {rest:.0f} s left"
        self.done += 1
        self.out(f"[{self.done}/{self.total}] {what} ({spent:.0f} s so far{left})")
