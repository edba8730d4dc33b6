"""Caffe's ``Datum`` and ``BlobProto`` as bytes: the values of a Caffe LMDB (:func:`encode_datum`,
:func:`decode_datum`, keys ``%08d_<relative path>``: :func:`make_key`) and the ``mean.binaryproto`` its
mean image is stored in. The layout of each Datum kind is in :mod:`gpufeed.formats.lmdb`'s docstring.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from gpufeed import io as gio
from gpufeed.errors import ConfigError, CorruptRecordError, InputError
from gpufeed.formats.atomic import AtomicFile
from gpufeed.formats.base import Sample, sniff_image_format
from gpufeed.formats.proto import caffe_pb2

#: LMDB's compile-time key limit (MDB_MAXKEYSIZE); a longer key fails at ``put``, so refuse it at encode.
MAX_KEY_BYTES = 511
#: float_data holds token ids as float32, exact only below 2**24.
MAX_TOKEN_ID = 1 << 24
#: Key prefix width: ``convert_imageset`` uses ``caffe::format_int(line_id, 8)``.
KEY_DIGITS = 8
#: Datum.float_data is a proto2 repeated float without ``packed``: every value is a field of its own, tag
#: ``6 << 3 | 5`` (fixed32) then 4 little-endian bytes. Built with numpy, as protobuf's per-value path takes
#: ~35 ms for one 224x224x3 float image.
_FLOAT_FIELD = np.dtype([("tag", "u1"), ("value", "<f4")])
_FLOAT_TAG = 6 << 3 | 5
#: Datum.encoded, field 7 varint, written explicitly in every Datum (DALI reads a missing one as true).
_ENCODED = {True: b"\x38\x01", False: b"\x38\x00"}


def make_key(index: int, name: str) -> bytes:
    """The LMDB key ``%08d_<name>`` Caffe's ``convert_imageset`` uses."""
    key = f"{index:0{KEY_DIGITS}d}_{name}".encode()
    if len(key) > MAX_KEY_BYTES:
        raise InputError(name, f"the LMDB key is {len(key)} bytes, over LMDB's {MAX_KEY_BYTES}-byte limit",
                         "shorten the relative path")
    return key


def split_key(key: bytes) -> tuple[int | None, str]:
    """``(index, name)`` of a ``%08d_<name>`` key; index ``None`` for keys of another shape."""
    head, sep, tail = key.partition(b"_")
    if sep and head.isdigit():
        return int(head), tail.decode("utf-8", "replace")
    return None, key.decode("utf-8", "replace")


def _bgr_chw(pixels: np.ndarray) -> tuple[int, int, int, np.ndarray]:
    """HWC RGB(A)/gray pixels -> (c, h, w, CHW array in OpenCV's BGR(A) channel order)."""
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.ndim != 3 or pixels.shape[2] not in (1, 3, 4):
        raise ConfigError(f"raw pixels must be HxW or HxWxC with C in 1, 3, 4, not shape {pixels.shape}")
    h, w, c = pixels.shape
    if c >= 3:
        pixels = pixels[:, :, [2, 1, 0, 3][:c]]
    return c, h, w, np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _hwc_rgb(chw: np.ndarray) -> np.ndarray:
    c = chw.shape[0]
    hwc = chw.transpose(1, 2, 0)
    if c >= 3:
        hwc = hwc[:, :, [2, 1, 0, 3][:c]]
    return np.ascontiguousarray(hwc)


def _int_label(sample: Sample, labels: tuple) -> int:
    first = labels[0] if labels else 0
    if float(first) != int(first):
        raise InputError(sample.key, f"label {first!r} is not an integer; Caffe's Datum.label is int32",
                         "give several labels (they go to float_data) or use RecordIO/TFRecord")
    return int(first)


def _float_fields(values) -> bytes:
    """``values`` as Datum.float_data entries, exactly the bytes protobuf would write, at numpy speed."""
    values = np.asarray(values, np.float32).ravel()
    fields = np.empty(values.size, _FLOAT_FIELD)
    fields["tag"] = _FLOAT_TAG
    fields["value"] = values
    return fields.tobytes()


def encode_datum(sample: Sample) -> bytes:
    """Serialize ``sample`` as a Caffe ``Datum`` (layout in the module docstring)."""
    datum = caffe_pb2.Datum()
    multi = sample.is_multilabel
    labels = sample.labels
    if not labels and multi:
        raise InputError(sample.key, "a multi-label sample with no labels cannot be a Caffe Datum")
    datum.label = _int_label(sample, labels)
    floats = labels if multi else None
    if sample.kind == "encoded":
        datum.data = bytes(sample.payload)
    elif sample.kind == "raw":
        c, h, w, chw = _bgr_chw(np.asarray(sample.payload))
        datum.channels, datum.height, datum.width = c, h, w
        if chw.dtype == np.uint8:
            datum.data = chw.tobytes()
        elif chw.dtype in (np.float16, np.float32, np.float64):
            if multi:
                raise InputError(sample.key, "float pixels and several labels both need Datum.float_data",
                                 "store uint8 pixels or a single label")
            floats = chw
        else:
            raise InputError(sample.key, f"raw pixels of dtype {chw.dtype} cannot be a Datum",
                             "store uint8, float16 or float32")
    elif sample.kind == "tokens":
        ids = np.asarray(sample.payload)
        if ids.ndim != 1:
            raise InputError(sample.key, f"token ids must be a 1-D array, not shape {ids.shape}")
        if multi:
            raise InputError(sample.key, "token ids and several labels both need Datum.float_data")
        if ids.size and (ids.min() < 0 or ids.max() >= MAX_TOKEN_ID):
            raise InputError(sample.key, f"token ids must lie in 0..{MAX_TOKEN_ID - 1} to be exact as float32")
        datum.channels, datum.height, datum.width = 1, 1, int(ids.size)
        floats = ids
    else:
        raise InputError(sample.key, f"unknown sample kind {sample.kind!r}")
    # Fields 1-5 by protobuf, then 6 (float_data) and 7 (encoded): the order protobuf itself writes.
    tail = _float_fields(floats) if floats is not None else b""
    return datum.SerializeToString() + tail + _ENCODED[sample.kind == "encoded"]


def decode_datum(key: bytes, value: bytes, path: str = "?", record_index: int | None = None,
                 byte_offset: int | None = None, float_dtype: str | None = None) -> Sample:
    """Parse one LMDB value back into a :class:`Sample`; raise :class:`CorruptRecordError` if it is not a Datum.

    Float pixels come back as ``float_dtype`` (what the writer recorded), float32 by default."""
    datum = caffe_pb2.Datum()

    def corrupt(reason):
        return CorruptRecordError(path, record_index, byte_offset, reason)

    try:
        datum.ParseFromString(value)
    except DecodeError as e:
        raise corrupt(f"not a caffe.Datum ({e})") from e
    index, name = split_key(key)
    floats = datum.float_data
    meta: dict[str, Any] = {}
    if datum.encoded or not datum.HasField("encoded") and datum.HasField("data") and not datum.channels:
        label = tuple(floats) if floats else datum.label
        meta["format"] = sniff_image_format(datum.data)
        return Sample(name, label, datum.data, "encoded", index or 0, meta)
    c, h, w = datum.channels, datum.height, datum.width
    if datum.HasField("data"):
        if len(datum.data) != c * h * w or not c:
            raise corrupt(f"raw Datum of {c}x{h}x{w} carries {len(datum.data)} bytes")
        pixels = _hwc_rgb(np.frombuffer(datum.data, np.uint8).reshape(c, h, w))
        label = tuple(floats) if floats else datum.label
    elif c == 1 and h == 1 and len(floats) == w:
        return Sample(name, datum.label, np.asarray(floats, np.float32).astype(np.int32), "tokens",
                      index or 0, meta)
    elif len(floats) == c * h * w and c:
        pixels = _hwc_rgb(np.asarray(floats, np.float32).reshape(c, h, w)).astype(float_dtype or np.float32)
        label = datum.label
    else:
        raise corrupt(f"Datum of {c}x{h}x{w} with {len(datum.data)} data bytes and {len(floats)} floats")
    meta.update(channels=c, height=h, width=w)
    return Sample(name, label, pixels, "raw", index or 0, meta)


def write_mean_binaryproto(path: str, mean_chw: np.ndarray, order: str = "BGR") -> None:
    """Write a mean image the way Caffe's ``compute_image_mean`` does: ``BlobProto(num=1, C, H, W, data)``.

    ``mean_chw`` is CHW; Caffe subtracts it from BGR Datums, so pass ``order="RGB"`` if its channels are RGB
    and they are reversed before writing. ``path`` may be a local path or an fsspec URL.
    """
    mean = np.asarray(mean_chw, np.float32)
    if mean.ndim != 3:
        raise ConfigError(f"{path}: the mean image must be CHW (3 dimensions), not shape {mean.shape}")
    if order not in ("BGR", "RGB"):
        raise ConfigError(f"{path}: channel order must be 'BGR' or 'RGB', not {order!r}")
    if order == "RGB" and mean.shape[0] >= 3:
        mean = mean[[2, 1, 0, 3][:mean.shape[0]]]
    blob = caffe_pb2.BlobProto(num=1, channels=mean.shape[0], height=mean.shape[1], width=mean.shape[2])
    blob.data.extend(mean.ravel().tolist())
    out = AtomicFile(path, "mean")
    out.write(blob.SerializeToString())
    out.commit()


def read_mean_binaryproto(path: str) -> np.ndarray:
    """The CHW float32 mean stored in a ``mean.binaryproto`` (Caffe's or ours), channels as stored (BGR)."""
    with gio.open_file(path, "rb") as f:
        payload = f.read()
    blob = caffe_pb2.BlobProto()
    try:
        blob.ParseFromString(payload)
    except DecodeError as e:
        raise CorruptRecordError(path, 0, 0, f"not a caffe.BlobProto ({e})") from e
    if blob.HasField("shape"):
        shape = tuple(blob.shape.dim)
    else:
        shape = (blob.num, blob.channels, blob.height, blob.width)
    data = np.asarray(blob.data, np.float32)
    if int(np.prod(shape)) != data.size:
        raise CorruptRecordError(path, 0, 0, f"BlobProto of shape {shape} holds {data.size} floats")
    data = data.reshape(shape)
    return data[0] if data.ndim == 4 and data.shape[0] == 1 else data
