"""gpufeed's own I/O layer: every reader and writer opens files through here.

Two reasons it exists. Paths may be fsspec URLs (``memory://``, ``s3://``...) as well as local paths: the
helpers below are the one place that tells them apart. And storage-tier emulation must see every byte
gpufeed moves, from every process (DataLoader workers, Ray workers), without root. This layer knows no
emulator: one plugs in from above through the environment, so child processes inherit it.
``GPUFEED_TIER_STATE`` is the path of the emulator's shared state file and ``GPUFEED_TIER_HOOK`` the
``module:callable`` that attaches to it (:class:`gpufeed.bench.emulate.Throttle` sets both); the callable
returns an object with ``wrap(file)`` and ``charge(nbytes, write=)``. With the variables unset, the cost is
one dict lookup per open.

Memory-mapped reads (LMDB) bypass ``read()``: their readers call :func:`charge` with the bytes they touch.
"""

from __future__ import annotations

import errno
import importlib
import os
import shutil
import stat
from typing import IO

from gpufeed.errors import NotAFileError

ENV_VAR = "GPUFEED_TIER_STATE"
HOOK_VAR = "GPUFEED_TIER_HOOK"
#: What a process hands its children (Ray workers get it through their runtime environment).
TIER_VARS = (ENV_VAR, HOOK_VAR)

_throttle = None
_throttle_key = None


def is_local(path: str) -> bool:
    """True for plain paths and ``file://`` URLs (which :func:`local_path` turns into plain paths)."""
    return "://" not in str(path) or str(path).startswith("file://")


def local_path(path: str) -> str:
    path = os.fspath(path)
    return path[len("file://"):] if path.startswith("file://") else path


def canonical(path: str) -> str:
    """One spelling per place: a local path absolute, symlinks followed, without a trailing slash (relative
    to this process's directory); a URL without a trailing slash."""
    return os.path.realpath(local_path(path)) if is_local(path) else str(path).rstrip("/")


def throttle():
    """The active tier emulator for this process, or ``None``. Re-read if the variables change."""
    global _throttle, _throttle_key
    key = (os.environ.get(ENV_VAR), os.environ.get(HOOK_VAR))
    if key != _throttle_key:
        _throttle_key = key
        state, hook = key
        if state and not hook:
            raise RuntimeError(f"{ENV_VAR} is set but {HOOK_VAR} is not: set both (the emulator's "
                               "'module:callable' and its state file), or neither")
        if state:
            module, _, attr = hook.partition(":")
            target = importlib.import_module(module)
            for name in attr.split("."):
                target = getattr(target, name)
            _throttle = target(state)
        else:
            _throttle = None
    return _throttle


def charge(nbytes: int, write: bool = False) -> None:
    """Account ``nbytes`` moved outside :func:`open_file` (e.g. LMDB mmap reads) to the active tier."""
    t = throttle()
    if t is not None and nbytes > 0:
        t.charge(nbytes, write=write)


#: What can be at a path, as messages name it (a symlink: where a path is looked at without following links).
FILE, FOLDER, SYMLINK = "a file", "a folder", "a symlink"
KINDS = ((stat.S_ISREG, FILE), (stat.S_ISDIR, FOLDER), (stat.S_ISLNK, SYMLINK), (stat.S_ISFIFO, "a FIFO (named pipe)"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, as messages name it: :data:`FILE`, :data:`FOLDER`, "a FIFO (named pipe)"..."""
    return next((kind for test, kind in KINDS if test(mode)), "a special file")


def regular_file_size(path: str, fix: str | None = None) -> int | None:
    """The size of the local file ``path`` (links followed), ``None`` where nothing is there (a link to nothing
    too); :class:`~gpufeed.errors.NotAFileError` (with ``fix``) where something else than a regular file is."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise NotAFileError(path, kind_of(st.st_mode), fix)
    return st.st_size


def open_fd(path: str, flags: int = os.O_RDONLY, follow: bool = True, mode: int = 0o644) -> int:
    """A descriptor of the local file ``path`` opened with ``flags`` (``mode`` where it creates the file), only
    where it is a regular file: opened without blocking (a FIFO's open waits for a writer; a reader of one waited
    without end, and ``/dev/zero`` reads without end), then checked with ``fstat``, so what is read is what was
    checked (no race between a look and the open); through a symlink only with ``follow``.
    :class:`~gpufeed.errors.NotAFileError` for a FIFO, device, socket (or symlink), ``IsADirectoryError`` for a
    folder."""
    flags |= getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow and os.path.islink(path):
            raise NotAFileError(path, SYMLINK) from None
        if e.errno not in (errno.ENXIO, errno.EAGAIN, errno.EWOULDBLOCK):
            raise
        # ENXIO: a socket. EWOULDBLOCK: a file another process holds a lease on (a file server's, see open(2));
        # its blocking open waits for the lease to be given up, as any reader's does.
        try:
            found = (os.stat if follow else os.lstat)(path).st_mode
        except OSError:
            raise e from None
        if not stat.S_ISREG(found):
            raise NotAFileError(path, kind_of(found)) from None
        if e.errno == errno.ENXIO:
            raise
        fd = os.open(path, flags, mode)
    try:
        found = os.fstat(fd).st_mode
        if stat.S_ISDIR(found):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(found):
            raise NotAFileError(path, kind_of(found))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: ``open_file`` modes that open an existing file's bytes.
_EXISTING = ("rb", "r+b", "rb+")


def open_file(path: str, mode: str = "rb", buffering: int = -1) -> IO[bytes]:
    """Open ``path`` (local path or fsspec URL) in binary ``mode``, throttled when a tier is active. A local file
    opened to read is opened only where it is a regular file (:func:`open_fd`). Each open to read is a file of its
    own, with its own position, so that threads may read one file at once (an archive's members read ahead, its
    index walked in spans)."""
    if "b" not in mode:
        raise ValueError(f"gpufeed opens data files in binary mode, not {mode!r}")
    if is_local(path):
        f = open(local_path(path), mode, buffering=buffering, opener=open_fd if mode in _EXISTING else None)
    else:
        fs, p = url_to_fs(path)
        f = fs.open(p, mode)
        if mode == "rb" and f is getattr(fs, "store", {}).get(fs._strip_protocol(p)):
            import io

            # fsspec's memory:// hands every open of a file its one stored object, one position for all.
            f = io.BytesIO(f.getvalue())  # (the stored bytes, shared: not copied)
    t = throttle()
    return t.wrap(f) if t is not None else f


# -- local path or fsspec URL ----------------------------------------------------------------------------

def join(base: str, *parts: str) -> str:
    base = os.fspath(base)
    if is_local(base):
        return os.path.join(local_path(base), *parts)
    return "/".join([base.rstrip("/"), *parts])


def makedirs(url: str) -> None:
    if is_local(url):
        os.makedirs(local_path(url), exist_ok=True)
    else:
        fs, p = _fs(url)
        fs.makedirs(p, exist_ok=True)


def file_size(url: str) -> int | None:
    """The size of a file, or ``None`` if it cannot be found or read."""
    try:
        if is_local(url):
            return os.path.getsize(local_path(url))
        fs, p = _fs(url)
        return fs.size(p)
    except OSError:
        return None


def tree_bytes(url: str) -> int:
    """The bytes of the files in a folder and every folder in it (links not followed), or of one file; 0 where
    nothing is there (or it goes meanwhile)."""
    if not is_local(url):
        fs, p = _fs(url)
        try:
            return int(fs.du(p, total=True)) if fs.exists(p) else 0
        except OSError:
            return 0
    path = local_path(url)
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size if stat.S_ISREG(st.st_mode) else 0
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def exists(url: str) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, p = _fs(url)
    return fs.exists(p)


def remove(url: str) -> None:
    """Delete a file; one already gone is fine."""
    try:
        if is_local(url):
            os.remove(local_path(url))
        else:
            fs, p = _fs(url)
            if fs.exists(p):
                fs.rm(p)
    except FileNotFoundError:
        pass


def remove_tree(url: str) -> None:
    """Delete a directory tree; one already gone (or going meanwhile) is fine."""
    if is_local(url):
        shutil.rmtree(local_path(url), ignore_errors=True)
        return
    fs, p = _fs(url)
    try:
        if fs.exists(p):
            fs.rm(p, recursive=True)
    except FileNotFoundError:
        pass


def listdir(url: str) -> list[str]:
    """The entries of a directory, each as a path (or URL) under ``url``; ``FileNotFoundError`` if it is
    missing. Local directories are listed without importing fsspec (the start of a run lists its outputs)."""
    if is_local(url):
        base = local_path(url)
        return [os.path.join(base, name) for name in os.listdir(base)]
    fs, p = _fs(url)
    return [fs.unstrip_protocol(name) for name in fs.ls(p, detail=False)]


def remove_entry(url: str) -> None:
    """Delete a file or a directory tree (:func:`remove` or :func:`remove_tree`); one already gone is fine."""
    if is_local(url) and not os.path.isdir(local_path(url)):
        remove(url)
    else:  # a directory, or an object store's entry (a recursive rm takes a single object too)
        remove_tree(url)


def remove_empty_dir(url: str) -> None:
    """Delete a directory if it is empty (one holding anything, or gone, is left as it is)."""
    try:
        if is_local(url):
            os.rmdir(local_path(url))
        else:
            fs, p = _fs(url)
            if not fs.ls(p, detail=False):
                fs.rm(p, recursive=True)
    except OSError:
        pass


def rename(src: str, dst: str) -> None:
    """Give ``src`` the name ``dst`` (atomic on a local filesystem; a move on an object store)."""
    if is_local(src):
        os.replace(local_path(src), local_path(dst))
        return
    fs, src_path = _fs(src)
    fs.mv(src_path, _fs(dst)[1])


def url_to_fs(url: str):
    """``(filesystem, path)`` for an fsspec URL; a protocol whose package is not installed is one error naming
    the URL and what to install (fsspec says which packages)."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        from gpufeed.errors import ConfigError

        raise ConfigError(f"{url}: reading or writing {str(url).split('://')[0]}:// URLs needs a package that is not "
                          f"installed ({e}); pip install it, or give a local path") from None


_fs = url_to_fs
