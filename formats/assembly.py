"""Split outputs assembled in order: a format whose output is one per split (an LMDB environment, a single
``.rec``) needs every record of the split in one place, in shard order, so each such format has a
:class:`SplitSink` (``Format.assembler()``). Workers hand it their records through spool files
(:meth:`SplitSink.spool_writer`; where they live is the conversion's business, :mod:`gpufeed.convert.sinks`), and
the conversion's driver commits the shards in order as they complete while the workers go on encoding:

* LMDB (:class:`LmdbSink`): the spool holds each record with the check the LMDB writer keeps of it (CRC-32C
  of key then value, computed by the worker); the driver maps the spool, verifies each check and hands the
  records to the LMDB format's writer without copying them, one transaction per shard (``putmulti``); that
  environment becomes the output in place at the end.
* Single ``.rec`` (:class:`RecordIOSink`): each worker writes a complete RecordIO fragment; the driver
  writes it past the page cache (:class:`DirectAppend`) or has the kernel append it (no byte through Python),
  shifts the ``.idx`` offsets and appends the ``.lst``; one fsync makes every fragment appended since the last
  durable, on a thread of its own while the next are appended.

Partial outputs live in the local state directory and are renamed (or uploaded) to their final names only
when the split is complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import struct
import threading
import time

from gpufeed import io
from gpufeed.errors import ConfigError, OutputError, write_fix
from gpufeed.formats.atomic import AtomicFile, remove, replace_dir
from gpufeed.formats.base import EncodedRecord, WrittenFile, parts_digest
from gpufeed.io import file_size, join, makedirs

#: Spool record header: key length, value length, and the record's check as the LMDB writer keeps it
#: (CRC-32C of key then value, :func:`gpufeed.formats.lmdb.record_check`): computed once, by the worker.
_SPOOL_HEAD = struct.Struct("<III")
#: LMDB's map is a reservation of address space, not disk: one size for every partial environment
#: (Caffe uses 1 TB too), so it never has to grow between resumes.
_PARTIAL_MAP_SIZE = 1 << 40
#: Sidecar fields every fragment of one ``.rec`` must agree on (RecordIO stores one layout per file).
_LAYOUT_KEYS = ("kind", "shape", "dtype", "checksum")


# -- spool files -----------------------------------------------------------------------------------------

class SpoolWriter:
    """Writes a shard's LMDB records for the split's sink, each with its check; the file appears only when
    complete."""

    def __init__(self, path: str):
        from gpufeed.formats.lmdb import record_check

        self._check = record_check
        # Neither synced nor hashed: a lost spool is redone, and each record carries its own check.
        self._file = AtomicFile(path, role="spool", durable=False, hashed=False)

    def write_encoded(self, record: EncodedRecord) -> None:
        key, value = record.key, record.value
        self._file.write(_SPOOL_HEAD.pack(len(key), len(value), self._check(key, value)) + key)
        self._file.write(value)
        self._file.records += 1

    def close(self) -> WrittenFile:
        return self._file.commit()

    def abort(self) -> None:
        self._file.discard()


@contextlib.contextmanager
def spool_records(path: str, records: int | None = None):
    """The records of a spool file as a list of ``(key, value, check)``, each check verified: key bytes, value
    a memoryview of the file mapped into memory (valid inside the ``with``: nothing is copied). ``records``:
    how many its worker wrote (a spool that ends early or holds more is refused)."""
    import mmap

    from gpufeed.errors import CorruptRecordError
    from gpufeed.formats import _crc

    def corrupt(i, pos, why):
        return CorruptRecordError(path, i, pos, why)

    with io.open_file(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size if io.is_local(path) else None
        if size == 0:
            m, view = None, memoryview(b"")
        elif size is not None:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(m)
        else:
            m, view = None, memoryview(f.read())
    out = []
    try:
        crc, head, end = _crc.function(), _SPOOL_HEAD.unpack_from, len(view)
        pos = 0
        while pos < end:
            if pos + _SPOOL_HEAD.size > end:
                raise corrupt(len(out), pos, "it ends inside a record header")
            klen, vlen, check = head(view, pos)
            k = pos + _SPOOL_HEAD.size
            v = k + klen
            pos = v + vlen
            if pos > end:
                raise corrupt(len(out), k - _SPOOL_HEAD.size, f"a record of {klen} + {vlen} bytes runs past its end")
            key, value = bytes(view[k:v]), view[v:pos]
            if crc(value, crc(key)) != check:
                raise corrupt(len(out), k - _SPOOL_HEAD.size, "a record's CRC does not match")
            out.append((key, value, check))
        if records is not None and len(out) != records:
            raise corrupt(len(out), pos, f"it holds {len(out)} records, not the {records} its worker wrote")
        yield out
    finally:
        for _, value, _ in out:
            value.release()
        out.clear()
        view.release()
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # a slice still held (by the error being raised): unmapped when it goes


# -- ordered sinks on the driver -----------------------------------------------------------------------------

def output_error(path: str, e: BaseException) -> OutputError:
    """One sentence naming the output file (not a temporary name) and the fix."""
    if isinstance(e, OutputError) and isinstance(e.__cause__, OSError):
        e = e.__cause__  # the writer's own OutputError names the temporary file: keep only the reason
    reason = getattr(e, "strerror", None) or str(e)
    return OutputError(f"{path}: cannot be written ({reason}); {write_fix(path, e)}, then rerun the same command "
                       "to resume")


class SplitSink:
    """One split's output that a single writer assembles from every shard, in shard order (LMDB, a single
    ``.rec``): the ordered counterpart of the files workers write themselves.

    Spools are written without fsync: the sink's own output is fsync'd before a commit is journalled, a
    shard whose spool is gone is redone, and a damaged one fails its records' CRCs (LMDB) or its part's SHA-256
    (``gpufeed verify``, RecordIO). So a spool usually never reaches the disk: it is read back from the page
    cache and deleted.

    Its hooks follow a Ray Data ``Datasink``: :meth:`open` starts the output, or restores it to the commits
    the journal holds; :meth:`commit` takes one shard's spool (written by the shard's worker with
    :meth:`spool_writer`) and returns what the journal records of it (:meth:`commit_many`: several shards next
    in line, made durable together); :meth:`finish` completes the output
    under its final name; :meth:`close` gives up (a resumed run goes on from the journal). A commit is
    :meth:`append_many` then :meth:`sync`, which the driver may run on two threads: one appends the next
    shards while the other waits for the disk to hold those before and journals them. The engine knows
    no more of a format than this.
    """

    format = ""
    #: The spool's file name ends so (a RecordIO fragment's ``.rec``: its writer names the side files from it).
    spool_ext = ""

    def __init__(self, state_dir: str, out: str, split: str, float_dtype: str | None = None):
        self.state_dir, self.out, self.split, self.float_dtype = state_dir, out, split, float_dtype
        #: Seconds :meth:`sync` has waited for the output to reach the disk (RecordIO's fsync).
        self.sync_s = 0.0
        #: Seconds :meth:`append_many` spent handing appended bytes to the kernel's writeback (RecordIO's
        #: :func:`start_writeback` after each fragment): the calling thread submits the writes, and waits where
        #: the disk's queue is full.
        self.writeback_s = 0.0

    @staticmethod
    def spool_writer(fmt, path: str):
        """The writer a worker hands this sink's records to (``fmt`` encodes them)."""
        raise NotImplementedError

    @staticmethod
    def spool_files(spool: str) -> list[str]:
        """Every file that :meth:`spool_writer` makes for ``spool``, removed once committed."""
        return [spool]

    def open(self, commits: list[dict]) -> "SplitSink":
        raise NotImplementedError

    def commit(self, spool: str, files: list[dict]) -> dict:
        raise NotImplementedError

    def commit_many(self, batch: list) -> list[dict]:
        """Commit ``[(spool, files)]`` in order (shards next in line) and make them durable: what the journal
        records of each."""
        fields = self.append_many(batch)
        self.sync()
        return fields

    def append_many(self, batch: list) -> list[dict]:
        """Add ``[(spool, files)]`` to the output in order, not yet durable (:meth:`sync`): what the journal
        will record of each. Called from one thread at a time, which may run beside :meth:`sync`'s."""
        return [self.commit(spool, files) for spool, files in batch]

    def sync(self) -> None:
        """Make everything :meth:`append_many` has returned so far durable; its shards may then be journalled.
        (A sink whose every append is a durable transaction has nothing to do.)"""

    def finish(self) -> list[WrittenFile]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class LmdbSink(SplitSink):
    """A split's LMDB, written once, in key order, one transaction per shard, by the LMDB format's writer,
    whose environment becomes the output in place (no copy at the end).

    Determinism by construction: that environment has always been built from empty by the same sequence of
    transactions, so its bytes depend only on the records. A run that
    goes on after a kill does not reopen the environment it left (whose pages would carry that history):
    it rebuilds the journalled shards into a fresh one, one transaction each as before, then continues.
    That copy is the price of a resume, not of every run.
    """

    format = "lmdb"

    def __init__(self, state_dir: str, out: str, split: str, float_dtype: str | None = None):
        super().__init__(state_dir, out, split, float_dtype)
        self.partial_dir = os.path.join(state_dir, "partial")
        self.target = os.path.join(self.partial_dir, f"{split}_lmdb")
        from gpufeed.formats import get_format

        self.final = get_format("lmdb").output_path(out, split)
        self._writer = None

    @staticmethod
    def spool_writer(fmt, path: str):
        return SpoolWriter(path)

    def _new_writer(self):
        from gpufeed.formats import get_format

        # The map is a reservation of address space, not disk (Caffe reserves 1 TB too): it never grows, so
        # no transaction is ever redone; the writer ties the output's map size to its data at the end.
        return get_format("lmdb").writer(self.target, raw_float_dtype=self.float_dtype,
                                         initial_map_size=_PARTIAL_MAP_SIZE, batch_records=1 << 62,
                                         batch_bytes=1 << 62, compact=False, in_place=True)

    def open(self, commits: list[dict]) -> "LmdbSink":
        import glob

        import lmdb

        os.makedirs(self.partial_dir, exist_ok=True)
        old = sorted(glob.glob(os.path.join(glob.escape(self.partial_dir), f".{self.split}_lmdb.tmp-*")))
        if commits and not old:
            raise OutputError(f"{self.partial_dir}: the partial {self.split} LMDB journalled at "
                              f"{commits[-1]['records']} records is gone; rerun with --no-resume to start over")
        try:
            self._writer = self._new_writer()
            if commits:
                self._replay(old[-1], [c["records"] for c in commits])
        except (lmdb.Error, OSError) as e:  # OutputError too, which names the partial environment
            raise output_error(self.final, e) from e
        for stale in old:
            shutil.rmtree(stale, ignore_errors=True)
        return self

    def _replay(self, old: str, boundaries: list[int]) -> None:
        """Rebuild the journalled shards (cumulative record counts ``boundaries``) from the environment a
        stopped run left; records it committed past the journal are dropped (their shards are redone)."""
        import lmdb

        env = lmdb.open(old, readonly=True, lock=False, subdir=True, readahead=True)
        try:
            with env.begin(buffers=True) as txn:
                cursor = txn.cursor()
                n = 0
                more = cursor.first()
                for stop in boundaries:
                    while n < stop:
                        if not more:
                            raise OutputError(f"{old}: holds {n} records, fewer than the {stop} journalled; "
                                              "rerun with --no-resume to start over")
                        key, value = cursor.item()
                        self._writer.write_encoded(_lmdb_record(bytes(key), bytes(value)))
                        n += 1
                        more = cursor.next()
                    self._writer.flush()
        finally:
            env.close()

    def commit(self, spool: str, files: list[dict]) -> dict:
        """Append one shard's spooled records in one transaction; returns the records committed so far."""
        import lmdb

        from gpufeed.errors import CorruptRecordError

        written = {f["path"]: f for f in files}.get(spool)
        try:
            with spool_records(spool, written and written["records"]) as records:
                self._writer.write_checked(records)
                self._writer.flush()
        except CorruptRecordError as e:
            remove(spool)  # so that the next run converts the shard again
            raise OutputError(f"{spool}: damaged (record {e.record_index} at byte {e.byte_offset}: {e.reason}), so "
                              "its shard cannot join the LMDB; it was removed: rerun the same command to convert "
                              "that shard again") from e
        except lmdb.Error as e:
            raise output_error(self.target, e) from e
        return {"records": self._writer.committed_records}

    def finish(self) -> list[WrittenFile]:
        """Compact the environment into its final name (in the destination, or uploaded to it)."""
        import lmdb

        try:
            written = self._writer.close()
        except (OSError, lmdb.Error) as e:
            raise output_error(self.final, e) from e
        self._writer = None
        if io.is_local(self.out):
            makedirs(os.path.dirname(self.final))
            try:
                replace_dir(self.target, io.local_path(self.final))
            except OSError as e:
                raise output_error(self.final, e) from e
            return [dataclasses.replace(w, path=os.path.join(self.final, os.path.relpath(w.path, self.target)))
                    for w in written]
        uploaded = [_upload(w, self.target, self.final) for w in written]
        shutil.rmtree(self.target, ignore_errors=True)
        return uploaded

    def close(self) -> None:
        # The working environment stays for a resume; only this process lets go of it.
        if self._writer is not None:
            self._writer.release()
            self._writer = None


def _lmdb_record(key: bytes, value: bytes) -> EncodedRecord:
    index, _, name = key.decode("utf-8", "surrogateescape").partition("_")
    return EncodedRecord(key, value, int(index), name, ())


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
        with open(local, "rb", opener=io.open_fd) as src:
            while chunk := src.read(8 << 20):
                out.write(chunk)
    except OSError as e:
        out.discard()
        raise output_error(target, e) from e
    out.records = records
    return out.commit()


class RecordIOSink(SplitSink):
    """A split's single ``.rec`` with its ``.idx`` and ``.lst``, assembled from shard fragments in order.

    Each worker writes its shard as a complete RecordIO fragment (records are 4-byte aligned, so fragments
    concatenate) and hashes it as it writes. The sink appends the fragment's ``.rec`` past the page cache from
    a memory spool (:class:`DirectAppend`), else with an in-kernel copy (:func:`kernel_copy`: no byte passes
    through Python, and filesystems with reflinks share the blocks), shifts the ``.idx`` offsets and appends the
    ``.lst`` lines. The ``.rec``'s checksum is a hash list: the SHA-256 of each fragment as its worker wrote it
    (``parts`` in the manifest, checked range by range by ``gpufeed verify``), so nothing is read back to hash it.
    """

    format = "recordio"
    spool_ext = ".rec"
    EXTS = (".rec", ".idx", ".lst")
    _ROLES = {".rec": "data", ".idx": "index", ".lst": "list"}

    def __init__(self, state_dir: str, out: str, split: str, float_dtype: str | None = None):
        super().__init__(state_dir, out, split, float_dtype)
        self.partial = {ext: os.path.join(state_dir, "partial", f"{split}{ext}") for ext in self.EXTS}
        from gpufeed.formats import get_format

        rec = get_format("recordio").output_path(out, split)
        self.final = {ext: rec[:-len(".rec")] + ext for ext in self.EXTS}
        self.sidecar = None  # the first non-empty fragment's sidecar: kind, raw shape and dtype
        self._files = {}
        self._sha = {}
        self.parts = []  # [bytes, sha256] of each fragment in the .rec, in order
        self.records = 0
        self._fds = {}  # the open partial files' descriptors, which sync() may use beside an append
        self._direct = None  # the .rec's DirectAppend, where its filesystem takes O_DIRECT
        self._writing = []  # its writes handed out by append_many and not yet waited for by sync()
        self._writing_lock = threading.Lock()

    @staticmethod
    def spool_writer(fmt, path: str):
        return fmt.writer(path, durable=False)  # a spool is redone if lost (see SplitSink)

    @staticmethod
    def spool_files(spool: str) -> list[str]:
        base = spool[:-len(".rec")]
        return [spool, base + ".idx", base + ".lst", spool + ".json"]

    def open(self, commits: list[dict]) -> "RecordIOSink":
        """Open the partial files, cut back to the last journalled commit."""
        last = commits[-1] if commits else None
        lengths = last["lengths"] if last else {}
        os.makedirs(os.path.dirname(self.partial[".rec"]), exist_ok=True)
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
                # Not O_APPEND: copy_file_range refuses such a destination; every write goes to the end. Never
                # through a link: the cut below would cut whatever it names.
                f = open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+b")
                if f.seek(0, os.SEEK_END) < want:
                    raise OutputError(f"{path}: shorter than the {want} bytes journalled; the state directory "
                                      "was damaged, rerun with --no-resume to start over")
                f.truncate(want)
                self._files[ext] = f
                if ext != ".rec":  # the side files are small: hashed again from the start
                    f.seek(0)
                    sha = hashlib.sha256()
                    while chunk := f.read(8 << 20):
                        sha.update(chunk)
                    self._sha[ext] = sha
                f.seek(0, os.SEEK_END)
        except OSError as e:
            raise output_error(self.partial[".rec"], e) from e
        self.parts = [c["part"] for c in commits if c.get("part")]
        self.records = last["records"] if last else 0
        self.sidecar = last and last["sidecar"]
        self._fds = {ext: f.fileno() for ext, f in self._files.items()}
        try:
            self._direct = DirectAppend.open(self.partial[".rec"], self._files[".rec"].tell())
        except OSError as e:
            raise output_error(self.partial[".rec"], e) from e
        return self

    def lengths(self) -> dict:
        return {ext: self._direct.end if ext == ".rec" and self._direct else f.tell() for ext, f in self._files.items()}

    def commit(self, spool: str, files: list[dict]) -> dict:
        """Append the fragment at ``spool`` (a ``.rec`` with its ``.idx``/``.lst``); returns the journal's
        fields: lengths, records, the fragment's part and the sidecar."""
        return self.commit_many([(spool, files)])[0]

    def append_many(self, batch: list) -> list[dict]:
        """Append several fragments in order: past the page cache, their writes handed to the writers (the last
        partial block written here), for :meth:`sync` to wait for; else each fragment's writeback started as soon
        as it is appended. The side files' buffers are handed to the kernel, so that a :meth:`sync` on another
        thread (file descriptors and the writes' futures only) makes them durable with the ``.rec``."""
        rec = self._files[".rec"]
        fields = []
        try:
            for spool, files in batch:
                start = rec.tell()
                fields.append(self._append(spool, files, rec))
                if self._direct is None:  # written past the page cache otherwise
                    kicked = time.perf_counter()
                    start_writeback(rec, start, rec.tell() - start)
                    self.writeback_s += time.perf_counter() - kicked
            if self._direct is not None:
                written = self._direct.seal()  # the last partial block written; the spans may be in flight
                with self._writing_lock:
                    self._writing += written
            for ext in (".idx", ".lst"):
                self._files[ext].flush()
        except OSError as e:
            raise output_error(self.partial[".rec"], e) from e
        return fields

    def sync(self) -> None:
        """Wait for the ``.rec``'s writes in flight, then fsync the three files together: one disk flush for every
        fragment appended since the last (a sync that waits for the disk lets several batches gather for the
        next)."""
        try:
            synced = time.perf_counter()
            with self._writing_lock:
                writing, self._writing = self._writing, []
            wait_all(writing)
            fsync_together(self._fds.values())
            self.sync_s += time.perf_counter() - synced
        except OSError as e:
            raise output_error(self.partial[".rec"], e) from e

    def _append(self, spool: str, files: list[dict], rec) -> dict:
        base = spool[:-len(".rec")]
        offset = self.lengths()[".rec"]
        written = {f["path"]: f for f in files}.get(spool)
        with io.open_file(spool + ".json", "rb") as f:
            side = json.loads(f.read())
        self._check_layout(spool, side)
        size = self._append_fragment(spool, rec)
        if written is None or written["bytes"] != size:
            raise OutputError(f"{spool}: {size} bytes, not the {written and written['bytes']} its worker "
                              "wrote; the spool was changed: rerun the same command to redo the shard")
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
        part = [size, written["sha256"]] if size else None
        if part:
            self.parts.append(part)
        self.records += len(lines)
        return {"lengths": self.lengths(), "records": self.records, "part": part, "sidecar": self.sidecar}

    def _append_fragment(self, spool: str, rec) -> int:
        if self._direct is not None and not self._direct.appended and _same_filesystem(spool, self.partial[".rec"]):
            # Spools beside the .rec (a cluster's, in DST/.gpufeed): copy_file_range, which shares the blocks
            # where the filesystem has reflinks; past the page cache only from another filesystem (memory).
            self._direct.close()
            self._direct = None
            rec.seek(0, os.SEEK_END)
        if self._direct is not None:
            return self._direct.append(spool)
        return append_file(spool, rec)

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
        if self._direct is not None:
            try:
                self._direct.close()  # the .rec cut to its length
            except OSError as e:
                raise output_error(self.final[".rec"], e) from e
            self._direct = None
        for ext, f in self._files.items():
            try:
                f.flush()
                size = f.seek(0, os.SEEK_END)
                os.fsync(f.fileno())
            finally:
                f.close()
            target = self.final[ext]
            if io.is_local(self.out):
                try:
                    os.replace(self.partial[ext], io.local_path(target))
                except OSError as e:
                    raise output_error(target, e) from e
            else:
                copy_file(self.partial[ext], target, self._ROLES[ext], self.records)
                os.remove(self.partial[ext])
            parts = tuple(tuple(p) for p in self.parts) if ext == ".rec" else ()
            digest[ext] = parts_digest(parts) if ext == ".rec" else self._sha[ext].hexdigest()
            written.append(WrittenFile(target, self.records, size, digest[ext], self._ROLES[ext], parts))
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
        if self._direct is not None:
            self._direct.close(cut=False)  # a resume cuts the .rec back to its journalled length
            self._direct = None
        for f in self._files.values():
            f.close()
        self._files = {}


def start_writeback(f, offset: int, length: int) -> None:
    """Have the kernel start writing ``length`` bytes of ``f`` from ``offset`` to the disk now, without
    waiting (Linux: ``POSIX_FADV_DONTNEED`` starts the range's writeback, then drops only its clean pages). A
    fragment is then written while the next ones are copied, and the sync waits for what is left instead of
    for all of it (one 64-core warm run: the .rec's disk was busy 24% of the time, each fragment copied, then
    flushed, in turn; a build that kicked it only at each sync, and kept the spools until journalled, waited
    3-4x longer in its syncs and converted 5-18% slower: results/convert-node-h200x2.txt, session 23)."""
    if length > 0 and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(f.fileno(), offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # a hint: the fsync that follows makes the bytes durable either way


def fsync_together(fds) -> None:
    """fsync the file descriptors ``fds`` side by side (threads: the waits release the GIL), so that a filesystem
    with a journal commits their metadata once rather than once a file."""
    fds = list(fds)
    errors = []

    def sync(f):
        try:
            os.fsync(f)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=sync, args=(f,)) for f in fds[1:]]
    for t in threads:
        t.start()
    if fds:
        sync(fds[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def append_file(src: str, dst) -> int:
    """Append the file ``src`` to the open file ``dst`` at its position; returns the bytes appended.

    Local to local, the kernel copies (:func:`kernel_copy`) and the bytes are charged to an emulated tier as
    read and written; otherwise they stream through."""
    if io.is_local(src):
        dst.flush()
        with open(io.local_path(src), "rb", opener=io.open_fd) as f:  # (a FIFO planted there would block)
            size = os.fstat(f.fileno()).st_size
            done = kernel_copy(f.fileno(), dst.fileno(), size)
        dst.seek(0, os.SEEK_END)
        if done == size:
            io.charge(size)
            io.charge(size, write=True)
            return size
        if done:  # the kernel stopped early and said nothing: the source changed under it
            raise OutputError(f"{src}: {done} bytes copied of {size}; the spool was changed: rerun the same "
                              "command to redo the shard")
    return stream_file(src, dst)


def stream_file(src: str, dst) -> int:
    """Append ``src`` to ``dst`` through Python, 8 MB at a time (where the kernel cannot copy: a remote spool)."""
    n = 0
    with io.open_file(src, "rb") as f:
        while chunk := f.read(8 << 20):
            dst.write(chunk)
            n += len(chunk)
    return n


def _same_filesystem(a: str, b: str) -> bool:
    if not io.is_local(a):
        return False
    try:
        return os.stat(io.local_path(a)).st_dev == os.stat(b).st_dev
    except OSError:
        return False


class DirectAppend:
    """Appends files to one local file past the page cache (``O_DIRECT``): a single ``.rec``'s fragments,
    cut into block-aligned spans, each read into a block-aligned buffer and written straight to the disk by one
    of :attr:`DEPTH` threads, so that several writes are in flight while the appending thread plans the next.
    A buffered append copies every byte into the page cache on the one thread that commits, and that copy
    (0.75-1.0 CPU s per GB on the 4x H200 hosts) set the pace of warm 64-worker conversions; one synchronous
    writer past the page cache halved the thread's CPU but left it waiting for each write in turn (busy 18-21 s of
    a 25-27 s run, results/convert-node-h200x4.txt, session 24). Here the thread only cuts the spans and hands
    them out; the copies from the spools and the disk's writes overlap on the writers.

    Every block is written once, in one span, except the file's last partial block: :meth:`seal` (or
    :meth:`flush`) writes it padded with zeros, at once and beside the spans in flight (none covers it), and the
    next append rewrites it whole after that, so two writes of one block are never in flight together. Bytes are on
    the disk once the futures :meth:`seal` returns are done (the sink seals each batch, and its syncing thread
    waits for them before the fsync and the journal line), or once :meth:`flush` returns; between them the file
    may run up to a block past its length; :attr:`end` is the length, which the journal records and a resume
    cuts the file back to, and :meth:`close` cuts it there. A source's bytes are read by the writers through a
    duplicate of its descriptor, so the caller may remove it once :meth:`append` returns. Where the filesystem
    refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some network filesystems), or the alignment of a first probe
    write, :meth:`open` gives None and the sink goes on through the page cache. The sink uses it for spools from
    another filesystem (memory spools); spools beside the ``.rec`` go by ``copy_file_range``, which shares their
    blocks where the filesystem has reflinks."""

    #: The alignment asked of offsets, lengths and buffers: a page covers every disk's logical block.
    ALIGN = 4096
    #: The most bytes one write takes (a writer's buffer, a page-aligned anonymous map, is this size): a
    #: ~12 MB fragment, often a batch of its own, goes out as six writes side by side.
    CHUNK = 2 << 20
    #: Writes in flight at once (one thread each); the appending thread waits only when twice as many are queued.
    DEPTH = 4

    def __init__(self, fd: int, end: int, carry: bytes, chunk: int | None = None, depth: int | None = None):
        import concurrent.futures
        import mmap
        import queue

        self.fd, self.end = fd, end
        self.chunk = chunk or self.CHUNK
        self.depth = depth or self.DEPTH
        if self.chunk % self.ALIGN:
            raise ValueError(f"chunk {self.chunk} is not a multiple of {self.ALIGN}")
        self._carry = carry  # the file's last partial block: on the disk once the next seal() or flush() writes it
        self._buffers = queue.SimpleQueue()
        self._maps = [mmap.mmap(-1, self.chunk) for _ in range(self.depth)]
        for m in self._maps:
            self._buffers.put(m)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.depth, thread_name_prefix="gpufeed-direct")
        self._inflight = []  # futures of the latest writes handed out, oldest first: at most twice the depth
        self._submitted = []  # futures of every write handed out since the last seal() or flush()
        self.appended = 0  # non-empty fragments appended this way

    @classmethod
    def open(cls, path: str, end: int, **kw) -> "DirectAppend | None":
        """Append to the local file ``path`` from its length ``end``; None where ``O_DIRECT`` does not apply.
        The file's last partial block is written again, padded (the probe: nothing is written where refused)."""
        if not hasattr(os, "O_DIRECT"):
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                return None
            raise
        try:
            block = end - end % cls.ALIGN
            with open(path, "rb") as f:  # the last partial block, rewritten with what follows it
                f.seek(block)
                carry = f.read(end - block)
            direct = cls(fd, end, carry, **kw)
        except BaseException:
            os.close(fd)
            raise
        try:
            direct._write([carry], block, cls.ALIGN, path)
        except OSError as e:
            direct.close(cut=False)
            if e.errno == errno.EINVAL:  # the filesystem took the open, not the aligned write
                return None
            raise
        return direct

    def append(self, src: str) -> int:
        """Append the file ``src`` (any URL; a local one read by the writers with ``preadv``); returns its
        length. Its bytes are on the disk once the futures of the next :meth:`seal` are done, or the next
        :meth:`flush` returns; a failed write raises from there (or from a later :meth:`append`, which waits for
        the oldest writes when too many are queued)."""
        if io.is_local(src):
            with open(io.local_path(src), "rb", buffering=0, opener=io.open_fd) as f:
                done = self._plan_local(f.fileno(), os.fstat(f.fileno()).st_size, src)
        else:
            with io.open_file(src, "rb") as f:
                done = self._plan_stream(f, src)
        if done:
            self.appended += 1
        io.charge(done)
        io.charge(done, write=True)
        return done

    def _plan_local(self, fd: int, n: int, src: str) -> int:
        """Cut the ``n`` bytes of ``fd`` into block-aligned spans behind the carried bytes, each handed to a
        writer with a duplicate of ``fd``; what is left past the last whole block is carried."""
        carry, done = self._carry, 0
        block = self.end - len(carry)
        while len(carry) + n - done >= self.ALIGN:
            total = min(self.chunk, len(carry) + n - done)
            take = total - total % self.ALIGN - len(carry)
            self._submit([carry, (os.dup(fd), done, take)], block, len(carry) + take, src)
            block, done, carry = block + len(carry) + take, done + take, b""
        tail = os.pread(fd, n - done, done) if n > done else b""
        if len(tail) != n - done:
            raise self._changed(src, done + len(tail), n)
        self._carry = carry + tail
        self.end += n
        return n

    def _plan_stream(self, f, src: str) -> int:
        """As :meth:`_plan_local`, for a source read in turn here (another filesystem's: a cluster's spools)."""
        carry, done = self._carry, 0
        block = self.end - len(carry)
        while data := f.read(self.chunk):
            done += len(data)
            span = (len(carry) + len(data)) // self.ALIGN * self.ALIGN
            if not span:
                carry += data
                continue
            take = span - len(carry)  # the chunk's bytes copied once, by the writer
            self._submit([carry, memoryview(data)[:take]], block, span, src)
            block, carry = block + span, data[take:]
        self._carry = carry
        self.end += done
        return done

    @staticmethod
    def _changed(src: str, got: int, n: int) -> OutputError:
        return OutputError(f"{src}: {got} bytes read of {n}; the spool was changed: rerun the same command to "
                           "redo the shard")

    def _submit(self, pieces: list, block: int, span: int, src: str) -> None:
        if len(self._inflight) >= 2 * self.depth:
            self._inflight.pop(0).result()
        try:
            future = self._pool.submit(self._write, pieces, block, span, src)
        except BaseException:
            _close_pieces(pieces)
            raise
        self._inflight.append(future)
        self._submitted.append(future)

    def _write(self, pieces: list, block: int, span: int, src: str) -> None:
        """Fill a buffer with ``pieces`` (bytes, or ``(fd, offset, length)`` read and closed here), pad it with
        zeros to ``span`` and write it at ``block``."""
        buf = self._buffers.get()
        view = memoryview(buf)
        try:
            at = 0
            for p in pieces:
                if isinstance(p, tuple):
                    fd, offset, length = p
                    got = 0
                    while got < length:
                        k = os.preadv(fd, [view[at + got:at + length]], offset + got)
                        if not k:
                            raise self._changed(src, offset + got, offset + length)
                        got += k
                    at += length
                else:
                    view[at:at + len(p)] = p
                    at += len(p)
            view[at:span] = bytes(span - at)
            written = 0
            while written < span:
                written += os.pwrite(self.fd, view[written:span], block + written)
        finally:
            view.release()
            self._buffers.put(buf)
            _close_pieces(pieces)

    def seal(self) -> list:
        """Write the last partial block now (padded), beside the spans still in flight (none of them covers it,
        and the next append's first span, which rewrites it, is handed out only after this returns); returns
        the futures of the writes handed out since the last :meth:`flush` or :meth:`seal`. Once they are done
        every byte appended is on the disk: :func:`wait_all` of them, then an fsync, makes it durable, on any
        thread, while this one appends the next (the sink's commit: appends on one thread, syncs beside it)."""
        if self._carry:
            self._write([self._carry], self.end - len(self._carry), self.ALIGN, "")
        submitted, self._submitted = self._submitted, []
        return submitted

    def flush(self) -> None:
        """:meth:`seal`, waiting for every write: every byte appended is then on the disk (the caller's fsync
        makes it durable); raises the first failed write's error."""
        self._inflight = []
        wait_all(self.seal())

    def _wait(self) -> None:
        submitted, self._submitted, self._inflight = self._submitted, [], []
        wait_all(submitted)

    def close(self, cut: bool = True) -> None:
        """Stop; ``cut``: the bytes flushed and the file cut to :attr:`end` (its padding dropped). Without, the
        writes in flight are waited for and the file left as it is (a resume cuts it to the journalled length)."""
        if self.fd is None:
            return
        try:
            if cut:
                self.flush()
                os.ftruncate(self.fd, self.end)
        finally:
            with contextlib.suppress(BaseException):
                self._wait()
            self._pool.shutdown(wait=True)
            os.close(self.fd)
            self.fd = None
            for m in self._maps:
                m.close()


def wait_all(futures) -> None:
    """Wait for every future, then raise the first one's error, if any."""
    error = None
    for future in futures:
        try:
            future.result()
        except BaseException as e:  # every write waited for before any is reported
            error = error or e
    if error is not None:
        raise error


def _close_pieces(pieces: list) -> None:
    for p in pieces:
        if isinstance(p, tuple):
            with contextlib.suppress(OSError):
                os.close(p[0])


#: Errors with which the kernel refuses a copy between two files before copying anything: the call does not
#: apply to them (another filesystem, a kind of file it does not take), not a failure of the disk.
_NOT_APPLICABLE = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def kernel_copy(src_fd: int, dst_fd: int, size: int) -> int:
    """Copy ``size`` bytes from ``src_fd``'s start to ``dst_fd``'s position inside the kernel; returns the bytes
    copied, 0 where neither way applies (the caller then streams them).

    ``copy_file_range`` within one filesystem (a reflink where the filesystem shares blocks); across two,
    where Linux refuses it (EXDEV since 5.19: memory spools in ``/dev/shm`` appended to a ``.rec`` on the disk),
    ``sendfile``, one copy from page cache to page cache, no byte through Python (its CPU against streaming:
    no consistent difference measured, results/append-copy-dev.txt). Where the filesystem takes O_DIRECT the
    ``.rec`` is written past the page cache instead (:class:`DirectAppend`)."""
    for call in (_copy_file_range, _sendfile):
        done = 0
        try:
            while done < size:
                n = call(src_fd, dst_fd, done, size - done)
                if n == 0:
                    break
                done += n
        except OSError as e:
            if done or e.errno not in _NOT_APPLICABLE:
                raise
        if done:
            return done
    return 0


def _copy_file_range(src_fd: int, dst_fd: int, offset: int, count: int) -> int:
    if not hasattr(os, "copy_file_range"):
        raise OSError(errno.ENOSYS, "copy_file_range")
    return os.copy_file_range(src_fd, dst_fd, count, offset)


def _sendfile(src_fd: int, dst_fd: int, offset: int, count: int) -> int:
    if not hasattr(os, "sendfile"):
        raise OSError(errno.ENOSYS, "sendfile")
    return os.sendfile(dst_fd, src_fd, offset, count)
