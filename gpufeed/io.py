"""gpufeed's own I/O layer: every reader and writer opens files through here.

Two reasons it exists. Paths may be fsspec URLs (``memory://``, ``s3://``...) as well as local paths; and
storage-tier emulation (:mod:`gpufeed.bench.emulate`) must see every byte gpufeed moves, from every process
(DataLoader workers, Ray workers), without root. A tier is switched on for a process tree by the
environment variable ``GPUFEED_TIER_STATE`` (the path of the emulator's shared state file), so child
processes inherit it. With the variable unset, the cost is one dict lookup per open.

Memory-mapped reads (LMDB) bypass ``read()``: their readers call :func:`charge` with the bytes they touch.
"""

from __future__ import annotations

import os
from typing import IO

ENV_VAR = "GPUFEED_TIER_STATE"

_throttle = None
_throttle_key = None


def is_local(path: str) -> bool:
    """True for plain paths and ``file://`` URLs (which :func:`local_path` turns into plain paths)."""
    return "://" not in str(path) or str(path).startswith("file://")


def local_path(path: str) -> str:
    path = os.fspath(path)
    return path[len("file://"):] if path.startswith("file://") else path


def throttle():
    """The active tier emulator for this process, or ``None``. Re-read if the variable changes."""
    global _throttle, _throttle_key
    state = os.environ.get(ENV_VAR)
    if state != _throttle_key:
        _throttle_key = state
        if state:
            from gpufeed.bench.emulate import Throttle

            _throttle = Throttle.attach(state)
        else:
            _throttle = None
    return _throttle


def charge(nbytes: int, write: bool = False) -> None:
    """Account ``nbytes`` moved outside :func:`open_file` (e.g. LMDB mmap reads) to the active tier."""
    t = throttle()
    if t is not None and nbytes > 0:
        t.charge(nbytes, write=write)


def open_file(path: str, mode: str = "rb", buffering: int = -1) -> IO[bytes]:
    """Open ``path`` (local path or fsspec URL) in binary ``mode``, throttled when a tier is active."""
    if "b" not in mode:
        raise ValueError(f"gpufeed opens data files in binary mode, not {mode!r}")
    if is_local(path):
        f = open(local_path(path), mode, buffering=buffering)
    else:
        import fsspec

        f = fsspec.open(path, mode).open()
    t = throttle()
    return t.wrap(f) if t is not None else f
