"""Where encoded records go: per-shard outputs written by the workers, and split outputs assembled in order.

Formats whose output is one file set per shard (TFRecord, RecordIO with ``--shards``, WebDataset) are written
by the worker that encodes the shard, straight to the destination through the format's atomic
:class:`~gpufeed.formats.base.Writer`. Formats whose output is one per split (an LMDB environment, a single
``.rec``) are assembled by the format's own :class:`~gpufeed.formats.assembly.SplitSink`
(``Format.assembler()``), from spool files the workers write: here is where those spools live (in memory
when every worker is on this machine, else ``DST/.gpufeed/spool``, reachable from every node; with
``--driver-writes`` the driver lands them in its local state directory, :func:`land`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time

from gpufeed import io
from gpufeed.formats.atomic import AtomicFile
from gpufeed.formats.assembly import output_error
from gpufeed.io import file_size, join, makedirs, remove, remove_tree  # noqa: F401 (used through this module too)

SPOOL_DIR = "spool"
#: Sidecar fields every fragment of one ``.rec`` must agree on (RecordIO stores one layout per file).
_LAYOUT_KEYS = ("kind", "shape", "dtype", "checksum")


# -- output layout ---------------------------------------------------------------------------------------

#: Where spools go when every worker runs on this machine: a memory filesystem. Spools on the destination's disk
#: are dirty pages the kernel writes back once they are 30 s old: with 64 workers writing three formats, 8 GB
#: of them reached the disk (results/convert-node-h100.txt) for nothing, since each is read back and deleted.
MEMORY_ROOT = "/dev/shm"
#: Bytes per sample and ordered sink a memory spool is sized for (ImageNet JPEGs as shipped: ~110 KB).
SPOOL_SAMPLE_BYTES = 256 * 1024
#: And for raw pixel records (a float16 224x224x3 crop is 294 KB; a float32 full-size photo several MB).
RAW_SPOOL_SAMPLE_BYTES = 4 << 20


def memory_spool_dir(out: str) -> str:
    """The memory spool folder of the local destination ``out``: one per destination, so a resumed run finds
    the spools a killed one left."""
    digest = hashlib.sha256(os.path.realpath(io.local_path(out)).encode()).hexdigest()[:16]
    return os.path.join(MEMORY_ROOT, _spool_prefix() + digest)


def _spool_prefix() -> str:
    return f"gpufeed-spool-{os.getuid()}-"


#: In each memory spool folder, the file its run holds an exclusive ``flock`` on for as long as it runs: a
#: folder whose lock nobody holds belongs to no live run (:func:`sweep_memory_spools`).
OWNER = ".owner"
#: A spool folder without an :data:`OWNER` file (made by a gpufeed before it had one, or by a run in the instant
#: between making the folder and its lock) is taken for abandoned once nothing in it has changed for this long.
UNOWNED_STALE_S = 3600.0
#: A folder being removed by a sweep is first renamed so (and a pid): no run uses it any more.
_REMOVING = ".removing-"
#: The lock of each memory spool folder this process's runs hold: path -> open file.
_owned: dict[str, object] = {}


def memory_spools(out: str, in_flight: int, sample_bytes: int = SPOOL_SAMPLE_BYTES) -> str | None:
    """A memory spool folder for ``out`` (made, private to this user, and locked for this run until
    :func:`release_memory_spools` or :func:`remove_memory_spools`) when :data:`MEMORY_ROOT` has room for
    ``in_flight`` samples' spools (``sample_bytes`` each) twice over; None where it has not, or the folder there
    is not this user's (spools then go to the destination's state folder)."""
    try:
        fs = os.statvfs(MEMORY_ROOT)
    except OSError:
        return None
    if in_flight * sample_bytes * 2 > fs.f_bavail * fs.f_frsize:
        return None
    path = memory_spool_dir(out)
    if path in _owned:
        return path
    while True:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            if not private_folder(path):
                return None
        except OSError:
            return None
        try:
            f = open(os.open(os.path.join(path, OWNER), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "rb")
            fcntl.flock(f, fcntl.LOCK_EX)  # a sweep holds it only while it removes an abandoned folder
        except OSError:
            return None
        if _same_file(f, os.path.join(path, OWNER)):
            _owned[path] = f
            return path
        f.close()  # a sweep removed the folder (another run's, as this one's was abandoned): make it again


def _same_file(f, path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    own = os.fstat(f.fileno())
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def private_folder(path: str) -> bool:
    """A real folder (no symlink), this user's, closed to everyone else: what :func:`memory_spools` makes."""
    import stat

    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def release_memory_spools(out: str) -> None:
    """This run no longer holds ``out``'s memory spool folder: what is in it stays (a sweep may remove it)."""
    if not io.is_local(out):
        return
    f = _owned.pop(memory_spool_dir(out), None)
    if f is not None:
        f.close()  # closing the descriptor drops the flock


def remove_memory_spools(out: str) -> None:
    """Drop ``out``'s memory spool folder and what a killed run left in it (memory, not disk, until reboot);
    a path there that is not such a folder of this user's is left alone."""
    if io.is_local(out) and private_folder(memory_spool_dir(out)):
        shutil.rmtree(memory_spool_dir(out), ignore_errors=True)
    release_memory_spools(out)


def sweep_memory_spools(keep: str = "") -> tuple[int, int]:
    """Remove this user's memory spool folders that no live run holds (runs killed outright: ``SIGKILL``, the
    OOM killer, a lost node), except ``out``'s own (``keep``: its spools are this run's to resume from): memory
    nothing else frees until reboot. Another destination's resume then converts those shards again, to the same
    bytes. A folder is only ever removed while its lock is held here, so a run that starts on it meanwhile waits
    and makes it again. Returns the folders removed and their bytes."""
    keep = memory_spool_dir(keep) if keep else ""
    prefix = _spool_prefix()
    try:
        names = [n for n in os.listdir(MEMORY_ROOT) if n.startswith(prefix)]
    except OSError:
        return 0, 0
    removed = size = 0
    for name in names:
        path = os.path.join(MEMORY_ROOT, name)
        if path == keep or path in _owned or not private_folder(path):
            continue
        if _REMOVING in name:  # a sweep that was stopped while it removed this one
            size += _drop(path)
            removed += 1
            continue
        try:
            fd = os.open(os.path.join(path, OWNER), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            try:
                if time.time() - os.lstat(path).st_mtime < UNOWNED_STALE_S:
                    continue
            except OSError:
                continue
            fd = None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # its run is alive
            # Out of its name first: a run that opens it now waits on the lock held here, then finds the lock
            # file no longer at its path and makes the folder again, which this removal cannot reach.
            gone = f"{path}{_REMOVING}{os.getpid()}"
            try:
                os.rename(path, gone)
            except OSError:
                continue
            size += _drop(gone)
            removed += 1
        finally:
            if fd is not None:
                os.close(fd)
    return removed, size


def _drop(path: str) -> int:
    """Remove a spool folder (flat); the bytes its files held, 0 for one gone meanwhile."""
    total = io.tree_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return total


def spool_path(spool_dir: str, split: str, fmt: str, shard: int) -> str:
    from gpufeed.formats import get_format

    return join(spool_dir, f"{split}-{fmt}-{shard:05d}{get_format(fmt).assembler().spool_ext}")


def land(blobs, files: list, out: str, spool_dir: str) -> None:
    """Write the files a worker returned (``--driver-writes``) to their places: shard outputs to ``out``
    (any fsspec URL, temporary name then rename), spool files to the local ``spool_dir``; rewrites the
    paths in ``files`` (relative, as the worker saw them) to where they now are."""
    roles = {f["path"]: f["role"] for f in files}
    where = {}
    for rel, data in blobs:
        head, _, rest = rel.partition("/")
        target = join(spool_dir, rest) if head == SPOOL_DIR else join(out, *rel.split("/"))
        if head != SPOOL_DIR:
            makedirs(join(out, head))
        try:
            f = AtomicFile(target, roles.get(rel, "data"))
            try:
                f.write(data)
            except OSError:
                f.discard()
                raise
            f.commit()
        except OSError as e:
            raise output_error(target, e) from e
        where[rel] = target
    for f in files:
        f["path"] = where[f["path"]]
