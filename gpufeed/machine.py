"""Facts about the machine that more than one layer needs."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_queue_seconds() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux's
    ``/proc/thread-self/schedstat``, second field), or ``None`` where the kernel does not say. Two readings
    around a piece of work tell how much of its wall time other processes' CPU use took: a conversion
    worker's shard that took longer than its CPU time waited either for a core (this) or for I/O."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def default_sigterm() -> None:
    """In a process forked for gpufeed's own work (a benchmark's reader or decoder pool): SIGTERM back to the
    kernel's default, ending the process. A fork keeps its parent's Python signal handlers: a Ray driver's
    raises SystemExit, gpufeed's command line's raises Terminated, and a pool worker with one of them, waiting
    on its task queue's lock, outlived ``Pool.terminate()`` while its parent joined it, for good."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def fork_pool(processes: int, initializer=None, initargs: tuple = ()):
    """``multiprocessing.Pool`` of ``processes`` forked from this one (they share what it has loaded), each
    giving SIGTERM its default (:func:`default_sigterm`) before ``initializer(*initargs)``, so
    ``Pool.terminate()`` ends them whatever handler this process has."""
    import multiprocessing

    return multiprocessing.get_context("fork").Pool(processes, initializer=_pool_start,
                                                     initargs=(initializer, initargs))


def _pool_start(initializer, initargs: tuple) -> None:
    default_sigterm()
    if initializer is not None:
        initializer(*initargs)
