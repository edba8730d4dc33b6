"""Tar archives indexed in place, never extracted.

Sources read ImageNet's ``ILSVRC2012_img_train.tar`` (a tar of per-class tars) and ``ILSVRC2012_img_val.tar``
by indexing member headers with seeks, so every image becomes a ``(offset, size)`` byte range of the original
file; CIFAR and Penn Treebank ``.tar.gz`` archives are streamed once. Nothing is ever written to disk from an
archive, but names still pass the checks an extractor would need: absolute paths, ``..``, links and device
files are refused (:class:`~gpufeed.errors.UnsafeArchiveError`), and so is an archive whose member count or
total size is beyond :class:`ArchiveLimits` (a tar bomb would otherwise exhaust memory while indexing).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import posixpath
import tarfile
import zlib
from collections.abc import Callable, Iterator

from gpufeed.errors import InputError, LabelError, UnsafeArchiveError
from gpufeed.io import open_file

#: Tar's unit: headers and member data are padded to 512-byte blocks.
BLOCK = 512


@dataclasses.dataclass(frozen=True)
class ArchiveLimits:
    """Refuse archives beyond these, counted over an archive and every tar nested inside it.

    Defaults leave room for the real ILSVRC2012 train tar (1,000 inner tars, 1,281,167 images, 138 GiB).
    """

    max_members: int = 5_000_000
    max_total_size: int = 2 ** 40
    max_member_size: int = 2 ** 32
    #: Members of a streamed ``.tar.gz`` are read into memory; the largest real one (CIFAR-100's ``train``
    #: pickle) is 155 MB, so a member claiming more than this is refused before it is inflated.
    max_read_size: int = 2 ** 30


@dataclasses.dataclass(frozen=True)
class TarEntry:
    """A regular file inside a tar: ``size`` bytes at absolute ``offset`` of the outermost file."""

    name: str
    offset: int
    size: int


class _Budget:
    """Members and bytes seen so far, shared by an outer tar and the tars inside it."""

    def __init__(self, limits: ArchiveLimits, url: str):
        self.limits, self.url, self.members, self.total = limits, url, 0, 0

    def add(self, name: str, size: int) -> None:
        lim = self.limits
        self.members += 1
        self.total += size
        if self.members > lim.max_members:
            raise UnsafeArchiveError(self.url, f"more than {lim.max_members} members (a tar bomb?)",
                                     "raise ArchiveLimits.max_members if the archive is genuine")
        if size > lim.max_member_size:
            raise UnsafeArchiveError(self.url, f"member {name!r} declares {size} bytes, over the limit of "
                                     f"{lim.max_member_size}", "raise ArchiveLimits.max_member_size if it is genuine")
        if self.total > lim.max_total_size:
            raise UnsafeArchiveError(self.url, f"members declare more than {lim.max_total_size} bytes in all "
                                     "(a tar bomb?)", "raise ArchiveLimits.max_total_size if the archive is genuine")


def has_undecodable(name: str) -> bool:
    """True when a name held bytes that were not UTF-8 (Python keeps them as lone surrogates)."""
    return not name.isascii() and any("\udc80" <= c <= "\udcff" for c in name)


def printable(name: str) -> str:
    """``name`` with undecodable bytes shown as ``\\xe9``, so a message naming it can always be printed."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def check_member(info: tarfile.TarInfo, archive: str) -> str | None:
    """The member's safe relative name, ``None`` for a directory; raise for anything an extractor must not touch."""
    name = info.name
    where = f"{archive}::{printable(name)}"
    if info.issym() or info.islnk():
        raise UnsafeArchiveError(where, f"is a {'symbolic' if info.issym() else 'hard'} link to "
                                 f"{info.linkname!r}; links are never followed", "remove it from the archive")
    if info.ischr() or info.isblk() or info.isfifo():
        raise UnsafeArchiveError(where, "is a device or fifo, not a file", "remove it from the archive")
    if info.isdir():
        return None
    if info.issparse():
        raise UnsafeArchiveError(where, "is a sparse file, which cannot be read as one byte range",
                                 "repack the archive without --sparse")
    if not info.isfile():
        raise UnsafeArchiveError(where, f"has tar type {info.type!r}, not a regular file", "remove it from the archive")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":") or "\\" in name or "\x00" in name:
        raise UnsafeArchiveError(where, "has an absolute or non-POSIX path", "remove it from the archive")
    if ".." in name.split("/"):
        raise UnsafeArchiveError(where, "climbs out of the archive with '..'", "remove it from the archive")
    if has_undecodable(name):
        raise LabelError(where, "has a file name that is not UTF-8", "rename the member with a UTF-8 name")
    clean = posixpath.normpath(name)
    if clean in ("", "."):
        raise UnsafeArchiveError(where, "has an empty name", "remove it from the archive")
    return clean


def _file_size(f) -> int:
    here = f.tell()
    size = f.seek(0, io.SEEK_END)
    f.seek(here)
    return size


def index_tar(url: str, *, limits: ArchiveLimits = ArchiveLimits(),
              on_problem: Callable[[Exception], None] | None = None,
              nested: Callable[[TarEntry], bool] | None = None) -> list[tuple[TarEntry, list[TarEntry] | None]]:
    """Index ``url`` (an uncompressed tar) by reading only its headers.

    Returns ``(entry, inner)`` per regular file in archive order; ``inner`` is the index of the tar inside
    that member when ``nested(entry)`` says it is one (offsets absolute in ``url``), else ``None``. A member
    that fails :func:`check_member` goes to ``on_problem`` (which may raise, or record and return); without
    it the error is raised. Limits breaches always raise.
    """
    with open_file(url) as f:
        size = _file_size(f)
        budget = _Budget(limits, url)
        out = []
        for entry in _index(f, 0, size, url, budget, on_problem):
            inner = None
            if nested is not None and nested(entry):
                inner = list(_index(f, entry.offset, entry.offset + entry.size, f"{url}::{entry.name}", budget,
                                    on_problem))
            out.append((entry, inner))
        return out


def _check_end(f, offset: int, end: int, where: str) -> None:
    """tarfile stops quietly at a damaged header past the first; a real end is zero blocks or end of file."""
    f.seek(offset)
    if offset < end and f.read(min(BLOCK, end - offset)).strip(b"\0"):
        raise InputError(where, f"has a damaged header at byte {offset}; members after it cannot be listed",
                         "download the archive again")


def _index(f, start: int, end: int, where: str, budget: _Budget, on_problem) -> Iterator[TarEntry]:
    """Regular members of the tar occupying bytes ``[start, end)`` of ``f``, offsets absolute in ``f``.

    tarfile counts offsets from where the file stands when it is opened, so a tar inside a tar is read in
    place; ``end`` keeps a hostile inner tar from reaching into the bytes after it.
    """
    f.seek(start)
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except tarfile.TarError as e:
        raise InputError(where, f"is not a readable tar archive ({e})", "check the file is complete") from e
    while True:
        try:
            info = tar.next()
        except tarfile.TarError as e:
            raise InputError(where, f"has a damaged header near byte {tar.offset} of the file ({e})",
                             "download the archive again") from e
        if info is None or info.offset >= end:
            _check_end(f, tar.offset if info is None else info.offset, end, where)
            return
        # Only headers are wanted: drop tarfile's member list so a million members cost no memory.
        tar.members = []
        name = _checked(info, where, on_problem)
        if name is None:
            continue
        budget.add(name, info.size)
        if info.offset_data + info.size > end:
            raise InputError(where, f"member {name!r} runs past the end of the archive "
                             f"({info.offset_data + info.size - start} > {end - start} bytes)",
                             "the archive is truncated: download it again")
        yield TarEntry(name, info.offset_data, info.size)


#: Leading bytes of the compressions tar archives come in, and the readers that check their trailers (CRC,
#: length), so a truncated download is an error instead of an archive that just seems to end early.
_COMPRESSIONS = ((b"\x1f\x8b", "gzip", "GzipFile"), (b"BZh", "bz2", "BZ2File"), (b"\xfd7zXZ\x00", "lzma", "LZMAFile"))


def _decompressed(f):
    head = f.read(6)
    f.seek(0)
    for magic, module, cls in _COMPRESSIONS:
        if head.startswith(magic):
            return getattr(importlib.import_module(module), cls)(fileobj=f, mode="rb")
    return f


def stream_tar(url: str, wanted: Callable[[str], bool], *, limits: ArchiveLimits = ArchiveLimits(),
               on_problem: Callable[[Exception], None] | None = None) -> Iterator[tuple[str, bytes]]:
    """Read a (compressed) tar once, front to back, yielding ``(name, bytes)`` of members ``wanted(name)``.

    For ``.tar.gz`` sources (CIFAR, Penn Treebank) where seeking would mean decompressing again.
    """
    budget = _Budget(limits, url)
    with open_file(url) as f:
        try:
            tar = tarfile.open(fileobj=_decompressed(f), mode="r|")
            with tar:
                for info in tar:
                    tar.members = []
                    name = _checked(info, url, on_problem)
                    if name is None:
                        continue
                    budget.add(name, info.size)
                    if wanted(name):
                        if info.size > limits.max_read_size:
                            raise UnsafeArchiveError(f"{url}::{name}", f"declares {info.size} bytes, more than the "
                                                     f"{limits.max_read_size} read into memory at most",
                                                     "raise ArchiveLimits.max_read_size if the file is genuine")
                        data = tar.extractfile(info).read()
                        if len(data) != info.size:
                            raise InputError(f"{url}::{name}", f"holds {len(data)} of {info.size} bytes",
                                             "the archive is truncated: download it again")
                        yield name, data
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            raise InputError(url, f"cannot be read to the end ({type(e).__name__}: {e})",
                             "the archive is truncated or corrupt: download it again") from e


def _checked(info: tarfile.TarInfo, where: str, on_problem) -> str | None:
    """:func:`check_member`, with a refused member passed to ``on_problem`` (when given) instead of raised."""
    try:
        return check_member(info, where)
    except InputError as e:
        if on_problem is None:
            raise
        on_problem(e)
        return None
