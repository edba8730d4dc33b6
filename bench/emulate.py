"""Storage-tier emulation inside gpufeed's own I/O: a token bucket shared by every process of a run.

Kernel throttles (cgroup ``io.max``, dm-delay, FUSE) need root or devices containers lack, so the emulator
sits where gpufeed reads and writes (:mod:`gpufeed.io`). Each request of ``n`` bytes costs
``ceil(n / io_unit)`` operations against the IOPS bucket and ``n`` bytes against the MB/s bucket, and finishes
no earlier than ``start + latency``. Latency overlaps across concurrent requests, so ``q`` outstanding
requests give ``min(caps, q / latency)``: a single reader is latency-bound, many readers hit the caps.

The buckets live in a small state file that every process maps (``mmap``) and updates under ``fcntl.flock``:
DataLoader workers, Ray workers and the parent all draw from one device. A bucket is a "free at" time
(GCRA): a request reserves ``cost / rate`` seconds from ``max(now - burst, free_at)``.

Only bytes the device would serve are charged. In ``device`` accounting (the default) a read is charged the
bytes the kernel actually read from the host disk for it (``/proc/thread-self/io`` ``read_bytes`` delta, which
includes kernel readahead), so page-cache hits are free exactly as on a real disk with the same cache. The
host disk's own time overlaps the emulated time (a request ends at the later of the two), which is why the host
must be clearly faster than the profile (:mod:`gpufeed.bench.hostdisk` checks). ``requests`` accounting
charges every request in full whatever the cache holds (the self-test uses it to time the buckets alone).
Writes are charged when written (the device would have to absorb them; write-back is not modelled).

Memory-mapped reads (LMDB) call :meth:`Throttle.charge`; in device accounting they are charged the bytes the
thread faulted in from disk since its last charge, as one request per call.

Example::

    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.tiers import get_profile

    with Throttle.emulate(get_profile("ssd").limits(500)) as t:   # sets GPUFEED_TIER_STATE for children
        with gpufeed.io.open_file("train.rec") as f:
            f.read(1 << 20)
        print(t.stats())
"""

from __future__ import annotations

import ctypes
import fcntl
import io
import math
import mmap
import os
import struct
import tempfile
import threading
import time
from contextlib import contextmanager

from gpufeed.bench.cache import pread_read_bytes
from gpufeed.errors import ConfigError, GpufeedError

#: State file layout: magic, limits (iops, bytes/s, latency s, io unit, burst s), accounting mode
#: (0 device, 1 requests), the two buckets' free-at times (CLOCK_MONOTONIC, shared by all processes on the
#: host), then counters (requests, ops, bytes read, bytes written, seconds slept). Doubles for times and rates,
#: 64-bit integers for counts; little-endian so a file means the same to every process.
_STATE = struct.Struct("<8sdddqdq" "dd" "qqqqd")
_MAGIC = b"GFTIER01"
_LIMITS_END = struct.calcsize("<8sdddqdq")
_BUCKETS = struct.Struct("<dd")
_COUNTERS = struct.Struct("<qqqqd")
_STATE_SIZE = 4096

ACCOUNTING = ("device", "requests")

#: Slack for scheduling jitter: a bucket may lag ``now`` by this much, so a request whose thread woke late (ms
#: on a busy machine) can catch up and the long-run rate matches the cap. It lets at most 20 ms of extra work
#: through after an idle spell: < 2% in a one-second self-test.
DEFAULT_BURST_S = 0.02

#: PR_SET_TIMERSLACK: the kernel otherwise rounds sleeps up by 50 us, which alone would cap QD1 near 20k IOPS.
_PR_SET_TIMERSLACK = 29


def _tight_timer_slack():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _ThreadIO(threading.local):
    """This thread's ``/proc/thread-self/io`` and ``stat`` (kept open: re-reading from offset 0 regenerates
    them). Counters of a new thread or forked process start at zero, so zero baselines are right for them."""

    fd: int | None = None
    last: int = 0
    broken: bool = False
    stat_fd: int | None = None
    last_faults: int = 0

    def read_bytes(self) -> int | None:
        if self.broken:
            return None
        try:
            if self.fd is None:
                self.fd = os.open("/proc/thread-self/io", os.O_RDONLY)
            return pread_read_bytes(self.fd)
        except OSError:
            self.broken = True
            return None

    def new_faults(self) -> int | None:
        """Major page faults (each one a synchronous read from disk) since the last call."""
        try:
            if self.stat_fd is None:
                self.stat_fd = os.open("/proc/thread-self/stat", os.O_RDONLY)
            text = os.pread(self.stat_fd, 1024, 0)
        except OSError:
            return None
        now = int(text[text.rindex(b")") + 2:].split()[_MAJFLT])
        delta, self.last_faults = now - self.last_faults, now
        return delta


#: Index of ``majflt`` among the fields after the command name in /proc/<pid>/stat (field 12 of proc(5)).
_MAJFLT = 9


class Throttle:
    """One emulated device, shared through ``state_path``. Use :meth:`emulate` (or :meth:`create`) to make
    one and :meth:`attach` to join it from another process; :mod:`gpufeed.io` does the latter by itself."""

    _attached: dict[str, "Throttle"] = {}

    def __init__(self, state_path: str):
        self.path = os.fspath(state_path)
        self._open()

    def _open(self):
        try:
            self._fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            raise GpufeedError(f"{self.path}: tier emulator state file not found; it is created by "
                               "Throttle.emulate() in the parent process and removed when that ends") from None
        self._map = mmap.mmap(self._fd, _STATE_SIZE)
        magic, iops, bps, lat, unit, burst, acct = struct.unpack_from("<8sdddqdq", self._map, 0)
        if magic != _MAGIC:
            raise GpufeedError(f"{self.path}: not a gpufeed tier emulator state file; unset the "
                               "GPUFEED_TIER_STATE environment variable or point it at a live run's file")
        self.iops, self.bytes_per_s, self.latency_s, self.io_unit, self.burst_s = iops, bps, lat, unit, burst
        self.accounting = ACCOUNTING[acct]
        self._lock = threading.Lock()
        self._tio = _ThreadIO()
        # Device accounting counts from here: what this thread read before attaching is not the tier's.
        self._mark()
        self._tio.new_faults()
        _tight_timer_slack()

    def _reopen_after_fork(self):
        # A forked child shares the parent's open file description, and flock locks belong to that
        # description: without a fresh open the child and parent would not exclude each other.
        try:
            self._map.close()
            os.close(self._fd)
        except (OSError, ValueError):
            pass
        self._open()

    @classmethod
    def create(cls, state_path: str, limits, accounting: str = "device",
               burst_s: float = DEFAULT_BURST_S) -> "Throttle":
        """Write a fresh state file for ``limits`` (a :class:`gpufeed.bench.tiers.Limits`) and attach to it."""
        if accounting not in ACCOUNTING:
            raise ConfigError(f"accounting must be one of {', '.join(ACCOUNTING)}, not {accounting!r}")
        if min(limits.iops, limits.bytes_per_s, limits.io_unit) <= 0 or limits.latency_s < 0:
            raise ConfigError(f"tier limits must be positive, got {limits}")
        buf = bytearray(_STATE_SIZE)
        _STATE.pack_into(buf, 0, _MAGIC, float(limits.iops), float(limits.bytes_per_s), float(limits.latency_s),
                         int(limits.io_unit), float(burst_s), ACCOUNTING.index(accounting),
                         0.0, 0.0, 0, 0, 0, 0, 0.0)
        tmp = f"{state_path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(buf)
        os.replace(tmp, state_path)
        cls._attached.pop(os.fspath(state_path), None)
        return cls.attach(state_path)

    @classmethod
    def attach(cls, state_path: str) -> "Throttle":
        """The process's handle on the device described by ``state_path`` (one per path per process)."""
        key = os.fspath(state_path)
        t = cls._attached.get(key)
        if t is None:
            t = cls._attached[key] = cls(key)
        return t

    @classmethod
    @contextmanager
    def emulate(cls, limits, accounting: str = "device", state_dir: str | None = None,
                burst_s: float = DEFAULT_BURST_S):
        """Create a state file, export ``GPUFEED_TIER_STATE`` (child processes inherit the tier), yield the
        Throttle; restore the environment and remove the file afterwards."""
        fd, path = tempfile.mkstemp(prefix="gpufeed-tier-", suffix=".state", dir=state_dir)
        os.close(fd)
        try:
            cls.create(path, limits, accounting=accounting, burst_s=burst_s)
            with cls.joined(path) as t:
                yield t
        finally:
            cls._attached.pop(path, None)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    @classmethod
    @contextmanager
    def joined(cls, state_path: str):
        """Throttle this process (and the children it starts) by the device in ``state_path``, made by
        :meth:`create` (here or in another process, which removes it): the ranks of one benchmark share one
        emulated disk, as they would share the real one. The environment is restored afterwards."""
        from gpufeed.io import ENV_VAR, HOOK_VAR

        previous = {var: os.environ.get(var) for var in (ENV_VAR, HOOK_VAR)}
        try:
            t = cls.attach(state_path)
            os.environ[HOOK_VAR] = f"{__name__}:{cls.__name__}.attach"
            os.environ[ENV_VAR] = os.fspath(state_path)
            yield t
        finally:
            for var, value in previous.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value

    def _reserve(self, nbytes: int, ops: int, write: bool, t0: float, serial: int = 1) -> float:
        """Take ``ops`` and ``nbytes`` from the buckets for ``serial`` requests issued one after another from
        ``t0`` (each waits for the one before: page faults); return when the last may complete."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                ops_free, bytes_free = _BUCKETS.unpack_from(self._map, _LIMITS_END)
                floor = t0 - self.burst_s
                ops_end = max(floor, ops_free) + ops / self.iops
                bytes_end = max(floor, bytes_free) + nbytes / self.bytes_per_s
                _BUCKETS.pack_into(self._map, _LIMITS_END, ops_end, bytes_end)
                done = max(t0 + serial * self.latency_s, ops_end, bytes_end)
                req, nops, rd, wr, slept = _COUNTERS.unpack_from(self._map, _LIMITS_END + _BUCKETS.size)
                wait = max(0.0, done - time.monotonic())
                _COUNTERS.pack_into(self._map, _LIMITS_END + _BUCKETS.size, req + serial, nops + ops,
                                    rd + (0 if write else nbytes), wr + (nbytes if write else 0), slept + wait)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return done

    def _settle(self, nbytes: int, write: bool, t0: float, serial: int = 1) -> None:
        if nbytes <= 0:
            return
        done = self._reserve(nbytes, max(serial, math.ceil(nbytes / self.io_unit)), write, t0, serial)
        wait = done - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def _device_bytes(self, requested: int) -> int:
        """Bytes to charge for a read: what the kernel fetched for this thread since it last looked."""
        if self.accounting == "requests":
            return requested
        now = self._tio.read_bytes()
        if now is None:
            return requested
        delta, self._tio.last = now - self._tio.last, now
        return delta

    def _mark(self) -> float:
        if self.accounting == "device":
            now = self._tio.read_bytes()
            if now is not None:
                self._tio.last = now
        return time.monotonic()

    def charge(self, nbytes: int, write: bool = False) -> None:
        """Account ``nbytes`` moved outside :meth:`wrap` (LMDB's mmap reads), sleeping as the tier would.

        In device accounting a read is charged what the thread faulted in from disk since its last charge
        (nothing when the pages were cached), as one request per major page fault, one after another: with
        readahead off (LMDB's ``readahead=False``) each fault reads one page and the next waits for it, so a
        100 KB value costs ~24 dependent 4 KiB reads, which is what makes LMDB slow on high-latency disks."""
        t0 = time.monotonic()
        serial = 1
        if not write:
            nbytes = self._device_bytes(nbytes)
            if self.accounting == "device" and nbytes > 0:
                serial = max(1, self._tio.new_faults() or 1)
        self._settle(nbytes, write, t0, serial)

    def read_done(self, requested: int, t0: float) -> None:
        """Charge a read of ``requested`` bytes that started at ``t0`` (a value :meth:`start` returned)."""
        self._settle(self._device_bytes(requested), False, t0)

    def start(self) -> float:
        """Call before a read that :meth:`read_done` will charge (resets this thread's read_bytes baseline)."""
        return self._mark()

    def wrap(self, fileobj):
        """A file object like ``fileobj`` whose reads and writes are charged to this tier.

        Local buffered files are rebuilt on a throttled raw file, so Python's buffer sits above the device
        (only buffer fills and large reads are requests, as the kernel would see them); other file objects
        (fsspec) are charged per call.
        """
        if isinstance(fileobj, (io.BufferedReader, io.BufferedWriter, io.BufferedRandom)) and isinstance(
                fileobj.raw, io.FileIO):
            cls = type(fileobj)
            raw = _ThrottledRaw(fileobj.detach(), self)
            return cls(raw)
        if isinstance(fileobj, io.FileIO):
            return _ThrottledRaw(fileobj, self)
        return _ThrottledFile(fileobj, self)

    def stats(self) -> dict:
        """Counters since creation (or :meth:`reset_stats`): requests, ops, bytes read/written, seconds slept."""
        req, ops, rd, wr, slept = _COUNTERS.unpack_from(self._map, _LIMITS_END + _BUCKETS.size)
        return {"requests": req, "ops": ops, "bytes_read": rd, "bytes_written": wr, "slept_s": slept}

    def reset_stats(self) -> None:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                _COUNTERS.pack_into(self._map, _LIMITS_END + _BUCKETS.size, 0, 0, 0, 0, 0.0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def limits(self):
        from gpufeed.bench.tiers import Limits

        return Limits(iops=self.iops, bytes_per_s=self.bytes_per_s, latency_s=self.latency_s,
                      io_unit=self.io_unit)


def _after_fork_in_child():
    for t in Throttle._attached.values():
        t._reopen_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _ThrottledRaw(io.RawIOBase):
    """A raw local file whose every system-call-level read and write is a device request."""

    def __init__(self, raw: io.FileIO, throttle: Throttle):
        super().__init__()
        self._raw, self._t = raw, throttle

    @property
    def name(self):
        return self._raw.name

    @property
    def mode(self):
        return self._raw.mode

    def readable(self):
        return self._raw.readable()

    def writable(self):
        return self._raw.writable()

    def seekable(self):
        return self._raw.seekable()

    def fileno(self):
        return self._raw.fileno()

    def seek(self, pos, whence=io.SEEK_SET):
        return self._raw.seek(pos, whence)

    def tell(self):
        return self._raw.tell()

    def truncate(self, size=None):
        return self._raw.truncate(size)

    def readinto(self, b):
        t0 = self._t.start()
        n = self._raw.readinto(b)
        if n:
            self._t.read_done(n, t0)
        return n

    def write(self, b):
        t0 = time.monotonic()
        n = self._raw.write(b)
        if n:
            self._t._settle(n, True, t0)
        return n

    def flush(self):
        if not self._raw.closed:
            self._raw.flush()

    def close(self):
        if not self.closed:
            try:
                super().close()
            finally:
                self._raw.close()


class _ThrottledFile:
    """Any other file object (fsspec): each read/readinto/write call is charged in full as one request (the
    host's page cache says nothing about a remote store)."""

    def __init__(self, f, throttle: Throttle):
        self._f, self._t = f, throttle

    def read(self, n=-1):
        t0 = time.monotonic()
        data = self._f.read(n)
        self._t._settle(len(data), False, t0)
        return data

    def readinto(self, b):
        t0 = time.monotonic()
        n = self._f.readinto(b)
        if n:
            self._t._settle(n, False, t0)
        return n

    def write(self, b):
        t0 = time.monotonic()
        n = self._f.write(b)
        self._t._settle(len(b) if n is None else n, True, t0)
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


#: What the self-test runs: the patterns of the vendors' own figures (TIERS.md).
SELF_TEST_PATTERNS = ("rand_4k_qd1", "rand_4k_qd32", "seq_1m")


def _unlimited():
    from gpufeed.bench.tiers import Limits

    return Limits(iops=1e12, bytes_per_s=1e15, latency_s=0.0, io_unit=4096)


def self_test(limits, directory: str, seconds: float = 0.5, patterns=SELF_TEST_PATTERNS) -> list[dict]:
    """Time the emulator alone against ``limits``: each pattern runs on a small cached file with every request
    charged (``requests`` accounting), and its rate is compared with what the profile allows.

    Each entry: ``pattern``, ``expected`` and ``emulated`` requests/s, ``error`` (emulated / expected - 1),
    ``saturated`` (the profile's caps bind rather than its latency), ``unthrottled`` (the same loop through an
    emulator without limits) and ``host_limited`` (that loop cannot go 1.2x faster than the profile, so the
    error is the machine's CPU, not the bucket's)."""
    from gpufeed.bench.hostdisk import CLEARLY_FASTER, PATTERNS, run_pattern, test_file

    path = test_file(directory, 8 * 2**20)
    out = []
    try:
        with open(path, "rb") as f:
            while f.read(2**20):
                pass
        for name in patterns:
            size, qd, _ = PATTERNS[name]
            expected = limits.qd_iops(size, qd)
            # The same loop through an emulator with no limits: what this machine can drive at all.
            with Throttle.emulate(_unlimited(), accounting="requests", state_dir=directory) as t:
                free = run_pattern(path, name, min(seconds, 0.2), throttle=t, wrap=True)["iops"]
            with Throttle.emulate(limits, accounting="requests", state_dir=directory) as t:
                got = run_pattern(path, name, seconds, throttle=t, wrap=True)["iops"]
            saturated = expected < qd / limits.latency_s * 0.999
            out.append({"pattern": name, "request_bytes": size, "queue_depth": qd, "expected": expected,
                        "emulated": got, "error": got / expected - 1, "saturated": saturated, "unthrottled": free,
                        "host_limited": free < CLEARLY_FASTER * expected})
    finally:
        os.unlink(path)
    return out
