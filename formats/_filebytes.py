"""How the file-based readers (RecordIO, TFRecord) get at their bytes, fast and safely in many processes.

A local file with no tier emulation active is memory-mapped once per process and sequential scans hand records
out as ``memoryview`` slices of the map: no copy, no system call per record, which is what lets a reader that
checks every record keep up with a plain 1 MiB ``read()`` loop from the page cache (bench/experiments/formats_speed.py).
A record read at random (``read_raw(i)``, ``reader[i]``) is one request for its extent instead
(:meth:`ByteSource.record`), an ``os.pread`` of a local file: through the map, a cold record is read by page
faults taken while the first touch holds the GIL, so the threads of one process wait on the disk one at a
time, and the faults follow the map's readahead, not the record's size; through a file object (an emulated
tier) the header, payload and checksum would be three dependent requests. Anything else (fsspec URLs, an emulated tier, gzip)
is read through :func:`gpufeed.io.open_file` so tier emulation sees every byte. Handles are opened lazily and re-opened after ``fork``; pickling drops them, so a reader can be sent
to DataLoader workers or Ray tasks.
"""

from __future__ import annotations

import gzip
import mmap
import os
import threading
import zlib

from gpufeed import io
from gpufeed.errors import CorruptRecordError

#: Reads whose length comes from a field not yet verified start at _FIRST_PIECE and double up to _PIECE, so a
#: damaged length can never make a reader allocate much more than the stream really holds (some streams,
#: like gzip, preallocate the size they are asked for).
_FIRST_PIECE = 1 << 20
_PIECE = 64 << 20


def read_fully(f, n: int) -> bytes:
    """Up to ``n`` bytes from ``f``; shorter only at end of file."""
    piece = min(n, _FIRST_PIECE)
    data = f.read(piece)
    if data is None or len(data) == n or not data:
        return data or b""
    parts = [data]
    got = len(data)
    while got < n:
        piece = min(piece * 2, _PIECE)
        more = f.read(min(n - got, piece))
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def position(i: int, count: int, path: str) -> int:
    """``i`` as a position in ``0..count-1`` (negative counts from the end, as for lists)."""
    if not -count <= i < count:
        raise IndexError(f"record {i} outside 0..{count - 1} of {path}")
    return i % count


class ViewCursor:
    """Sequential reads over a memoryview; ``read`` returns zero-copy slices."""

    __slots__ = ("mv", "pos", "size")

    def __init__(self, mv: memoryview, pos: int = 0):
        self.mv, self.pos, self.size = mv, pos, len(mv)

    def read(self, n: int):
        p = self.pos
        self.pos = min(p + n, self.size)
        return self.mv[p:p + n]

    def remaining(self) -> int:
        return self.size - self.pos


class StreamCursor:
    """Sequential reads over a file object, tracking the position itself (gzip and fsspec streams)."""

    __slots__ = ("f", "pos", "size")

    def __init__(self, f, pos: int = 0, size: int | None = None):
        self.f, self.pos, self.size = f, pos, size

    def read(self, n: int):
        data = read_fully(self.f, n)
        self.pos += len(data)
        return data

    def remaining(self) -> int | None:
        return None if self.size is None else self.size - self.pos


class RecordCursor:
    """Reads of one record at random: its extent (``hint`` bytes, the index's record size) fetched in one
    request (``fetch(offset, n)``: an ``os.pread`` of a local file, the GIL released; or one read of a file
    object, which an emulated tier charges as one request, as a disk serves it), then zero-copy slices of that
    buffer; reads past it (a hint that was short) fetch the rest."""

    __slots__ = ("fetch", "pos", "start", "buf", "size")

    def __init__(self, fetch, pos: int, hint: int, size: int | None):
        self.fetch, self.pos, self.start, self.size = fetch, pos, pos, size
        self.buf = memoryview(fetch(pos, max(0, hint if size is None else min(hint, size - pos))))

    def read(self, n: int):
        at = self.pos - self.start
        if at + n <= len(self.buf):
            out = self.buf[at:at + n]
        else:
            out = bytes(self.buf[at:])
            while len(out) < n:
                more = self.fetch(self.pos + len(out), n - len(out))
                if not more:
                    break
                out += more
        self.pos += len(out)
        return out

    def remaining(self) -> int | None:
        return None if self.size is None else self.size - self.pos


#: Serialises opening sources (once per process each).
_OPEN_LOCK = threading.Lock()

#: The longest byte range one read-ahead hint names. Linux starts reading a POSIX_FADV_WILLNEED range only up
#: to the larger of the file's readahead window (read_ahead_kb, 128 KiB by default) and the device's optimal
#: request size, and silently drops the rest, so a longer range is hinted in pieces of this size.
WILL_NEED_PIECE = 128 << 10


def advise_will_need(fd: int, extents) -> int:
    """Has the kernel start reading every ``(offset, size)`` byte range of the file open as ``fd`` now, all of
    them at once, and return without waiting (``posix_fadvise(POSIX_FADV_WILLNEED)``). A reader that then reads
    the ranges one at a time finds them in the page cache or on their way: a DataLoader worker reading a
    batch of cold records keeps the disk's queue full instead of waiting for one record at a time. Touching
    ranges are merged first. Nothing under an emulated tier: it charges and paces every read as it comes, and a
    read-ahead behind its back would serve them from the page cache. Returns the number of hints given (0 there,
    and where the platform has no such call)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or io.throttle() is not None:
        return 0
    hints = 0
    start = end = None
    for offset, size in sorted((int(o), int(n)) for o, n in extents if n > 0):
        if start is not None and offset <= end:
            end = max(end, offset + size)
            continue
        if start is not None:
            hints += _hint(advise, fd, start, end)
        start, end = offset, offset + size
    if start is not None:
        hints += _hint(advise, fd, start, end)
    return hints


def _hint(advise, fd: int, start: int, end: int) -> int:
    for at in range(start, end, WILL_NEED_PIECE):
        advise(fd, at, min(WILL_NEED_PIECE, end - at), os.POSIX_FADV_WILLNEED)
    return -(-(end - start) // WILL_NEED_PIECE)


def random_read_fd(path: str) -> int:
    """A read-only descriptor of ``path`` for reading records at random: the kernel is told so
    (``POSIX_FADV_RANDOM``), so a cold record read fetches that record's pages and no read-ahead around them. A
    plain descriptor let every cold 118 KB read pull in its neighbours too: a training loop's shuffled reads made
    the disk read 1.7-2.1 times the records' bytes on the 4-GPU machine (results/gpu-ranks-h100x4.txt), half the
    disk's speed lost where it was the limit. Its own descriptor, because the hint holds for an open file, and
    the same file's sequential scans (its memory map, opened ``MADV_SEQUENTIAL``) keep their read-ahead. Hints
    of the ranges a batch needs (:func:`advise_will_need`) still start those reads at once."""
    fd = io.open_fd(path)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


class ByteSource:
    """One data file, opened on first use in each process. Safe to read from several threads at once: the
    memory map is shared, and where reads go through a file object (an emulated tier, an fsspec URL) each
    thread has its own handle, since a shared one would move under another thread's seek."""

    def __init__(self, path: str, compression: str | None = None, use_mmap: bool = True):
        self.path = os.fspath(path)
        self.compression = compression
        self.use_mmap = use_mmap
        self._pid = None
        self._f = None
        self._mv = None
        self._rfd = None  # the descriptor random record reads go through (random_read_fd)
        self._local = threading.local()
        self._handles: list = []
        self._handles_lock = threading.Lock()

    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(_pid=None, _f=None, _mv=None, _rfd=None, _local=None, _handles=[], _handles_lock=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()
        self._handles_lock = threading.Lock()

    def _thread_file(self):
        """This thread's handle on the file (random reads seek it)."""
        f = getattr(self._local, "f", None)
        if f is None or getattr(self._local, "pid", None) != os.getpid():
            f = io.open_file(self.path, "rb", buffering=0 if io.is_local(self.path) else -1)
            self._local.f, self._local.pid = f, os.getpid()
            with self._handles_lock:
                self._handles.append(f)
        return f

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        with _OPEN_LOCK:  # threads reading a fresh source at once open it once
            if self._pid != os.getpid():
                self._open_once()

    def _open_once(self) -> None:
        if self._rfd is not None:  # a forked child's copy of its parent's descriptor
            os.close(self._rfd)
        self._f = self._mv = self._rfd = None
        f = io.open_file(self.path, "rb", buffering=0 if io.is_local(self.path) else -1)
        if (self.compression is None and self.use_mmap and io.is_local(self.path)
                and io.throttle() is None):
            fd = f.fileno()
            if os.fstat(fd).st_size == 0:
                self._mv = memoryview(b"")
            else:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                mm.madvise(mmap.MADV_SEQUENTIAL)
                self._mv = memoryview(mm)
                # The map keeps its own hold on the file: one descriptor per source stays open, the random one
                # (a loader's worker may hold a thousand shards open).
                self._rfd = random_read_fd(self.path)
                f.close()
                f = None
        self._f = f
        self._pid = os.getpid()

    def view(self) -> memoryview | None:
        """The whole (uncompressed, local) file as a memoryview, or ``None`` where reads must be used."""
        self._open()
        return self._mv

    def cursor(self, pos: int = 0):
        """A fresh sequential cursor from byte ``pos`` (of the uncompressed stream)."""
        self._open()
        if self._mv is not None:
            return ViewCursor(self._mv, pos)
        f = io.open_file(self.path, "rb")
        if self.compression == "gzip":
            f = _Gunzip(f, self.path)
            size = None
        else:
            size = _size(f)
        if pos:
            f.seek(pos)
        return StreamCursor(f, pos, size)

    def cursor_at(self, pos: int):
        """A cursor from byte ``pos`` for reading one record at random (shares this process's handle)."""
        self._open()
        if self._mv is not None:
            return ViewCursor(self._mv, pos)
        f = self._thread_file()
        f.seek(pos)
        return StreamCursor(f, pos, _size(f))

    def record(self, pos: int, hint: int):
        """A cursor for one record read at random from byte ``pos``, ``hint`` its expected size in bytes: the
        extent in one request (gzip streams: as :meth:`cursor_at`)."""
        self._open()
        if self._mv is not None:
            fd = self._rfd
            return RecordCursor(lambda offset, n: os.pread(fd, n, offset), pos, hint, len(self._mv))
        if self.compression is not None:
            return self.cursor_at(pos)
        f = self._thread_file()

        def fetch(offset: int, n: int):
            f.seek(offset)
            return read_fully(f, n)

        return RecordCursor(fetch, pos, hint, _size(f))

    def will_need(self, extents) -> int:
        """Read-ahead of these ``(offset, size)`` ranges (:func:`advise_will_need`) where this source is a plain
        local file; nothing for an fsspec URL or a gzip stream. Returns the hints given."""
        if self.compression is not None or not io.is_local(self.path):
            return 0
        self._open()
        return advise_will_need(self._rfd if self._rfd is not None else self._f.fileno(), extents)

    def read_at(self, offset: int, n: int):
        """``n`` bytes at ``offset`` (fewer at end of file); a zero-copy slice when memory-mapped."""
        self._open()
        if self._mv is not None:
            return self._mv[offset:offset + n]
        f = self._thread_file()
        f.seek(offset)
        return read_fully(f, n)

    def size(self) -> int:
        self._open()
        if self._mv is not None:
            return len(self._mv)
        return _size(self._thread_file())

    def close(self) -> None:
        mv, f, rfd = self._mv, self._f, self._rfd
        self._mv = self._f = self._rfd = None
        self._pid = None
        if f is not None:
            f.close()
        if rfd is not None:
            os.close(rfd)
        with self._handles_lock:
            handles, self._handles = self._handles, []
        for h in handles:
            h.close()
        self._local = threading.local()
        if mv is not None:
            # Slices handed out keep the map alive; it is unmapped when the last one is dropped.
            try:
                mv.release()
            except BufferError:
                pass


class _Gunzip:
    """A GZIP stream whose damage (bad header, bad CRC, early end) raises CorruptRecordError like any other."""

    def __init__(self, f, path: str):
        self._raw = f
        self._gz = gzip.GzipFile(fileobj=f, mode="rb")
        self._path = path
        self._pos = 0

    def read(self, n: int) -> bytes:
        try:
            data = self._gz.read(n)
        except (OSError, EOFError, zlib.error) as e:
            raise CorruptRecordError(self._path, None, self._pos, f"the GZIP stream is damaged after "
                                                                  f"{self._pos} uncompressed bytes ({e})") from None
        if not data and n and not self._pos and not self._raw.tell():
            # A GZIP shard with no records still holds a header and trailer: an empty file is a lost one.
            raise CorruptRecordError(self._path, None, 0, "the file is empty, not a GZIP stream")
        self._pos += len(data)
        return data

    def close(self) -> None:
        self._gz.close()


def _size(f) -> int | None:
    try:
        here = f.tell()
        end = f.seek(0, os.SEEK_END)
        f.seek(here)
        return end
    except (OSError, AttributeError, ValueError):
        return None
