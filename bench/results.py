"""Benchmark results as JSON lines: the row schema every benchmark writes and the report reads.

One row is one configuration (bench x tier x format x parameters) measured ``repeats`` times after a
warm-up. Its primary metric is in ``metric``/``unit``/``median``/``spread``/``values``; every other figure of
the same runs is in ``metrics[name] = {"unit", "median", "spread", "values"}``. Rows also carry what is needed
to judge them later: the tier (``mode`` measured or emulated, ``profile``), the dataset (format, sample and
record sizes, total bytes, dataset/RAM ratio), the machine and the library versions.

Example::

    from gpufeed.bench.results import ResultWriter, load_results, summarize

    w = ResultWriter("results.jsonl")
    w.write({"bench": "read", "tier": "ssd", "mode": "emulated", "profile": "ssd", "format": "lmdb",
             "params": {"workers": 4}, **summarize("samples_per_s", "samples/s", [812.0, 799.5, 820.1])})
    rows = load_results("results.jsonl")

Nothing here imports Ray or torch; versions are read from package metadata.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from typing import Any

from gpufeed.errors import ConfigError, CorruptRecordError
from gpufeed.machine import run_queue_seconds
from gpufeed.machine import usable_cores  # noqa: F401 (bench modules import it from here)

#: Bumped when a field changes meaning; readers check it.
SCHEMA_VERSION = 1

BENCHES = ("convert", "read", "train", "feed")
MODES = ("measured", "emulated")

#: Every row has these; ResultWriter fills ``machine``, ``versions``, ``time`` and ``schema`` itself.
REQUIRED = ("bench", "tier", "mode", "profile", "format", "params", "repeats", "metric", "unit",
            "median", "spread", "values")

#: Dataset description fields a row carries when it reads or writes a dataset (None when not applicable).
DATASET_FIELDS = ("n_samples", "sample_bytes", "record_bytes", "total_bytes", "dataset_ram_ratio")

#: Packages whose versions are recorded (distribution names, read from metadata: nothing is imported).
_VERSIONED = ("gpufeed", "numpy", "torch", "torchvision", "ray", "lmdb", "opencv-python-headless", "Pillow",
              "tfrecord", "protobuf", "psutil", "nvidia-dali-cuda120", "mxnet", "tensorflow")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in _VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            if dist in ("gpufeed", "numpy", "torch", "ray", "lmdb"):
                out[dist] = None
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_seconds(own: bool = True) -> float:
    """CPU time (user + system) of this process (``own``) and every live process under it (a Ray runtime's
    raylet and workers, a DataLoader's workers). On a shared machine CPU time is what stays comparable; wall time
    follows the load. Processes that exited are not counted."""
    import psutil

    total = 0.0
    me = psutil.Process()
    under = me.children(recursive=True)
    for p in [me, *under] if own else under:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def children_private_bytes() -> int | None:
    """Unique set size (USS: pages no other process maps) of every live process under this one, e.g. a
    DataLoader's workers: what they hold of their own. Forked workers share their parent's pages until they
    write them, so their resident or anonymous sizes count the parent again; USS does not. None where the
    platform does not say."""
    import psutil

    total, seen = 0, False
    for p in psutil.Process().children(recursive=True):
        try:
            total += p.memory_full_info().uss
            seen = True
        except (psutil.Error, AttributeError):
            continue
    return total if seen else None


def proc_kib_field(path: str, key: str) -> int | None:
    """Bytes of a ``Key:  N kB`` line of a /proc file (``/proc/meminfo``, ``/proc/<pid>/status``)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _ram_bytes() -> int | None:
    return proc_kib_field("/proc/meminfo", "MemTotal")


def _physical_cores() -> int | None:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except ImportError:
        return None


def _gpus() -> list[dict[str, str]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "memory": parts[1], "driver": parts[2]})
    return gpus


def _read_sys(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _mount_of(path: str) -> dict[str, str] | None:
    """The /proc/mounts entry whose mount point is the longest prefix of ``path``."""
    real = os.path.realpath(path)
    best = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts = line.split()[:4]
                mnt = mnt.replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (
                        best is None or len(mnt) > len(best["mount"])):
                    best = {"device": dev, "mount": mnt, "fstype": fstype, "options": opts}
    except OSError:
        return None
    return best


def _block_info(device: str) -> dict[str, Any]:
    """Model, size and rotational flag of the block device behind ``device`` (partitions resolve to disks)."""
    name = os.path.basename(os.path.realpath(device)) if device.startswith("/dev/") else None
    if not name or not os.path.exists(f"/sys/class/block/{name}"):
        return {}
    sys_dir = os.path.realpath(f"/sys/class/block/{name}")
    disk = name if os.path.exists(f"{sys_dir}/queue") else os.path.basename(os.path.dirname(sys_dir))
    base = f"/sys/block/{disk}"
    size = _read_sys(f"{base}/size")
    queue = _read_sys(f"{base}/queue/nr_requests")
    return {"disk": disk, "queue_requests": int(queue) if queue and queue.isdigit() else None,
            "model": _read_sys(f"{base}/device/model"),
            "rotational": _read_sys(f"{base}/queue/rotational") == "1",
            "scheduler": _read_sys(f"{base}/queue/scheduler"),
            "size_bytes": int(size) * 512 if size and size.isdigit() else None}


def disk_info(path: str) -> dict[str, Any]:
    """Filesystem and disk under ``path``: mount point, fs type, device, model, rotational, size, free."""
    info: dict[str, Any] = {"path": os.path.abspath(path)}
    mount = _mount_of(path)
    if mount:
        info.update(mount)
        info.update(_block_info(mount["device"]))
    try:
        usage = shutil.disk_usage(path)
        info["free_bytes"] = usage.free
    except OSError:
        pass
    return info


def _stat_file(path: str) -> str | None:
    """The ``stat`` file in /sys of the block device holding ``path``: its own device number's, else (an
    overlay or another device-less filesystem) the disk of the mount's device; ``None`` where neither."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    own = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    if os.path.exists(own):
        return own
    mount = _mount_of(path)
    disk = _block_info(mount["device"]).get("disk") if mount else None
    return f"/sys/block/{disk}/stat" if disk else None


def disk_counters(path: str) -> dict[str, int] | None:
    """What the block device holding ``path`` has done since boot: bytes read from it and written to it (what
    reached the device, not what processes asked of the page cache), the milliseconds it was busy with requests
    in flight, the reads it completed and the milliseconds they took, summed over the reads (so, between two
    readings, that sum over the time between them is the reads in flight on average). Two readings give the
    device's work in between; ``None`` where no device is found."""
    stat = _stat_file(path)
    text = _read_sys(stat) if stat else None
    if not text:
        return None
    f = [int(x) for x in text.split()]
    # Documentation/block/stat.rst: sectors are 512 bytes whatever the device's own sector size.
    return {"read_bytes": f[2] * 512, "written_bytes": f[6] * 512, "busy_ms": f[9], "reads": f[0],
            "read_ms": f[3]}


def read_depth(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Between two :func:`disk_counters` readings ``seconds`` apart: the device's reads in flight on average
    (``disk_reads_in_flight``, Little's law: the reads' summed time over the wall time) and their mean size
    (``disk_read_request_kb``); empty where it completed no read."""
    reads = after.get("reads", 0) - before.get("reads", 0)
    if reads <= 0 or seconds <= 0 or "read_ms" not in after or "read_ms" not in before:
        return {}
    return {"disk_reads_in_flight": (after["read_ms"] - before["read_ms"]) / 1e3 / seconds,
            "disk_read_request_kb": (after["read_bytes"] - before["read_bytes"]) / reads / 1e3}


def disk_delta(before: dict | None, after: dict | None, seconds: float) -> dict[str, Any]:
    """Between two :func:`disk_counters` readings ``seconds`` apart: the bytes the device read and wrote, their
    MB/s together, and the share of the time it was busy (empty where either reading is missing)."""
    if not before or not after or seconds <= 0:
        return {}
    read, written = after["read_bytes"] - before["read_bytes"], after["written_bytes"] - before["written_bytes"]
    return {"disk_read_bytes": read, "disk_written_bytes": written,
            "disk_mb_per_second": round((read + written) / seconds / 1e6, 1),
            "disk_busy": round(min((after["busy_ms"] - before["busy_ms"]) / 1e3 / seconds, 1.0), 3)}


_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def pressure_totals() -> dict[str, float]:
    """Seconds of stall Linux's pressure stall information has counted since boot (/proc/pressure, 4.20+), by
    resource and kind: ``cpu_some`` (some task runnable without a core), ``memory_some`` / ``memory_full``
    (some / every non-idle task stalled in reclaim, refaults or a memory limit's throttling), ``io_some`` /
    ``io_full``; empty where the kernel does not keep them. Two readings give what stalled in between."""
    out: dict[str, float] = {}
    for resource in ("cpu", "memory", "io"):
        try:
            with open(f"/proc/pressure/{resource}") as f:
                out.update(parse_pressure(resource, f.read()))
        except OSError:
            continue
    return out


def parse_pressure(resource: str, text: str) -> dict[str, float]:
    """One /proc/pressure file's ``total=`` (microseconds) of each line, in seconds, as ``<resource>_<kind>``."""
    out = {}
    for line in text.splitlines():
        kind, *fields = line.split()
        for field in fields:
            name, _, value = field.partition("=")
            if name == "total":
                out[f"{resource}_{kind}"] = int(value) / 1e6
    return out


def pressure_delta(before: dict, after: dict) -> dict[str, float]:
    """Between two :func:`pressure_totals` readings: ``pressure_<resource>_<kind>_s``, the seconds of stall."""
    return {f"pressure_{k}_s": round(after[k] - before[k], 3) for k in before if k in after}


def cpu_times() -> dict[str, int]:
    """Jiffies of all CPUs from /proc/stat by kind (user, system, idle, iowait, ...; ``total`` too)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    out = dict(zip(_CPU_FIELDS, fields))
    out["total"] = sum(fields)
    return out


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat; idle and iowait count as not busy. Two readings give
    the machine's CPU use in between."""
    t = cpu_times()
    return t["total"] - t["idle"] - t["iowait"], t["total"]


class ResourceWindow:
    """What the machine's shared resources did during a timed window: the bytes the block device holding
    ``path`` read (what reached the device, not the page cache), its busy share, and the share of every core
    that was busy. :meth:`stop` returns ``disk_read_mb_per_s``, ``disk_read_bytes``, ``disk_busy`` (fractions of
    the window), the reads in flight on average and their mean size (:func:`read_depth`), ``cpu_busy``,
    ``main_thread_busy`` (the share of the window this process's main thread ran, :func:`thread_cpu_seconds`) and
    ``main_thread_waited`` (the share it was ready to run but waited for a core,
    :func:`gpufeed.machine.run_queue_seconds`: a training loop's thread that waits there launches the model's work
    late); each is left out where the kernel does not say. With ``gpu`` (nvidia-smi's name for one GPU,
    :func:`gpu_name`), also ``gpu_busy`` (the share of time a kernel ran on it) and ``gpu_sm_mhz`` (its SM clock),
    as :class:`GpuSampler` read them: a GPU that ran kernels less of the time at the same clock went without work."""

    def __init__(self, path: str | None, gpu: str | None = None):
        self.path = path
        self.gpu = GpuSampler(gpu) if gpu is not None else None
        self.disk = disk_counters(path) if path else None
        self.cpu = cpu_ticks()
        self.main = thread_cpu_seconds()
        self.waited = run_queue_seconds(os.getpid())
        self.t0 = time.perf_counter()

    def stop(self) -> dict[str, float]:
        seconds = time.perf_counter() - self.t0
        out: dict[str, float] = {}
        disk = disk_counters(self.path) if self.disk else None
        if disk and seconds > 0:
            read = disk["read_bytes"] - self.disk["read_bytes"]
            out.update(disk_read_bytes=read, disk_read_mb_per_s=read / seconds / 1e6,
                       disk_busy=min((disk["busy_ms"] - self.disk["busy_ms"]) / 1e3 / seconds, 1.0),
                       **read_depth(self.disk, disk, seconds))
        busy, total = cpu_ticks()
        if total > self.cpu[1]:
            out["cpu_busy"] = (busy - self.cpu[0]) / (total - self.cpu[1])
        main = thread_cpu_seconds()
        if main is not None and self.main is not None and seconds > 0:
            out["main_thread_busy"] = min((main - self.main) / seconds, 1.0)
        waited = run_queue_seconds(os.getpid())
        if waited is not None and self.waited is not None and seconds > 0:
            out["main_thread_waited"] = min((waited - self.waited) / seconds, 1.0)
        if self.gpu is not None:
            out.update(self.gpu.stop())
        return out


class GpuSampler:
    """nvidia-smi's readings of one GPU every ``period_ms`` from now until :meth:`stop`: ``utilization.gpu`` (the
    share of its last sample period in which a kernel ran) and the SM clock. Nothing where nvidia-smi is absent or
    fails: the driver's own tool, found on every NVIDIA GPU machine, so no NVML binding is needed."""

    def __init__(self, gpu: str, period_ms: int = 200):
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu,clocks.sm", "--format=csv,noheader,nounits", "-i", gpu,
                 "-lms", str(period_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None

    def stop(self) -> dict[str, float]:
        """``gpu_busy`` (0-1) and ``gpu_sm_mhz``, the means of the readings taken; empty where none were."""
        if self.proc is None:
            return {}
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.proc = None
        return gpu_readings(out or "")


def gpu_readings(text: str) -> dict[str, float]:
    """The mean of nvidia-smi's ``utilization.gpu, clocks.sm`` lines (csv, no header, no units) as ``gpu_busy``
    (a fraction) and ``gpu_sm_mhz``; lines that are not two numbers (a message, "[N/A]") are skipped."""
    busy, clock = [], []
    for line in text.splitlines():
        try:
            u, c = (float(v) for v in line.split(","))
        except ValueError:
            continue
        busy.append(u / 100.0)
        clock.append(c)
    return {"gpu_busy": statistics.fmean(busy), "gpu_sm_mhz": statistics.fmean(clock)} if busy else {}


def gpu_name(device) -> str | None:
    """How nvidia-smi names the CUDA ``device`` (a torch device): its UUID (``GPU-...``), else its PCI bus id,
    either of which holds whatever CUDA_VISIBLE_DEVICES renumbers; None off CUDA or where torch says neither."""
    try:
        import torch

        if device is None or device.type != "cuda":
            return None
        props = torch.cuda.get_device_properties(device)
    except (ImportError, RuntimeError, AssertionError):
        return None
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:
        return None


def thread_cpu_seconds(tid: int | None = None) -> float | None:
    """CPU seconds (user + system) one thread of this process has used; by default the main thread, whose id is
    the process id. A training loop's main thread launches the model's kernels and takes each batch: near one
    core busy, it is the loop's limit whatever the cores and the disk do. None where /proc does not say."""
    tid = os.getpid() if tid is None else tid
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command's closing parenthesis: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_info(data_path: str | None = None) -> dict[str, Any]:
    """CPU, cores, RAM, GPUs, kernel, and (given ``data_path``) the disk and filesystem holding the data."""
    info = {"hostname": socket.gethostname(), "kernel": platform.release(), "cpu": cpu_model(),
            "logical_cores": os.cpu_count(), "physical_cores": _physical_cores(),
            "usable_cores": usable_cores(),
            "ram_bytes": _ram_bytes(), "gpus": _gpus()}
    if data_path is not None:
        info["disk"] = disk_info(data_path)
    return info


def summarize(metric: str, unit: str, values: Sequence[float]) -> dict[str, Any]:
    """Row fields for a primary metric: ``metric``, ``unit``, ``median``, ``spread``, ``values``, ``repeats``."""
    return {"metric": metric, "unit": unit, "repeats": len(values), **stat(values)}


def stat(values: Sequence[float]) -> dict[str, Any]:
    """``median``; ``spread`` = (max - min) / median, the relative range MLPerf's "within 5%" refers to."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "spread": None, "values": []}
    med = statistics.median(vals)
    spread = (max(vals) - min(vals)) / abs(med) if med else 0.0
    return {"median": med, "spread": spread, "values": vals}


def metrics_block(runs: Sequence[dict[str, float]], units: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``{name: {"unit", "median", "spread", "values"}}`` over repeated runs, each a ``{name: value}`` dict."""
    names = [n for n in units if any(n in r for r in runs)]
    return {n: {"unit": units[n], **stat([r.get(n) for r in runs])} for n in names}


def repeat(fn: Callable[[int], dict[str, float]], repeats: int, warmup: int = 1,
           before_each: Callable[[], Any] | None = None) -> list[dict[str, float]]:
    """Run ``fn(i)`` ``warmup`` times (discarded), then ``repeats`` times; ``before_each`` runs before every
    call (e.g. page-cache eviction for cold reads). Returns the measured runs' dicts."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, not {repeats}")
    runs = []
    for i in range(warmup + repeats):
        if before_each is not None:
            before_each()
        out = fn(i)
        if i >= warmup:
            runs.append(out)
    return runs


def dataset_ram_ratio(total_bytes: int) -> float | None:
    ram = _ram_bytes()
    return total_bytes / ram if ram else None


def append_rows(path: str | None, rows: Sequence[dict[str, Any]]) -> None:
    """Append plain JSON rows (diagnostics outside the result schema, e.g. decode rates) to ``path``, if given."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(r, default=_jsonable) + "\n" for r in rows)


class ResultWriter:
    """Appends result rows to a JSON-lines file, one ``write`` = one line (``O_APPEND``: safe across processes).

    ``machine`` is gathered once per writer (``data_path`` names the disk to describe) and added to every row,
    along with ``versions``, ``time`` (UTC ISO 8601) and ``schema``.
    """

    def __init__(self, path: str, data_path: str | None = None):
        self.path = os.fspath(path)
        self._machine = machine_info(data_path)
        self._versions = versions()
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)

    def write(self, row: dict[str, Any]) -> dict[str, Any]:
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ConfigError(f"result row for {self.path} lacks {', '.join(missing)}; "
                              "build it with gpufeed.bench.results.summarize(...) plus bench/tier/mode/profile/"
                              "format/params")
        if row["bench"] not in BENCHES:
            raise ConfigError(f"result row bench {row['bench']!r} is not one of {', '.join(BENCHES)}")
        if row["mode"] not in MODES:
            raise ConfigError(f"result row mode {row['mode']!r} is not one of {', '.join(MODES)}")
        full = {"schema": SCHEMA_VERSION, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **{k: None for k in DATASET_FIELDS}, "valid": True, "metrics": {},
                **row, "machine": {**self._machine, **row.get("machine", {})},
                "versions": {**self._versions, **row.get("versions", {})}}
        line = json.dumps(full, sort_keys=False, default=_jsonable) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return full


def _jsonable(obj):
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:
        pass
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def load_results(path: str | Iterable[str]) -> list[dict[str, Any]]:
    """Every row of one results file (or of several, in order). A line that is not JSON raises
    CorruptRecordError naming its line; a row from a newer schema raises ConfigError."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    rows = []
    for p in paths:
        with open(p, "rb") as f:
            offset = 0
            for lineno, raw in enumerate(f):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise CorruptRecordError(p, lineno, start, f"not a JSON result row ({e.msg})") from e
                if row.get("schema", SCHEMA_VERSION) > SCHEMA_VERSION:
                    raise ConfigError(f"{p}: line {lineno + 1} uses results schema {row['schema']}, newer than "
                                      f"this gpufeed's {SCHEMA_VERSION}; upgrade gpufeed to read it")
                rows.append(row)
    return rows
