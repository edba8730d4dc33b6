"""Run a check in a forked child, so that a reader crashing on damaged input (SIGBUS from a memory map past
the end of a truncated file) fails the test instead of killing the test session; and map over forked
children that share a reader the parent opened."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time

import pytest

#: Seconds each child forked meanwhile pauses in its at-fork hook (:func:`slow_child_start`); 0: none.
_child_pause = 0.0


def _pause_in_child() -> None:
    if _child_pause:
        time.sleep(_child_pause)


os.register_at_fork(after_in_child=_pause_in_child)


@contextlib.contextmanager
def slow_child_start(seconds: float = 1.0):
    """Every process forked from this one meanwhile pauses ``seconds`` in the fork's own hooks, before anything
    of its own runs: a signal sent to it then reaches it with this process's handlers."""
    global _child_pause
    _child_pause = seconds
    try:
        yield
    finally:
        _child_pause = 0.0


def in_child(fn, *args, timeout: float = 120) -> None:
    """``fn(*args)`` in a forked child. What the child inherits is frozen out of its garbage collector: a
    collection there (the loader's, as it closes) freed a Ray object an earlier test of the session left in this
    process, whose destructor crashed the child (SIGSEGV in ``~GlobalStateAccessor``, its threads not forked)."""
    import gc

    proc = multiprocessing.get_context("fork").Process(target=fn, args=args)
    gc.freeze()
    try:
        proc.start()
    finally:
        gc.unfreeze()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        pytest.fail("the reader hung on damaged input")
    assert proc.exitcode == 0, (f"the reader crashed (signal {-proc.exitcode}) on damaged input"
                                if proc.exitcode < 0 else "see the child's traceback above")


def fork_map(fn, args: list, processes: int = 3) -> list:
    """``Pool.map`` in forked children, closed and joined rather than terminated (as bench/dataset.py ends its
    pool: a terminated pool hung two full test runs, a worker left waiting on the task queue's lock)."""
    pool = multiprocessing.get_context("fork").Pool(processes)
    try:
        return pool.map(fn, args)
    finally:
        pool.close()
        pool.join()
