"""MXNet RecordIO: ``.rec`` records in dmlc framing, with the ``.idx`` and ``.lst`` that MXNet and DALI read.

The framing is written here by hand rather than through a library: mxnet 1.9.1 (the last release) cannot be
imported with numpy >= 1.24, and no maintained library implements dmlc's record framing, so the few lines of
``dmlc-core/src/recordio.cc`` it takes are reproduced below from the specification in FORMATS.md.

One record on disk is one or more *parts*: ``u32 magic, u32 lrec, bytes, zero padding to 4``, with
``lrec = cflag << 29 | length``. A payload holding the magic word at a 4-byte-aligned offset is split there
(cflag 1 first, 2 middle, 3 last) and the magic is dropped; readers put it back. Splitting is required because
tools that cut a ``.rec`` into chunks find record starts by scanning aligned words for the magic.

A record's value is an IRHeader (``<IfQQ``: flag, label, id, id2) and then the payload: image bytes (JPEG/PNG),
raw HWC pixels, or little-endian int32 token ids. ``flag = k > 0`` means k float32 labels follow the header
and ``label`` is 0. ``id`` is the sample's index, also its ``.idx`` key and its ``.lst`` number, as im2rec does.
gpufeed puts a CRC-32C of the whole value (computed with ``id2`` zero) in ``id2``, which MXNet and DALI leave
unused: RecordIO has no checksum of its own, and without one a flipped byte in an image would be read as a
different, wrong image. The ``<stem>.rec.json`` sidecar says so, along with the payload kind, the raw-pixel
shape and dtype, the record count, the gpufeed version and the writer's parameters; files made by other tools
(no sidecar) are read as encoded images without the CRC check.
"""

from __future__ import annotations

import dataclasses
import collections
import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from gpufeed.formats import _crc
import numpy as np

import gpufeed
from gpufeed import io
from gpufeed.errors import ConfigError, CorruptRecordError, InputError, RecordTooLargeError, ShardNotFound
from gpufeed.formats.atomic import AtomicFile, commit_all, exists
from gpufeed.formats._filebytes import ByteSource, ViewCursor, position
from gpufeed.formats.base import (PER_SHARD, PER_SPLIT, EncodedRecord, Format, Reader, Sample, WrittenFile, Writer,
                                  label_key, require_output)

#: dmlc's ``RecordIOWriter::kMagic``; little-endian on disk like every other field.
MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_MAGIC_WORD = np.dtype("<u4")
#: A part header: magic, then ``lrec`` = continuation flag in the top 3 bits and the length in the low 29.
_PART = struct.Struct("<II")
_LENGTH_BITS = 29
_LENGTH_MASK = (1 << _LENGTH_BITS) - 1
#: dmlc refuses records of 2**29 bytes or more rather than splitting them (the length field has 29 bits).
MAX_RECORD = (1 << _LENGTH_BITS) - 1
#: cflag values: whole record, first / middle / last part of a record split at an escaped magic word.
_WHOLE, _FIRST, _MIDDLE, _LAST = 0, 1, 2, 3
#: mxnet.recordio's IRHeader (``_IR_FORMAT = 'IfQQ'``, native = little-endian with no padding on x86/ARM).
IRHEADER = struct.Struct("<IfQQ")
_ID2_OFFSET = 16
_ZERO_ID2 = bytes(8)
_ID2 = struct.Struct("<Q")
_ZEROS = bytes(4)

_SIDECAR_FORMAT = "gpufeed.recordio"
_SIDECAR_VERSION = 1
#: What ``checksum`` in the sidecar means: id2 = CRC-32C of the value with id2 set to 0.
_CHECKSUM = "crc32c-id2"
_DTYPES = ("uint8", "float16", "float32")


@dataclass(frozen=True)
class Layout:
    """What a ``.rec``'s payloads are, from its sidecar (or the im2rec defaults when there is none)."""

    kind: str = "encoded"
    shape: tuple | None = None
    dtype: str | None = None
    checksum: bool = False
    records: int | None = None
    #: SHA-256 of the ``.idx`` and ``.lst`` as written ("idx", "lst"); readers check them before trusting either.
    sha256: dict | None = None


_IM2REC = Layout()


def index_path(path: str) -> str:
    return (path[:-4] if path.endswith(".rec") else path) + ".idx"


def list_path(path: str) -> str:
    return (path[:-4] if path.endswith(".rec") else path) + ".lst"


def sidecar_path(path: str) -> str:
    return path + ".json"


def frame_parts(value: bytes) -> list:
    """The byte strings that make up ``value`` framed as one record (parts, escaping, padding)."""
    n = len(value)
    if n > MAX_RECORD:
        raise RecordTooLargeError("?", n, MAX_RECORD, "RecordIO cannot hold it: store the image smaller")
    view = memoryview(value)
    out = []
    start = 0
    # dmlc splits a record only where the magic word sits at a 4-byte-aligned offset: one vectorised compare
    # of the aligned words (~10x bytes.find, which also stops at every unaligned match).
    for hit in np.flatnonzero(np.frombuffer(value, _MAGIC_WORD, n >> 2) == MAGIC).tolist():
        hit <<= 2
        out.append(_PART.pack(MAGIC, (_FIRST if start == 0 else _MIDDLE) << _LENGTH_BITS | (hit - start)))
        out.append(view[start:hit])
        start = hit + 4
    out.append(_PART.pack(MAGIC, (_LAST if start else _WHOLE) << _LENGTH_BITS | (n - start)))
    out.append(view[start:])
    if n & 3:
        out.append(bytes(4 - (n & 3)))
    return out


def frame(value: bytes) -> bytes:
    """``value`` framed as one dmlc record, exactly as ``MXRecordIO.write`` would put it on disk."""
    return b"".join(frame_parts(value))


def _checksum(value) -> int:
    return _crc.crc32c(value[IRHEADER.size:], _crc.crc32c(_ZERO_ID2, _crc.crc32c(value[:_ID2_OFFSET])))


def _scan(cur, path: str, first_index: int = 0, limit: int | None = None) -> Iterator[tuple[int, int, object]]:
    """``(record_index, byte_offset, value)`` for each record from the cursor, checking the framing."""
    i = first_index
    read = cur.read
    while limit is None or i < first_index + limit:
        offset = cur.pos
        head = read(8)
        if len(head) < 8:
            if len(head):
                raise CorruptRecordError(path, i, offset, f"file ends {len(head)} bytes into a record header")
            return
        magic, lrec = _PART.unpack(head)
        if magic != MAGIC:
            raise CorruptRecordError(path, i, offset, f"expected the RecordIO magic 0x{MAGIC:08x}, found "
                                                      f"0x{magic:08x}")
        cflag, n = lrec >> _LENGTH_BITS, lrec & _LENGTH_MASK
        if cflag == _WHOLE:
            value = _read_body(cur, path, i, offset, n)
        elif cflag == _FIRST:
            parts = [_read_body(cur, path, i, offset, n, aligned=True)]
            while True:
                part_at = cur.pos
                head = read(8)
                if len(head) < 8:
                    raise CorruptRecordError(path, i, offset, "file ends inside a record split into parts")
                magic, lrec = _PART.unpack(head)
                cflag, n = lrec >> _LENGTH_BITS, lrec & _LENGTH_MASK
                if magic != MAGIC or cflag not in (_MIDDLE, _LAST):
                    raise CorruptRecordError(path, i, offset, f"the part at byte {part_at} does not continue "
                                                              "the record split before it")
                parts.append(_read_body(cur, path, i, offset, n, aligned=cflag == _MIDDLE))
                if cflag == _LAST:
                    break
            value = _MAGIC_BYTES.join(parts)
            if len(value) > MAX_RECORD:
                raise CorruptRecordError(path, i, offset, "parts add up to more than a record can hold")
        else:
            raise CorruptRecordError(path, i, offset, f"continuation flag {cflag} where a record must start")
        yield i, offset, value
        i += 1


#: Bytes read first for a record whose extent the index cannot bound (the last one, or an index out of file
#: order), and the most read first for any record: the rest comes with one more read.
_LAST_EXTENT = 256 << 10
_MAX_EXTENT = 16 << 20


def _extent_hint(offsets, i: int) -> int:
    """Bytes from record ``i``'s offset to the next record's: its frame(s) in a file written in index order."""
    if i + 1 < len(offsets) and offsets[i + 1] > offsets[i]:
        return min(offsets[i + 1] - offsets[i], _MAX_EXTENT)
    return _LAST_EXTENT


def _check_value(value, path, i, offset) -> None:
    if len(value) < IRHEADER.size:
        raise CorruptRecordError(path, i, offset, f"a {len(value)}-byte record is shorter than the 24-byte IRHeader")
    if _checksum(value) != IRHEADER.unpack_from(value)[3]:
        raise CorruptRecordError(path, i, offset, "CRC-32C in the IRHeader's id2 does not match the record")


def _count_check(path, count, expected) -> None:
    if expected is not None and count != expected:
        raise CorruptRecordError(path, count, None, f"the file holds {count} records but should hold {expected} "
                                                    "(truncated?)")


def _scan_checked(records, path, checksum: bool, expected: int | None):
    """Records from :func:`_scan` with the CRC in id2 checked and the record count compared at the end."""
    count = 0
    for i, offset, value in records:
        if checksum:
            _check_value(value, path, i, offset)
        count += 1
        yield i, offset, value
    _count_check(path, count, expected)


def _scan_view(mv, path, checksum: bool = False, expected: int | None = None):
    """:func:`_scan_checked` over a whole memory-mapped file, as one tight loop over offsets for unsplit records
    (the common case): per-record Python overhead decides how many small records a second a reader delivers,
    and values are zero-copy slices of the map, so the CRC is the only pass over their bytes."""
    unpack_from, crc, size = _PART.unpack_from, _crc.function(), len(mv)
    head, id2_at, zero_id2 = IRHEADER.size, _ID2_OFFSET, _ZERO_ID2
    pos = i = 0
    while pos < size:
        if pos + 8 > size:
            raise CorruptRecordError(path, i, pos, f"file ends {size - pos} bytes into a record header")
        magic, lrec = unpack_from(mv, pos)
        if magic != MAGIC or lrec >> _LENGTH_BITS:
            # A bad magic or a split record: the general scanner reports or reassembles it.
            for rec in _scan_checked(_scan(ViewCursor(mv, pos), path, i, 1), path, checksum, None):
                yield rec
                i, pos = i + 1, _end_of_record(mv, pos)
            continue
        start = pos + 8
        end = start + lrec
        padded = (end + 3) & ~3
        if padded > size:
            raise CorruptRecordError(path, i, pos, f"the record says {lrec} bytes but the file ends "
                                                   f"{size - start} bytes later (truncated?)")
        if padded != end and mv[end:padded] != _ZEROS[:padded - end]:
            raise CorruptRecordError(path, i, pos, "padding after the record is not zero bytes")
        if checksum:
            if lrec < head:
                raise CorruptRecordError(path, i, pos, f"a {lrec}-byte record is shorter than the IRHeader")
            if crc(mv[start + head:end], crc(zero_id2, crc(mv[start:start + id2_at]))) != \
                    _ID2.unpack_from(mv, start + id2_at)[0]:
                raise CorruptRecordError(path, i, pos, "CRC-32C in the IRHeader's id2 does not match the record")
        yield i, pos, mv[start:end]
        pos = padded
        i += 1
    _count_check(path, i, expected)


def _end_of_record(mv, pos: int) -> int:
    """Offset just past the (possibly split) record starting at ``pos``, already checked by :func:`_scan`."""
    while True:
        lrec = _PART.unpack_from(mv, pos)[1]
        pos += 8 + ((lrec & _LENGTH_MASK) + 3 & ~3)
        if lrec >> _LENGTH_BITS in (_WHOLE, _LAST):
            return pos


def _read_body(cur, path, i, offset, n, aligned=False):
    if aligned and n & 3:
        raise CorruptRecordError(path, i, offset, f"a split part of {n} bytes is not a multiple of 4")
    remaining = cur.remaining()
    if remaining is not None and n > remaining:
        raise CorruptRecordError(path, i, offset, f"the record says {n} bytes but the file ends "
                                                  f"{remaining} bytes later (truncated?)")
    body = cur.read(n)
    if len(body) < n:
        raise CorruptRecordError(path, i, offset, "file ends inside the record (truncated?)")
    pad = -n & 3
    if pad and cur.read(pad) != bytes(pad):
        raise CorruptRecordError(path, i, offset, "padding after the record is not zero bytes")
    return body


class RecordIOFormat(Format):
    """``single=True`` (what im2rec writes, the default): a conversion writes one ``<split>.rec`` per split;
    ``single=False``: one ``.rec`` per shard (``convert --shards``)."""

    name = "recordio"
    indexed = True

    def __init__(self, single: bool = True):
        self.single = bool(single)
        self.layout = PER_SPLIT if self.single else PER_SHARD

    side_files = {".idx": ".rec", ".lst": ".rec", ".rec.json": ".rec"}

    @classmethod
    def for_conversion(cls, shards: int | None = None, label_offset: int = 0) -> "RecordIOFormat":
        return cls(single=shards is None)  # im2rec's one .rec per split, unless --shards asks for K

    def claims(self, path: str) -> bool:
        return path.rstrip("/").endswith(".rec")

    def assembler(self):
        from gpufeed.formats.assembly import RecordIOSink

        return RecordIOSink if self.single else None

    def output_path(self, out: str, split: str, shard: int = 0, count: int = 1) -> str:
        from gpufeed.formats.naming import shard_name
        from gpufeed.io import join

        return join(out, self.name, f"{split}.rec" if self.single else shard_name(split, shard, count, ".rec"))

    def parse_output(self, relpath: str) -> str | None:
        from gpufeed.formats.naming import parse_shard_name

        head, _, name = relpath.partition("/")
        if head != self.name or "/" in name or not name.endswith(".rec"):
            return None
        parsed = parse_shard_name(name)
        if parsed:
            return parsed[0] if parsed[3] == ".rec" else None
        return name[:-len(".rec")]

    def listed_labels(self, out: str, relpath: str) -> tuple[str, dict] | None:
        """A ``.lst``'s split and label counts (its lines ``index<TAB>label[<TAB>label...]<TAB>path``)."""
        from gpufeed.io import join

        if not relpath.endswith(".lst"):
            return None
        split = self.parse_output(relpath[:-len(".lst")] + ".rec")
        if split is None:
            return None
        path = join(out, *relpath.split("/"))
        counts = collections.Counter()
        with io.open_file(path, "rb") as f:
            for i, line in enumerate(f.read().decode("utf-8", "surrogateescape").splitlines()):
                fields = line.split("\t")
                try:
                    if len(fields) < 3:
                        raise ValueError(line)
                    counts[label_key(fields[1:-1])] += 1
                except ValueError:
                    raise CorruptRecordError(path, i, None, f"line {i + 1} is not index<TAB>label<TAB>path") from None
        return split, dict(counts)

    def encode(self, sample: Sample) -> EncodedRecord:
        if "\t" in sample.key or "\n" in sample.key:
            # Refused here, not only by the writer: an input error found while encoding is skipped under
            # --on-error skip before any format has written the sample.
            raise InputError(sample.meta.get("source", sample.key), "the name holds a tab or newline, which a .lst "
                             "line cannot", "rename the file, or leave it out with --on-error skip")
        # The record's id (IRHeader id, .idx key, .lst number): an im2rec list's own index where the sample
        # came from one, as im2rec keeps it; else the sample's planned position.
        rid = sample.meta.get("list_index", sample.index)
        if not 0 <= rid < 1 << 64:
            raise InputError(sample.key, f"index {rid} does not fit the IRHeader's unsigned 64-bit id")
        body, shape, dtype = _payload_bytes(sample)
        labels = sample.labels
        if sample.is_multilabel:
            extra = np.asarray(labels, dtype="<f4")
            if not np.array_equal(extra, np.asarray(labels, dtype=np.float64)):
                raise InputError(sample.key, f"labels {labels} are not all exact in float32, which RecordIO "
                                             "stores", "use class indices below 2**24")
            flag, label, extra = len(labels), 0.0, extra.tobytes()
        else:
            flag, label, extra = 0, labels[0], b""
            if float(np.float32(label)) != float(label):
                raise InputError(sample.key, f"label {label} is not exact in float32, which RecordIO stores",
                                 "use class indices below 2**24")
        size = IRHEADER.size + len(extra) + len(body)
        if size > MAX_RECORD:
            raise RecordTooLargeError(sample.key, size, MAX_RECORD,
                                      "RecordIO records must stay under 2**29 bytes: store the image smaller")
        head = IRHEADER.pack(flag, label, rid, 0)
        crc = _crc.crc32c(body, _crc.crc32c(extra, _crc.crc32c(head)))
        value = b"".join((IRHEADER.pack(flag, label, rid, crc), extra, body))
        return EncodedRecord(str(rid).encode(), value, rid, sample.key, tuple(labels),
                             sample.kind, shape, dtype)

    def decode(self, key: bytes, value, path: str = "?", record_index: int | None = None,
               byte_offset: int | None = None, *, layout: Layout = _IM2REC, name: str | None = None) -> Sample:
        """Parse one record value; ``layout`` comes from the file's sidecar (:meth:`RecordIOReader.layout`)."""
        n = len(value)
        if n < IRHEADER.size:
            raise CorruptRecordError(path, record_index, byte_offset, f"a {n}-byte record is shorter than the "
                                                                      "24-byte IRHeader")
        flag, label, id_, id2 = IRHEADER.unpack_from(value)
        if layout.checksum and _checksum(value) != id2:
            raise CorruptRecordError(path, record_index, byte_offset, "CRC-32C in the IRHeader's id2 does not "
                                                                      "match the record")
        start = IRHEADER.size + 4 * flag
        if start > n:
            raise CorruptRecordError(path, record_index, byte_offset, f"IRHeader flag says {flag} labels but "
                                                                      f"the record has {n} bytes")
        if flag:
            lab = tuple(float(x) for x in np.frombuffer(value, "<f4", flag, IRHEADER.size))
        else:
            lab = int(label) if math.isfinite(label) and float(label).is_integer() else float(label)
        body = value[start:]
        kind = layout.kind
        if kind == "encoded":
            payload = bytes(body)
        elif kind == "tokens":
            if len(body) % 4:
                raise CorruptRecordError(path, record_index, byte_offset, f"{len(body)} token bytes are not a "
                                                                          "whole number of int32 ids")
            payload = np.frombuffer(bytes(body), "<i4").astype(np.int32, copy=False)
        else:
            dt = np.dtype(layout.dtype).newbyteorder("<")
            if len(body) != math.prod(layout.shape) * dt.itemsize:
                raise CorruptRecordError(path, record_index, byte_offset, f"{len(body)} pixel bytes do not "
                                                                          f"make the shape {layout.shape} "
                                                                          f"{layout.dtype}")
            payload = np.frombuffer(bytes(body), dt).astype(layout.dtype, copy=False).reshape(layout.shape)
        key_text = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        return Sample(key=name if name is not None else key_text, label=lab, payload=payload, kind=kind,
                      index=id_, meta={})

    def writer(self, path: str, **options) -> "RecordIOWriter":
        return RecordIOWriter(path, **options)

    def reader(self, path: str, **options) -> "RecordIOReader":
        return RecordIOReader(path, **options)

    def output_files(self, path: str) -> list[str]:
        return [path, index_path(path), list_path(path), sidecar_path(path)]


def _payload_bytes(sample: Sample) -> tuple[bytes, tuple, str]:
    kind = sample.kind
    if kind == "encoded":
        if not isinstance(sample.payload, (bytes, bytearray, memoryview)):
            raise InputError(sample.key, "an encoded sample needs bytes as payload")
        return bytes(sample.payload), (), ""
    arr = np.asarray(sample.payload)
    if kind == "tokens":
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise InputError(sample.key, f"tokens must be a 1-D integer array, not {arr.dtype} {arr.shape}")
        if arr.size and (arr.min() < -(1 << 31) or arr.max() >= 1 << 31):
            raise InputError(sample.key, "token ids do not fit int32")
        return arr.astype("<i4").tobytes(), (), "int32"
    if kind == "raw":
        if arr.ndim != 3 or arr.dtype.name not in _DTYPES:
            raise InputError(sample.key, f"raw pixels must be an HWC array of {', '.join(_DTYPES)}, not "
                                         f"{arr.dtype} {arr.shape}")
        return np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes(), arr.shape, arr.dtype.name
    raise InputError(sample.key, f"unknown sample kind {kind!r}")


class RecordIOWriter(Writer):
    """Writes ``path`` (``.rec``) with its ``.idx``, ``.lst`` and sidecar, all appearing at :meth:`close`.

    ``params`` (a JSON-serialisable dict, e.g. the conversion options) is stored in the sidecar;
    ``durable=False`` skips the fsyncs (see :class:`~gpufeed.formats.atomic.AtomicFile`).
    """

    def __init__(self, path: str, params: dict | None = None, durable: bool = True):
        self.path = os.fspath(path)
        self.params = dict(params or {})
        self.durable = durable
        self._files = []
        self._rec = self._open(self.path, "data")
        self._idx = self._open(index_path(self.path), "index")
        self._lst = self._open(list_path(self.path), "list")
        self._layout = None
        self._keys = set()
        self._done = False

    def _open(self, path, role):
        try:
            f = AtomicFile(path, role, durable=self.durable)
        except Exception:
            self.abort()
            raise
        self._files.append(f)
        return f

    def write_encoded(self, record: EncodedRecord) -> None:
        layout = (record.kind, tuple(record.shape), record.dtype)
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            raise ConfigError(f"{self.path}: record {record.name!r} is {layout[0]} {layout[1]} {layout[2]} but "
                              f"earlier records are {self._layout[0]} {self._layout[1]} {self._layout[2]}; one "
                              "RecordIO file holds one kind and one raw shape: resize raw images to one size")
        if "\t" in record.name or "\n" in record.name:
            raise InputError(record.name, "the name holds a tab or newline, which a .lst line cannot",
                             "rename the file")
        if record.index in self._keys:
            raise ConfigError(f"{self.path}: index {record.index} written twice; each sample needs its own index")
        self._keys.add(record.index)
        offset = self._rec.size
        try:
            parts = frame_parts(record.value)
        except RecordTooLargeError as e:
            raise RecordTooLargeError(record.name, e.size, e.limit, e.fix) from None
        for part in parts:
            self._rec.write(part)
        self._idx.write(b"%d\t%d\n" % (record.index, offset))
        labels = "".join("%f\t" % x for x in record.labels)
        self._lst.write(f"{record.index}\t{labels}{record.name}\n".encode())
        for f in (self._rec, self._idx, self._lst):
            f.records += 1

    def close(self) -> list[WrittenFile]:
        if self._done:
            raise ConfigError(f"{self.path}: writer already closed")
        kind, shape, dtype = self._layout or ("encoded", (), "")
        side = {"format": _SIDECAR_FORMAT, "version": _SIDECAR_VERSION, "gpufeed": gpufeed.__version__,
                "kind": kind, "shape": list(shape) or None, "dtype": dtype or None, "checksum": _CHECKSUM,
                "records": self._rec.records, "params": self.params,
                "sha256": {"idx": self._idx.sha256, "lst": self._lst.sha256}}
        sc = self._open(sidecar_path(self.path), "sidecar")
        sc.write(json.dumps(side, indent=1, sort_keys=True).encode() + b"\n")
        sc.records = self._rec.records
        self._done = True
        return commit_all(self._files)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            for f in self._files:
                f.discard()


def read_sidecar(path: str) -> Layout:
    """The layout of the ``.rec`` at ``path``; the im2rec defaults when it has no sidecar."""
    sc = sidecar_path(path)
    if not exists(sc):
        return _IM2REC
    with io.open_file(sc, "rb") as f:
        try:
            side = json.loads(f.read())
        except ValueError as e:
            raise CorruptRecordError(sc, None, 0, f"the sidecar is not valid JSON ({e})") from None
    if not isinstance(side, dict) or side.get("format") != _SIDECAR_FORMAT:
        raise CorruptRecordError(sc, None, 0, "not a gpufeed RecordIO sidecar")
    if side.get("version") != _SIDECAR_VERSION:
        raise ConfigError(f"{sc}: layout version {side.get('version')} is not {_SIDECAR_VERSION}; read it with "
                          f"the gpufeed that wrote it ({side.get('gpufeed')}) or convert again")
    kind, shape, dtype = side.get("kind"), side.get("shape"), side.get("dtype")
    if kind not in ("encoded", "raw", "tokens") or (kind == "raw" and (
            dtype not in _DTYPES or not isinstance(shape, list) or len(shape) != 3)):
        raise CorruptRecordError(sc, None, 0, f"the sidecar's layout {kind} {shape} {dtype} is not one gpufeed "
                                              "writes")
    hashes = side.get("sha256")
    return Layout(kind, tuple(shape) if shape else None, dtype, side.get("checksum") == _CHECKSUM,
                  side.get("records"), hashes if isinstance(hashes, dict) else None)


class RecordIOReader(Reader):
    """Reads a ``.rec``: sequentially (any ``.rec``), or by position / key through its ``.idx``.

    ``verify=False`` skips the CRC check (the framing is always checked). Safe to pickle into worker
    processes; each process maps the file itself.
    """

    def __init__(self, path: str, verify: bool = True, use_mmap: bool = True):
        self.path = os.fspath(path)
        require_output(self.path)
        for side in (".idx", ".lst"):  # read as records, either would look damaged from its first byte
            if self.path.endswith(side) and exists(self.path[:-len(side)] + ".rec"):
                raise ConfigError(f"{self.path} is the {side} file of {self.path[:-len(side)]}.rec, not a RecordIO "
                                  "file; read that")
        self.verify = verify
        self.layout = read_sidecar(self.path)
        self._unchecked = dataclasses.replace(self.layout, checksum=False)
        self._check = self.layout if verify else self._unchecked
        self._src = ByteSource(self.path, use_mmap=use_mmap)
        self._offsets = self._keys = self._by_key = self._names = None
        self._has_idx = exists(index_path(self.path))

    def _index(self):
        if self._offsets is None:
            if not self._has_idx:
                raise TypeError(f"{self.path} has no .idx: iterate it sequentially instead")
            # Built whole, checked, then published: another thread sees None or the finished index.
            keys, offsets = _read_idx(index_path(self.path), self._side_hash("idx"))
            if self.layout.records is not None and len(offsets) != self.layout.records:
                raise CorruptRecordError(index_path(self.path), None, None,
                                         f"the index lists {len(offsets)} records, the sidecar "
                                         f"{self.layout.records}")
            self._keys = keys
            self._offsets = offsets
        return self._offsets

    def _side_hash(self, name: str) -> str | None:
        return (self.layout.sha256 or {}).get(name) if self.verify else None

    def __len__(self) -> int:
        return len(self._index())

    def _record_at(self, i: int):
        offsets = self._index()
        i = position(i, len(offsets), self.path)
        # The next record's offset bounds this one (a multi-part record or an index out of file order reads on).
        cur = self._src.record(offsets[i], _extent_hint(offsets, i))
        for _, offset, value in _scan(cur, self.path, i, 1):
            return i, offset, value
        raise CorruptRecordError(self.path, i, offsets[i], "the index points past the end of the file")

    def read_raw(self, i: int):
        i, offset, value = self._record_at(i)
        self._verify(i, offset, value, self._keys[i])
        return value

    def prefetch(self, indices) -> int:
        offsets = self._index()
        n = len(offsets)
        return self._src.will_need((offsets[i], _extent_hint(offsets, i))
                                   for i in (position(i, n, self.path) for i in indices))

    def _verify(self, i, offset, value, key):
        if self._check.checksum:
            _check_value(value, self.path, i, offset)
            if key != b"%d" % IRHEADER.unpack_from(value)[2]:
                raise CorruptRecordError(self.path, i, offset, f"the .idx key {key!r} is not the record's id")

    def __getitem__(self, i: int) -> Sample:
        i, offset, value = self._record_at(i)
        self._verify(i, offset, value, self._keys[i])
        return self._decode(i, offset, value, self._keys[i], self._unchecked)

    def by_key(self, key) -> Sample:
        """The record whose ``.idx`` key is ``key`` (an int or its text, i.e. the sample index)."""
        self._index()
        if self._by_key is None:
            self._by_key = {k: i for i, k in enumerate(self._keys)}
        k = key if isinstance(key, bytes) else str(key).encode()
        try:
            return self[self._by_key[k]]
        except KeyError:
            raise KeyError(f"{self.path}: no record with key {key!r} in {index_path(self.path)}") from None

    def _decode(self, i, offset, value, key=None, layout=None) -> Sample:
        if key is None and len(value) >= IRHEADER.size:
            key = b"%d" % IRHEADER.unpack_from(value)[2]
        names = self._load_names()
        name = None
        if names is not None and len(value) >= IRHEADER.size:
            name = names.get(IRHEADER.unpack_from(value)[2])
        return _FORMAT.decode(key or b"", value, self.path, i, offset, layout=layout or self._check, name=name)

    def _load_names(self):
        if self._names is None:
            lst = list_path(self.path)
            names = {}
            if exists(lst):
                for line in _read_side_file(lst, self._side_hash("lst")).decode("utf-8", "replace").splitlines():
                    parts = line.split("\t")
                    if len(parts) >= 2 and parts[0].strip().isdigit():
                        names[int(parts[0])] = parts[-1]
            self._names = names  # published whole: another thread never sees it half filled
        return self._names

    def _records(self, checksum: bool):
        expected = self.layout.records
        if expected is None and self._offsets is not None:
            expected = len(self._offsets)
        view = self._src.view()
        if view is not None:
            return _scan_view(view, self.path, checksum, expected)
        return _scan_checked(_scan(self._src.cursor(0), self.path), self.path, checksum, expected)

    def iter_raw(self) -> Iterator:
        """Every record value (IRHeader + payload) in file order, as zero-copy views where possible."""
        for _, _, value in self._records(self._check.checksum):
            yield value

    def __iter__(self) -> Iterator[Sample]:
        for i, offset, value in self._records(self._check.checksum):
            yield self._decode(i, offset, value, layout=self._unchecked)

    def close(self) -> None:
        self._src.close()


def _read_side_file(path: str, sha256: str | None) -> bytes:
    with io.open_file(path, "rb") as f:
        data = f.read()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CorruptRecordError(path, None, None, "the file does not match the SHA-256 its .rec.json sidecar "
                                                   "recorded")
    return data


def _read_idx(path: str, sha256: str | None = None) -> tuple[list[bytes], list[int]]:
    """``.idx`` keys and offsets, sorted by offset (file order, as DALI reads it)."""
    lines = _read_side_file(path, sha256).splitlines()
    pairs = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        parts = line.split(b"\t")
        try:
            if len(parts) != 2:
                raise ValueError
            pairs.append((int(parts[1]), parts[0].strip()))
        except ValueError:
            raise CorruptRecordError(path, n, None, f"line {n + 1} is not 'key<TAB>offset'") from None
    pairs.sort()
    return [k for _, k in pairs], [o for o, _ in pairs]


_FORMAT = RecordIOFormat()
RecordIOWriter.format = _FORMAT
