"""Dataset sources: each dataset as it is really shipped, listed into deterministic :class:`Item` lists.

``open_source(dataset, src, **options)`` looks at what ``src`` holds and picks the reader:

========== ==================================================================================================
imagenet   ``train/<wnid>/*.JPEG``, ``val/<wnid>/*`` or flat ``val/ILSVRC2012_val_*.JPEG``; the original
           ``ILSVRC2012_img_train.tar`` / ``ILSVRC2012_img_val.tar`` read in place; labels and names from the
           devkit (dir or ``.tar.gz``), ``LOC_synset_mapping.txt``, ``LOC_val_solution.csv`` or ``val_labels.txt``
folder     any ``root/<class>/*`` tree (optionally ``root/<split>/<class>/*``), or an im2rec ``.lst`` / Caffe
           list file (``list_file=``)
cifar10/100 ``cifar-10-batches-py/``, ``cifar-100-python/``, the binary ``*.bin`` version or the ``.tar.gz``
ptb        ``ptb.{train,valid,test}.txt``, plain or inside ``simple-examples.tgz``
========== ==================================================================================================

Every source reads through fsspec (local paths, ``file://``, ``memory://``...). Problems found while listing
(an unlabelled file, an unknown synset, a duplicate key, a non-UTF-8 name, an unsafe archive member) follow
``on_error``: ``"fail"`` (default) raises the error, ``"skip"`` leaves the input out and reports it in
:meth:`skipped`. Nothing is left out silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import os
import posixpath
import stat
from collections.abc import Sequence

from gpufeed.errors import ConfigError, InputError, LabelError, NotAFileError, SourceNotFound, make_readable
from gpufeed.io import FOLDER, is_local, kind_of, local_path, open_file
from gpufeed.pipelines import ON_ERROR
from gpufeed.pipelines.base import (ClassInfo, FileRef, InlineRef, Item, Ref, Skipped, SynthRef, TarMemberRef, item_key,
                                    keys_of)


@dataclasses.dataclass(frozen=True)
class Vocabulary(ClassInfo):
    """A text dataset's vocabulary: ``names[i]`` is token id ``i``; ``counts[i]`` its count in train."""

    counts: Sequence[int] | None = None


def open_source(dataset: str, src: str, *, on_error: str = "fail", **options):
    """The :class:`~gpufeed.pipelines.base.Source` for ``dataset`` (imagenet, folder, cifar10, cifar100, ptb,
    synthetic: ``src`` is then ``KIND:N[:SEED]``, :mod:`gpufeed.pipelines.sources_synthetic`).

    Options: imagenet ``layout="auto"|"tree"|"archives"`` (which to read when a folder holds both),
    ``limits`` (:class:`~gpufeed.pipelines.archive.ArchiveLimits`, also for cifar and ptb archives);
    folder ``list_file``
    (im2rec ``.lst`` or Caffe ``path label`` list, relative paths from ``src``); ptb ``seq_len=35``,
    ``ptb_mode="window"|"sentence"``.
    """
    if on_error not in ON_ERROR:
        raise ConfigError(f"on_error must be one of {ON_ERROR}, not {on_error!r}")
    if dataset == "synthetic":  # SRC names what to make (KIND:N[:SEED]), no place
        from gpufeed.pipelines.sources_synthetic import SyntheticSource

        return SyntheticSource(src, on_error)
    root = Root(src)
    if not root.exists(root.path):
        raise SourceNotFound(src, None, "check the path: SRC is the dataset as shipped, a folder or an archive")
    if dataset == "imagenet":
        from gpufeed.pipelines.sources_imagenet import ImageNetSource as cls
    elif dataset == "folder":
        from gpufeed.pipelines.sources_imagenet import FolderSource as cls
    elif dataset in ("cifar10", "cifar100"):
        from gpufeed.pipelines.sources_cifar import CifarSource

        return CifarSource(root, on_error, dataset, **options)
    elif dataset == "ptb":
        from gpufeed.pipelines.sources_ptb import PtbSource as cls
    else:
        from gpufeed.pipelines import DATASETS

        raise ConfigError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    return cls(root, on_error, **options)


#: The largest input file gpufeed reads (ImageNet's largest JPEG is ~15 MB): a larger one is refused by
#: its size, before any of it is read, so a link to a device or a huge file cannot fill a worker's memory.
MAX_INPUT_BYTES = 1 << 30
_SKIP_FIX = "remove it from the source, or leave it out with --on-error skip"


#: What to do about a part of the source the user running gpufeed may not read.
UNREADABLE_FIX = f"{make_readable()}, or remove it from the source"


def unreadable(path: str, e: OSError, what: str = "cannot be read") -> InputError:
    """An :class:`InputError` for a part of the source that exists but cannot be listed or read (no permission,
    an I/O error), naming it; a source under ``--on-error skip`` leaves out what it held and lists it."""
    return InputError(path, f"{what} ({e.strerror or e})", UNREADABLE_FIX)


def _scan(path: str) -> tuple[list[str], list[str]]:
    """The names of a local folder's entries, unsorted: files, and folders (entries that are, or link to, a
    folder). A link that resolves to nothing (dangling, a loop) is listed as a file, and reading it says what
    is wrong with it; a folder that cannot be listed (no permission) is an :class:`InputError` naming it. (Per
    entry this is a listing's cost: ImageNet's train split has 1.28 million.)"""
    files, folders = [], []
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    is_dir = e.is_dir()
                except OSError:
                    is_dir = False
                (folders if is_dir else files).append(e.name)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as e:
        raise unreadable(path, e, "is a folder that cannot be listed") from None
    return files, folders


def _sorted_entries(files: list[str], folders: list[str]) -> list[tuple[str, bool]]:
    """:func:`_scan`'s names as ``(name, is_dir)``, sorted by name."""
    return sorted([(n, False) for n in files] + [(n, True) for n in folders])


def read_named(url: str, limit: int | None = None) -> bytes:
    """The bytes of a file a source reads by name (a class list, a CIFAR batch, a list file), at most ``limit``
    and one more where given. A local one is opened only if it is a regular file: a FIFO among CIFAR's batches was
    waited on without end."""
    if is_local(url):
        path = local_path(url)
        mode = _dataset_file_mode(path)
        if mode is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if not stat.S_ISREG(mode):
            raise _not_a_dataset_file(path, mode)
    with reading(url):
        if limit is None:
            return read_url(url)
        with open_file(url) as f:
            return f.read(limit + 1)


@contextlib.contextmanager
def reading(url: str):
    """Around reading a local dataset file: one that is there but cannot be read (no permission, an I/O error)
    is an :class:`InputError` naming it (:func:`unreadable`); one that is not there stays a FileNotFoundError."""
    try:
        yield
    except (FileNotFoundError, IsADirectoryError):
        raise
    except OSError as e:
        if not is_local(url):
            raise
        raise unreadable(url, e) from None


def _dataset_file_mode(path: str) -> int | None:
    """The mode of what is at a dataset file's ``path`` (links followed), ``None`` where nothing is; a link to
    nothing or a path that cannot be looked at is an :class:`InputError` naming it."""
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise InputError(path, "is a link to nothing, where the dataset's file of that name goes",
                             "point the link at the file, or remove it") from None
        return None
    except PermissionError as e:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.access(folder, os.X_OK):  # the folder it would be in may not be searched: name that
            raise unreadable(folder, e, "is a folder that cannot be searched") from None
        raise unreadable(path, e) from None
    except OSError as e:
        raise unreadable(path, e) from None


def _not_a_dataset_file(path: str, mode: int) -> InputError:
    """A file a source reads by name (a tar, a class list, a CIFAR batch) that is something else."""
    return InputError(path, f"is {kind_of(mode)}, where the dataset's file of that name goes",
                      "replace it with the file, or remove it")


def read_local_file(path: str, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """A local input's bytes, opened only if it is a regular file (after following links: :func:`open_file` checks
    what it opened) no larger than ``max_bytes``; every failure is an :class:`InputError` (or
    :class:`SourceNotFound`) naming the input, so ``--on-error`` applies to it, never an error about the
    destination."""
    try:
        f = open_file(path)
    except FileNotFoundError:
        raise SourceNotFound(path, "input file (deleted, or a link to nothing)",
                             f"restore it, or {_SKIP_FIX.split(', or ')[1]}") from None
    except (NotAFileError, IsADirectoryError) as e:
        kind = e.kind if isinstance(e, NotAFileError) else FOLDER
        raise InputError(path, f"is {kind}, not a regular file", _SKIP_FIX) from None
    except OSError as e:
        raise InputError(path, f"cannot be opened ({e.strerror or e})", _SKIP_FIX) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise InputError(path, f"is {size} bytes, more than the {max_bytes} an input may have", _SKIP_FIX)
        try:
            data = f.read(size + 1)  # one byte more: a file still growing is noticed
        except OSError as e:
            raise InputError(path, f"cannot be read ({e.strerror or e})", _SKIP_FIX) from None
    if len(data) != size:
        raise InputError(path, f"changed size while being read ({size} -> {len(data)}+ bytes)",
                         "convert it once it is no longer being written")
    return data


def read_ref(ref: Ref):
    """The bytes a :class:`FileRef` or :class:`TarMemberRef` names (one ranged read), or the inline array."""
    if isinstance(ref, InlineRef):
        return ref.data
    if isinstance(ref, SynthRef):
        from gpufeed.pipelines.sources_synthetic import make_data

        return make_data(ref)
    if isinstance(ref, FileRef):
        if is_local(ref.url):
            return read_local_file(local_path(ref.url))
        try:
            return read_url(ref.url)
        except FileNotFoundError:
            raise SourceNotFound(ref.url, "input file", f"restore it, or {_SKIP_FIX.split(', or ')[1]}") from None
        except OSError as e:
            raise InputError(ref.url, f"cannot be read ({e})", _SKIP_FIX) from None
    if isinstance(ref, TarMemberRef):
        try:
            with open_file(ref.url) as f:
                f.seek(ref.offset)
                data = f.read(ref.size)
        except OSError as e:
            raise InputError(f"{ref.url}::{ref.member}", f"cannot be read ({e.strerror or e})",
                             "check that the archive is still there and readable") from None
        if len(data) != ref.size:
            raise InputError(f"{ref.url}::{ref.member}", f"holds {len(data)} of its {ref.size} bytes at offset "
                             f"{ref.offset}", "the archive changed or was truncated since it was listed")
        return data
    raise TypeError(f"not a source reference: {ref!r}")


#: The class lists :func:`write_class_list` writes (one of the first two, and CIFAR-100's coarse classes).
CLASS_FILES = ("classes.txt", "vocab.txt", "coarse_classes.txt")


def write_class_list(classes: ClassInfo, dst_dir_url: str) -> list[str]:
    """Write ``classes.txt`` (``index<TAB>name[<TAB>text]``) into ``dst_dir_url``; ``vocab.txt`` for text.

    ``vocab.txt`` holds one token per line, line ``i`` being id ``i`` (the TensorFlow PTB convention).
    CIFAR-100 also gets ``coarse_classes.txt``. Returns the URLs written.
    """
    base = dst_dir_url.rstrip("/")
    if is_local(base):
        os.makedirs(local_path(base), exist_ok=True)
    if isinstance(classes, Vocabulary):
        files = {CLASS_FILES[1]: "".join(f"{w}\n" for w in classes.names)}
    else:
        lines = []
        for i, name in enumerate(classes.names):
            text = classes.texts[i] if classes.texts else None
            lines.append(f"{i}\t{name}\t{text}\n" if text is not None else f"{i}\t{name}\n")
        files = {CLASS_FILES[0]: "".join(lines)}
        if classes.coarse_names:
            files[CLASS_FILES[2]] = "".join(f"{i}\t{n}\n" for i, n in enumerate(classes.coarse_names))
    from gpufeed.formats.atomic import write_file

    written = []
    for name, text in files.items():
        url = f"{base}/{name}"
        write_file(url, text.encode("utf-8"), "classes")
        written.append(url)
    return written


def read_url(url: str) -> bytes:
    with open_file(url) as f:
        return f.read()


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector held off while a listing builds its items: it makes no cycles, and
    each full collection walks every object made so far, which doubled the cost of listing ImageNet's 1.28
    million training images (3.1 s of item building against 1.4 s with the collector held off)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class Root:
    """A dataset root on any fsspec filesystem; local paths stay plain paths (fast ``os.scandir`` walks)."""

    def __init__(self, src: str):
        src = os.fspath(src)
        self.src = src
        self.local = is_local(src)
        if self.local:
            self.path = os.path.abspath(local_path(src))
            self.fs = None
        else:
            from gpufeed.io import url_to_fs

            self.fs, self.path = url_to_fs(src)
            self.path = self.path.rstrip("/") or self.path

    def join(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts) if not self.local else os.path.join(self.path, *parts)

    def url(self, path: str) -> str:
        """What goes into a :class:`FileRef`/:class:`TarMemberRef`: a plain path, or a full URL."""
        return path if self.local else self.fs.unstrip_protocol(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path) if self.local else self.fs.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path) if self.local else self.fs.isdir(path)

    def isfile(self, path: str) -> bool:
        """Whether a file is at ``path`` (links followed); a folder there is not one. Something else there (a
        FIFO, a device, a socket, a link to nothing) is an :class:`InputError` naming it: a dataset file the
        source looks for by name that is present but cannot be read would otherwise leave its split or class list
        out without a word (a FIFO at ``ILSVRC2012_img_val.tar`` converted train alone)."""
        if not self.local:
            return self.fs.isfile(path)
        mode = _dataset_file_mode(path)
        if mode is None or stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return mode is not None and stat.S_ISREG(mode)
        raise _not_a_dataset_file(path, mode)

    def listdir(self, path: str) -> list[tuple[str, bool]]:
        """``(name, is_dir)`` of the entries of ``path``, sorted by name."""
        if self.local:
            return _sorted_entries(*_scan(path))
        out = []
        for info in self.fs.ls(path, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            out.append((name, info["type"] == "directory"))
        return sorted(out)

    def walk_files(self, path: str) -> list[str]:
        """Paths (relative to ``path``, ``/``-separated) of every file below ``path``, sorted.

        Symlinked folders are followed once: a link back to a folder already walked (a loop) is not entered.
        """
        top = None  # the entries of ``path`` itself, where scanned already
        if self.local:
            files, folders = _scan(path)
            if not folders:  # a class folder of ImageNet: its files, with no path work per file
                files.sort()
                return files
            top = _sorted_entries(files, folders)
        out = []
        stack = [""]
        seen = {os.path.realpath(path)} if self.local else set()
        while stack:
            rel = stack.pop()
            entries = self.listdir(self.join(path, rel)) if rel else top or self.listdir(path)
            for name, is_dir in entries:
                child = f"{rel}/{name}" if rel else name
                if not is_dir:
                    out.append(child)
                    continue
                if self.local:
                    real = os.path.realpath(self.join(path, child))
                    if real in seen:
                        continue
                    seen.add(real)
                stack.append(child)
        return sorted(out)

    def dirname(self, path: str) -> str:
        return os.path.dirname(path) if self.local else posixpath.dirname(path)

    def read(self, path: str, limit: int | None = None) -> bytes:
        """The file's bytes; with ``limit``, at most that many (one more is read, so a caller can tell that the
        file is larger than it accepts without reading it whole). See :func:`read_named`."""
        return read_named(self.url(path), limit)

    def __str__(self):
        return self.src


class BaseSource:
    """Shared plumbing: the error policy, cached listings, split checks."""

    name = ""
    modality = "image"
    #: A process pool the source may list with (:class:`gpufeed.pipelines.pooled.Lent`), where there is one: a
    #: conversion lends its local processes (ImageNet's class folders are walked, and its train tar's inner tars
    #: indexed, in them).
    pool = None
    #: Where a long listing says how far it is (a line of text; a conversion's progress), if anywhere.
    tell = None

    def __init__(self, root: Root, on_error: str = "fail"):
        self.root = root
        self.on_error = on_error
        self._skipped: list[Skipped] = []
        self._items: dict[str, list[Item]] = {}

    def problem(self, err: InputError) -> None:
        """Raise ``err`` under ``on_error="fail"``; record it as skipped under ``"skip"``: its path, and what is
        wrong (the reason alone; the summary names the path beside it, and the fix, leaving it out, is taken)."""
        if self.on_error == "fail":
            raise err
        self._skipped.append(Skipped(getattr(err, "path", str(self.root)), err.reason))

    def skipped(self) -> list[Skipped]:
        return list(self._skipped)

    def splits(self) -> list[str]:
        raise NotImplementedError

    def expect(self, splits: list[str]) -> None:
        """The splits a conversion is about to list, in this order: a source may begin, in its :attr:`pool`, what a
        later one needs while the first are listed (ImageNet's val tar)."""

    def _telling(self, where: str, unit: str):
        """``told(done, total)`` for a listing's work on ``where``, said through :attr:`tell` (``None`` where
        nothing listens): ``<where>: 412 of 1,000 <unit>`` (``total`` 0: not known yet)."""
        tell = self.tell
        if tell is None:
            return None
        return lambda done, total: tell(f"listing {where}: {done:,}{f' of {total:,}' if total else ''} {unit}")

    def _list(self, split: str) -> list[Item]:
        raise NotImplementedError

    def items(self, split: str) -> Sequence[Item]:
        if split not in self.splits():
            raise ConfigError(f"{self.root}: no split {split!r} in this {self.name} source; "
                              f"it has {', '.join(self.splits()) or 'none'}")
        if split not in self._items:
            with gc_paused():
                items = self._list(split)
                keys = keys_of(items)
                if not self.listed_order and keys != sorted(keys):  # (a folder walked in order is sorted already)
                    items = sorted(items, key=item_key)
                    keys = keys_of(items)
                self._items[split] = self.unique(items, keys)
        return self._items[split]

    #: Items keep the order the source lists them in (a list file's lines), instead of sorted by key.
    listed_order = False

    def unique(self, items: Sequence[Item], keys: list[str]) -> Sequence[Item]:
        """Items with a key already seen are a :class:`LabelError` (or skipped, by policy); ``keys`` are theirs."""
        if len(set(keys)) == len(items):
            return items  # the usual case, checked without a Python step per item
        out: list[Item] = []
        seen: dict[str, Item] = {}
        for it in items:
            first = seen.setdefault(it.key, it)
            if first is not it:
                self.problem(LabelError(it.origin, f"has the key {it.key!r} of {first.origin}; keys must be "
                                        "unique within a split", "remove or rename one of them"))
                continue
            out.append(it)
        return out

