"""``gpufeed bench convert SRC``: how long the real ``gpufeed convert`` takes per format, tier and worker count.

Each run is the shipped command (``python -m gpufeed convert ...``, Ray and all) in a fresh subprocess, with
the source evicted from the page cache and the previous output removed first. On an emulated tier the
subprocess inherits ``GPUFEED_TIER_STATE`` and the engine hands it to Ray workers through ``runtime_env``, so
source reads and output writes of every worker draw from one emulated disk. On a measured tier (``NAME=PATH``)
the source is copied onto the mount once and the output written there.

Per run: wall time and images/s (samples written, from the output's ``manifest.json``); CPU user and system
seconds of the whole process tree (the driver, raylet and workers, sampled with psutil) and their share of
``wall x workers``; the machine-wide I/O-wait share from ``/proc/stat``; write MB/s; and, on an emulated tier,
the share of worker time spent waiting on the emulated disk.

Nothing here imports Ray: the subprocess does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

from gpufeed.errors import ConfigError, GpufeedError
from gpufeed.formats import FORMATS, parse_formats
from gpufeed.machine import usable_cores
from gpufeed.pipelines import ON_ERROR

#: psutil sampling period for the process tree's CPU times: processes that exit between samples lose at most
#: this much CPU time from the total (Ray workers live for the whole run).
_SAMPLE_S = 0.1


def _cpu_stat() -> list[int]:
    """Machine-wide jiffies: user, nice, system, idle, iowait, irq, softirq, steal."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:9]]


class _TreeCPU:
    """Sum of user/system CPU seconds over a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int):
        import psutil

        self._psutil = psutil
        self._root = psutil.Process(pid)
        self._seen: dict[tuple[int, float], tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self):
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except self._psutil.Error:
            return
        for p in procs:
            try:
                key = (p.pid, p.create_time())
                t = p.cpu_times()
                self._seen[key] = (t.user, t.system)
            except self._psutil.Error:
                continue

    def _loop(self):
        while not self._stop.wait(_SAMPLE_S):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def totals(self) -> tuple[float, float]:
        return sum(u for u, _ in self._seen.values()), sum(s for _, s in self._seen.values())


def convert_command(dataset: str, src: str, fmt: str, out: str, workers: int, extra=()) -> list[str]:
    # Its stderr is a pipe (run_convert relays it): the progress comes as a plain line every 30 s, not a bar.
    return [sys.executable, "-m", "gpufeed", "convert", dataset, src, "--to", fmt, "--out", out,
            "--workers", str(workers), "--no-resume", *extra]


def run_convert(cmd: list[str], out: str, workers: int, throttle=None, timeout: float | None = None,
                echo=None) -> dict:
    """Run one conversion command and measure it. ``echo(line)`` gets each line the conversion prints on
    stderr as it prints it (its progress: a line every 30 s where stderr is not a terminal)."""
    stat0 = _cpu_stat()
    thr0 = throttle.stats() if throttle is not None else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    printed: list[str] = []

    def relay():
        for line in proc.stderr:
            said.append(line)
            if echo is not None:
                echo(line.rstrip("\n"))

    readers = [threading.Thread(target=relay, daemon=True),
               threading.Thread(target=lambda: printed.append(proc.stdout.read()), daemon=True)]
    for t in readers:
        t.start()
    with _TreeCPU(proc.pid) as tree:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise GpufeedError(f"`{' '.join(cmd)}` ran past {timeout} s; give a smaller source or a larger "
                               "--timeout") from None
    for t in readers:
        t.join()
    stdout, stderr = "".join(printed), "".join(said)
    wall = time.perf_counter() - t0
    stat1 = _cpu_stat()
    if proc.returncode != 0:
        raise GpufeedError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}: "
                           f"{(stderr or stdout).strip()[-800:]}")
    from gpufeed.convert import manifest as convert_manifest

    manifest = convert_manifest.load(out)
    written = sum(s["written"] for s in manifest["splits"].values())
    user, system = tree.totals()
    d = [b - a for a, b in zip(stat0, stat1)]
    busy_total = sum(d) or 1
    res = {"wall_s": wall, "images": written, "images_per_s": written / wall,
           "bytes_written": manifest["bytes_written"], "write_mb_per_s": manifest["bytes_written"] / wall / 1e6,
           "cpu_user_s": user, "cpu_sys_s": system, "cpu_share": (user + system) / (wall * workers),
           "machine_iowait_share": d[4] / busy_total, "machine_busy_share": (d[0] + d[1] + d[2]) / busy_total,
           "engine_images_per_s": manifest["timings"]["images_per_second"]}
    if throttle is not None:
        t = throttle.stats()
        slept = t["slept_s"] - thr0["slept_s"]
        res.update(emulated_wait_s=slept, emulated_wait_share=slept / (wall * workers),
                   device_requests=t["requests"] - thr0["requests"],
                   device_read_bytes=t["bytes_read"] - thr0["bytes_read"],
                   device_written_bytes=t["bytes_written"] - thr0["bytes_written"])
    return res


def _tier_source(tier, src: str) -> str:
    """The source for ``tier``: ``src`` itself, or a copy of it on the tier's mount."""
    from gpufeed.bench.tiers import copy_to_mount

    if tier.path is None:
        return src
    target = os.path.join(tier.path, "gpufeed-bench-src", os.path.basename(os.path.abspath(src)))
    if not os.path.exists(target):
        copy_to_mount(src, target)
    return target


def add_arguments(parser) -> None:
    from gpufeed.bench.cli import add_tier_arguments, int_list

    parser.add_argument("src", metavar="SRC", help="source dataset as shipped (e.g. from `gpufeed synth imagenet`)")
    parser.add_argument("--dataset", default="imagenet", help="dataset kind of SRC (as `gpufeed convert` takes)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="scratch directory for outputs on emulated tiers (default: a temporary folder in the "
                             "working directory, removed at the end; never beside SRC)")
    add_tier_arguments(parser)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats (default: all)")
    parser.add_argument("--workers", type=int_list, default=[usable_cores()],
                        help="worker counts to run, e.g. 1,2,4")
    parser.add_argument("--resize", type=int, default=None, help="passed to convert (shorter side)")
    parser.add_argument("--on-error", choices=ON_ERROR, default="fail",
                        help="passed to convert: a bad input stops the run (fail), or is skipped and listed (skip)")
    parser.add_argument("--synth", type=int, default=None, metavar="PER_CLASS",
                        help="if SRC does not exist, synthesise an ImageNet there with 10 classes of PER_CLASS")
    parser.add_argument("--address", default=None,
                        help="run conversions on this running Ray cluster (passed to `gpufeed convert "
                             "--address`); by default each run starts its own local Ray. The cluster's workers are "
                             "not children of the run, so CPU user/sys then cover the driver only (the machine-wide "
                             "shares still cover everything)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one conversion may take")
    parser.add_argument("--host-seconds", type=float, default=0.5,
                        help="seconds per pattern when measuring the host disk before emulating")


def bench_convert(args, progress=None) -> list[dict]:
    """The grid of ``gpufeed bench convert``; ``progress(line)`` gets a line as each conversion starts (and the
    conversion's own progress lines)."""
    import tempfile

    if args.out is not None:
        return _bench_convert(args, os.path.abspath(args.out), progress)
    scratch = tempfile.mkdtemp(prefix="gpufeed-bench-convert-", dir=os.getcwd())
    try:
        return _bench_convert(args, scratch, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _bench_convert(args, scratch: str, progress) -> list[dict]:
    from gpufeed.bench.cache import evict, files_under
    from gpufeed.bench.cli import tiers_from_args
    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.hostdisk import measure_host, require_valid
    from gpufeed.bench.results import ResultWriter, dataset_ram_ratio, metrics_block, repeat, summarize

    src = os.path.abspath(args.src)
    if not os.path.exists(src):
        if args.synth is None:
            raise ConfigError(f"{src} does not exist; give a dataset, or --synth PER_CLASS to synthesise one")
        from gpufeed.pipelines.synth import synth_imagenet

        synth_imagenet(src, classes=10, per_class=args.synth, val_per_class=max(1, args.synth // 4),
                       bad_files=False)
    formats = list(parse_formats(args.formats))
    src_files = files_under(src)
    src_bytes = sum(os.path.getsize(f) for f in src_files)
    extra = (["--resize", str(args.resize)] if args.resize else []) + (
        ["--address", args.address] if args.address else []) + ["--on-error", args.on_error]
    writer = ResultWriter(args.results, data_path=scratch if os.path.exists(scratch) else src)
    rows = []
    tiers = tiers_from_args(args, scratch)
    from gpufeed.bench.read import Eta

    clock = Eta(len(tiers) * len(formats) * len(args.workers) * (args.warmup + args.repeats), progress)
    for tier in tiers:
        tier_src = _tier_source(tier, src)
        base = os.path.join(tier.path, "gpufeed-bench-out") if tier.path else scratch
        os.makedirs(base, exist_ok=True)
        invalid, host = None, None
        if tier.mode == "emulated":
            host = measure_host(base, seconds=args.host_seconds)
            invalid = require_valid(tier, host, args.allow_invalid)
        for fmt in formats:
            for workers in args.workers:
                out = os.path.join(base, f"{fmt}-w{workers}")
                cmd = convert_command(args.dataset, tier_src, fmt, out, workers, extra)

                def prepare(out=out, tier_src=tier_src):
                    shutil.rmtree(out, ignore_errors=True)
                    evict(tier_src)

                def once(i, cmd=cmd, out=out, workers=workers, fmt=fmt):
                    run = "warm-up" if i < args.warmup else f"run {i - args.warmup + 1} of {args.repeats}"
                    clock.next(f"{tier.name} {fmt} w={workers}, {run}")
                    echo = (lambda line: progress(f"  {line}")) if progress is not None else None
                    if tier.mode == "emulated":
                        with Throttle.emulate(tier.limits, state_dir=base) as t:
                            return run_convert(cmd, out, workers, throttle=t, timeout=args.timeout, echo=echo)
                    return run_convert(cmd, out, workers, timeout=args.timeout, echo=echo)

                runs = repeat(once, args.repeats, args.warmup, before_each=prepare)
                row = {"bench": "convert", **tier.row_fields(), "format": fmt,
                       "params": {"workers": workers, "dataset": args.dataset, "resize": args.resize,
                                  "on_error": args.on_error,
                                  "warmup": args.warmup, "command": " ".join(cmd[1:])},
                       "n_samples": runs[-1]["images"], "sample_bytes": src_bytes / max(1, len(src_files)),
                       "record_bytes": runs[-1]["bytes_written"] / max(1, runs[-1]["images"]),
                       "total_bytes": src_bytes, "dataset_ram_ratio": dataset_ram_ratio(src_bytes),
                       "valid": invalid is None, "invalid_reason": invalid,
                       **summarize("images_per_s", "images/s", [r["images_per_s"] for r in runs]),
                       "metrics": metrics_block(runs, _UNITS)}
                rows.append(writer.write(row))
                shutil.rmtree(out, ignore_errors=True)
    return rows


_UNITS = {"wall_s": "s", "images_per_s": "images/s", "write_mb_per_s": "MB/s", "cpu_user_s": "s",
          "cpu_sys_s": "s", "cpu_share": "ratio", "machine_iowait_share": "ratio", "machine_busy_share": "ratio",
          "emulated_wait_share": "ratio", "engine_images_per_s": "images/s", "device_requests": "requests",
          "device_read_bytes": "bytes", "device_written_bytes": "bytes", "bytes_written": "bytes"}


def run(args) -> int:
    for r in bench_convert(args, progress=lambda line: print(line, file=sys.stderr, flush=True)):
        m = r["metrics"]
        wait = m.get("emulated_wait_share", m["machine_iowait_share"])["median"]
        print(f"{r['tier']:<9}{r['format']:<9}w={r['params']['workers']:<3}{r['median']:>8.1f} images/s  "
              f"wall {m['wall_s']['median']:6.2f} s  user {m['cpu_user_s']['median']:6.1f} s  "
              f"sys {m['cpu_sys_s']['median']:5.1f} s  io-wait {wait:5.1%}" + ("" if r["valid"] else "  INVALID"))
    return 0
