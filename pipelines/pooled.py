"""Listing work handed to a process pool (a conversion's local processes, :attr:`BaseSource.pool`), its results
taken back in order, as if it had been done here one piece after another.

A source lists a split before any image is converted, and a listing is mostly chains of requests a disk (or a
remote store) answers one at a time: a tar's headers, a folder's entries. Handed out a few at a time to a pool's
processes, many chains are in flight at once, and their Python runs on as many cores. Errors keep their place: a
piece's error is given where it falls, after every result before it, as the same listing in one process would
meet it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from gpufeed.errors import GpufeedError

#: What a piece of listing work may raise and still be given back in its place: a gpufeed error naming the input,
#: or the filesystem's (a folder that cannot be read).
PIECE_ERRORS = (GpufeedError, OSError)


def pieces(items: list, fn: Callable, *args) -> list[tuple]:
    """``(fn(item, *args), None)`` for each of ``items``, or ``(None, error)`` where it raised one of
    :data:`PIECE_ERRORS` (the caller raises it, or under ``--on-error skip`` leaves that piece out). A pool's
    task."""
    out = []
    for item in items:
        try:
            out.append((fn(item, *args), None))
        except PIECE_ERRORS as e:
            out.append((None, e))
    return out


class Lent:
    """A process pool (:class:`concurrent.futures.ProcessPoolExecutor`) lent to a listing, and ``ready()``: whether
    its processes are up. Work goes to it only once they are: until then the listing goes on here, as fast as it
    would without the pool (a conversion's processes start while its driver lists)."""

    def __init__(self, executor, ready: Callable[[], bool] | None = None):
        self.executor = executor
        self.ready = ready or (lambda: True)


def in_order(pool: Lent | None, task: Callable[..., list[tuple]], items: list, per_task: int, *args) -> Iterator[tuple]:
    """``task(chunk, *args)`` (:func:`pieces`' shape: ``(result, error)`` per item) over ``items``, ``per_task``
    a chunk; yields each item's ``(result, error)`` in order. The chunks are done here, one after another, until
    ``pool`` is ready; then every chunk left is handed to it at once and taken back in order. (A task may end its
    chunk at an error the caller always raises, as a tar's index does.) Where the pool cannot take the work (shut
    down, or broken: a process died), the chunks not back are done here. Closing the iterator cancels the tasks
    not begun."""
    from concurrent.futures import BrokenExecutor

    chunks = [items[i:i + per_task] for i in range(0, len(items), per_task)]
    futures: dict = {}
    handed = pool is None or len(chunks) <= 1  # (one chunk would only wait for a process to take it)
    try:
        for i, chunk in enumerate(chunks):
            if not handed and pool.ready():
                handed = True
                try:
                    for j in range(i, len(chunks)):
                        futures[j] = pool.executor.submit(task, chunks[j], *args)
                except (RuntimeError, BrokenExecutor):  # shut down or broken (BrokenProcessPool is a RuntimeError)
                    pass
            done = None
            if i in futures:
                try:
                    done = futures.pop(i).result()
                except BrokenExecutor:
                    pass
            yield from done if done is not None else task(chunk, *args)
    finally:
        for future in futures.values():
            future.cancel()
