"""An LMDB file's own bytes, which LMDB itself never checks: a CRC-32C of every B-tree page
(:class:`PageChecks`, verified before the file is mapped: :func:`verify_pages`), where each record's value
starts (:func:`value_offsets`, so a reader fetches it with one ``pread``), and the hashing of an environment
written in place (:func:`scan_in_place`) or of its compacting copy on the way to disk (:func:`copy_compacted`).
The on-disk layout is LMDB's (lmdb.h / mdb.c), 64-bit build.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading

from gpufeed.formats import _crc
import numpy as np

from gpufeed import io as gio
from gpufeed.errors import CorruptRecordError, OutputError

#: Per B-tree page (meta, branch, leaf; not the overflow pages that hold large values, which the records'
#: CRCs cover): page number and CRC-32C of the page. LMDB follows the pointers in these pages without
#: checks, and a damaged one can send it past the end of the file (SIGBUS); readers verify them first.
PAGE_DTYPE = np.dtype([("pgno", "<u8"), ("crc", "<u4")])
#: LMDB's page header (MDB_page, 64-bit build): page number, pad, flags, then lower/upper bounds of the
#: free space, or for the first page of an overflow run the u32 count of pages in the run.
_PAGE_HEADER = struct.Struct("<QHHI")
_P_OVERFLOW = 0x04


class PageChecks:
    """CRC-32C of every meta/branch/leaf page of a compacted ``data.mdb``, which holds no free pages, so a
    front-to-back walk meets only those and overflow runs (skipped by their page count); and the whole
    file's SHA-256. Fed the file in order, in chunks that are whole pages."""

    def __init__(self, psize: int):
        self.psize = psize
        self.sha = hashlib.sha256()
        self.pages = []
        self._pgno = 0  # the next page whose header has not been read
        self._base = 0  # page number of the next chunk's first page

    def update(self, chunk) -> None:
        self.sha.update(chunk)
        view = memoryview(chunk)
        psize = self.psize
        end = self._base + len(view) // psize
        while self._pgno < end:
            off = (self._pgno - self._base) * psize
            _, _, flags, count = _PAGE_HEADER.unpack_from(view, off)
            if flags & _P_OVERFLOW:
                self._pgno += max(count, 1)
            else:
                self.pages.append((self._pgno, _crc.crc32c(view[off:off + psize])))
                self._pgno += 1
        view.release()
        self._base = end

    def result(self) -> tuple[np.ndarray, str]:
        return np.array(self.pages, PAGE_DTYPE), self.sha.hexdigest()


#: LMDB's on-disk layout (lmdb.h / mdb.c, 64-bit): the main database's root page number sits in each meta
#: page at this offset (page header 16 + magic, version, address, mapsize 24 + the free DB's MDB_db 48 + the
#: main MDB_db's root field at 40), its transaction id at 144; page flags and node layout as in mdb.c.
_META_MAIN_ROOT, _META_TXNID = 128, 144
_P_BRANCH, _P_LEAF, _P_LEAF2 = 0x01, 0x02, 0x20
_F_BIGDATA = 0x01
_PAGE_HEADER_SIZE = 16
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_U16, _U64 = struct.Struct("<H"), struct.Struct("<Q")


def value_offsets(data_path: str, psize: int, records: int) -> np.ndarray:
    """The byte offset in ``data_path`` of every record's value, in key order: a walk of the main B-tree
    from the newer meta page (branch pages in key order, leaf nodes in order; an overflow value starts after
    its first page's header, an inline one after its node's key)."""
    import mmap

    out = np.zeros(records, np.uint64)
    n = 0
    with open(data_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        metas = [(_U64.unpack_from(m, i * psize + _META_TXNID)[0],
                  _U64.unpack_from(m, i * psize + _META_MAIN_ROOT)[0]) for i in (0, 1)]
        root = max(metas)[1]
        stack = [root] if root != 0xFFFFFFFFFFFFFFFF else []  # P_INVALID: an empty database
        while stack:
            base = stack.pop() * psize
            flags, lower = _U16.unpack_from(m, base + 10)[0], _U16.unpack_from(m, base + 12)[0]
            ptrs = [_U16.unpack_from(m, base + _PAGE_HEADER_SIZE + 2 * k)[0]
                    for k in range((lower - _PAGE_HEADER_SIZE) >> 1)]
            if flags & _P_BRANCH:
                children = []
                for ptr in ptrs:
                    lo, hi, fl, _ = _NODE.unpack_from(m, base + ptr)
                    children.append(lo | hi << 16 | fl << 32)
                stack.extend(reversed(children))  # popped in key order
            elif flags & _P_LEAF and not flags & _P_LEAF2:
                for ptr in ptrs:
                    _, _, fl, ksize = _NODE.unpack_from(m, base + ptr)
                    data = base + ptr + _NODE.size + ksize
                    out[n] = (_U64.unpack_from(m, data)[0] * psize + _PAGE_HEADER_SIZE) if fl & _F_BIGDATA else data
                    n += 1
            else:
                raise CorruptRecordError(data_path, None, base, f"page {base // psize} of the B-tree has flags "
                                         f"{flags:#x}, neither a branch nor a leaf")
    if n != records:
        raise CorruptRecordError(data_path, None, None, f"its B-tree holds {n} records, not {records}")
    return out


#: Byte ranges of an in-place ``data.mdb`` hashed separately, in parallel (its SHA-256 is their hash list).
HASH_PART = 256 << 20


def scan_in_place(data_path: str, psize: int, fsync: bool = False) -> tuple[np.ndarray, list]:
    """Page CRCs and ``[bytes, sha256]`` of each :data:`HASH_PART` range of a ``data.mdb`` written in
    place (fsync'd first with ``fsync``: the commits synced their pages, this covers the meta pages). The
    page walk reads only the headers of overflow runs and the tree pages (and free pages, which are checked
    like tree pages); the ranges are hashed by a thread each, one per usable core: the workers are done by
    then (hashlib releases the GIL)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from gpufeed.machine import usable_cores

    size = os.path.getsize(data_path)
    out = []
    with open(data_path, "rb+" if fsync else "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            pgno, pages = 0, size // psize
            while pgno < pages:
                off = pgno * psize
                _, _, flags, count = _PAGE_HEADER.unpack_from(view, off)
                if flags & _P_OVERFLOW:
                    pgno += max(count, 1)
                else:
                    out.append((pgno, _crc.crc32c(view[off:off + psize])))
                    pgno += 1
            view.release()

        def part(start: int) -> list:
            h = hashlib.sha256()
            end = min(start + HASH_PART, size)
            pos = start
            while pos < end:
                chunk = os.pread(f.fileno(), min(1 << 20, end - pos), pos)
                if not chunk:
                    raise OutputError(f"{data_path}: shorter than its {size} bytes while being hashed")
                h.update(chunk)
                pos += len(chunk)
            return [end - start, h.hexdigest()]

        with ThreadPoolExecutor(max_workers=max(1, usable_cores())) as pool:
            parts = list(pool.map(part, range(0, size, HASH_PART)))
    return np.array(out, PAGE_DTYPE), parts


#: Pipe buffer for the compacting copy (Linux's F_SETPIPE_SZ; the default 64 KiB halves the copy's speed).
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20


def copy_compacted(env, data_path: str, psize: int) -> tuple[np.ndarray, str]:
    """LMDB's compacting copy of ``env`` into ``data_path``, hashed on its way to the file: the copy writes
    into a pipe, and a thread takes whole pages from it, checks them (:class:`PageChecks`) and writes them
    out, so the file is never read back. Returns the page CRCs and the file's SHA-256."""
    import fcntl

    checks = PageChecks(psize)
    failed = []
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:
        pass  # a smaller pipe is slower, not wrong
    out = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def drain():
        buf = bytearray(max(_PIPE_BYTES * 4 // psize, 1) * psize)
        view = memoryview(buf)
        while True:
            n = 0
            while n < len(buf):  # whole chunks, so every chunk but the last is whole pages
                k = os.readv(r, [view[n:]])
                if not k:
                    break
                n += k
            if not n:
                return
            if failed:
                continue  # keep emptying the pipe, or the copy would block on it for ever
            try:
                checks.update(view[:n])
                done = 0
                while done < n:
                    done += os.write(out, view[done:n])
            except BaseException as e:
                failed.append(e)

    thread = threading.Thread(target=drain, name="gpufeed-lmdb-copy", daemon=True)
    thread.start()
    try:
        try:
            env.copyfd(w, compact=True)
        finally:
            os.close(w)
            thread.join()
    finally:
        os.close(r)
        os.close(out)
    if failed:
        raise failed[0]
    return checks.result()


def verify_pages(data_path: str, pages_path: str, psize: int) -> None:
    """Check the B-tree pages of ``data_path`` against their CRCs in ``pages_path`` (:data:`PAGE_DTYPE`)
    before LMDB maps the file and follows them."""
    with gio.open_file(pages_path) as f:  # a regular file only: a FIFO there blocked the reader
        data = f.read()
    pages = np.frombuffer(data, PAGE_DTYPE, len(data) // PAGE_DTYPE.itemsize)
    pgnos, crcs = pages["pgno"].tolist(), pages["crc"].tolist()
    with open(data_path, "rb") as f:
        fd = f.fileno()
        last = os.fstat(fd).st_size // psize  # pages the file holds
        for k, pgno in enumerate(pgnos):
            if not 0 <= pgno < last:
                raise CorruptRecordError(pages_path, k, k * PAGE_DTYPE.itemsize,
                                         f"lists page {pgno}, which {os.path.basename(data_path)} ({last} pages) "
                                         "does not hold")
        # The tree pages sit between the values' overflow pages: readahead here would pull values into the
        # page cache that nobody asked for yet (and make a cold read benchmark look warm).
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        start = 0
        # Consecutive pages are read in one call: for small records the tree is nearly the whole file.
        while start < len(pgnos):
            stop = start + 1
            while stop < len(pgnos) and stop - start < 256 and pgnos[stop] == pgnos[stop - 1] + 1:
                stop += 1
            data = os.pread(fd, (stop - start) * psize, pgnos[start] * psize)
            view = memoryview(data)
            for k in range(start, stop):
                off = (k - start) * psize
                if len(data) < off + psize or _crc.crc32c(view[off:off + psize]) != crcs[k]:
                    raise CorruptRecordError(data_path, None, pgnos[k] * psize,
                                             f"LMDB page {pgnos[k]} does not match {os.path.basename(pages_path)}")
            gio.charge(len(data))
            start = stop
