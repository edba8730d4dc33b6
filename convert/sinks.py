"""Where encoded records go: per-shard outputs written by the workers, and ordered sinks on the driver.

TFRecord shards and sharded RecordIO (``--shards``) are written by the worker that encodes the shard,
straight to the destination through the format's atomic :class:`~gpufeed.formats.base.Writer`.

Two outputs need every record of a split in one place, in order: an LMDB environment (one writer) and a
single ``.rec``. Workers hand them their records through spool files in ``DST/.gpufeed/spool`` (reachable
from every node, as the destination is; with ``--driver-writes`` the driver puts them in its local state
directory, see :func:`land`), and the driver takes the shards in order as they complete while
the workers go on encoding:

* LMDB: the spool is a sequence of CRC-checked frames (:func:`gpufeed.formats.tfrecord.frame`), one per
  record, ``u32 key length, key, value``. The driver commits each shard into a partial environment in one
  transaction; at the end the split is written once more, in key order, through the LMDB format's own
  writer into a fresh environment, so the final ``data.mdb`` depends only on its records, not on the
  history of commits and resumes (LMDB pages keep stale bytes from earlier versions of a page).
* Single ``.rec``: the worker writes its shard as a complete RecordIO fragment (``.rec``/``.idx``/``.lst``)
  with the RecordIO writer. Records are 4-byte aligned, so fragments concatenate: the driver appends the
  ``.rec`` bytes, shifts the ``.idx`` offsets by the bytes already written and appends the ``.lst`` lines.

Partial outputs live in the local state directory and are renamed (or uploaded) to their final names only
when the split is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct

from gpufeed import io
from gpufeed.errors import ConfigError, OutputError
from gpufeed.formats._atomic import AtomicFile
from gpufeed.formats._atomic import _remove as remove  # noqa: F401 (the one remove, for engine and manifest)
from gpufeed.formats.base import EncodedRecord, WrittenFile
from gpufeed.formats.naming import shard_name

#: Spool frame body: key length, then key and value. The frame around it carries length and CRCs.
_SPOOL_KEY = struct.Struct("<I")
#: LMDB's map is a reservation of address space, not disk: one size for every partial environment
#: (Caffe uses 1 TB too), so it never has to grow between resumes.
_PARTIAL_MAP_SIZE = 1 << 40

SPOOL_DIR = "spool"
#: Sidecar fields every fragment of one ``.rec`` must agree on (RecordIO stores one layout per file).
_LAYOUT_KEYS = ("kind", "shape", "dtype", "checksum")


def join(base: str, *parts: str) -> str:
    base = os.fspath(base)
    if io.is_local(base):
        return os.path.join(io.local_path(base), *parts)
    return "/".join([base.rstrip("/"), *parts])


def makedirs(url: str) -> None:
    if io.is_local(url):
        os.makedirs(io.local_path(url), exist_ok=True)
    else:
        import fsspec

        fs, p = fsspec.core.url_to_fs(url)
        fs.makedirs(p, exist_ok=True)


def file_size(url: str) -> int | None:
    try:
        if io.is_local(url):
            return os.path.getsize(io.local_path(url))
        import fsspec

        fs, p = fsspec.core.url_to_fs(url)
        return fs.size(p)
    except OSError:
        return None


def remove_tree(url: str) -> None:
    if io.is_local(url):
        shutil.rmtree(io.local_path(url), ignore_errors=True)
        return
    import fsspec

    fs, p = fsspec.core.url_to_fs(url)
    if fs.exists(p):
        fs.rm(p, recursive=True)


# -- output layout ---------------------------------------------------------------------------------------

def tfrecord_path(out: str, split: str, shard: int, count: int) -> str:
    return join(out, "tfrecord", shard_name(split, shard, count))


def recordio_shard_path(out: str, split: str, shard: int, count: int) -> str:
    return join(out, "recordio", shard_name(split, shard, count, ".rec"))


def recordio_single_path(out: str, split: str) -> str:
    return join(out, "recordio", f"{split}.rec")


def lmdb_path(out: str, split: str) -> str:
    return join(out, "lmdb", f"{split}_lmdb")


def spool_path(spool_dir: str, split: str, fmt: str, shard: int) -> str:
    ext = ".rec" if fmt == "recordio" else ""
    return join(spool_dir, f"{split}-{fmt}-{shard:05d}{ext}")


# -- spool files -----------------------------------------------------------------------------------------

class SpoolWriter:
    """Writes a shard's LMDB records as CRC-checked frames; the file appears only when complete."""

    def __init__(self, path: str):
        from gpufeed.formats.tfrecord import frame

        self._frame = frame
        self._file = AtomicFile(path, role="spool")

    def write_encoded(self, record: EncodedRecord) -> None:
        self._file.write(self._frame(_SPOOL_KEY.pack(len(record.key)) + record.key + record.value))
        self._file.records += 1

    def close(self) -> WrittenFile:
        return self._file.commit()

    def abort(self) -> None:
        self._file.discard()


def iter_spool(path: str):
    """``(key, value)`` of every record in a spool file, CRC-checked."""
    from gpufeed.formats.tfrecord import iter_frames

    with io.open_file(path, "rb") as f:
        for _offset, payload in iter_frames(f, path):
            payload = bytes(payload)
            (n,) = _SPOOL_KEY.unpack_from(payload)
            start = _SPOOL_KEY.size
            yield payload[start:start + n], payload[start + n:]


# -- ordered sinks on the driver -----------------------------------------------------------------------------

def output_error(path: str, e: BaseException) -> OutputError:
    """One sentence naming the output file (not a temporary name) and the fix."""
    if isinstance(e, OutputError) and isinstance(e.__cause__, OSError):
        e = e.__cause__  # the writer's own OutputError names the temporary file: keep only the reason
    reason = getattr(e, "strerror", None) or str(e)
    return OutputError(f"{path}: cannot be written ({reason}); free space on the destination (or fix its "
                       "permissions) and rerun the same command to resume")


class LmdbSink:
    """A split's LMDB: shards committed in order into a partial environment, rebuilt at the end."""

    def __init__(self, state_dir: str, out: str, split: str, float_dtype: str | None = None):
        self.split = split
        self.partial = os.path.join(state_dir, "partial", f"{split}_lmdb")
        self.final = lmdb_path(out, split)
        self.out = out
        # Datum.float_data is float32 whatever the samples held; the writer records the stored dtype in
        # its sidecar so readers give float16 back as float16.
        self.float_dtype = float_dtype
        self._env = None

    def open(self):
        import lmdb

        os.makedirs(self.partial, exist_ok=True)
        try:
            self._env = lmdb.open(self.partial, map_size=_PARTIAL_MAP_SIZE, subdir=True, readahead=False,
                                  meminit=False)
        except lmdb.Error as e:
            raise output_error(self.partial, e) from e
        return self

    def entries(self) -> int:
        return self._env.stat()["entries"]

    def commit(self, spool: str) -> int:
        """Append one shard's spooled records in one transaction; returns the total record count."""
        import lmdb

        try:
            with self._env.begin(write=True) as txn:
                for key, value in iter_spool(spool):
                    if not txn.put(key, value, append=True):
                        raise OutputError(f"{self.partial}: record key {key!r} is out of order; this is a "
                                          "bug, please report it")
            self._env.sync(True)
        except lmdb.Error as e:
            raise output_error(self.partial, e) from e
        return self.entries()

    def finish(self) -> list[WrittenFile]:
        """Write the final environment in key order with the LMDB format's writer; remove the partial."""
        import lmdb

        from gpufeed.formats import get_format

        local_final = self.final if io.is_local(self.out) else os.path.join(
            os.path.dirname(self.partial), f"{self.split}_lmdb.upload")
        if not io.is_local(self.out):
            shutil.rmtree(local_final, ignore_errors=True)
        os.makedirs(os.path.dirname(local_final), exist_ok=True)
        writer = get_format("lmdb").writer(local_final, raw_float_dtype=self.float_dtype)
        try:
            with self._env.begin(buffers=False) as txn:
                for key, value in txn.cursor():
                    index, _, name = key.decode("utf-8", "surrogateescape").partition("_")
                    writer.write_encoded(EncodedRecord(key, value, int(index), name, ()))
        except BaseException:
            writer.abort()
            raise
        try:
            written = writer.close()
        except (OSError, lmdb.Error) as e:
            raise output_error(local_final, e) from e
        self.close()
        shutil.rmtree(self.partial, ignore_errors=True)
        if io.is_local(self.out):
            return written
        return [_upload(w, local_final, self.final) for w in written]

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


def _upload(w: WrittenFile, local_dir: str, remote_dir: str) -> WrittenFile:
    """Copy one file of a locally built LMDB to the remote destination, then drop the local copy."""
    target = join(remote_dir, os.path.relpath(w.path, local_dir))
    written = copy_file(w.path, target, w.role, w.records)
    os.remove(w.path)
    return written


def copy_file(local: str, target: str, role: str, records: int) -> WrittenFile:
    """Copy a local file to ``target`` (any URL) under a temporary name, then rename it into place."""
    makedirs(target.rsplit("/", 1)[0] if not io.is_local(target) else os.path.dirname(io.local_path(target)))
    out = AtomicFile(target, role)
    try:
        with open(local, "rb") as src:
            while chunk := src.read(8 << 20):
                out.write(chunk)
    except OSError as e:
        out.discard()
        raise output_error(target, e) from e
    out.records = records
    return out.commit()


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


class RecordIOSink:
    """A split's single ``.rec`` with its ``.idx`` and ``.lst``, assembled from shard fragments in order."""

    EXTS = (".rec", ".idx", ".lst")

    def __init__(self, state_dir: str, out: str, split: str):
        self.split = split
        self.out = out
        self.partial = {ext: os.path.join(state_dir, "partial", f"{split}{ext}") for ext in self.EXTS}
        self.final = {ext: join(out, "recordio", f"{split}{ext}") for ext in self.EXTS}
        self.sidecar = None  # the first non-empty fragment's sidecar: kind, raw shape and dtype
        self._files = {}
        self._sha = {}
        self.records = 0

    def open(self, lengths: dict | None, records: int, sidecar: dict | None = None):
        """Open the partial files, cut back to the last journalled commit (``lengths``; none: empty)."""
        os.makedirs(os.path.dirname(self.partial[".rec"]), exist_ok=True)
        lengths = lengths or {}
        try:
            for ext, path in self.partial.items():
                want = lengths.get(ext, 0)
                if want and not os.path.exists(path):
                    # Killed while moving the finished split into place: take the moved file back.
                    if file_size(self.final[ext]) != want:
                        raise OutputError(f"{path}: the partial output journalled at {want} bytes is gone; "
                                          "rerun with --no-resume to start over")
                    if io.is_local(self.out):
                        os.replace(io.local_path(self.final[ext]), path)
                    else:
                        with io.open_file(self.final[ext], "rb") as src, open(path, "wb") as dst:
                            shutil.copyfileobj(src, dst, 8 << 20)
                f = open(path, "a+b")
                if f.seek(0, os.SEEK_END) < want:
                    raise OutputError(f"{path}: shorter than the {want} bytes journalled; the state directory "
                                      "was damaged, rerun with --no-resume to start over")
                f.truncate(lengths.get(ext, 0))
                f.seek(0)
                sha = hashlib.sha256()
                while chunk := f.read(8 << 20):
                    sha.update(chunk)
                self._files[ext], self._sha[ext] = f, sha
        except OSError as e:
            raise output_error(self.partial[".rec"], e) from e
        self.records = records
        self.sidecar = sidecar
        return self

    def lengths(self) -> dict:
        return {ext: f.tell() for ext, f in self._files.items()}

    def commit(self, fragment: str) -> dict:
        """Append the fragment ``.rec`` at ``fragment`` (with its ``.idx``/``.lst``); returns the lengths."""
        base = fragment[:-len(".rec")]
        rec = self._files[".rec"]
        offset = rec.tell()
        try:
            with io.open_file(fragment + ".json", "rb") as f:
                side = json.loads(f.read())
            self._check_layout(fragment, side)
            with io.open_file(fragment, "rb") as f:
                while chunk := f.read(8 << 20):
                    rec.write(chunk)
                    self._sha[".rec"].update(chunk)
            with io.open_file(base + ".idx", "rb") as f:
                lines = []
                for line in f.read().splitlines():
                    key, _, off = line.partition(b"\t")
                    lines.append(b"%s\t%d\n" % (key, int(off) + offset))
            idx = b"".join(lines)
            with io.open_file(base + ".lst", "rb") as f:
                lst = f.read()
            for ext, data in ((".idx", idx), (".lst", lst)):
                self._files[ext].write(data)
                self._sha[ext].update(data)
            for f in self._files.values():
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise output_error(self.partial[".rec"], e) from e
        self.records += len(lines)
        return self.lengths()

    def _check_layout(self, fragment: str, side: dict) -> None:
        layout = {k: side.get(k) for k in _LAYOUT_KEYS}
        if self.sidecar is None or (side.get("records") and not self.sidecar.get("records")):
            self.sidecar = dict(side)  # an empty fragment (every input skipped) has no layout of its own
        elif side.get("records") and layout != {k: self.sidecar.get(k) for k in _LAYOUT_KEYS}:
            raise ConfigError(f"{fragment}: records of layout {layout} cannot join {self.final['.rec']} of layout "
                              f"{ {k: self.sidecar.get(k) for k in _LAYOUT_KEYS} }; one .rec holds one raw "
                              "shape: give --size HxW for raw pixels, or --shards to write one .rec per shard")

    def finish(self) -> list[WrittenFile]:
        written = []
        digest = {}
        makedirs(join(self.out, "recordio"))
        roles = {".rec": "data", ".idx": "index", ".lst": "list"}
        for ext, f in self._files.items():
            size = f.tell()
            f.close()
            target = self.final[ext]
            if io.is_local(self.out):
                try:
                    os.replace(self.partial[ext], io.local_path(target))
                except OSError as e:
                    raise output_error(target, e) from e
            else:
                copy_file(self.partial[ext], target, roles[ext], self.records)
                os.remove(self.partial[ext])
            digest[ext] = self._sha[ext].hexdigest()
            written.append(WrittenFile(target, self.records, size, digest[ext], roles[ext]))
        self._files = {}
        # The sidecar of the whole file: the fragments' layout, with the whole file's record count.
        side = dict(self.sidecar or {}, records=self.records)
        if "sha256" in side:  # the side files' checksums, which the reader checks
            side["sha256"] = {"idx": digest[".idx"], "lst": digest[".lst"]}
        out = AtomicFile(self.final[".rec"] + ".json", "sidecar")
        out.write(json.dumps(side, indent=1, sort_keys=True).encode() + b"\n")
        out.records = self.records
        written.append(out.commit())
        return written

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
