"""The process server a conversion's local processes fork from (:class:`gpufeed.convert.scheduler._LocalStart`).

It is a separate process that imports the worker side (:mod:`.worker`), OpenCV and every format's module once, then forks a
worker in milliseconds for each request. The command line starts it before the driver imports anything
heavy (:func:`start`), so its imports run while the driver imports, lists and plans: the first shard waits
for neither. Kept in a module of its own that imports almost nothing, for that reason.
"""

from __future__ import annotations

import multiprocessing
import os

from gpufeed import io


def worker_env() -> dict:
    """What every worker's environment must hold, Ray's or local: a fixed hash seed, and the emulated
    storage tier the driver runs under."""
    env = {"PYTHONHASHSEED": "0"}
    env.update({var: os.environ[var] for var in io.TIER_VARS if os.environ.get(var)})
    return env


def context():
    """The ``forkserver`` multiprocessing context, set to preload what a shard needs. The server starts
    from this process's environment, which gets :func:`worker_env` first (a Ray runtime started here later
    inherits it too)."""
    from gpufeed.formats import format_modules

    os.environ.update(worker_env())
    ctx = multiprocessing.get_context("forkserver")
    # crc32c too: the formats import it on first use (gpufeed.formats._crc), where a worker would pay it per process.
    # This module too: imported there, it lets the server leave without tearing its interpreter down (_server_exit).
    ctx.set_forkserver_preload([__name__, "gpufeed.convert.worker", "gpufeed.pipelines.transforms", "cv2", "crc32c",
                                *format_modules()])
    return ctx


def start() -> None:
    """Start the server now (it imports in the background); the local processes use it when they start."""
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()


#: How long a pool's warm-up task waits for the pool's other processes to start (:func:`wait_for_the_others`).
START_WAIT_S = 1.0
_started = None  # the pool's start barrier (a multiprocessing.Barrier of its process count), given at start


def worker_init(pid: int, nice: int = 0, started=None) -> None:
    """A local process's start: ``nice`` added to its niceness, its end tied to the driver's
    (:func:`die_with`), and ``started``, the pool's start barrier, kept for :func:`wait_for_the_others`."""
    global _started
    _started = started
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass  # a niceness is a preference: the process converts all the same
    die_with(pid)


def wait_for_the_others() -> None:
    """Hold this process (in its warm-up task) until every process of its pool has started, for at most
    :data:`START_WAIT_S`. A pool starts a process for a task only where none is idle, and a warm-up task returns
    in microseconds: without the wait, 64 warm-up tasks started 19 of 64 processes, and the other 45 were
    started one by one as the driver handed out the first shards (on its main thread, a fork each): 10-12 idle
    worker-seconds before every worker had one at 64 workers (4x H200, session 25), 1.6-2.1 at 32, against
    0.1-0.25 at 32 with the wait (results/convert-node-h200x2.txt)."""
    import threading

    if _started is not None:
        try:
            _started.wait(START_WAIT_S)
        except threading.BrokenBarrierError:
            pass  # one was slow to start: the others go on, and it starts when a shard needs it


def die_with(pid: int) -> None:
    """End this process as soon as process ``pid`` (the driver) ends, however it ends (``kill -9`` too).

    A local process forked from the server is not the driver's child, and waits on the pool's queue, whose
    pipe it holds both ends of: with the driver gone it would wait forever, and keep the server (and the
    terminal's or ``tee``'s pipe it inherited) alive with it. A thread waits on the driver's pidfd (a poll
    of its pid where the kernel has none); the server itself ends once its last process is gone."""
    import threading

    def watch():
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            import select

            select.select([fd], [], [])  # readable once the process has ended
        else:
            import time

            while _alive(pid):
                time.sleep(0.5)
        os._exit(1)

    if not _alive(pid):
        os._exit(1)
    threading.Thread(target=watch, name="gpufeed-die-with-driver", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _server_exit() -> None:
    """The fork server's exit, once the driver has gone: its output flushed, then ``os._exit``.

    The server holds the driver's stdout and stderr (inherited), so whoever reads them (``| tee``, a
    benchmark's pipe) waits for it; tearing down an interpreter that has imported OpenCV, NumPy and every
    format took ~0.1 s of that wait on 2 cores after the driver had exited. The server keeps nothing that
    needs an orderly end: its processes have ended before it (they die with the driver, die_with), and it
    holds no file of ours."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


def _imported_by_server() -> bool:
    """Whether this import is the fork server's preload (``multiprocessing.forkserver.main`` on the stack),
    not the driver's or a worker's import."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back
    return False


if _imported_by_server():
    import atexit

    atexit.register(_server_exit)
