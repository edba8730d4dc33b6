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
    """A pool (a conversion's :class:`concurrent.futures.ProcessPoolExecutor`, or :func:`threads`) lent to a
    listing, and ``ready()``: whether its processes are up. Work goes to it only once they are: until then the
    listing goes on here, as fast as it would without the pool (a conversion's processes start while its driver
    lists)."""

    def __init__(self, executor, ready: Callable[[], bool] | None = None):
        self.executor = executor
        self.ready = ready or (lambda: True)
        self._waiting: list[Later] = []

    def later(self, fn: Callable, *args) -> Later:
        """``fn(*args)`` (picklable, run for its result) for the pool: handed to it now if its processes are up,
        else by the next listing work that finds them up (:func:`in_order`); where that never comes before its
        result is asked for, done here then (:meth:`Later.result`)."""
        job = Later(self, fn, args)
        self._waiting.append(job)
        self.hand_over()
        return job

    def hand_over(self) -> None:
        """Submit the work :meth:`later` holds, once the processes are up."""
        if self._waiting and self.ready():
            waiting, self._waiting = self._waiting, []
            for job in waiting:
                job.future = self.submit(job.fn, *job.args)

    def submit(self, fn: Callable, *args):
        """The pool's future of ``fn(*args)``; ``None`` where the pool cannot take work (shut down, or broken: a
        process died; BrokenProcessPool is a RuntimeError)."""
        from concurrent.futures import BrokenExecutor

        try:
            return self.executor.submit(fn, *args)
        except (RuntimeError, BrokenExecutor):
            return None


def _back(future, fn: Callable, *args):
    """What ``future`` holds, or ``fn(*args)`` done here where there is none or its pool broke."""
    from concurrent.futures import BrokenExecutor

    if future is not None:
        try:
            return future.result()
        except BrokenExecutor:
            pass
    return fn(*args)


#: Threads a remote source lists with (:func:`threads`).
LISTING_THREADS = 32
_threads: Lent | None = None


def threads() -> Lent:
    """Threads of this process, lent to the listings of a remote filesystem (one pool for the process). There a
    folder's listing or a tar header is a request that waits on the network, not on Python, so threads keep many
    in flight; another process would not see the same filesystem objects (``memory://`` is this process's own)."""
    global _threads
    if _threads is None:
        from concurrent.futures import ThreadPoolExecutor

        _threads = Lent(ThreadPoolExecutor(LISTING_THREADS, thread_name_prefix="gpufeed-listing"))
    return _threads


class Later:
    """Work lent to a pool ahead of when its result is needed (:meth:`Lent.later`)."""

    def __init__(self, pool: Lent, fn: Callable, args: tuple):
        self.pool, self.fn, self.args, self.future = pool, fn, args, None  # (future: None until handed over)

    def withdraw(self) -> bool:
        """Take the work back if the pool has not been given it yet (it is then not done at all): whether it was."""
        if self.future is None and self in self.pool._waiting:
            self.pool._waiting.remove(self)
            return True
        return False

    def result(self):
        """What ``fn(*args)`` returned (or raised), from the pool, or done here where the pool never took it (its
        processes not up yet, shut down, or broken)."""
        self.withdraw()
        return _back(self.future, self.fn, *self.args)


def in_order(pool: Lent | None, task: Callable[..., list[tuple]], items: list, per_task: int, *args,
             told: Callable[[int, int], None] | None = None) -> Iterator[tuple]:
    """``task(chunk, *args)`` (:func:`pieces`' shape: ``(result, error)`` per item) over ``items``, ``per_task``
    a chunk; yields each item's ``(result, error)`` in order. The chunks are done here, one after another, until
    ``pool`` is ready; then every chunk left is handed to it at once and taken back in order. (A task may end its
    chunk at an error the caller always raises, as a tar's index does.) Where the pool cannot take the work (shut
    down, or broken: a process died), the chunks not back are done here. Closing the iterator cancels the tasks
    not begun. ``told(done, len(items))`` after each chunk: how far it is (a listing's progress)."""
    chunks = [items[i:i + per_task] for i in range(0, len(items), per_task)]
    futures: dict = {}
    handed = pool is None or len(chunks) <= 1  # (one chunk would only wait for a process to take it)
    try:
        for i, chunk in enumerate(chunks):
            if pool is not None:
                pool.hand_over()  # work lent ahead goes first: it was asked for before these chunks
            if not handed and pool.ready():
                handed = True
                for j in range(i, len(chunks)):
                    future = pool.submit(task, chunks[j], *args)
                    if future is None:  # (the chunks not handed over are done here)
                        break
                    futures[j] = future
            done = _back(futures.pop(i, None), task, chunk, *args)
            if told is not None:
                told(min((i + 1) * per_task, len(items)), len(items))
            yield from done
    finally:
        for future in futures.values():
            future.cancel()
