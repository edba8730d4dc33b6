"""TFRecord shards of ``tf.train.Example`` records, with DALI's index files, as TensorFlow writes and checks them.

A record on disk is ``u64 length, u32 masked_crc32c(length bytes), payload, u32 masked_crc32c(payload)``
(TensorFlow ``record_writer.cc``). Both CRCs are checked on every read, sequential or random: the ``tfrecord``
package skips them by default and then returns damaged images without a word (bench/experiments/formats_speed.py compares
it with this module). CRC-32C comes from the ``crc32c`` package (hardware instructions, GIL released).

Payloads are ``tf.train.Example`` protobufs built with ``proto/tf_example_pb2`` (TensorFlow's messages, generated
and checked in: the ``tfrecord`` package's own copy would import torch into every conversion worker).
Images use the feature keys of TensorFlow's ``build_imagenet_data.py`` (``image/encoded``, ``image/format``,
``image/class/label``, ``image/class/synset``, ``image/class/text``, ``image/height``, ``image/width``,
``image/channels``, ``image/colorspace``, ``image/filename``). ``image/class/label`` is the 0-based class index
by default; ``label_offset=1`` writes TensorFlow's 1..1000 convention (0 = background) and records the offset
in ``image/class/label_offset`` so gpufeed reads the 0-based index back. Several labels are one ``int64_list``
(``float_list`` when they are not whole numbers). Raw pixels store the HWC bytes in ``image/encoded`` with
``image/format = b"RAW"`` and ``image/dtype``; token sequences are ``tokens`` (int64_list), ``length``, ``key``
and ``label``. The layout is described in docs/formats.md.

Each shard ``train-00000-of-00004`` gets ``train-00000-of-00004.idx`` written inline, one ``offset size`` line per
record with ``size = 12 + length + 4`` (DALI's ``tfrecord2idx``). GZIP shards (``path`` ending ``.gz`` or
``compression="gzip"``) are what ``tf.data.TFRecordDataset(compression_type="GZIP")`` reads; they get no index,
because offsets into a compressed stream cannot be seeked to, and they are read sequentially.
"""

from __future__ import annotations

import gzip
import os
import struct
from collections.abc import Iterator

from gpufeed.formats import _crc
import numpy as np
from google.protobuf.message import DecodeError
from gpufeed.formats.proto import tf_example_pb2 as example_pb2

from gpufeed.errors import ConfigError, CorruptRecordError, GpufeedError, InputError, ShardNotFound
from gpufeed.formats.atomic import AtomicFile, commit_all, exists
from gpufeed.formats._filebytes import ByteSource, position
from gpufeed.formats.base import (EncodedRecord, Format, Reader, Sample, WrittenFile, Writer, require_output,
                                  sniff_image_format)
from gpufeed import io

#: Record header: payload length and the masked CRC-32C of those 8 length bytes.
_HEAD = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
#: Header + footer bytes around each payload; DALI's index ``size`` is length + this.
FRAME_OVERHEAD = _HEAD.size + _CRC.size
#: TensorFlow masks stored CRCs (crc32c.h ``Mask``) because a CRC of data that holds CRCs is weak.
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
#: zlib's default level, which TensorFlow's GZIP writer uses too.
_GZIP_LEVEL = 6

_DTYPES = ("uint8", "float16", "float32")


def masked_crc(data) -> int:
    crc = _crc.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32


def _count_check(path, count, expected) -> None:
    if expected is not None and count != expected:
        raise CorruptRecordError(path, count, None, f"the file holds {count} records but its index lists "
                                                    f"{expected} (truncated?)")


def _scan_view(mv, path, verify=True, expected=None):
    """:func:`_scan` over a whole memory-mapped file: the same checks, written as one tight loop over offsets
    (no cursor calls, payloads are zero-copy slices) because per-record Python overhead decides how many
    small records a second a reader can deliver."""
    crc, unpack_from, crc_from, size = _crc.function(), _HEAD.unpack_from, _CRC.unpack_from, len(mv)
    pos = i = 0
    while pos < size:
        if pos + 12 > size:
            raise CorruptRecordError(path, i, pos, f"file ends {size - pos} bytes into a record header")
        length, length_crc = unpack_from(mv, pos)
        c = crc(mv[pos:pos + 8])
        if (((c >> 15) | (c << 17)) + _MASK_DELTA) & _U32 != length_crc:
            raise CorruptRecordError(path, i, pos, "the length's CRC does not match (not a TFRecord file, "
                                                   "or damaged)")
        end = pos + 12 + length
        if end + 4 > size:
            raise CorruptRecordError(path, i, pos, f"the record says {length} bytes but the file ends "
                                                   f"{size - pos - 12} bytes later (truncated?)")
        payload = mv[pos + 12:end]
        if verify:
            c = crc(payload)
            if (((c >> 15) | (c << 17)) + _MASK_DELTA) & _U32 != crc_from(mv, end)[0]:
                raise CorruptRecordError(path, i, pos, "the payload's CRC does not match")
        yield i, pos, payload
        pos = end + 4
        i += 1
    _count_check(path, i, expected)


def _scan_counted(records, path, expected):
    count = 0
    for rec in records:
        count += 1
        yield rec
    _count_check(path, count, expected)


def _scan(cur, path, first_index=0, limit=None, verify=True):
    """``(record_index, byte_offset, payload)`` from the cursor; raises CorruptRecordError on any defect."""
    i = first_index
    read, crc, unpack = cur.read, _crc.function(), _HEAD.unpack
    while limit is None or i < first_index + limit:
        offset = cur.pos
        head = read(12)
        if len(head) < 12:
            if len(head):
                raise CorruptRecordError(path, i, offset, f"file ends {len(head)} bytes into a record header")
            return
        length, length_crc = unpack(head)
        c = crc(head[:8])
        if (((c >> 15) | (c << 17)) + _MASK_DELTA) & _U32 != length_crc:
            raise CorruptRecordError(path, i, offset, "the length's CRC does not match (not a TFRecord file, "
                                                      "or damaged)")
        remaining = cur.remaining()
        if remaining is not None and length + 4 > remaining:
            raise CorruptRecordError(path, i, offset, f"the record says {length} bytes but the file ends "
                                                      f"{remaining} bytes later (truncated?)")
        payload = read(length)
        foot = read(4)
        if len(foot) < 4:
            raise CorruptRecordError(path, i, offset, "file ends inside the record (truncated?)")
        if verify:
            c = crc(payload)
            if (((c >> 15) | (c << 17)) + _MASK_DELTA) & _U32 != _CRC.unpack(foot)[0]:
                raise CorruptRecordError(path, i, offset, "the payload's CRC does not match")
        yield i, offset, payload
        i += 1


def _add_labels(feat, key, labels, offset):
    values = [float(x) for x in labels]
    if all(v.is_integer() for v in values):
        feat[key].int64_list.value.extend(int(v) + offset for v in values)
    elif offset:
        raise ConfigError(f"label_offset={offset} applies to class indices, not to the labels {labels}")
    else:
        feat[key].float_list.value.extend(values)


class TFRecordFormat(Format):
    """``label_offset`` is added to integer class labels when encoding (1 gives TensorFlow's 1..1000)."""

    name = "tfrecord"
    indexed = True
    side_files = {".idx": ""}
    claims_other_files = True
    takes_label_offset = True

    @classmethod
    def for_conversion(cls, shards: int | None = None, label_offset: int = 0) -> "TFRecordFormat":
        return cls(label_offset=label_offset)

    def __init__(self, label_offset: int = 0):
        self.label_offset = int(label_offset)

    def encode(self, sample: Sample, label_offset: int | None = None) -> EncodedRecord:
        try:
            return self._encode(sample, self.label_offset if label_offset is None else int(label_offset))
        except (ValueError, TypeError, OverflowError) as e:
            if isinstance(e, GpufeedError):
                raise
            raise InputError(sample.key, f"cannot be stored as a tf.train.Example ({e})",
                             "labels, sizes and token ids must be integers that fit int64") from None

    def _encode(self, sample: Sample, offset: int) -> EncodedRecord:
        ex = example_pb2.Example()
        feat = ex.features.feature
        meta = sample.meta
        if sample.kind == "tokens":
            ids = np.asarray(sample.payload)
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise InputError(sample.key, f"tokens must be a 1-D integer array, not {ids.dtype} {ids.shape}")
            feat["tokens"].int64_list.value.extend(ids.tolist())
            feat["length"].int64_list.value.append(len(ids))
            feat["key"].bytes_list.value.append(sample.key.encode())
            _add_labels(feat, "label", sample.labels, 0)
        else:
            if sample.kind == "raw":
                arr = np.asarray(sample.payload)
                if arr.ndim != 3 or arr.dtype.name not in _DTYPES:
                    raise InputError(sample.key, f"raw pixels must be an HWC array of {', '.join(_DTYPES)}, "
                                                 f"not {arr.dtype} {arr.shape}")
                data = np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes()
                fmt = b"RAW"
                height, width, channels = arr.shape
                feat["image/dtype"].bytes_list.value.append(arr.dtype.name.encode())
            elif sample.kind == "encoded":
                data = bytes(sample.payload)
                fmt = str(meta["format"]).encode() if meta.get("format") else (sniff_image_format(data) or "").encode()
                height, width, channels = meta.get("height"), meta.get("width"), meta.get("channels")
            else:
                raise InputError(sample.key, f"unknown sample kind {sample.kind!r}")
            feat["image/encoded"].bytes_list.value.append(data)
            feat["image/format"].bytes_list.value.append(fmt)
            _add_labels(feat, "image/class/label", sample.labels, offset)
            if offset:
                feat["image/class/label_offset"].int64_list.value.append(offset)
            for name, value in (("image/height", height), ("image/width", width),
                                ("image/channels", channels)):
                if value is not None:
                    feat[name].int64_list.value.append(int(value))
            colorspace = meta.get("colorspace") or ("Grayscale" if channels == 1 else "RGB")
            feat["image/colorspace"].bytes_list.value.append(colorspace.encode())
            feat["image/class/synset"].bytes_list.value.append(str(meta.get("synset", "")).encode())
            feat["image/class/text"].bytes_list.value.append(str(meta.get("text", "")).encode())
            feat["image/filename"].bytes_list.value.append(sample.key.encode())
        # deterministic: map entries sorted by key, so the same sample always gives the same bytes (and hashes)
        return EncodedRecord(b"", ex.SerializeToString(deterministic=True), sample.index, sample.key,
                             tuple(sample.labels), sample.kind)

    def decode(self, key: bytes, value, path: str = "?", record_index: int | None = None,
               byte_offset: int | None = None) -> Sample:
        def bad(reason):
            return CorruptRecordError(path, record_index, byte_offset, reason)

        try:
            ex = example_pb2.Example.FromString(value if isinstance(value, bytes) else bytes(value))
            feat = ex.features.feature
            if "tokens" in feat:
                ids = np.asarray(feat["tokens"].int64_list.value, dtype=np.int64)
                if len(ids) != _one_int(feat, "length", bad):
                    raise bad("`length` does not match the number of tokens")
                if ids.size and (ids.min() < -(1 << 31) or ids.max() >= 1 << 31):
                    raise bad("token ids do not fit int32")
                return Sample(key=_one_bytes(feat, "key", bad).decode(), label=_labels(feat, "label", 0, bad),
                              payload=ids.astype(np.int32), kind="tokens", index=record_index or 0)
            data = _one_bytes(feat, "image/encoded", bad)
            fmt = _one_bytes(feat, "image/format", bad).decode()
            offset = _one_int(feat, "image/class/label_offset", bad) if "image/class/label_offset" in feat else 0
            label = _labels(feat, "image/class/label", offset, bad)
            meta = {"format": fmt}
            for name in ("height", "width", "channels"):
                if f"image/{name}" in feat:
                    meta[name] = _one_int(feat, f"image/{name}", bad)
            for name, field in (("synset", "image/class/synset"), ("text", "image/class/text"),
                                ("colorspace", "image/colorspace")):
                if field in feat:
                    meta[name] = _one_bytes(feat, field, bad).decode()
            sample_key = _one_bytes(feat, "image/filename", bad).decode() if "image/filename" in feat else ""
            if fmt != "RAW":
                return Sample(key=sample_key, label=label, payload=data, kind="encoded", index=record_index or 0,
                              meta=meta)
            dtype = _one_bytes(feat, "image/dtype", bad).decode()
            if dtype not in _DTYPES or not all(n in meta for n in ("height", "width", "channels")):
                raise bad("a RAW image needs image/dtype, image/height, image/width and image/channels")
            shape = (meta["height"], meta["width"], meta["channels"])
            dt = np.dtype(dtype).newbyteorder("<")
            if min(shape) < 0 or len(data) != shape[0] * shape[1] * shape[2] * dt.itemsize:
                raise bad(f"{len(data)} pixel bytes do not make the shape {shape} {dtype}")
            pixels = np.frombuffer(data, dt).astype(dtype, copy=False).reshape(shape)
            return Sample(key=sample_key, label=label, payload=pixels, kind="raw", index=record_index or 0,
                          meta=meta)
        except (DecodeError, UnicodeDecodeError, ValueError, TypeError, OverflowError) as e:
            if isinstance(e, CorruptRecordError):
                raise
            raise bad(f"the payload is not a tf.train.Example gpufeed can read ({e})") from None

    def writer(self, path: str, **options) -> "TFRecordWriter":
        options.setdefault("label_offset", self.label_offset)
        return TFRecordWriter(path, **options)

    def reader(self, path: str, **options) -> "TFRecordReader":
        return TFRecordReader(path, **options)

    def output_files(self, path: str) -> list[str]:
        return [path] if _compression(path, None) else [path, index_path(path)]


def _one_bytes(feat, name, bad) -> bytes:
    one = feat[name] if name in feat else None
    if one is None or one.WhichOneof("kind") != "bytes_list" or len(values := one.bytes_list.value) != 1:
        raise bad(f"feature {name!r} is missing or not one bytes value")
    return values[0]


def _one_int(feat, name, bad) -> int:
    one = feat[name] if name in feat else None
    if one is None or one.WhichOneof("kind") != "int64_list" or len(values := one.int64_list.value) != 1:
        raise bad(f"feature {name!r} is missing or not one int64 value")
    return values[0]


def _labels(feat, name, offset, bad):
    kind = feat[name].WhichOneof("kind") if name in feat else None
    if kind == "int64_list":
        values = [v - offset for v in feat[name].int64_list.value]
    elif kind == "float_list":
        values = [float(v) for v in feat[name].float_list.value]
    else:
        raise bad(f"feature {name!r} is missing or holds no numbers")
    if len(values) == 1:
        return values[0]
    return tuple(values)


def index_path(path: str) -> str:
    return path + ".idx"


def _compression(path: str, compression: str | None) -> str | None:
    if compression not in (None, "", "gzip", "GZIP"):
        raise ConfigError(f"compression {compression!r} is not supported; use None or 'gzip'")
    return "gzip" if compression or str(path).endswith(".gz") else None


class TFRecordWriter(Writer):
    """Writes one shard and, unless compressed, its DALI index; both appear at :meth:`close`."""

    def __init__(self, path: str, label_offset: int | None = None, compression: str | None = None):
        self.path = os.fspath(path)
        self.compression = _compression(self.path, compression)
        self.label_offset = label_offset
        self._data = AtomicFile(self.path, "data")
        self._idx = None
        self._gz = None
        self._pos = 0
        self._done = False
        try:
            if self.compression:
                self._gz = gzip.GzipFile(filename="", mode="wb", fileobj=self._data, compresslevel=_GZIP_LEVEL,
                                         mtime=0)
            else:
                self._idx = AtomicFile(index_path(self.path), "index")
        except Exception:
            self.abort()
            raise

    def write(self, sample: Sample) -> None:
        self.write_encoded(self.format.encode(sample, self.label_offset))

    def write_encoded(self, record: EncodedRecord) -> None:
        payload = record.value
        length = _LENGTH.pack(len(payload))
        out = self._gz or self._data
        out.write(length + _CRC.pack(masked_crc(length)))
        out.write(payload)
        out.write(_CRC.pack(masked_crc(payload)))
        size = len(payload) + FRAME_OVERHEAD
        if self._idx is not None:
            self._idx.write(b"%d %d\n" % (self._pos, size))
            self._idx.records += 1
        self._pos += size
        self._data.records += 1

    def close(self) -> list[WrittenFile]:
        if self._done:
            raise ConfigError(f"{self.path}: writer already closed")
        if self._gz is not None:
            try:
                self._gz.close()
            except Exception:
                self.abort()
                raise
        self._done = True
        return commit_all([self._data, self._idx])

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._data.discard()
            if self._idx is not None:
                self._idx.discard()


class TFRecordReader(Reader):
    """Reads one shard: sequentially, or by position through its ``.idx`` (built by a header scan if absent).

    ``verify=False`` skips the payload CRC (never the length CRC); for comparing costs only.
    """

    def __init__(self, path: str, compression: str | None = None, verify: bool = True, use_mmap: bool = True):
        self.path = os.fspath(path)
        require_output(self.path)
        if self.path.endswith(".idx") and exists(self.path[:-len(".idx")]):  # read as records: "damaged"
            raise ConfigError(f"{self.path} is the DALI index of {self.path[:-len('.idx')]}, not a TFRecord "
                              "file; read that")
        self.compression = _compression(self.path, compression)
        self.verify = verify
        self._src = ByteSource(self.path, self.compression, use_mmap)
        self._has_idx = not self.compression and exists(index_path(self.path))
        self._index = None

    def _entries(self) -> list[tuple[int, int]]:
        if self._index is None:
            if self.compression:
                raise TypeError(f"{self.path} is GZIP-compressed and cannot be read at random; iterate it")
            self._index = self._checked_idx() if self._has_idx else self._scan_index()
        return self._index

    def _idx_count(self) -> int:
        with io.open_file(index_path(self.path), "rb") as f:
            data = f.read()
        return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)

    def _checked_idx(self):
        """The DALI index, checked to tile the file exactly: records are contiguous, so an index whose
        entries were reordered, dropped or altered is caught here rather than serving records out of place."""
        entries, idx = _read_idx(index_path(self.path)), index_path(self.path)
        pos = 0
        for n, (offset, size) in enumerate(entries):
            if offset != pos or size < FRAME_OVERHEAD:
                raise CorruptRecordError(idx, n, offset, f"line {n + 1} does not start where the previous record "
                                                         f"ends (byte {pos}); rewrite the index")
            pos += size
        if pos != self._src.size():
            raise CorruptRecordError(idx, len(entries), pos, f"the index covers {pos} bytes of a "
                                                             f"{self._src.size()}-byte file (truncated?)")
        return entries

    def _scan_index(self):
        cur = self._src.cursor(0)
        entries = []
        while True:
            offset = cur.pos
            head = cur.read(12)
            if not head:
                return entries
            if len(head) < 12 or masked_crc(head[:8]) != _HEAD.unpack(head)[1]:
                raise CorruptRecordError(self.path, len(entries), offset, "bad record header while indexing")
            length = _HEAD.unpack(head)[0]
            entries.append((offset, length + FRAME_OVERHEAD))
            cur = self._src.cursor_at(offset + length + FRAME_OVERHEAD)

    def __len__(self) -> int:
        return len(self._entries())

    def read_raw(self, i: int):
        entries = self._entries()
        i = position(i, len(entries), self.path)
        offset, size = entries[i]
        for _, _, payload in _scan(self._src.record(offset, size), self.path, i, 1, self.verify):
            if len(payload) + FRAME_OVERHEAD != size:
                raise CorruptRecordError(self.path, i, offset, f"the index says {size} bytes, the record "
                                                               f"{len(payload) + FRAME_OVERHEAD}")
            return payload
        raise CorruptRecordError(self.path, i, offset, "the index points past the end of the file")

    def prefetch(self, indices) -> int:
        entries = self._entries()
        return self._src.will_need(entries[position(i, len(entries), self.path)] for i in indices)

    def __getitem__(self, i: int) -> Sample:
        payload = self.read_raw(i)
        i %= len(self)
        return _FORMAT.decode(b"", payload, self.path, i, self._entries()[i][0])

    def _records(self):
        # A sequential scan needs only the index's record count (to notice a shard cut at a record boundary),
        # not the parsed and checked entries random access uses.
        expected = len(self._index) if self._index is not None else self._idx_count() if self._has_idx else None
        view = self._src.view()
        if view is not None:
            return _scan_view(view, self.path, self.verify, expected)
        return _scan_counted(_scan(self._src.cursor(0), self.path, verify=self.verify), self.path, expected)

    def iter_raw(self) -> Iterator:
        """Every payload (a serialized Example) in file order, CRC-checked, as zero-copy views where possible."""
        for _, _, payload in self._records():
            yield payload

    def __iter__(self) -> Iterator[Sample]:
        for i, offset, payload in self._records():
            yield _FORMAT.decode(b"", payload, self.path, i, offset)

    def close(self) -> None:
        self._src.close()


def _read_idx(path: str) -> list[tuple[int, int]]:
    with io.open_file(path, "rb") as f:
        lines = f.read().splitlines()
    out = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            offset, size = (int(x) for x in line.split())
        except ValueError:
            raise CorruptRecordError(path, n, None, f"line {n + 1} is not 'offset size'") from None
        out.append((offset, size))
    return out


_FORMAT = TFRecordFormat()
TFRecordWriter.format = _FORMAT
