"""Conversion at node scale: ``gpufeed convert --workers P`` against the machine's own parallel limit.

On one ImageNet-like corpus of ``n`` files (``unique`` photo-like JPEGs from
:func:`gpufeed.bench.experiments.transform_speed.make_corpus`, copied under new names: decode cost depends on the size,
not the content; 90% ~500x375, 10% 1600x1200), each run starts from a cold page cache and they run side by
side in one invocation:

* ``limit``: a plain ``multiprocessing.Pool(P)`` reading each file and running the per-core limit loop on
  it (DCT-domain downscale decode, cv2 resize of the shorter side to 256, JPEG q95 encode; nothing
  written), timed once its processes are up: what P cores can do with no framework at all. Also one process on a sample, for the hardware's
  own P-way scaling;
* ``limit-write3`` (``limit-write1``, ...): the limit loop writing what it encodes, as a conversion to three
  formats (one) must at least: each chunk of :data:`WRITE_CHUNK` images appended to three files (one) that are
  fsync'd and closed when the chunk ends, as a shard's outputs are. The CPU work is the limit's; what it adds
  is the disk carrying the run's reads and writes together, so a conversion's ratio to it
  (``of_limit_write``) is what the machine allows with that disk;
* ``convert`` at ``--workers P`` for each format alone and all together (``--resize 256``), as a user types
  it: a fresh ``python -m gpufeed convert`` process timed from its start to its exit (Ray's start-up,
  listing, planning, assembling the single-file outputs, the manifest: all counted);
* ``--encode pass`` to every format, and to RecordIO alone, on the first ``pass_n`` files against ``cp -r``
  of the same files (fsync'd), in bytes of input per second (three formats write three copies);
* ``recordio-cluster``: RecordIO through ``--address`` of a Ray runtime started beforehand (``ray start``):
  the same conversion without the cost of starting Ray and its workers, which the default run pays.

For every run it records what reached the disk (bytes read and written, from the block device's counters in
/sys, and the share of the time it was busy). For each conversion it records images/s and the ratio to the limit, how busy the machine's CPUs were
(``/proc/stat``) and its busy CPU milliseconds per image against the limit loop's, how the workers' shard
time divides into CPU, waiting for a core (Linux schedstat) and the rest (waiting for reads and writes), when the first shard began converting (from the manifest's timings) and the driver's
peak anonymous RSS in the first and second half of the run. From the rate per worker it projects ImageNet-1k's
1,281,167 train images onto a 64-core node (linear in workers: the projection says so).

    python -m gpufeed.bench.experiments.convert_node --n 120000 --unique 3000 --workers 16 --work /tmp/gpufeed-node \
        --results results/convert-node.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time

from gpufeed.machine import usable_cores

#: Pools start their processes from a clean server process, not by forking the caller, which may run
#: threads (a test session's Ray): a fork then can copy a lock held by one of them, and hang.
_POOLS = multiprocessing.get_context("forkserver")
#: The runs a full invocation makes, in order; ``--runs`` picks a subset.
RUNS = ("limit", "recordio", "tfrecord", "lmdb", "all", "limit-write3", "pass", "pass-recordio", "cp",
        "recordio-cluster")
#: ``limit-write<K>``: the limit loop writing K copies of what it encodes (any K >= 1 may be asked for).
LIMIT_WRITE = "limit-write"
#: Images per chunk of the writing limit loop: about a conversion shard's count (its files closed at the end).
WRITE_CHUNK = 256
ALL = "lmdb,recordio,tfrecord"
IMAGENET_TRAIN = 1_281_167
#: The targets of the node-scale issue: each format alone, all three, pass-through against cp.
TARGETS = {"recordio": 0.90, "tfrecord": 0.90, "lmdb": 0.90, "all": 0.85, "pass": 0.80, "pass-recordio": 0.80,
           "recordio-cluster": 0.90}


def _make_unique(args) -> list[bytes]:
    from gpufeed.bench.experiments.transform_speed import make_corpus

    n, seed, mix = args
    return [data for data, _, _ in make_corpus(n, seed=seed, mix=mix)]


#: Corpus layouts: ``folder`` (``class%03d/%07d.JPEG``, converted with ``convert folder``) or ``imagenet``
#: (ILSVRC2012's train tree, ``train/<wnid>/<wnid>_<n>.JPEG`` over 1,000 classes, converted with
#: ``convert imagenet`` as users type it).
LAYOUTS = ("folder", "imagenet")


def corpus_path(root: str, i: int, layout: str, classes: int) -> str:
    """Where file ``i`` of a corpus of ``layout`` lives under ``root``."""
    if layout == "imagenet":
        wnid = f"n{1440764 + 1000 * (i % classes):08d}"
        return os.path.join(root, "train", wnid, f"{wnid}_{i // classes + 1}.JPEG")
    return os.path.join(root, f"class{i % classes:03d}", f"{i:07d}.JPEG")


def build_corpus(root: str, n: int, unique: int, processes: int, classes: int | None = None,
                 layout: str = "folder", mix: str = "default") -> tuple[int, list[str]]:
    """``n`` files under ``root`` in ``layout`` (copies of ``unique`` synthesised JPEGs of size mix ``mix``),
    written by threads (a whole ImageNet is 1.28M files); returns the bytes and the paths in listing order."""
    from concurrent.futures import ThreadPoolExecutor

    classes = classes or (1000 if layout == "imagenet" else 100)
    chunks = [(unique // processes + (i < unique % processes), 1000 + i, mix) for i in range(processes)]
    with _POOLS.Pool(processes) as pool:
        datas = [d for part in pool.map(_make_unique, [c for c in chunks if c[0]]) for d in part]
    paths = [corpus_path(root, i, layout, classes) for i in range(n)]
    for d in sorted({os.path.dirname(p) for p in paths[:classes]}):
        os.makedirs(d, exist_ok=True)

    def write(at: int) -> int:
        total = 0
        for i in range(at, min(at + 4096, n)):
            data = datas[i % len(datas)]
            with open(paths[i], "wb") as f:
                f.write(data)
            total += len(data)
        return total

    with ThreadPoolExecutor(min(16, processes)) as ex:
        total = sum(ex.map(write, range(0, n, 4096)))
    return total, sorted(paths)


def parse_run(spec: str) -> tuple[str, int | None, bool]:
    """``NAME[@K][+warm]`` -> (name, K, warm): ``@K`` runs on the corpus's first K files (a tree of hard
    links: the same files), ``+warm`` with them in the page cache (read once before; nothing evicted)."""
    name, warm = (spec[:-len("+warm")], True) if spec.endswith("+warm") else (spec, False)
    name, _, k = name.partition("@")
    if k and not (k.isdigit() and int(k) > 0):
        raise ValueError(f"run {spec!r}: @K needs a positive file count")
    return name, (int(k) if k else None), warm


#: Markers beside a tree this benchmark makes (a file in the tree would be an input): ``.making`` while it is
#: written (a killed run leaves it), ``.complete`` once whole. Only a tree with one of them is ever removed.
MAKING, COMPLETE = ".making", ".complete"


def make_tree_here(tree: str) -> None:
    """Clear the way for a tree this benchmark makes at ``tree``: what it made there before (its marker beside
    it) is removed; anything else is refused, named, and left as it is."""
    if os.path.lexists(tree) and not any(os.path.exists(tree + m) for m in (MAKING, COMPLETE)):
        raise FileExistsError(f"{tree} is in the way and was not made by this benchmark (no {tree}{COMPLETE} "
                              "beside it): move it, or give another --work")
    open(tree + MAKING, "w").close()
    if os.path.exists(tree + COMPLETE):
        os.remove(tree + COMPLETE)
    shutil.rmtree(tree, ignore_errors=True)


def tree_made(tree: str) -> None:
    open(tree + COMPLETE, "w").close()
    os.remove(tree + MAKING)


def remove_made_tree(tree: str) -> None:
    """Remove ``tree`` and its marker where this benchmark made it (a marker beside it); else nothing."""
    markers = [tree + m for m in (MAKING, COMPLETE) if os.path.exists(tree + m)]
    if markers:
        shutil.rmtree(tree, ignore_errors=True)
        for m in markers:
            os.remove(m)


def subset_tree(src: str, paths: list[str], k: int, into: str) -> tuple[str, list[str]]:
    """A tree of hard links to the first ``k`` of ``paths`` (under ``src``) at ``into``, made once."""
    chosen = paths[:k]
    linked = [os.path.join(into, os.path.relpath(p, src)) for p in chosen]
    if not os.path.exists(into + COMPLETE):
        make_tree_here(into)
        for p, q in zip(chosen, linked):
            os.makedirs(os.path.dirname(q), exist_ok=True)
            os.link(p, q)
        tree_made(into)
    return into, linked


def drop_caches(*trees: str) -> str:
    """Cold page cache: the kernel's drop_caches where this process may write it (root), else every file
    of ``trees`` evicted with fadvise (gpufeed.bench.cache.evict). Returns which was used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        from gpufeed.bench.cache import evict

        for t in trees:
            evict(t)
        return "fadvise"


def _limit_one(path: str) -> int:
    from gpufeed.bench.experiments.transform_speed import limit_one

    with open(path, "rb") as f:
        return limit_one(f.read())


def _limit_write(args) -> int:
    """The limit loop over one chunk of paths, each image's encoded JPEG appended to ``copies`` files in
    ``out``, fsync'd and closed at the chunk's end."""
    from gpufeed.bench.experiments.transform_speed import limit_encode

    chunk, paths, copies, out = args
    files = [open(os.path.join(out, f"chunk{chunk:06d}-{k}.bin"), "wb") for k in range(copies)]
    try:
        for p in paths:
            with open(p, "rb") as f:
                encoded = limit_encode(f.read())
            for g in files:
                g.write(encoded)
        for g in files:
            g.flush()
            os.fsync(g.fileno())
    finally:
        for g in files:
            g.close()
    return len(paths)


def write_copies(name: str) -> int | None:
    """K of a ``limit-write<K>`` run name (``None`` for any other name)."""
    k = name[len(LIMIT_WRITE):] if name.startswith(LIMIT_WRITE) else ""
    return int(k) if k.isdigit() and int(k) > 0 else None


def _pool_init() -> None:
    import cv2

    cv2.setNumThreads(1)


def limit_rate(paths: list[str], processes: int, copies: int = 0, out: str | None = None) -> tuple[float, float, dict]:
    """Images/s of the plain-multiprocessing limit loop over ``paths``, timed from when every process is up
    with OpenCV imported (a stricter limit than counting the pool's start, as a conversion's Ray start is),
    the machine's busy CPU seconds per image meanwhile, and what the disk holding ``paths`` did and what stalled
    (:func:`_machine_since`). With ``copies``, each image's JPEG is written that many times into ``out``
    (:func:`_limit_write`)."""
    if copies:
        os.makedirs(out, exist_ok=True)
        tasks = [(i, paths[at:at + WRITE_CHUNK], copies, out) for i, at in enumerate(range(0, len(paths), WRITE_CHUNK))]
    with _POOLS.Pool(processes, initializer=_pool_init) as pool:
        pool.map(_pool_ready, range(processes), chunksize=1)
        before = _machine_reading(paths[0])
        t0 = time.perf_counter()
        if copies:
            n = sum(pool.imap_unordered(_limit_write, tasks, chunksize=1))
        else:
            n = sum(pool.imap_unordered(_limit_one, paths, chunksize=64))
        seconds = time.perf_counter() - t0
        used, machine = _machine_since(before, paths[0], seconds)
        return n / seconds, (used["total"] - used["idle"] - used["iowait"]) / _HZ / n, machine


def _machine_reading(path: str) -> tuple:
    """The machine's counters before a run: CPU jiffies by kind, the disk holding ``path``, the kernel's stall
    totals (:func:`_machine_since` takes them)."""
    from gpufeed.bench.results import cpu_times, disk_counters, pressure_totals

    return cpu_times(), disk_counters(path), pressure_totals()


def _machine_since(before: tuple, path: str, seconds: float) -> tuple[dict, dict]:
    """Since :func:`_machine_reading`'s ``before``, ``seconds`` ago: the jiffies of each CPU kind (``total`` at
    least 1), and for the row what the disk did (:func:`~gpufeed.bench.results.disk_delta`), what stalled
    (:func:`~gpufeed.bench.results.pressure_delta`: tasks waiting for a core, for memory, for I/O) and the share
    of the vCPUs' time the host of a virtual machine took (``cpu_steal``: counted busy, and a task's wall time
    beyond its CPU and core waits where it falls on its vCPU)."""
    from gpufeed.bench.results import cpu_times, disk_counters, disk_delta, pressure_delta, pressure_totals

    cpu0, disk0, stall0 = before
    cpu1 = cpu_times()
    used = {k: max(cpu1[k] - cpu0[k], 0) for k in cpu0}
    used["total"] = max(used["total"], 1)
    return used, {**disk_delta(disk0, disk_counters(path), seconds), **pressure_delta(stall0, pressure_totals()),
                  "cpu_steal": round(used["steal"] / used["total"], 3)}


#: Jiffies per second in /proc/stat.
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


#: Ports `ray start --head` gives its own components unless told otherwise (the dashboard agent's 52365 is in
#: Linux's range of free ports: a head given it failed to start once in a test run).
RAY_DEFAULT_PORTS = (6379, 8265, 10001, 52365)


@contextlib.contextmanager
def ray_cluster(workers: int, path: str | None = None):
    """A Ray runtime started beforehand on this machine (``ray start --head``, ``workers`` CPUs), its
    address yielded for ``convert --address``: a conversion then pays neither Ray's start nor its workers'
    (what a user with a standing cluster sees). Stopped afterwards."""
    import socket
    import tempfile

    from gpufeed.machine import free_port

    port = free_port(avoid=RAY_DEFAULT_PORTS)  # (a free port may be one Ray takes for a component of its own)
    # --block: the command stays up with the runtime and takes it down when terminated (`ray stop` would
    # stop every Ray runtime of the machine, a test session's too).
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             f"--port={port}", f"--num-cpus={workers}", "--include-dashboard=false",
                             "--disable-usage-stats"], stdout=subprocess.DEVNULL, stderr=log,
                            env=_env(path))
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"ray start failed ({proc.returncode}): {log.read().decode()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("ray start: no runtime listening after 60 s") from None
                time.sleep(0.2)
        time.sleep(3)  # the raylet up, its workers prestarted
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        _forget_address(port)


def _forget_address(port: int) -> None:
    """Remove the address ``ray start`` recorded for ``ray.init()`` to find, when it is this runtime's: it is
    gone, and a later plain ``ray.init()`` on the machine would try to join it."""
    # Where Ray keeps it: RAY_TMPDIR, else TMPDIR (Linux), else /tmp; then ray/.
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    path = os.path.join(base, "ray", "ray_current_cluster")
    try:
        with open(path) as f:
            if f.read().strip().endswith(f":{port}"):
                os.remove(path)
    except OSError:
        pass


def _pool_ready(_) -> None:
    time.sleep(0.05)  # long enough that each process takes one


class _RssSampler(threading.Thread):
    """Samples a process's anonymous RSS (its heap; an LMDB map's file pages are page cache, not the
    process's memory) until it exits: ``[(t, bytes)]``, ``t`` from ``t0`` (the process's start). Every
    ``fast`` s for the first ``fast_for`` s, so that a run of under a second still has samples in each half,
    then every ``period`` s."""

    def __init__(self, pid: int, t0: float, period: float = 0.25, fast: float = 0.02, fast_for: float = 2.0):
        super().__init__(daemon=True)
        self.pid, self.t0, self.samples = pid, t0, []
        self.period, self.fast, self.fast_for = period, fast, fast_for

    def run(self) -> None:
        from gpufeed.bench.experiments.scale import anon_rss

        # None once gone, or a zombie (no memory left to report); 0 is a reading (a process just exec'd)
        while (rss := anon_rss(self.pid)) is not None:
            t = time.perf_counter() - self.t0
            self.samples.append((t, rss))
            time.sleep(self.fast if t < self.fast_for else self.period)

    def halves(self, wall: float) -> tuple[int, int]:
        """The peak in the first and in the second half of the process's ``wall`` seconds."""
        from gpufeed.bench.experiments.scale import peak_halves

        return peak_halves(self.samples, wall)


class _CpuByRole(threading.Thread):
    """The CPU every process on the machine uses while a conversion runs, summed by role (the driver, the
    local processes, Ray's workers, its raylet and GCS, its other services, kernel threads, the rest), from
    ``/proc/<pid>/stat`` read every ``period`` s: where the CPU the machine spends beyond the workers' goes.
    A process that starts and ends between two readings is missed, and so is the last part of one that
    ends; with interrupt time, that is the machine's busy time no role holds (``unattributed`` in a row)."""

    ROLES = ("driver", "local processes", "ray workers", "raylet", "gcs", "ray services", "kernel threads",
             "other")

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.driver, self.period = None, period  # the driver's pid: set before start()
        self.done = threading.Event()
        self.roles: dict = {}  # (pid, start time) -> role
        self.base = self._sweep()  # what processes there already had used: not this run's
        self.last = dict(self.base)

    def _role(self, pid: int) -> str:
        if pid == self.driver:
            return "driver"
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            return "other"
        if not argv[0]:
            return "kernel threads"
        program = argv[0].split(" ")[0]  # a retitled process: one string
        script = next((a for a in argv[1:] if not a.startswith("-")), "")  # python [-u] script ...
        if program.endswith(("/raylet", "/gcs_server")):  # (the raylet's arguments name the workers' script)
            return "raylet" if program.endswith("raylet") else "gcs"
        if program.startswith("ray::"):  # retitled: a worker (IDLE, or the task it runs), or an agent
            return "ray services" if program.endswith("Agent") else "ray workers"
        if script.endswith("default_worker.py"):
            return "ray workers"
        if "multiprocessing.forkserver" in " ".join(argv):
            return "local processes"
        if "/ray/" in script:
            return "ray services"  # the minimal dashboard, the log monitor, the autoscaler's monitor, ...
        return "other"

    def _sweep(self) -> dict:
        seen = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue  # gone already
            fields = stat[stat.rindex(b")") + 2:].split()
            key = (int(name), fields[19])  # pid and start time: a reused pid is another process
            seen[key] = int(fields[11]) + int(fields[12])  # utime + stime of all its threads
            if key not in self.roles:  # named while alive: a Ray worker's command line goes with it
                self.roles[key] = self._role(key[0])
        return seen

    def run(self) -> None:
        while not self.done.wait(self.period):
            self.last.update(self._sweep())

    def stop(self) -> dict:
        """Seconds of CPU by role since this sampler was made."""
        self.done.set()
        self.join()
        self.last.update(self._sweep())
        used = dict.fromkeys(self.ROLES, 0.0)
        for key, ticks in self.last.items():
            delta = ticks - self.base.get(key, 0)
            if delta > 0 and key[0] != os.getpid():  # this benchmark's own process: not the conversion's
                used[self.roles[key]] += delta / _HZ
        return used



def convert_run(src: str, out: str, formats: str, workers: int, *extra: str, path: str | None = None,
                dataset: str = "folder") -> dict:
    """One ``gpufeed convert DATASET`` process, timed from start to exit; its summary figures. ``path``: a
    folder whose gpufeed (another build, for a side-by-side comparison) the process imports instead."""
    cmd = [sys.executable, "-m", "gpufeed", "convert", dataset, src, "--to", formats, "--out", out,
           "--workers", str(workers), "--no-progress", "--no-resume", *extra]
    roles = _CpuByRole()
    before = _machine_reading(src)
    start = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(path))
    rss = _RssSampler(proc.pid, t0)
    rss.start()
    roles.driver = proc.pid
    roles.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    used, machine = _machine_since(before, src, wall)
    by_role = roles.stop()
    rss.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr.decode()[-3000:]}")
    with open(os.path.join(out, "manifest.json")) as f:
        doc = json.load(f)
    written = sum(s["written"] for s in doc["splits"].values())
    timings = doc["timings"]
    first, second = rss.halves(wall)
    line = timings.get("timeline") or {}

    busy = used["total"] - used["idle"] - used["iowait"]
    span = (line.get("shards_done") or 0) - (line.get("first_shard_started") or 0)
    worker_s = line.get("worker_seconds") or 0
    shares = {}
    if worker_s > 0 and "worker_cpu_seconds" in line:  # (a build before these figures has neither)
        # Of the shards' wall time in the workers: their CPU (read threads included), their converting
        # threads' waits for a core (other processes' CPU use), and the rest (waits for reads and writes).
        shares = {"workers_cpu_share": round(line["worker_cpu_seconds"] / worker_s, 3)}
        if "worker_run_queue_seconds" in line:
            shares["workers_run_queue_share"] = round(line["worker_run_queue_seconds"] / worker_s, 3)
    return {"formats": formats, "workers": workers, "images": written, "seconds": round(wall, 2),
            "images_per_second": round(written / wall, 1), "bytes_written": doc["bytes_written"],
            "cpu_busy": round(1 - (used["idle"] + used["iowait"]) / used["total"], 3),
            # where the rest of the machine's time went: waiting on the disk, and in the kernel
            "cpu_iowait": round(used["iowait"] / used["total"], 3),
            "cpu_system": round((used["system"] + used["irq"] + used["softirq"]) / used["total"], 3),
            **machine,
            # the whole machine's busy CPU per image (driver, workers, Ray, the kernel), against the limit's
            "cpu_ms_per_image": round(busy / _HZ / max(written, 1) * 1e3, 3),
            **shares,
            # the same by process role; unattributed: interrupts, and processes too short-lived to be seen
            "cpu_ms_per_image_by_role": _per_image(by_role, busy, written),
            "first_shard_started_s": round(timings["first_shard_started"] - start, 2)
            if timings.get("first_shard_started") else None,
            "driver_anon_rss_mib": [round(first / 2**20), round(second / 2**20)],
            "timeline": timings.get("timeline"),
            # Of the workers' time from the first shard's start to the last shard's end, the share their
            # shards took (the rest: start-up, hand-over, the last wave's idle cores).
            "workers_busy": round(line["worker_seconds"] / (workers * span), 3)
            if span > 0 and line.get("worker_seconds") else None,
            "stderr": stderr.decode()[-2000:]}


def _per_image(by_role: dict, busy_ticks: int, images: int) -> dict:
    """CPU ms per image by role, and the machine's busy time no role holds."""
    out = {role: round(seconds / max(images, 1) * 1e3, 3) for role, seconds in by_role.items()}
    out["unattributed"] = round((busy_ticks / _HZ - sum(by_role.values())) / max(images, 1) * 1e3, 3)
    return out


def _env(path: str | None) -> dict | None:
    """The environment of a process that imports the gpufeed in ``path`` (``None``: this one's)."""
    if not path:
        return None
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (path, os.environ.get("PYTHONPATH"))))}


def copy_run(src: str, dst: str) -> float:
    """Seconds for ``cp -r`` of ``src`` and an fsync of the copy (as a conversion's outputs are fsync'd)."""
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    subprocess.run(["sync", "-f", dst], check=True)
    return time.perf_counter() - t0


def run(n: int, unique: int, workers: int, work: str, runs=RUNS, pass_n: int | None = None,
        results: str | None = None, keep_corpus: bool = True, compare: str | None = None,
        executors: tuple[str, ...] = (), layout: str = "folder", mix: str = "default") -> list[dict]:
    """``compare``: a folder holding another gpufeed build; each conversion then runs with it and with this
    one, back to back on the same cold files (rows tagged ``build`` and ``pair_position``, the build going
    first alternating from one conversion to the next), so a change is measured side by side.
    ``executors`` (``convert --executor`` values, this build): each conversion runs with each of them, the
    same way (rows tagged ``executor`` and ``pair_position``)."""
    if compare and executors:
        raise ValueError("compare builds or executors side by side, not both")
    variants = ([{"build": "compare", "path": compare, "extra": ()}, {"build": "current", "path": None, "extra": ()}]
                if compare else [{"executor": e, "path": None, "extra": ("--executor", e)} for e in executors]
                or [{"path": None, "extra": ()}])
    from gpufeed.bench.results import machine_info

    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, "src")
    meta_path = os.path.join(work, "corpus.json")
    want = {"n": n, "unique": unique, "layout": layout, "mix": mix}
    meta = None
    if keep_corpus and os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        have = {"n": meta.get("n"), "unique": meta.get("unique"), "layout": meta.get("layout", "folder"),
                "mix": meta.get("mix", "default")}
        if have != want:
            meta = None  # another corpus: built again
    if meta is None:
        if os.path.exists(meta_path) and not os.path.exists(src + COMPLETE):  # a corpus made before the markers
            open(src + COMPLETE, "w").close()
        make_tree_here(src)
        for d in os.listdir(work):  # the subset trees made for the old corpus: those with their marker only
            if d.startswith("src-") and d[len("src-"):].isdigit():
                remove_made_tree(os.path.join(work, d))
        t0 = time.perf_counter()
        nbytes, _ = build_corpus(src, n, unique, workers, layout=layout, mix=mix)
        meta = {**want, "bytes": nbytes, "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps({"corpus": meta}), flush=True)
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        tree_made(src)
    dataset = "imagenet" if layout == "imagenet" else "folder"
    paths = sorted(os.path.join(d, name) for d, _, names in os.walk(src) for name in names)
    pass_n = min(pass_n or n, len(paths))
    pass_src = os.path.join(work, "pass-src")
    if ("pass" in runs or "cp" in runs) and not os.path.isdir(pass_src):
        for p in paths[:pass_n]:  # hard links: the same files, read cold by both runs
            q = os.path.join(pass_src, os.path.relpath(p, src))
            os.makedirs(os.path.dirname(q), exist_ok=True)
            os.link(p, q)
    pass_bytes = sum(os.path.getsize(p) for p in paths[:pass_n])
    rows = []
    base = {"bench": "convert-node", "n": len(paths), "unique": meta["unique"], "input_bytes": meta["bytes"],
            "layout": layout, "mix": mix, "machine": machine_info(src)}
    every = (src, paths)
    limits = {}  # scope -> the limit loop's images/s over those files, so cached

    def emit(row):
        row = {**base, **row}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("machine", "stderr")}), flush=True)
        if results:
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")

    out = os.path.join(work, "out")
    pairs = 0  # side-by-side pairs run so far: which build goes first alternates
    for spec in runs:
        name, k, warm = parse_run(spec)
        src, paths = every if k is None or k >= len(every[1]) else subset_tree(*every, k, f"{every[0]}-{k}")
        # Which files and whether cached: a conversion is compared with limit runs of the same scope only.
        scope = {"scope": f"{len(paths)}{' warm' if warm else ''}"}

        def prepare(src=src, paths=paths, warm=warm) -> str:
            if not warm:
                return drop_caches(src)
            from gpufeed.bench.cache import warm as read_into_cache

            # What is still to reach the disk (the corpus just built, the files of the run before) is written
            # now, not during the run: the first warm limit loop of a call wrote the 17 GB corpus while it ran
            # and measured 10-14% slower than the last (results/convert-node-h100x2.txt, calls 2-3).
            os.sync()

            return f"warm ({read_into_cache(*paths) / 1e9:.1f} GB read before)"  # from the disk once, then memory

        make_tree_here(out)
        cache = prepare()
        limit = limits.get(scope["scope"])
        if name == "limit":
            sample = paths[:: max(len(paths) // 2000, 1)]
            one, _, _ = limit_rate(sample, 1)
            if not warm:
                drop_caches(src)
            limit, limit_cpu, disk = limit_rate(paths, workers)
            limits[scope["scope"]] = limit
            emit({"run": "limit", **scope, "workers": workers, "images_per_second": round(limit, 1),
                  "cpu_ms_per_image": round(limit_cpu * 1e3, 3),
                  "one_process_images_per_second": round(one, 1),
                  "hardware_scaling": round(limit / (workers * one), 3), **disk, "cache": cache})
        elif write_copies(name):
            rate, cpu, disk = limit_rate(paths, workers, write_copies(name), out)
            written = sum(e.stat().st_size for e in os.scandir(out))
            emit({"run": name, **scope, "workers": workers, "copies": write_copies(name), "images_per_second": round(rate, 1),
                  "cpu_ms_per_image": round(cpu * 1e3, 3), "bytes_written": written,
                  **({"of_limit": round(rate / limit, 3)} if limit else {}), **disk, "cache": cache})
        elif name == "cp":
            seconds = copy_run(pass_src, out)
            emit({"run": "cp", "images": pass_n, "seconds": round(seconds, 2), "input_bytes": pass_bytes,
                  "input_mb_per_second": round(pass_bytes / seconds / 1e6, 1), "cache": cache})
        else:
            # Which build goes first alternates from pair to pair: a machine that drifts over a call (the
            # first minutes after a burst of work ran faster on the GPU machine) then favours neither.
            order = variants if pairs % 2 == 0 else variants[::-1]
            if name == "recordio-cluster" and executors:
                order = [{"path": None, "extra": ()}]  # a cluster runs every shard on Ray: no executor to pick
            pairs += len(order) > 1
            for position, variant in enumerate(order):
                if position:
                    make_tree_here(out)
                    cache = prepare()
                tag = ({key: variant[key] for key in ("build", "executor") if key in variant} | {"pair_position": position}
                       if len(order) > 1 else {})
                path, extra = variant["path"], variant["extra"]
                if name in ("pass", "pass-recordio"):
                    row = convert_run(pass_src, out, ALL if name == "pass" else "recordio", workers, "--encode",
                                      "pass", *extra, path=path)
                    row["input_bytes"] = pass_bytes
                    row["input_mb_per_second"] = round(pass_bytes / row["seconds"] / 1e6, 1)
                elif name == "recordio-cluster":
                    with ray_cluster(workers, path) as address:
                        cache = prepare()  # again: the cluster's start read files
                        row = convert_run(src, out, "recordio", workers, "--resize", "256", "--address", address,
                                          path=path, dataset=dataset)
                else:
                    row = convert_run(src, out, ALL if name == "all" else name, workers, "--resize", "256", *extra,
                                      path=path, dataset=dataset)
                if not name.startswith("pass"):
                    if limit:
                        row["of_limit"] = round(row["images_per_second"] / limit, 3)
                        row["target"] = TARGETS.get(name)
                    # A 64-core node, linear in workers from this run's rate per worker.
                    row["projected_imagenet_64_cores_minutes"] = round(
                        IMAGENET_TRAIN / (row["images_per_second"] / workers * 64) / 60, 1)
                emit({"run": name, **scope, **tag, **row, "cache": cache})
    remove_made_tree(out)
    _bracket(rows)
    _against_writes(rows)
    copy = next((r for r in rows if r["run"] == "cp"), None)
    for passed in [r for r in rows if r["run"] in ("pass", "pass-recordio")]:
        if copy:
            tag = {key: passed[key] for key in ("build", "executor") if key in passed}
            emit({"run": f"{passed['run']}/cp", **tag, "formats": passed["formats"], "target": TARGETS[passed["run"]],
                  "ratio": round(passed["input_mb_per_second"] / copy["input_mb_per_second"], 3)})
    return rows


def _bracket(rows: list[dict]) -> None:
    """Where a conversion has a limit run both before and after it (``--runs limit,recordio,limit,...``): its
    ratio to the mean of the two, ``of_limit_bracketed``. The GPU machine's own speed moved by up to 15%
    within minutes (the limit loop gave 3,158-3,697 img/s in one call), so a ratio to one limit run measured
    minutes earlier carries that drift; the rows already written keep ``of_limit``."""
    for i, r in enumerate(rows):
        if "of_limit" not in r:
            continue
        before, after = _neighbours(rows, i, "limit")
        if before and after:
            mean = (before["images_per_second"] + after["images_per_second"]) / 2
            r["of_limit_bracketed"] = round(r["images_per_second"] / mean, 3)


def _neighbours(rows: list[dict], i: int, run: str) -> tuple[dict | None, dict | None]:
    """The ``run`` rows nearest before and after row ``i`` in the same call (rows of a results file that
    gathers several calls carry their ``call``; a machine's speed in one call says nothing of another's), over
    the same files as warm or as cold (``scope``)."""
    call, scope = rows[i].get("call"), rows[i].get("scope")
    same = [(k, r) for k, r in enumerate(rows) if r["run"] == run and r.get("call") == call
            and r.get("scope") == scope]
    before = [r for k, r in same if k < i][-1:]
    after = [r for k, r in same if k > i][:1]
    return (before[0] if before else None), (after[0] if after else None)


def _around(rows: list[dict], i: int, run: str) -> float | None:
    """The images/s of the ``run`` rows nearest before and after row ``i`` (their mean where both exist)."""
    near = [r for r in _neighbours(rows, i, run) if r]
    return sum(r["images_per_second"] for r in near) / len(near) if near else None


def _against_writes(rows: list[dict]) -> None:
    """Each conversion's ratio to the writing limit loop with as many copies as it has formats (the nearest
    such runs before and after it), ``of_limit_write``, where the run has one: how much of what the CPUs and
    the disk together allow it reached."""
    for i, r in enumerate(rows):
        if not r.get("formats") or str(r["run"]).startswith(("pass", LIMIT_WRITE)) or "/" in str(r["run"]):
            continue  # not a conversion (a pass-through is measured against cp)
        ref = _around(rows, i, f"{LIMIT_WRITE}{len(r['formats'].split(','))}")
        if ref:
            r["of_limit_write"] = round(r["images_per_second"] / ref, 3)


def _disk(r: dict) -> str:
    """``read / written GB (MB/s, busy %)`` of a row that recorded its disk."""
    if "disk_read_bytes" not in r:
        return ""
    return (f"{r['disk_read_bytes'] / 1e9:.1f} / {r['disk_written_bytes'] / 1e9:.1f} "
            f"({r['disk_mb_per_second']:,.0f} MB/s, {r['disk_busy']:.0%})")


def _scope(r: dict) -> str:
    """`` [K files, warm]`` for a row over part of the corpus or with a warm cache, else nothing."""
    if not r.get("scope") or r["scope"] == str(r.get("n")):
        return ""
    files, _, warm = r["scope"].partition(" ")
    return f" [{int(files):,} files{', ' + warm if warm else ''}]"


def table(rows: list[dict]) -> str:
    rows = [dict(r) for r in rows]
    _bracket(rows)  # rows read back from a results file were written before the limit run after them
    _against_writes(rows)
    lines = ["| run | img/s | of limit (target) | CPUs busy | CPU ms/img | first shard at | workers busy | workers' "
             "time: CPU / core wait (per image, local processes / Ray's) | listed / shards done / outputs done (s) | driver anon. RSS MiB (1st/2nd half) | disk read / written GB (MB/s, busy) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["run"] in ("limit",):
            lines.append(f"| limit, {r['workers']} processes{_scope(r)} | {r['images_per_second']:,.0f} | 1.00 | | "
                         f"{r.get('cpu_ms_per_image', '')} | | | | | "
                         f"(1 process {r['one_process_images_per_second']:,.0f}; "
                         f"scaling {r['hardware_scaling']}) | {_disk(r)} |")
        elif write_copies(r["run"]):
            of = str(r.get("of_limit", ""))
            if r.get("of_limit_bracketed") is not None:
                of += f"; {r['of_limit_bracketed']} of the limit runs either side"
            lines.append(f"| limit writing {r['copies']} cop{'ies' if r['copies'] > 1 else 'y'}, {r['workers']} "
                         f"processes{_scope(r)} | {r['images_per_second']:,.0f} | {of} | | {r.get('cpu_ms_per_image', '')} "
                         f"| | | | | | {_disk(r)} |")
        elif r["run"] == "cp":
            lines.append(f"| cp -r {r['images']} files | {r['input_mb_per_second']} MB/s | | | | | | | | | |")
        elif r["run"].endswith("/cp"):
            built = _variant(r)
            lines.append(f"| {built}pass-through to {r['formats']} / cp | | {r['ratio']} ({r['target']}) | | | | | | | | |")
        else:
            of = "; ".join(part for part in (
                f"{r['of_limit']} ({r['target']})" if r.get("of_limit") is not None else "",
                f"{r['of_limit_bracketed']} of the limit runs either side" if r.get("of_limit_bracketed") else "",
                f"{r['of_limit_write']} of the limit writing as many copies" if r.get("of_limit_write") else "")
                if part)
            rate = (f"{r['images_per_second']:,.0f} ({r['input_mb_per_second']} MB/s)" if r["run"].startswith("pass")
                    else f"{r['images_per_second']:,.0f}")
            what = _variant(r) + ("pass-through to" if r["run"].startswith("pass") else "convert")
            line = r.get("timeline") or {}
            marks = " / ".join(str(line.get(k, "?")) for k in ("listed", "shards_done", "sinks_done"))
            busy = f"{r['workers_busy']:.0%}" if r.get("workers_busy") else ""
            if r["run"] == "recordio-cluster":
                what += " (standing Ray)"
            split = " / ".join(f"{r[k]:.0%}" for k in ("workers_cpu_share", "workers_run_queue_share") if k in r)
            per = [f"{where} {line[f'{where}_cpu_ms_per_sample']}" for where in ("local", "ray")
                   if f"{where}_cpu_ms_per_sample" in line]
            if per:
                split += f" (CPU ms/img: {', '.join(per)})"
            if "idle_worker_s_last_wave" in line:
                split += ("; idle worker-s: " + " / ".join(f"{line[f'idle_worker_s_{k}']:.0f}"
                                                           for k in ("ramp", "middle", "last_wave"))
                          + " (ramp / middle / last wave)")
            if "shard_s_max" in line:
                split += (f"; shards took {line['shard_s_p50']} / {line['shard_s_p90']} / {line['shard_s_max']} s "
                          "(median / p90 / longest)")
                if "shard_s_max_cpu" in line:
                    split += (f", the longest (shard {line.get('shard_s_max_shard', '?')}) started "
                              f"{line['shard_s_max_started']} s in, on a core {line['shard_s_max_cpu']} s"
                              + (f", waiting for one {line['shard_s_max_run_queue']} s"
                                 if "shard_s_max_run_queue" in line else ""))
            if line.get("held_by_commit_window_s"):
                split += f"; shards held back by the commits for {line['held_by_commit_window_s']} s"
            if "driver_commit_sync_s" in line:
                split += f"; the driver appended {line['driver_commit_s']} s"
                if "driver_commit_writeback_s" in line:
                    split += f", {line['driver_commit_writeback_s']} s of it starting writeback"
                if "driver_commit_cpu_s" in line:
                    split += f", {line['driver_commit_cpu_s']} s of it on a core"
                if "driver_commit_run_queue_s" in line:
                    split += f", {line['driver_commit_run_queue_s']} s waiting for one"
                split += f"; beside it, {line['driver_commit_sync_s']} s waiting for writes and fsyncs"
                if "driver_commit_journal_s" in line:
                    split += f", {line['driver_commit_journal_s']} s journalling"
            if "driver_cpu_s" in line:
                split += (f"; the driver's CPU {line['driver_cpu_s']} s, its main thread's "
                          f"{line['driver_main_cpu_s']} s")
            waits = [f"{where} {line[f'{where}_read_ms_per_sample']} / {line[f'{where}_close_ms_per_sample']}"
                     for where in ("local", "ray") if f"{where}_close_ms_per_sample" in line]
            if waits:
                split += f"; reading / closing outputs, ms/img: {', '.join(waits)}"
            slept = [f"{where} {line[f'{where}_write_ms_per_sample']} ms writing, {line[f'{where}_sleeps_per_sample']}"
                     f" sleeps and {line[f'{where}_page_faults_per_sample']} page faults"
                     for where in ("local", "ray") if f"{where}_sleeps_per_sample" in line]
            if slept:
                split += f"; per image: {', '.join(slept)}"
            stalls = [f"{k} {r[f'pressure_{k}_s']} s" for k in ("cpu_some", "memory_some", "memory_full", "io_some")
                      if f"pressure_{k}_s" in r]
            if stalls:
                split += f"; stalled (the kernel's pressure totals): {', '.join(stalls)}"
            if r.get("cpu_steal"):
                split += f"; the vCPUs' time taken by the host: {r['cpu_steal']:.1%}"
            lines.append(f"| {what} {r['formats']}{_scope(r)} | {rate} | {of} | {r['cpu_busy']:.0%} | "
                         f"{r.get('cpu_ms_per_image', '')} | {r['first_shard_started_s']} s | {busy} | {split} | {marks} | "
                         f"{r['driver_anon_rss_mib'][0]} / {r['driver_anon_rss_mib'][1]} | {_disk(r)} |")
    return "\n".join(lines)


def _variant(row: dict) -> str:
    """``(compare build) `` / ``(--executor ray) `` for a row run side by side with another, else nothing."""
    if row.get("build"):
        return f"({row['build']} build) "
    return f"(--executor {row['executor']}) " if row.get("executor") else ""


def roles_table(rows: list[dict]) -> str:
    """The machine's CPU ms per image by process role, for the conversions that recorded it, next to the
    limit loop's whole-machine figure."""
    limit = next((r.get("cpu_ms_per_image") for r in rows if r["run"] == "limit"), None)
    roles = [*_CpuByRole.ROLES, "unattributed"]
    lines = [f"| run (limit loop: {limit} CPU ms/img) | machine | " + " | ".join(roles) + " |",
             "|---|---|" + "---|" * len(roles)]
    for r in rows:
        by = r.get("cpu_ms_per_image_by_role")
        if not by:
            continue
        what = _variant(r) + r["formats"]
        lines.append(f"| {what} | {r['cpu_ms_per_image']} | " + " | ".join(str(by.get(k, "")) for k in roles) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m gpufeed.bench.experiments.convert_node", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=120_000, help="files in the corpus")
    p.add_argument("--unique", type=int, default=3000, help="distinct synthesised JPEGs among them")
    p.add_argument("--workers", type=int, default=usable_cores(), help="processes / Ray workers")
    p.add_argument("--pass-n", type=int, default=40_000, help="files for the pass-through and cp runs")
    p.add_argument("--runs", default=",".join(RUNS),
                   help=f"a subset of {','.join(RUNS)} (any {LIMIT_WRITE}K: K copies written), each as NAME[@K][+warm]: "
                        "on the corpus's first K files, with them in the page cache")
    p.add_argument("--layout", choices=LAYOUTS, default="folder",
                   help="the corpus's tree: class folders (convert folder) or ILSVRC2012's train tree (convert imagenet)")
    from gpufeed.bench.experiments.transform_speed import MIXES

    p.add_argument("--mix", choices=tuple(MIXES), default="default",
                   help="image sizes: the results' usual mix (~193 KB) or ImageNet train's (~110 KB)")
    p.add_argument("--work", help="a directory on the disk to measure (the corpus stays there); required to run")
    p.add_argument("--results", help="append JSON rows here")
    p.add_argument("--table", metavar="JSONL", help="only print the table of the rows in this results file")
    p.add_argument("--compare", metavar="DIR", help="a folder holding another gpufeed build (pip install --target "
                   "DIR --no-deps): each conversion runs with it and with this one on the same cold files, the "
                   "build going first alternating from one conversion to the next")
    p.add_argument("--executors", default="", metavar="E[,E...]",
                   help="convert --executor values (pool, ray) to run each conversion with, side by side on the "
                        "same cold files, the first alternating")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(table(rows))
        print(roles_table(rows))
        return
    if not args.work:
        p.error("--work is required to run the benchmark")
    runs = tuple(r for r in args.runs.split(",") if r)
    try:
        names = [parse_run(r)[0] for r in runs]
    except ValueError as e:
        p.error(str(e))
    unknown = {r for r in names if r not in RUNS and not write_copies(r)}
    if unknown:
        p.error(f"unknown runs {sorted(unknown)}; choose from {','.join(RUNS)}")
    executors = tuple(e for e in args.executors.split(",") if e)
    if executors and args.compare:
        p.error("--compare and --executors each run conversions side by side; give one")
    rows = run(args.n, args.unique, args.workers, args.work, runs, args.pass_n, args.results, compare=args.compare,
               executors=executors, layout=args.layout, mix=args.mix)
    print(table(rows))
    print(roles_table(rows))


if __name__ == "__main__":
    main()
