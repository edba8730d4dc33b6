"""Output files that appear under their final name only when complete, hashed as they are written.

Writers of every file-based format (RecordIO, TFRecord) write data, index and sidecar files through
:class:`AtomicFile`: bytes go to a hidden temporary name beside the target (:func:`gpufeed.formats.naming.temp_name`)
through :func:`gpufeed.io.open_file`, so tier emulation sees them; :meth:`AtomicFile.commit` fsyncs and renames,
:meth:`AtomicFile.discard` removes. The SHA-256 and size are computed on the way, so a manifest never has to
read a file back.
"""

from __future__ import annotations

import hashlib
import os

from gpufeed import io
from gpufeed.errors import OutputError, write_fix
from gpufeed.formats.base import WrittenFile
from gpufeed.formats.naming import temp_name


class AtomicFile:
    """A binary file being written to a temporary name; ``commit`` makes it appear as ``path``.

    ``durable=False`` leaves out the fsync, for an intermediate file whose loss only means redoing its work
    (a conversion's spools: read back from the page cache and deleted seconds later, they then need never
    reach the disk); the rename still makes it appear whole or not at all. ``hashed=False`` leaves out the
    SHA-256 (``sha256`` is then empty), for a file whose records carry checks of their own (an LMDB spool)."""

    def __init__(self, path: str, role: str = "data", durable: bool = True, hashed: bool = True):
        self.path = os.fspath(path)
        self.role = role
        self.durable = durable
        self.tmp = temp_name(self.path)
        try:
            # A new name, never an entry already there (a link planted at it would be written through).
            self._f = io.open_file(self.tmp, "xb" if io.is_local(self.tmp) else "wb")
        except FileExistsError as e:
            raise OutputError(f"{self.path}: cannot be written: something else is already at its new temporary name "
                              f"{self.tmp}; move it away, then write it again") from e
        except OSError as e:
            raise OutputError(f"{self.path}: cannot be written ({e}); check that the directory exists and "
                              "is writable") from e
        self._sha = hashlib.sha256() if hashed else None
        self.size = 0
        self.records = 0

    def write(self, data) -> int:
        self._f.write(data)
        if self._sha is not None:
            self._sha.update(data)
        n = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        self.size += n
        return n

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of everything written so far ("" when not ``hashed``)."""
        return self._sha.hexdigest() if self._sha is not None else ""

    def flush(self) -> None:
        self._f.flush()

    def commit(self) -> WrittenFile:
        """Flush, fsync (local files), rename to the final name; return what was written."""
        try:
            self._f.flush()
            if self.durable and io.is_local(self.tmp):
                try:
                    fd = self._f.fileno()
                except (AttributeError, OSError, ValueError):
                    fd = None  # a wrapper without a descriptor (tier emulation's): it syncs on close
                if fd is not None:
                    os.fsync(fd)  # a failed fsync is a failed write: the OSError below discards the file
            self._f.close()
            _rename(self.tmp, self.path)
        except OSError as e:
            self.discard()
            raise OutputError(f"{self.path}: could not be completed ({e.strerror or e}); {write_fix(self.path, e)}, "
                              "then write it again") from e
        return WrittenFile(self.path, self.records, self.size, self.sha256, self.role)

    def discard(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass
        remove(self.tmp)


def write_file(path: str, data: bytes, role: str = "data") -> WrittenFile:
    """``data`` as the whole of ``path``: written under a new temporary name, then renamed into place, so never
    through an entry already at either name (a link planted at ``path`` is replaced, not written through)."""
    target = AtomicFile(path, role)
    try:
        target.write(data)
    except BaseException:
        target.discard()
        raise
    return target.commit()


def commit_all(files) -> list[WrittenFile]:
    """Commit every file (data first, side files after); on any failure discard those not yet committed."""
    files = [f for f in files if f is not None]
    try:
        return [f.commit() for f in files]
    except Exception:
        for f in files:
            f.discard()
        raise


_rename = io.rename
#: The one removal of a file (absent is fine), for the conversion's own files too.
remove = io.remove
exists = io.exists


def replace_dir(src: str, dst: str) -> None:
    """Move the local directory ``src`` to ``dst``; an existing ``dst`` is swapped out first, then removed,
    so ``dst`` is never missing and never half of each."""
    import shutil

    old = None
    if os.path.exists(dst):
        old = temp_name(dst)
        os.rename(dst, old)
    os.rename(src, dst)
    if old:
        shutil.rmtree(old, ignore_errors=True)
