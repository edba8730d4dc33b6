"""Evict files from the page cache without root, and prove it with the bytes the kernel read.

``/proc/sys/vm/drop_caches`` is root-only, but ``posix_fadvise(POSIX_FADV_DONTNEED)`` drops a file's clean,
unmapped pages for anyone who can open it. Dirty pages stay, so each file is ``fsync``-ed first; pages still
mapped by a process stay too, so an open LMDB environment (which maps ``data.mdb``) must be closed before
eviction: :func:`evict` refuses while any process maps a file it was asked to evict. ``mincore``-based tools
misreport files one cannot write, so the proof of a cold read is :func:`proc_io`'s ``read_bytes``: the bytes
the kernel actually fetched from storage for a process (or thread).

Example::

    from gpufeed.bench.cache import evict, proc_io

    evict("data/lmdb")                      # every file under the tree
    before = proc_io()["read_bytes"]
    ...                                     # read the dataset
    from_device = proc_io()["read_bytes"] - before
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from gpufeed.errors import ConfigError


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """``/proc/<pid>/io`` as ints (``read_bytes``, ``write_bytes``, ``rchar``...); ``pid`` may be
    ``"self"`` or ``"thread-self"``. A process's figure includes its threads, not its children."""
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def pread_read_bytes(fd: int) -> int:
    """``read_bytes`` of an already open ``/proc/.../io`` fd: the per-read hot path keeps the fd and rereads
    it from offset 0 (the kernel regenerates the text) instead of opening the file each time."""
    text = os.pread(fd, 512, 0)
    i = text.index(b"read_bytes:") + len(b"read_bytes:")
    return int(text[i:text.index(b"\n", i)])


def files_under(path: str) -> list[str]:
    """Regular files at or below ``path``, sorted (a file is itself)."""
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _dirs, names in os.walk(path):
        out.extend(os.path.join(root, n) for n in names)
    return sorted(p for p in out if os.path.isfile(p) and not os.path.islink(p))


def warm(*paths: str, threads: int = 16) -> int:
    """Read every file at or below ``paths`` once (``threads`` at a time: a corpus of 300,000 files is read at
    the disk's queue depth, not one file after another), so the next run finds them in the page cache; the
    bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    files = [f for p in paths for f in files_under(p)]

    def read(batch: list[str]) -> int:
        n = 0
        for f in batch:
            with open(f, "rb", buffering=0) as fh:
                while chunk := fh.read(1 << 20):
                    n += len(chunk)
        return n

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(read, [files[i:i + 256] for i in range(0, len(files), 256)]))


def _mapped_files(pid: int | str = "self") -> set[str]:
    mapped = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    mapped.add(parts[5].rstrip("\n").removesuffix(" (deleted)"))
    except OSError:  # gone, or another user's
        pass
    return mapped


def mapping_processes(files: Sequence[str]) -> dict[int, list[str]]:
    """``{pid: [files it maps]}`` over every process this user can see, this one included: a page mapped by any
    process (another rank's reader, a DataLoader worker still exiting) survives ``DONTNEED``."""
    wanted = {os.path.realpath(f) for f in files}
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = sorted(wanted & _mapped_files(entry))
            if found:
                out[int(entry)] = found
    return out


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"
    except OSError:
        return "exited"


def evict(*paths: str, grace_s: float = 10.0) -> int:
    """Drop every file at or under ``paths`` from the page cache (sync, then fadvise DONTNEED).

    Returns the bytes covered. Raises ConfigError if this process maps one of them (close the LMDB environment or
    other mmap first: mapped pages cannot be evicted), or if another process still maps one after ``grace_s``
    seconds (processes that are exiting, such as a closed loader's workers, are waited for)."""
    files = [f for p in paths for f in files_under(p)]
    mine = _mapped_files()
    still = [f for f in files if os.path.realpath(f) in mine]
    if still:
        raise ConfigError(f"{still[0]} is memory-mapped by this process, so its pages cannot be evicted; close "
                          "the LMDB environment (or reader) that maps it before evicting")
    deadline = time.monotonic() + grace_s
    while True:
        others = mapping_processes(files)
        if not others:
            break
        if time.monotonic() >= deadline:
            pid, found = next(iter(others.items()))
            raise ConfigError(f"{found[0]} is memory-mapped by process {pid} ({_command(pid)}), so its pages cannot "
                              f"be evicted; end that process (or close its reader) before a cold run")
        time.sleep(0.1)
    # Every dirty page on the machine is written first, not only these files': a cold run that starts while a
    # dataset just built is still being written back shares the disk with that writeback.
    os.sync()
    total = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            # fsync on a read-only descriptor flushes the file's dirty pages too; they would survive DONTNEED.
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def cold_fraction(device_bytes: int, payload_bytes: int) -> float:
    """Share of the bytes a run read that came from the device (1.0 = fully cold, 0.0 = all cache)."""
    return device_bytes / payload_bytes if payload_bytes else 0.0
