"""Measure the host disk, and refuse to emulate a tier the host cannot outrun.

An emulated request ends at the later of the host's own I/O and the profile's time, so emulation is only
faithful where the host is faster than the profile for the same access pattern. :func:`measure_host` times the
patterns that matter (sequential 1 MiB, 4 KiB random at queue depth 1 and 32, 128 KiB random with 16 threads)
with cold reads: the test file is evicted with ``posix_fadvise`` first, and the bytes the kernel read from the
device (``/proc/self/io``) are recorded beside each figure so a cached run cannot pass for a disk.
:func:`check_emulation` compares those figures with a profile's; :func:`require_valid` raises
:class:`~gpufeed.errors.EmulationInvalid` (or, when invalid runs are allowed, returns the reason to record).

Threads issue ``os.pread`` directly (it releases the GIL), so queue depth = thread count.
"""

from __future__ import annotations

import os
import random
import threading
import time

from gpufeed.bench.cache import evict, proc_io
from gpufeed.bench.tiers import KiB, MiB, Limits
from gpufeed.errors import EmulationInvalid

#: pattern -> (request bytes, threads = queue depth, random offsets?)
PATTERNS = {
    "seq_1m": (1 * MiB, 1, False),
    "rand_4k_qd1": (4 * KiB, 1, True),
    "rand_4k_qd32": (4 * KiB, 32, True),
    "rand_128k_x16": (128 * KiB, 16, True),
}

#: The host must beat the profile by this factor on every pattern: scheduling jitter on a shared machine moves
#: single figures by ~10%, and a host only just faster would leak its own time into the emulated figures.
CLEARLY_FASTER = 1.2

_TEST_FILE = "gpufeed-hostdisk.bin"

_measured: dict[tuple, dict] = {}


def test_file(directory: str, size: int) -> str:
    """A file of ``size`` random bytes in ``directory``, synced to disk."""
    path = os.path.join(directory, _TEST_FILE)
    chunk = os.urandom(MiB)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        for _ in range(size // MiB):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def run_pattern(path: str, pattern: str, seconds: float, throttle=None, seed: int = 0,
                wrap: bool = False) -> dict:
    """Run ``pattern`` on ``path`` for about ``seconds``; with ``throttle``, every read is charged to it.
    Each block is read at most once (the run ends early when all are read) unless ``wrap`` (the self-test's
    small cached file).

    Returns requests/s (``iops``), ``mb_per_s`` (10**6 bytes), ``requests``, ``bytes``, ``seconds`` and
    ``device_bytes`` (what the kernel read from disk meanwhile)."""
    size_req, threads, is_random = PATTERNS[pattern] if isinstance(pattern, str) else pattern
    size = os.path.getsize(path)
    slots = max(1, size // size_req)
    counts = [0] * threads
    stop = threading.Event()
    barrier = threading.Barrier(threads + 1)

    def worker(i: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if is_random else os.POSIX_FADV_SEQUENTIAL)
            # Each thread owns a slice of the file and visits each block once (shuffled when random), so a
            # cold measurement never re-reads a block another request already brought into the cache.
            order = list(range(i * slots // threads, (i + 1) * slots // threads)) or [0]
            if is_random:
                random.Random(seed * 1000 + i).shuffle(order)
            barrier.wait()
            n = 0
            while not stop.is_set():
                if n >= len(order) and not wrap:
                    break
                pos = order[n % len(order)] * size_req
                t0 = throttle.start() if throttle is not None else 0.0
                got = len(os.pread(fd, size_req, pos))
                if throttle is not None:
                    throttle.read_done(got, t0)
                n += 1
            counts[i] = n
        finally:
            os.close(fd)

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    before = proc_io()["read_bytes"]
    barrier.wait()
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline and any(t.is_alive() for t in pool):
        time.sleep(min(0.01, max(0.0, deadline - time.perf_counter())))
    stop.set()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    requests = sum(counts)
    nbytes = requests * size_req
    return {"pattern": pattern if isinstance(pattern, str) else random_pattern(size_req, threads),
            "request_bytes": size_req, "queue_depth": threads, "requests": requests,
            "bytes": nbytes, "seconds": elapsed, "iops": requests / elapsed, "mb_per_s": nbytes / elapsed / 1e6,
            "device_bytes": proc_io()["read_bytes"] - before}


def measure_host(directory: str, seconds: float = 1.0, file_bytes: int = 256 * MiB,
                 patterns=tuple(PATTERNS)) -> dict:
    """Cold-read figures of the disk under ``directory`` for each pattern (cached per process)."""
    key = (os.path.realpath(directory), seconds, file_bytes, tuple(patterns))
    if key in _measured:
        return _measured[key]
    path = test_file(directory, file_bytes)
    out = {"directory": os.path.realpath(directory), "file_bytes": file_bytes, "patterns": {}}
    try:
        for name in patterns:
            evict(path)
            r = run_pattern(path, name, seconds)
            r["device_fraction"] = r["device_bytes"] / r["bytes"] if r["bytes"] else 0.0
            out["patterns"][name] = r
    finally:
        # Not left in the user's data directory (where a measured tier's copy would pick it up).
        os.unlink(path)
    _measured[key] = out
    return out


def random_pattern(request_bytes: int, queue_depth: int) -> str:
    return f"rand_{request_bytes // KiB}k_qd{queue_depth}"


def pattern_shape(pattern: str | None) -> tuple[int | None, int | None]:
    """(request bytes, queue depth) a :func:`random_pattern` name says (``rand_116k_qd256``: 116 KiB reads, 256 in
    flight), each None where the name does not say it."""
    size = depth = None
    for part in (pattern or "").split("_"):
        if part.startswith("qd") and part[2:].isdigit():
            depth = int(part[2:])
        elif part.endswith("k") and part[:-1].isdigit():
            size = int(part[:-1]) * KiB
    return size, depth


#: Where measured ceilings are kept: a disk's ceiling for one request size and queue depth is measured once per
#: machine and read back afterwards (``bench train`` asks for it before every grid).
CEILINGS_FILE = "hostdisk-ceilings.json"


def ceiling(directory: str, record_bytes: int, queue_depth: int, seconds: float = 2.0,
            file_bytes: int = 1024 * MiB) -> dict | None:
    """The cold random-read ceiling of the disk under ``directory`` for requests of ``record_bytes`` (rounded up
    to 4 KiB) at ``queue_depth``: ``mb_per_s``, ``iops``, ``pattern``, ``disk``, ``measured`` (when). Measured
    once per disk, request size and queue depth, and kept (:data:`CEILINGS_FILE` in the user cache); ``None``
    where the test's reads did not come from the device (the page cache could not be evicted)."""
    from gpufeed.bench.kept import keep, kept
    from gpufeed.bench.results import disk_info

    info = disk_info(directory)
    disk = ":".join(str(info.get(k)) for k in ("disk", "model", "size_bytes", "fstype"))
    size = -(-max(1, int(record_bytes)) // (4 * KiB)) * 4 * KiB
    key = f"{disk}|{random_pattern(size, queue_depth)}"
    found = kept(CEILINGS_FILE, key)
    if found is not None:
        return found
    test = test_file(directory, file_bytes)
    try:
        evict(test)
        r = run_pattern(test, (size, queue_depth, True), seconds)
    finally:
        os.unlink(test)
    if not r["bytes"] or r["device_bytes"] / r["bytes"] < 0.5:
        return None
    found = {"mb_per_s": r["mb_per_s"], "iops": r["iops"], "pattern": r["pattern"], "disk": disk,
             "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    keep(CEILINGS_FILE, key, found)
    return found


def row_figures(host: dict) -> dict:
    """What a benchmark row keeps of :func:`measure_host`'s result: requests/s and MB/s per pattern."""
    return {k: {"iops": v["iops"], "mb_per_s": v["mb_per_s"]} for k, v in host["patterns"].items()}


def check_emulation(host: dict, limits: Limits, factor: float = CLEARLY_FASTER) -> list[str]:
    """Reasons the host cannot emulate ``limits`` (empty when it can): for each pattern, the host's cold
    requests/s must be ``factor`` x what the profile allows, from the device and not from cache."""
    reasons = []
    for name, r in host["patterns"].items():
        want = limits.qd_iops(r["request_bytes"], r["queue_depth"])
        if r["device_fraction"] < 0.5:
            reasons.append(f"{name}: only {r['device_fraction']:.0%} of the host test's bytes came from the disk "
                           "(page cache not evicted), so the host figure proves nothing")
        elif r["iops"] < factor * want:
            reasons.append(f"{name}: host {r['iops']:.0f} req/s is not {factor}x the profile's {want:.0f}")
    return reasons


def require_valid(tier, host: dict, allow_invalid: bool) -> str | None:
    """None when ``tier`` (a TierSpec) may be emulated on ``host``; otherwise raise EmulationInvalid, or with
    ``allow_invalid`` return the reason, to be stored in the row (``valid: false``)."""
    if tier.limits is None:
        return None
    reasons = check_emulation(host, tier.limits)
    if not reasons:
        return None
    reason = f"host disk under {host['directory']} is not clearly faster than profile {tier.name}: " + \
        "; ".join(reasons)
    if allow_invalid:
        return reason
    raise EmulationInvalid(reason + "; run on a faster disk, measure a real mount (--tier NAME=PATH), or pass "
                           "--allow-invalid to record the rows marked invalid")
