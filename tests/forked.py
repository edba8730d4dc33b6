"""Run a check in a forked child, so that a reader crashing on damaged input (SIGBUS from a memory map past
the end of a truncated file) fails the test instead of killing the test session; and map over forked
children that share a reader the parent opened."""

from __future__ import annotations

import multiprocessing

import pytest


def in_child(fn, *args, timeout: float = 120) -> None:
    proc = multiprocessing.get_context("fork").Process(target=fn, args=args)
    proc.start()
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
