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

import hashlib
import os
import shutil

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
    return os.path.join(MEMORY_ROOT, f"gpufeed-spool-{os.getuid()}-{digest}")


def memory_spools(out: str, in_flight: int, sample_bytes: int = SPOOL_SAMPLE_BYTES) -> str | None:
    """A memory spool folder for ``out`` (made, private to this user) when :data:`MEMORY_ROOT` has room for
    ``in_flight`` samples' spools (``sample_bytes`` each) twice over; None where it has not, or the folder there
    is not this user's (spools then go to the destination's state folder)."""
    try:
        fs = os.statvfs(MEMORY_ROOT)
    except OSError:
        return None
    if in_flight * sample_bytes * 2 > fs.f_bavail * fs.f_frsize:
        return None
    path = memory_spool_dir(out)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not _private_folder(path):
            return None
    except OSError:
        return None
    return path


def _private_folder(path: str) -> bool:
    """A real folder (no symlink), this user's, closed to everyone else: what :func:`memory_spools` makes."""
    import stat

    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def remove_memory_spools(out: str) -> None:
    """Drop ``out``'s memory spool folder and what a killed run left in it (memory, not disk, until reboot);
    a path there that is not such a folder of this user's is left alone."""
    if io.is_local(out) and _private_folder(memory_spool_dir(out)):
        shutil.rmtree(memory_spool_dir(out), ignore_errors=True)


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
