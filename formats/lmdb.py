"""Caffe LMDB: one environment directory whose values are serialized ``caffe.Datum`` messages.

What Caffe's ``convert_imageset`` writes and what Caffe's ``Data`` layer and DALI's ``fn.readers.caffe``
read: keys ``%08d_<relative path>`` (so byte order of keys is write order), values ``Datum`` from
``proto/caffe.proto``:

* encoded image: ``data`` = the JPEG/PNG bytes, ``label``, ``encoded = true`` (always written: DALI takes a
  Datum without the field for an encoded one, Caffe for a raw one). Like ``ReadFileToDatum``, no
  ``channels/height/width``: the decoder learns them from the image.
* raw pixels: ``channels, height, width``, ``data`` = uint8 planes in CHW order, BGR like OpenCV (what
  ``CVMatToDatum`` stores), ``encoded = false``. Normalised float pixels go to ``float_data`` in the same
  CHW/BGR order, with ``data`` left out (Caffe's ``DataTransformer`` then reads ``float_data``).
* tokens: ``channels = 1, height = 1, width = n``, ``float_data`` = the ids, ``encoded = false``.
* several labels: ``label`` = the first, ``float_data`` = all of them (encoded and uint8 raw samples only).

The Datum bytes are :mod:`gpufeed.formats.caffe_datum`'s. The directory also holds ``gpufeed.json`` (version,
parameters, sizes), ``gpufeed.crc32c`` (one CRC-32C per record, in key order), ``gpufeed.pages`` (one per
B-tree page) and ``gpufeed.offsets`` (where each value starts): LMDB itself has no checksums, so a flipped
byte in a value would otherwise be read as good data, and a damaged page sends it past the end of the map
(:mod:`gpufeed.formats._lmdb_pages`). Caffe and DALI open only ``data.mdb``; the extra files do not disturb them.

Writing goes to a hidden working environment next to the target, committed in batches, its map grown on
``MDB_MAP_FULL``. :meth:`LMDBWriter.close` makes a compacted copy (``mdb_env_copy2`` with ``MDB_CP_COMPACT``)
and renames that directory into place, so the result holds no free pages and no lock file; or, for a
conversion, whose transactions are the same on every run (``in_place``), renames the working environment
itself, written once.
"""

from __future__ import annotations

import array
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterator

from gpufeed.formats import _crc
import numpy as np

from gpufeed import io as gio
from gpufeed.errors import (ConfigError, CorruptRecordError, IncompleteOutputError, OutputError, ShardNotFound,
                            write_fix)
from gpufeed.formats import _lmdb_pages, naming
from gpufeed.formats.atomic import replace_dir
from gpufeed.formats._filebytes import advise_will_need, position, random_read_fd
from gpufeed.formats.base import (PER_SPLIT, EncodedRecord, Format, Reader, Sample, WrittenFile, Writer,
                                  require_output)
from gpufeed.formats.caffe_datum import KEY_DIGITS, decode_datum, encode_datum, make_key, split_key

#: Bump when the layout of keys, values or side files changes; readers refuse newer versions.
VERSION = 1
SIDECAR = "gpufeed.json"
CHECKSUMS = "gpufeed.crc32c"
PAGES = "gpufeed.pages"
#: Where each record's value starts in ``data.mdb`` (u64 per record, in key order): readers fetch a value
#: with one ``pread`` instead of a page fault per 4 KiB of it (a 110 KB JPEG spans ~27 overflow pages).
OFFSETS = "gpufeed.offsets"
DATA = "data.mdb"
#: LMDB's lock file, which a writer opened with locking makes beside ``data.mdb`` (gpufeed's writers do not lock).
LOCK = "lock.mdb"
#: The files an environment gpufeed writes holds.
_OUTPUT_FILES = (DATA, CHECKSUMS, PAGES, OFFSETS, SIDECAR)
#: Per record, in key order: CRC-32C of key + value, and the value's length. Little-endian, packed, so the
#: file reads straight into a numpy array. The length is checked before the value is touched: a damaged
#: node header could otherwise point a read past the end of the map.
_CHECK_DTYPE = np.dtype([("crc", "<u4"), ("size", "<u8")])


_SCAN_CHUNK = 1 << 16

_DEFAULT_INITIAL_MAP = 64 << 20
#: Each commit is an fsync: by count for small records, by bytes (below) for large ones.
_DEFAULT_BATCH_RECORDS = 10_000
_DEFAULT_BATCH_BYTES = 64 << 20


def _require_local(path: str, what: str) -> str:
    if not gio.is_local(path):
        raise ConfigError(f"{path}: {what} needs a local path because LMDB memory-maps its file; copy it to "
                          "local disk first, or write RecordIO/TFRecord for remote storage")
    return os.path.abspath(gio.local_path(path))




def record_check(key, value) -> int:
    """CRC-32C of key then value: the key names the record, so damage there must be caught too."""
    return _crc.crc32c(value, _crc.crc32c(key))




def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _read_sidecar(directory: str) -> dict | None:
    try:
        with gio.open_file(os.path.join(directory, SIDECAR), "rb") as f:
            meta = json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise CorruptRecordError(os.path.join(directory, SIDECAR), None, 0, f"not JSON ({e})") from e
    if meta.get("format") != "caffe-lmdb":
        raise ConfigError(f"{directory}: {SIDECAR} describes format {meta.get('format')!r}, not caffe-lmdb")
    if int(meta.get("version", 0)) > VERSION:
        raise ConfigError(f"{directory}: written by a newer gpufeed (layout version {meta['version']}, this "
                          f"one reads up to {VERSION}); upgrade gpufeed")
    return meta


@dataclasses.dataclass(frozen=True)
class WriterOptions:
    """Writer parameters, recorded in the sidecar. ``initial_map_size`` is where the map starts: it
    doubles on ``MDB_MAP_FULL``, as Caffe's own LMDB writer does."""

    initial_map_size: int = _DEFAULT_INITIAL_MAP
    batch_records: int = _DEFAULT_BATCH_RECORDS
    batch_bytes: int = _DEFAULT_BATCH_BYTES
    compact: bool = True
    #: dtype of normalised pixels ("float16"/"float32"). Datum.float_data is float32 whatever was stored, so
    #: readers cast back to this. :meth:`LMDBWriter.write` learns it from the samples; a caller that only
    #: hands over encoded records (:meth:`LMDBWriter.write_encoded`) passes it.
    raw_float_dtype: str | None = None
    #: The working environment becomes the output, renamed into place: no copy at the end. For a writer
    #: whose transactions are the same on every run (a conversion commits one per shard, and rebuilds a
    #: resumed environment from empty), the file is as deterministic as a compacted copy and is written
    #: once; it keeps the few free pages that copy-on-write left. Its SHA-256 is a hash list of
    #: :data:`gpufeed.formats._lmdb_pages.HASH_PART` ranges, hashed in parallel.
    in_place: bool = False


class LMDBWriter(Writer):
    """Writes one environment directory. ``resume=True`` reopens the working environment a crashed writer
    left next to ``path`` and goes on after its last committed record (see :attr:`committed_records`)."""

    def __init__(self, fmt: "LMDBFormat", path: str, resume: bool = False, **options):
        self.format = fmt
        self.path = _require_local(path, "writing Caffe LMDB")
        self.options = WriterOptions(**options)
        self._float_dtype = self.options.raw_float_dtype
        if self._float_dtype not in (None, "float16", "float32"):
            raise ConfigError(f"{path}: raw_float_dtype must be 'float16' or 'float32', not {self._float_dtype!r}")
        if self.options.initial_map_size < (1 << 16) or self.options.batch_records < 1:
            raise ConfigError(f"{path}: initial_map_size must be >= 64 KiB and batch_records >= 1")
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            raise OutputError(f"{parent}: the directory for {os.path.basename(self.path)} does not exist; "
                              "create it first")
        self._work = self._find_working() if resume else None
        fresh = self._work is None
        if fresh:
            self._work = naming.temp_name(self.path)
            os.mkdir(self._work)
        import lmdb

        self._lmdb = lmdb
        self._map_size = self.options.initial_map_size
        # metasync=False: a crash may lose the last batch (resume redoes it) but never damages the file.
        # lock=False in place: the output holds no lock.mdb (one writer, no readers while it writes).
        self._env = lmdb.open(self._work, map_size=self._map_size, subdir=True, max_dbs=0, readahead=False,
                              metasync=False, lock=not self.options.in_place)
        self._map_size = self._env.info()["map_size"]
        self._crc = array.array("I")
        self._sizes = array.array("Q")
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._data_bytes = 0
        self._grows = 0
        self._last_index = -1
        self._last_key = b""
        self._committed_key = b""
        self._final_tmp = None
        self._closed = False
        self._final_stats = None
        try:
            if fresh:
                self._write_work_sidecar()
            else:
                self._recover()
        except OSError as e:
            if fresh:
                self.abort()
            else:  # the working environment stays, for the next resume
                self._closed = True
                self._env.close()
            raise OutputError(f"{self.path}: cannot be written ({e.strerror or e}); {write_fix(self.path, e)}, "
                              "then write it again") from e

    def _find_working(self) -> str | None:
        """The most recent working environment of a crashed writer for the same target, if any."""
        head, tail = os.path.split(self.path)
        found = []
        for cand in glob.glob(os.path.join(glob.escape(head), f".{glob.escape(tail)}.tmp-*")):
            meta = _read_sidecar(cand) if os.path.isdir(cand) else None
            if meta and meta.get("state") == "writing" and os.path.exists(os.path.join(cand, DATA)):
                found.append((os.path.getmtime(os.path.join(cand, DATA)), cand))
        found.sort()
        for _, stale in found[:-1]:
            shutil.rmtree(stale, ignore_errors=True)
        return found[-1][1] if found else None

    def _write_work_sidecar(self):
        with open(os.path.join(self._work, SIDECAR), "w") as f:
            json.dump({"format": "caffe-lmdb", "version": VERSION, "state": "writing",
                       "target": os.path.basename(self.path)}, f)

    def _recover(self):
        """Reload what a resumed writer needs: last key, sizes, and the CRCs its batches saved (any tail a
        crash left unsaved is recomputed from the values)."""
        path = os.path.join(self._work, CHECKSUMS)
        saved = np.fromfile(path, _CHECK_DTYPE) if os.path.exists(path) else np.zeros(0, _CHECK_DTYPE)
        with self._env.begin(buffers=True) as txn:
            for i, (key, value) in enumerate(txn.cursor()):
                # len() of a buffer reads only the node header, not the value's pages.
                self._data_bytes += len(key) + len(value)
                self._crc.append(int(saved["crc"][i]) if i < saved.size else record_check(key, value))
                self._sizes.append(len(value))
                self._last_key = key
            self._last_key = bytes(self._last_key)
        self._committed_key = self._last_key
        if self._last_key:
            index, _ = split_key(self._last_key)
            self._last_index = index if index is not None else len(self._crc) - 1
        self._save_crcs(truncate=True)

    def _save_crcs(self, truncate: bool = False):
        """Persist the committed records' CRCs in the working directory, so a resume need not reread values."""
        path = os.path.join(self._work, CHECKSUMS)
        done = self.committed_records
        with open(path, "r+b" if os.path.exists(path) else "wb") as f:
            start = 0 if truncate else f.seek(0, os.SEEK_END) // _CHECK_DTYPE.itemsize
            f.seek(start * _CHECK_DTYPE.itemsize)
            f.write(self._checks(start, done).tobytes())
            f.truncate()

    def _checks(self, start: int, stop: int) -> np.ndarray:
        checks = np.empty(max(stop - start, 0), _CHECK_DTYPE)
        checks["crc"] = self._crc[start:stop]
        checks["size"] = self._sizes[start:stop]
        return checks

    @property
    def committed_records(self) -> int:
        """Records durably committed so far (after ``resume=True``: what the crashed writer had committed)."""
        return len(self._crc) - len(self._pending)

    @property
    def last_committed_key(self) -> bytes | None:
        """The key of the last committed record (``%08d_<path>``), or ``None`` before the first commit."""
        return self._committed_key or None

    def write(self, sample: Sample) -> None:
        if sample.kind == "raw":
            dtype = np.asarray(sample.payload).dtype
            if dtype.kind == "f":
                if self._float_dtype not in (None, dtype.name):
                    raise ConfigError(f"{self.path}: sample {sample.key!r} has {dtype.name} pixels after "
                                      f"{self._float_dtype} ones; one LMDB holds one pixel dtype")
                self._float_dtype = dtype.name
        super().write(sample)

    def write_encoded(self, record: EncodedRecord) -> None:
        if self._closed:
            raise ConfigError(f"{self.path}: the writer is closed")
        if record.index <= self._last_index or record.key <= self._last_key:
            raise ConfigError(f"{self.path}: record {record.key!r} comes after index {self._last_index}; "
                              "LMDB records must be written in increasing index order so keys sort as written")
        self.write_checked(((record.key, record.value, record_check(record.key, record.value)),))
        self._last_index = record.index
        if len(self._pending) >= self.options.batch_records or self._pending_bytes >= self.options.batch_bytes:
            self._commit()

    def write_checked(self, records) -> None:
        """Add ``(key, value, check)`` records whose :func:`record_check` the caller has verified already
        (a conversion's spool carries it from the worker that encoded them), in increasing key order; they
        are committed with the next :meth:`flush`. ``key`` is bytes; ``value`` may be a buffer (a memoryview
        of a spool) that stays valid until then."""
        if self._closed:
            raise ConfigError(f"{self.path}: the writer is closed")
        last = self._last_key
        pending, crcs, sizes = self._pending, self._crc, self._sizes
        nbytes = 0
        for key, value, check in records:
            if key <= last:
                raise ConfigError(f"{self.path}: record {key!r} comes after {last!r}; LMDB records "
                                  "must be written in increasing key order")
            last = key
            pending.append((key, value))
            crcs.append(check)
            sizes.append(len(value))
            nbytes += len(key) + len(value)
        if pending:
            self._last_key = last
            index, _ = split_key(last)
            if index is not None:
                self._last_index = index
            self._pending_bytes += nbytes

    def flush(self) -> None:
        """Commit the records written so far in one transaction (callers that choose their own transaction
        boundaries, such as a conversion's shards, pass huge ``batch_records``/``batch_bytes``)."""
        if self._closed:
            raise ConfigError(f"{self.path}: the writer is closed")
        self._commit()

    def release(self) -> None:
        """Close the environment without committing pending records, keeping the working environment for a
        later ``resume`` or rebuild (unlike :meth:`abort`, which removes it)."""
        if not self._closed:
            self._closed = True
            self._env.close()

    def _commit(self):
        if not self._pending:
            return
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    # One call: the loop over records runs in py-lmdb's C code.
                    _, added = txn.cursor().putmulti(self._pending, append=True)
                    if added != len(self._pending):
                        raise OutputError(f"{self.path}: LMDB took {added} of {len(self._pending)} records "
                                          "(keys not in increasing order?)")
                break
            except self._lmdb.MapFullError:
                # The transaction was aborted whole: double the map (as Caffe does) and redo the batch.
                self._map_size *= 2
                self._grows += 1
                self._env.set_mapsize(self._map_size)
        self._committed_key = bytes(self._pending[-1][0])
        self._data_bytes += self._pending_bytes
        # LMDB writes through its own pwrite/mmap, not gpufeed.io: tell tier emulation what it wrote.
        gio.charge(self._pending_bytes, write=True)
        self._pending.clear()
        self._pending_bytes = 0
        self._save_crcs()

    @property
    def stats(self) -> dict:
        """Map size vs data size: the map the working environment grew to (``map_size``, after ``map_grows``
        doublings), the key+value bytes (``data_bytes``) and, after :meth:`close`, the final ``file_bytes``."""
        if self._final_stats is not None:
            return dict(self._final_stats)
        work = os.path.join(self._work, DATA)
        return {"records": len(self._crc), "data_bytes": self._data_bytes, "map_size": self._map_size,
                "map_grows": self._grows,
                "working_file_bytes": os.path.getsize(work) if os.path.exists(work) else None}

    def close(self) -> list[WrittenFile]:
        if self._closed:
            raise ConfigError(f"{self.path}: the writer is already closed")
        try:
            self._commit()
            stats = self.stats
            psize = self._env.stat()["psize"]
            if self.options.in_place:
                directory = self._work
                self._env.close()
                pages, parts = _lmdb_pages.scan_in_place(os.path.join(directory, DATA), psize, fsync=True)
                digest = None
            else:
                directory = self._final_tmp = naming.temp_name(self.path)
                os.mkdir(directory)
                # The meta page records the map size; tie it to the data, not to the growth history.
                self._env.set_mapsize(max(self._env.info()["last_pgno"] + 1, 1) * psize)
                if self.options.compact:
                    pages, digest = _lmdb_pages.copy_compacted(self._env, os.path.join(directory, DATA), psize)
                else:
                    self._env.copy(directory)
                    pages, digest = None, None
                parts = None
                self._env.close()
                with open(os.path.join(directory, DATA), "rb+") as f:
                    os.fsync(f.fileno())
            stats["file_bytes"] = os.path.getsize(os.path.join(directory, DATA))
            if not self.options.in_place:  # the in-place commits were charged as they were written
                gio.charge(stats["file_bytes"], write=True)
            self._write_side_files(directory, psize, pages, stats)
            self._replace(directory)
            if not self.options.in_place:
                shutil.rmtree(self._work, ignore_errors=True)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise OutputError(f"{self.path}: could not finish the LMDB ({e}); check free disk space") from e
            raise
        self._closed = True
        self._final_stats = stats
        from gpufeed.formats.base import parts_digest

        data = (self._written(DATA, "data", len(self._crc), parts_digest(parts), tuple(parts)) if parts
                else self._written(DATA, "data", len(self._crc), digest))
        side = [OFFSETS] + ([PAGES] if pages is not None else [])
        return ([data, self._written(CHECKSUMS, "sidecar", len(self._crc))]
                + [self._written(name, "sidecar", 0) for name in side + [SIDECAR]])

    def _write_side_files(self, directory: str, psize: int, pages, stats: dict) -> None:
        """The value CRCs, the page CRCs (when the pages were walked) and the sidecar of a finished output."""
        with open(os.path.join(directory, CHECKSUMS), "wb") as f:
            f.write(self._checks(0, len(self._crc)).tobytes())
        sidecar = {"format": "caffe-lmdb", "version": VERSION, "state": "complete",
                   "records": len(self._crc), "checksums": CHECKSUMS, "key_format": "%08d_<relative path>",
                   "page_size": psize, "options": dataclasses.asdict(self.options),
                   "raw_float_dtype": self._float_dtype, "stats": stats}
        offsets = _lmdb_pages.value_offsets(os.path.join(directory, DATA), psize, len(self._crc))
        with open(os.path.join(directory, OFFSETS), "wb") as f:
            f.write(offsets.astype("<u8").tobytes())
        sidecar["offsets"] = OFFSETS
        if pages is not None:
            with open(os.path.join(directory, PAGES), "wb") as f:
                f.write(pages.tobytes())
            sidecar["pages"] = PAGES
        with open(os.path.join(directory, SIDECAR), "w") as f:
            json.dump(sidecar, f, indent=1, sort_keys=True)

    def _written(self, name, role, records, digest=None, parts=()):
        p = os.path.join(self.path, name)
        return WrittenFile(p, records, os.path.getsize(p), digest or _sha256(p), role, parts)

    def _replace(self, new_dir: str):
        replace_dir(new_dir, self.path)

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._env.close()
        finally:
            for d in (self._work, self._final_tmp):
                if d:
                    shutil.rmtree(d, ignore_errors=True)


#: (path, device, inode of data.mdb) -> [environment, users] for this process. py-lmdb refuses to open one
#: environment twice in a process, and readers of the same output (a dataset and a verifier) must coexist;
#: the inode tells a rewritten output from the one already mapped.
_ENVS: dict[str, list] = {}
_ENVS_PID = None


def _shared_env(path: str, before_open=None, readahead: bool = False):
    global _ENVS_PID
    if _ENVS_PID != os.getpid():
        # Inherited through fork: unusable here (LMDB forbids it), so close our copies and start afresh.
        for env, _ in _ENVS.values():
            env.close()
        _ENVS.clear()
        _ENVS_PID = os.getpid()
    st = os.stat(os.path.join(path, DATA))
    key = (path, st.st_dev, st.st_ino, readahead)
    entry = _ENVS.get(key)
    if entry is None:
        import lmdb

        if before_open is not None:
            before_open()
        env = lmdb.open(path, readonly=True, lock=False, readahead=readahead, subdir=True, max_readers=4096,
                        max_dbs=0)
        entry = _ENVS[key] = [env, 0]
    entry[1] += 1
    return key, entry[0]


def _release_env(key) -> None:
    entry = _ENVS.get(key)
    if entry is not None and _ENVS_PID == os.getpid():
        entry[1] -= 1
        if entry[1] <= 0:
            del _ENVS[key]
            entry[0].close()


#: Serialises opening readers (rare, and an environment may be opened once per process).
_OPEN_LOCK = threading.Lock()


class LMDBReader(Reader):
    """Reads an environment directory written by gpufeed or by Caffe's ``convert_imageset``.

    Opens on first use in each process (read-only, no lock file), so the reader can be built in
    a parent and used in forked or spawned DataLoader workers. Record ``i`` is the ``i``-th key in key order;
    when keys carry the ``%08d_`` prefixes ``0..n-1`` it is found by a B-tree seek on ``%08d_`` % i, with no
    key list in memory (1.28 M ImageNet keys would cost ~100 MB in every worker); otherwise the keys are
    listed once per process.

    Values are read with one ``pread`` of their byte range where the output lists them (:data:`OFFSETS`,
    gpufeed's LMDBs): a cold 110 KB value is one read, not ~27 dependent page faults, and the kernel's
    readahead serves sequential scans. Otherwise (Caffe's LMDBs) :meth:`read_raw` and :meth:`iter_raw`
    return ``memoryview`` slices of the memory map, valid until :meth:`close`. Decoded samples own their
    bytes.
    """

    #: ``readahead`` is off by default: with it on, a page fault reads ``read_ahead_kb`` around it (8 MiB on
    #: some hosts), so random access to 110 KB values reads ~70x the bytes it needs. With it off, a value
    #: spanning several pages is read one dependent 4 KiB fault at a time, which costs on high-latency disks.
    #: Turn it on for sequential scans on a disk with a modest readahead window (what Caffe does).
    def __init__(self, path: str, verify: bool = True, readahead: bool = False):
        self.path = _require_local(path, "reading Caffe LMDB")
        if os.path.basename(self.path) in (DATA, "lock.mdb") and os.path.isfile(self.path):
            raise ConfigError(f"{path} is a file inside an LMDB; an LMDB is read (as Caffe and DALI read it) "
                              f"from its folder, {os.path.dirname(path)}")
        self.readahead = readahead
        self.data_path = os.path.join(self.path, DATA)
        require_output(self.data_path, "run `gpufeed convert` to create the LMDB, or check the path")
        self.meta = _read_sidecar(self.path)
        if self.meta and self.meta.get("state") != "complete":
            raise IncompleteOutputError(f"{self.path}: an unfinished LMDB; rerun the conversion with --resume")
        self.verify = verify
        self._float_dtype = (self.meta or {}).get("raw_float_dtype")
        self._pid = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k in ("path", "data_path", "meta", "verify", "_float_dtype",
                                                                    "readahead")} | {
            "_pid": None}

    def _open(self):
        if self._pid == os.getpid():
            return
        with _OPEN_LOCK:  # threads reading a fresh reader at once open it once
            if self._pid != os.getpid():
                self._open_once()

    def _open_once(self):
        import lmdb

        self._errors = lmdb.Error
        try:
            self._env_key, env = _shared_env(self.path, self._before_open, self.readahead)
        except lmdb.Error as e:
            raise CorruptRecordError(self.data_path, None, None, f"LMDB cannot open it ({e})") from e
        try:
            self._txn = env.begin(buffers=True)
            self._cursor = self._txn.cursor()
            self._env, self._owner = env, threading.get_ident()
            self._local, self._thread_txns, self._txn_lock = threading.local(), [], threading.Lock()
            self._check_environment(env)
        except BaseException as e:
            txn = self.__dict__.pop("_txn", None)
            if txn is not None:
                txn.abort()
            self.__dict__.pop("_cursor", None)
            _release_env(self._env_key)
            if isinstance(e, lmdb.Error):
                raise CorruptRecordError(self.data_path, None, None, f"LMDB error ({e})") from e
            raise
        self._pid = os.getpid()

    def _before_open(self) -> None:
        """Checks that must pass before LMDB maps the file: its size, and its B-tree pages' CRCs."""
        size = os.path.getsize(self.data_path)
        expected = (self.meta or {}).get("stats", {}).get("file_bytes")
        if expected is not None and size != expected:
            raise CorruptRecordError(self.data_path, None, min(size, expected), f"the file is {size} bytes, "
                                     f"{SIDECAR} says {expected}: it was truncated or damaged")
        if self.verify and self.meta and self.meta.get("pages"):
            _lmdb_pages.verify_pages(os.path.join(self.path, DATA), os.path.join(self.path, self.meta["pages"]),
                                     int(self.meta["page_size"]))

    def _check_environment(self, env) -> None:
        """Sizes, record count and key shape, checked once per process before any record is touched."""
        self._len = env.stat()["entries"]
        used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        size = os.path.getsize(self.data_path)
        # A short file would be mapped past its end, and touching those pages kills the process (SIGBUS).
        if size < used:
            raise CorruptRecordError(self.data_path, None, size, f"the file is {size} bytes but its pages "
                                     f"need {used}: it was truncated")
        self._keys = None
        self._crcs = self._sizes = self._offsets = None
        if self.meta:
            if self.meta.get("records") != self._len:
                raise IncompleteOutputError(f"{self.path}: holds {self._len} records but {SIDECAR} says "
                                            f"{self.meta.get('records')}; rewrite it with `gpufeed convert`")
            checks = self._per_record(self.meta.get("checksums"), _CHECK_DTYPE)
            if checks is not None:
                self._sizes = checks["size"]
                self._crcs = checks["crc"] if self.verify else None
                offsets = self._per_record(self.meta.get("offsets"), np.dtype("<u8"))
                if offsets is not None:
                    self._offsets = offsets
                    self._fd = random_read_fd(self.data_path)
        cur = self._cursor
        self._seekable = self._len == 0 or (
            cur.first() and bytes(cur.key()).startswith(b"%08d_" % 0)
            and cur.last() and bytes(cur.key()).startswith(b"%08d_" % (self._len - 1)))

    def _per_record(self, name: str | None, dtype: np.dtype):
        """A sidecar array of one entry per record, mapped (DataLoader workers share its pages instead of
        each holding ~100 MB of lists for ImageNet), or ``None`` when the output has none."""
        if not name or not self._len:
            return None
        path = os.path.join(self.path, name)
        size = gio.regular_file_size(path, "rewrite it with `gpufeed convert`")
        if size is None:
            raise ShardNotFound(path, "rewrite it with `gpufeed convert`")
        count = size // dtype.itemsize
        if count != self._len:
            raise IncompleteOutputError(f"{self.path}: {name} lists {count} records, the LMDB {self._len}; "
                                        "rewrite it with `gpufeed convert`")
        return np.memmap(path, dtype, mode="r", shape=(count,)).view(np.ndarray)

    def prefetch(self, indices) -> int:
        """Read-ahead of the values' byte ranges where the output lists them (:data:`OFFSETS`); the B-tree pages
        that lead to them are still read as each lookup touches them."""
        self._open()
        if self._offsets is None:
            return 0
        return advise_will_need(self._fd, ((self._offsets[i], self._sizes[i])
                                           for i in (position(i, self._len, self.path) for i in indices)))

    def _pread_value(self, i: int) -> bytes:
        """Record ``i``'s value in one read of its byte range (see :data:`OFFSETS`), charged to an emulated
        tier as one request, as the other formats' reads are."""
        size, offset = int(self._sizes[i]), int(self._offsets[i])
        throttle = gio.throttle()
        t0 = throttle.start() if throttle is not None else None
        value = os.pread(self._fd, size, offset)
        if throttle is not None:
            throttle.read_done(len(value), t0)
        if len(value) != size:
            raise CorruptRecordError(self.data_path, i, offset, f"the file ends inside the value ({len(value)} "
                                     f"of {size} bytes): it was truncated")
        return value

    def __len__(self) -> int:
        self._open()
        return self._len

    def _txn_cursor(self):
        """This thread's read transaction and cursor: a cursor moves, so threads reading at once each need
        their own (the thread that opened the reader uses the first)."""
        if threading.get_ident() == self._owner:
            return self._txn, self._cursor
        local = self._local
        if getattr(local, "cursor", None) is None:
            local.txn = self._env.begin(buffers=True)
            local.cursor = local.txn.cursor()
            with self._txn_lock:
                self._thread_txns.append(local.txn)
        return local.txn, local.cursor

    def _key_value(self, i: int):
        self._open()
        i = position(i, self._len, self.path)
        txn, cur = self._txn_cursor()
        try:
            if not self._seekable and self._keys is None:
                self._keys = self._list_keys()
            if self._seekable or isinstance(self._keys, np.ndarray):
                prefix = b"%08d_" % (i if self._seekable else self._keys[i])
                if not cur.set_range(prefix) or not bytes(cur.key()[:len(prefix)]) == prefix:
                    raise CorruptRecordError(self.data_path, i, None, f"no key with prefix {prefix!r}")
                key = cur.key()  # the leaf page only; the value is read below
                value = self._pread_value(i) if self._offsets is not None else cur.value()
            else:
                key = self._keys[i]
                value = self._pread_value(i) if self._offsets is not None else txn.get(key)
        except self._errors as e:
            raise CorruptRecordError(self.data_path, i, None, f"LMDB error ({e})") from e
        if self._offsets is None:  # read through the map: charged its page faults
            gio.charge(len(value))
        if self._crcs is not None:
            self._verify(i, key, value)
        return key, value

    def _list_keys(self):
        """Position -> key for an environment whose prefixes are not exactly ``0..n-1`` (Caffe skips the
        lines it cannot read): the prefixes as an int array when every key has one (8 bytes a record),
        else the keys themselves."""
        keys = [bytes(k) for k in self._txn.cursor().iternext(keys=True, values=False)]
        heads = [k[:KEY_DIGITS] for k in keys]
        if all(h.isdigit() and k[KEY_DIGITS:KEY_DIGITS + 1] == b"_" for h, k in zip(heads, keys)):
            return np.array([int(h) for h in heads], np.int64)
        return keys

    def _verify(self, i: int, key, value) -> None:
        if len(value) != self._sizes[i]:
            raise CorruptRecordError(self.data_path, i, None, f"value of {len(value)} bytes where {CHECKSUMS} "
                                     f"says {self._sizes[i]}")
        if record_check(key, value) != self._crcs[i]:
            raise CorruptRecordError(self.data_path, i, None, f"CRC-32C of key and value does not match "
                                     f"{CHECKSUMS}")

    def read_raw(self, i: int) -> memoryview:
        return self._key_value(i)[1]

    def __getitem__(self, i: int) -> Sample:
        key, value = self._key_value(i)
        return decode_datum(bytes(key), value, self.data_path, i % self._len, float_dtype=self._float_dtype)

    def _scan(self) -> Iterator[tuple[int, memoryview, memoryview]]:
        self._open()
        # The per-record work is inlined: at 3 KB a record, a function call costs as much as the CRC.
        verify, crc = self._crcs is not None, _crc.function()
        throttle = gio.throttle() if self._offsets is None else None  # preads charge themselves
        i = base = 0
        crcs = sizes = ()
        pairs = (((key, self._pread_value(k)) for k, key in enumerate(self._txn.cursor().iternext(values=False)))
                 if self._offsets is not None else self._txn.cursor())
        try:
            for key, value in pairs:
                n = len(value)
                if throttle is not None:
                    throttle.charge(n)
                if verify:
                    if i - base >= len(crcs):
                        # Expected values in plain lists, a slice at a time: indexing numpy per record is slower.
                        base = i
                        crcs = self._crcs[i:i + _SCAN_CHUNK].tolist()
                        sizes = self._sizes[i:i + _SCAN_CHUNK].tolist()
                    if n != sizes[i - base] or crc(value, crc(key)) != crcs[i - base]:
                        self._verify(i, key, value)
                yield i, key, value
                i += 1
        except self._errors as e:
            raise CorruptRecordError(self.data_path, i, None, f"LMDB error ({e})") from e

    def iter_raw(self) -> Iterator[memoryview]:
        for _, _, value in self._scan():
            yield value

    def __iter__(self) -> Iterator[Sample]:
        for i, key, value in self._scan():
            yield decode_datum(bytes(key), value, self.data_path, i, float_dtype=self._float_dtype)

    def close(self) -> None:
        txn = self.__dict__.pop("_txn", None)
        self.__dict__.pop("_cursor", None)
        self.__dict__.pop("_env", None)
        others = self.__dict__.pop("_thread_txns", [])
        # A transaction opened in a parent process is not ours to end (LMDB forbids it after fork).
        if txn is not None and self._pid == os.getpid():
            for other in others:
                other.abort()
            txn.abort()
            _release_env(self._env_key)
        fd = self.__dict__.pop("_fd", None)
        if fd is not None and self._pid == os.getpid():
            os.close(fd)
        self._pid = None


class LMDBFormat(Format):
    name = "lmdb"
    indexed = True
    #: One environment per split (``<split>_lmdb``), as Caffe's tools make.
    layout = PER_SPLIT
    local_only = True
    #: A transaction (an fsync) per shard, its free pages in the file.
    commits_per_shard = True

    def reader_path(self, relpath: str) -> str:
        return relpath.rsplit("/", 1)[0]

    def data_file(self, output: str) -> str:
        return os.path.join(output, "data.mdb")

    #: Caffe's convert_cifar_data stores raw pixel Datums.
    cifar_encode = "raw"

    def claims(self, path: str) -> bool:
        return os.path.isdir(path) and os.path.exists(os.path.join(path, "data.mdb"))

    def assembler(self):
        from gpufeed.formats.assembly import LmdbSink

        return LmdbSink

    def part_of(self, path: str) -> str | None:
        return os.path.dirname(path) if os.path.basename(path) in ("data.mdb", "lock.mdb") else None

    def output_path(self, out: str, split: str, shard: int = 0, count: int = 1) -> str:
        return gio.join(out, self.name, f"{split}_lmdb")

    def parse_output(self, relpath: str) -> str | None:
        head, _, name = relpath.partition("/")
        env = name.split("/")[0]
        return env[:-len("_lmdb")] if head == self.name and env.endswith("_lmdb") else None

    def owned_split(self, relpath: str) -> str | None:
        """An environment's directory, or one of the files the writer puts in it (LMDB's own lock file too)."""
        head, _, rest = relpath.partition("/")
        env, _, name = rest.partition("/")
        split = self.parse_output(f"{head}/{env}")
        if split is None or "/" in name or (name and name not in (*_OUTPUT_FILES, LOCK)):
            return None
        return split

    def encode(self, sample: Sample) -> EncodedRecord:
        return EncodedRecord(make_key(sample.index, sample.key), encode_datum(sample), sample.index, sample.key,
                             sample.labels)

    def decode(self, key: bytes, value: bytes, path: str = "?", record_index: int | None = None,
               byte_offset: int | None = None) -> Sample:
        return decode_datum(key, value, path, record_index, byte_offset)

    def writer(self, path: str, **options) -> LMDBWriter:
        """``options``: ``resume``, ``initial_map_size``, ``batch_records``, ``batch_bytes``, ``compact``."""
        return LMDBWriter(self, path, **options)

    def reader(self, path: str, **options) -> LMDBReader:
        """``options``: ``verify`` (check each value's CRC-32C against ``gpufeed.crc32c``; default True)."""
        return LMDBReader(path, **options)

    def output_files(self, path: str) -> list[str]:
        return [os.path.join(path, name) for name in _OUTPUT_FILES]
