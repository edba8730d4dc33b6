"""Facts about the machine that more than one layer needs."""

from __future__ import annotations

import contextlib
import os


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_queue_seconds(tid: int | None = None) -> float | None:
    """Seconds a thread of this process has spent runnable but waiting for a CPU (Linux's schedstat, second
    field): the calling thread by default, else thread ``tid`` (the main thread's id is the process id); ``None``
    where the kernel does not say. Two readings around a piece of work tell how much of its wall time other
    processes' CPU use took: a conversion worker's shard that took longer than its CPU time waited either for a
    core (this) or for I/O; a training loop's main thread that waits here launches the model's kernels late."""
    path = "/proc/thread-self/schedstat" if tid is None else f"/proc/self/task/{tid}/schedstat"
    try:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def core_groups() -> list[list[int]]:
    """The usable cores grouped by physical core: each logical core with its hyper-thread siblings (as
    /sys lists them; a VM that lists none gives one core per group), groups in the order of their lowest core."""
    usable = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    groups: dict[int, list[int]] = {}
    for cpu in sorted(usable):
        siblings = {cpu}
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                for part in f.read().strip().split(","):
                    lo, _, hi = part.partition("-")
                    siblings.update(range(int(lo), int(hi or lo) + 1))
        except (OSError, ValueError):
            pass
        groups.setdefault(min(siblings & usable), []).append(cpu)  # each core is visited once
    return [groups[k] for k in sorted(groups)]


def reserved_cores(per_rank: int, local_ranks: int = 1) -> tuple[list[set[int]], set[int]]:
    """``(reserved, rest)``: for each of ``local_ranks`` ranks on this node, ``per_rank`` physical cores of its
    own (with their hyper-thread siblings; rank ``r`` the ``r``-th run of :func:`core_groups`, the same answer in
    every rank), and the usable cores none of them reserved. Raises ValueError where that leaves no core."""
    groups = core_groups()
    want = max(0, per_rank) * max(1, local_ranks)
    if want and want >= len(groups):
        raise ValueError(f"{per_rank} core(s) for each of {local_ranks} rank(s) leaves none of the "
                         f"{len(groups)} physical cores here for anything else")
    reserved = [set().union(*groups[r * per_rank:(r + 1) * per_rank]) if per_rank > 0 else set()
                for r in range(max(1, local_ranks))]
    rest = set().union(*groups) - set().union(*reserved)
    return reserved, rest


def default_sigterm() -> None:
    """In a process forked for gpufeed's own work (a benchmark's reader or decoder pool): SIGTERM back to the
    kernel's default, ending the process, and let through if its parent held it while forking
    (:func:`sigterm_held`). A fork keeps its parent's Python signal handlers: a Ray driver's raises SystemExit,
    gpufeed's command line's raises Terminated, and a pool worker with one of them, waiting on its task queue's
    lock, outlived ``Pool.terminate()`` while its parent joined it, for good."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one that came meanwhile ends it now


@contextlib.contextmanager
def sigterm_held():
    """SIGTERM held (blocked) in this thread, and so in the processes it forks and the threads it starts, until
    they call :func:`default_sigterm`. A SIGTERM that reaches a fresh fork while it still has this process's
    Python handler runs that handler where Python ignores what it raises (the fork's own hooks: "Exception
    ignored ... SystemExit"): the process goes on, and a pool's worker then waits for good on the queue's lock
    that ``terminate()`` holds (7 pools in 1,000 terminated as they started, on 2 busy cores). Held, it waits
    in the kernel until the process has its default, and then ends it.

    Starting multiprocessing's resource tracker (a spawn or fork-server context's first lock or process) lets
    SIGTERM through in the calling thread when it is done, whatever was held before: start those first."""
    import signal

    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def fork_pool(processes: int, initializer=None, initargs: tuple = ()):
    """``multiprocessing.Pool`` of ``processes`` forked from this one (they share what it has loaded), each
    giving SIGTERM its default (:func:`default_sigterm`) before ``initializer(*initargs)``, so
    ``Pool.terminate()`` ends them whatever handler this process has, from the moment they exist: made under
    :func:`sigterm_held`, as are the pool's own threads, which fork any worker it replaces."""
    import multiprocessing

    with sigterm_held():
        return multiprocessing.get_context("fork").Pool(processes, initializer=_pool_start,
                                                         initargs=(initializer, initargs))


def _pool_start(initializer, initargs: tuple) -> None:
    default_sigterm()
    if initializer is not None:
        initializer(*initargs)


def free_port(avoid=()) -> int:
    """A TCP port of 127.0.0.1 that nothing holds now (the kernel's pick), other than those in ``avoid``."""
    import socket

    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port
