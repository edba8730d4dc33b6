"""WebDataset shards: plain POSIX tar files whose consecutive members sharing a key make one sample, as the
``webdataset`` package and DALI's ``fn.readers.webdataset`` read them, with DALI's ``wds2idx`` index beside each.

A sample ``i`` is the members ``%09d.<ext>`` (its planned index; keys hold no dots), in a fixed order:

* the payload: ``.jpg`` / ``.png`` (the stored image bytes, as the webdataset package and DALI decode them by
  extension), ``.npy`` (raw pixels, HWC, or token ids: ``numpy.save`` bytes), ``.bin`` for other bytes;
* ``.cls``: the class index as ASCII digits (one integer label; several labels, or a label that is not a whole
  number, are the ``.json``'s ``labels`` instead);
* ``.json``: the sample's source name (``key``), its kind, image size where known, and ``crc32c``: a CRC-32C over
  the other members' bytes and this JSON without the CRC, so that a flipped byte anywhere in a sample is an
  error, never different data (tar protects its headers with a checksum, not the data). The JSON is written in
  one canonical form, which the reader checks byte for byte.

Headers are USTAR, made by :mod:`tarfile` with fixed metadata (mode 0644, uid/gid 0, no user or group name,
mtime 0), data padded to 512 bytes, two zero blocks at the end: the same samples always give the same bytes.
Shards are ``{split}-{shard:06d}.tar``; each gets ``{shard}.tar.idx`` (``wds2idx``'s ``v1.2`` text: a first line
``v1.2 <samples>``, then per sample ``<ext> <data offset> <size> <member name>`` for each member).
"""

from __future__ import annotations

import io as _io
import json
import re
import tarfile
from collections.abc import Iterator

from gpufeed.formats import _crc
import numpy as np

from gpufeed import io
from gpufeed.errors import ConfigError, CorruptRecordError, InputError, ShardNotFound
from gpufeed.formats.atomic import AtomicFile, commit_all, exists
from gpufeed.formats._filebytes import ByteSource, position
from gpufeed.formats.base import (EncodedRecord, Format, Reader, Sample, WrittenFile, Writer, require_output,
                                  sniff_image_format)

BLOCK = 512
#: The end-of-archive marker: two zero blocks.
END = bytes(2 * BLOCK)
KEY = "%09d"
INDEX_VERSION = "v1.2"
#: Payload extension by the image format the bytes are in; anything else is ``.bin``.
IMAGE_EXTENSIONS = {"JPEG": "jpg", "PNG": "png"}
PAYLOAD_EXTENSIONS = ("jpg", "png", "npy", "bin")
_SHARD = re.compile(r"^(?P<split>[A-Za-z0-9][A-Za-z0-9_.-]*)-(?P<shard>\d{6})\.tar$")


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = size, 0o644, 0, tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


def _member(name: str, data: bytes) -> bytes:
    return _header(name, len(data)) + data + bytes(-len(data) % BLOCK)


def _canonical(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _check(members: list[tuple[str, bytes]], meta: dict) -> int:
    crc = 0
    for ext, data in members:
        crc = _crc.crc32c(ext.encode() + b"\0" + data, crc)
    return _crc.crc32c(_canonical(meta), crc)


class WebDatasetFormat(Format):
    name = "webdataset"
    indexed = True
    side_files = {".idx": ""}

    def output_path(self, out: str, split: str, shard: int = 0, count: int = 1) -> str:
        if not 0 <= shard < max(count, 1):
            raise ValueError(f"shard index {shard} outside 0..{count - 1}")
        return io.join(out, self.name, f"{split}-{shard:06d}.tar")

    def parse_output(self, relpath: str) -> str | None:
        head, _, name = relpath.partition("/")
        m = _SHARD.match(name) if head == self.name and "/" not in name else None
        return m["split"] if m else None

    def output_files(self, path: str) -> list[str]:
        return [path, index_path(path)]

    def claims(self, path: str) -> bool:
        return path.rstrip("/").endswith(".tar")

    def encode(self, sample: Sample) -> EncodedRecord:
        if not 0 <= sample.index < 10 ** 9:
            raise InputError(sample.key, f"index {sample.index} does not fit a 9-digit WebDataset key")
        key = KEY % sample.index
        meta = {"key": sample.key, "kind": sample.kind}
        if sample.kind == "encoded":
            data = bytes(sample.payload)
            found = sample.meta.get("format") or sniff_image_format(data)
            ext = IMAGE_EXTENSIONS.get(str(found).upper(), "bin")
            for name in ("height", "width", "channels"):
                if sample.meta.get(name) is not None:
                    meta[name] = int(sample.meta[name])
        elif sample.kind in ("raw", "tokens"):
            arr = np.asarray(sample.payload)
            buf = _io.BytesIO()
            np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
            data, ext = buf.getvalue(), "npy"
        else:
            raise InputError(sample.key, f"unknown sample kind {sample.kind!r}")
        members = [(ext, data)]
        labels = sample.labels
        if not sample.is_multilabel and float(labels[0]).is_integer() and labels[0] >= 0:
            members.append(("cls", b"%d" % int(labels[0])))
        else:
            meta["labels"] = [float(x) for x in labels]
        meta["crc32c"] = _check(members, meta)
        members.append(("json", _canonical(meta)))
        value = b"".join(_member(f"{key}.{ext}", data) for ext, data in members)
        return EncodedRecord(key.encode(), value, sample.index, sample.key, tuple(labels), sample.kind)

    def decode(self, key: bytes, value, path: str = "?", record_index: int | None = None,
               byte_offset: int | None = None, verify: bool = True) -> Sample:
        def bad(reason):
            return CorruptRecordError(path, record_index, byte_offset, reason)

        members = _members(memoryview(value), path, record_index, byte_offset)
        names = {name.split(".", 1)[0] for name, _, _ in members}
        if len(names) != 1:
            raise bad(f"the members {', '.join(n for n, _, _ in members)} do not share one key")
        sample_key = names.pop()
        exts = [name.split(".", 1)[1] for name, _, _ in members]
        got = {ext: bytes(value[start:start + size]) for ext, (_, start, size) in zip(exts, members)}
        raw_json = got.pop("json", b"")
        try:
            meta = json.loads(raw_json)
        except (ValueError, UnicodeDecodeError):
            raise bad("no readable .json member (gpufeed's sample metadata and check)") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("crc32c"), int):
            raise bad("the .json member holds no crc32c")
        stored = meta.pop("crc32c")
        ordered = _ordered(got)
        # Every member once, in the written order, the .json last in its one canonical form, and the CRC.
        if verify and (exts != [ext for ext, _ in ordered] + ["json"]
                       or raw_json != _canonical({**meta, "crc32c": stored}) or _check(ordered, meta) != stored):
            raise bad("CRC-32C of the sample's members does not match its .json (damaged)")
        payload_ext = next((ext for ext in PAYLOAD_EXTENSIONS if ext in got), None)
        if payload_ext is None:
            raise bad("no payload member (.jpg, .png, .npy or .bin)")
        data = got[payload_ext]
        label = int(got["cls"]) if "cls" in got else tuple(meta.get("labels") or ())
        if isinstance(label, tuple) and len(label) == 1:
            label = label[0]
        index = int(sample_key) if sample_key.isdigit() else (record_index or 0)
        kind = meta.get("kind", "encoded")
        if kind == "encoded":
            extra = {k: meta[k] for k in ("height", "width", "channels") if k in meta}
            fmt = {"jpg": "JPEG", "png": "PNG"}.get(payload_ext)
            return Sample(key=meta.get("key", sample_key), label=label, payload=data, kind="encoded", index=index,
                          meta={**({"format": fmt} if fmt else {}), **extra})
        try:
            arr = np.load(_io.BytesIO(data), allow_pickle=False)
        except ValueError as e:
            raise bad(f"the .npy member does not load ({e})") from None
        return Sample(key=meta.get("key", sample_key), label=label, payload=arr, kind=kind, index=index, meta={})

    def writer(self, path: str, **options) -> "WebDatasetWriter":
        return WebDatasetWriter(path, **options)

    def reader(self, path: str, **options) -> "WebDatasetReader":
        return WebDatasetReader(path, **options)


def _ordered(got: dict) -> list[tuple[str, bytes]]:
    """The members other than the ``.json``, in the order they are written: payload, then ``.cls``."""
    return [(ext, got[ext]) for ext in (*PAYLOAD_EXTENSIONS, "cls") if ext in got]


def _members(view: memoryview, path: str, record_index, byte_offset,
             check: bool = True) -> list[tuple[str, int, int]]:
    """``(name, data start, size)`` of each member in one sample's bytes, every header's checksum and every
    padding byte checked. ``check=False`` reads only each header's name and size (a sample this process just
    encoded, whose layout the writer's index lists)."""
    out, pos, n = [], 0, len(view)
    while pos < n:
        if check:
            info = _parse_header(view[pos:pos + BLOCK], path, record_index, (byte_offset or 0) + pos)
            name, size = info.name, info.size
        else:
            name = bytes(view[pos:pos + 100]).rstrip(b"\0").decode()
            size = int(bytes(view[pos + 124:pos + 136]).strip(b" \0") or b"0", 8)
        start = pos + BLOCK
        end = start + size
        padded = end + (-size % BLOCK)
        if padded > n:
            raise CorruptRecordError(path, record_index, byte_offset, f"member {name} runs past its sample")
        if check and bytes(view[end:padded]) != bytes(padded - end):
            raise CorruptRecordError(path, record_index, byte_offset, f"the padding after {name} is not zero")
        out.append((name, start, size))
        pos = padded
    if not out:
        raise CorruptRecordError(path, record_index, byte_offset, "an empty sample")
    return out


def _parse_header(block, path: str, record_index, offset: int) -> tarfile.TarInfo:
    if len(block) < BLOCK:
        raise CorruptRecordError(path, record_index, offset, "a tar header is cut short (truncated?)")
    try:
        info = tarfile.TarInfo.frombuf(bytes(block), "utf-8", "strict")
    except (tarfile.HeaderError, UnicodeDecodeError) as e:
        raise CorruptRecordError(path, record_index, offset, f"a damaged tar header ({e})") from None
    if not info.isreg() or "." not in info.name.rsplit("/", 1)[-1]:
        raise CorruptRecordError(path, record_index, offset, f"member {info.name!r} is not a sample's file")
    # The checksum is a plain sum, and its octal digits may gain or lose a leading blank unnoticed: the header
    # must be the one its fields make, byte for byte.
    if info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict") != bytes(block):
        raise CorruptRecordError(path, record_index, offset, f"the tar header of {info.name} is damaged")
    return info


def index_path(path: str) -> str:
    return path + ".idx"


class WebDatasetWriter(Writer):
    """Writes one shard and its ``wds2idx`` index; both appear at :meth:`close`."""

    def __init__(self, path: str):
        self.path = str(path)
        self._data = AtomicFile(self.path, "data")
        self._lines: list[str] = []
        self._pos = 0
        self._done = False

    def write(self, sample: Sample) -> None:
        self.write_encoded(_FORMAT.encode(sample))

    def write_encoded(self, record: EncodedRecord) -> None:
        value = bytes(record.value)
        members = _members(memoryview(value), self.path, None, self._pos, check=False)
        self._lines.append(" ".join(f"{name.split('.', 1)[1]} {self._pos + start} {size} {name}"
                                    for name, start, size in members))
        self._data.write(value)
        self._data.records += 1
        self._pos += len(value)

    def close(self) -> list[WrittenFile]:
        if self._done:
            raise ConfigError(f"{self.path}: writer already closed")
        self._done = True
        try:
            self._data.write(END)
            idx = AtomicFile(index_path(self.path), "index")
            idx.write(("\n".join([f"{INDEX_VERSION} {len(self._lines)}", *self._lines]) + "\n").encode())
            idx.records = len(self._lines)
        except Exception:
            self._data.discard()
            raise
        return commit_all([self._data, idx])

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._data.discard()


class WebDatasetReader(Reader):
    """Reads one shard: sequentially, or by sample through its ``wds2idx`` index (built by a header scan if
    absent). Every sample's members are checked (header checksums, padding, the CRC in its ``.json``)."""

    def __init__(self, path: str, use_mmap: bool = True, verify: bool = True):
        self.path = str(path)
        self.verify = verify  # False skips each sample's CRC-32C (never the tar headers): for comparing costs only
        require_output(self.path)
        if self.path.endswith(".idx") and exists(self.path[:-len(".idx")]):
            raise ConfigError(f"{self.path} is the DALI index of {self.path[:-len('.idx')]}, not a shard; read that")
        self._src = ByteSource(self.path, None, use_mmap)
        self._has_idx = exists(index_path(self.path))
        self._spans: list[tuple[int, int]] | None = None

    def _entries(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every sample, checked to tile the shard up to its end-of-archive marker."""
        if self._spans is None:
            spans = self._read_index() if self._has_idx else self._scan()
            size = self._src.size()
            pos = 0
            for n, (offset, length) in enumerate(spans):
                if offset != pos:
                    raise CorruptRecordError(self.path, n, offset, f"sample {n} does not start where the one before "
                                                                   f"ends (byte {pos})")
                pos += length
            if pos + len(END) != size or bytes(self._src.read_at(pos, len(END))) != END:
                raise CorruptRecordError(self.path, len(spans), pos, f"{size - pos} bytes after the last sample "
                                                                     "are not the end-of-archive marker (truncated?)")
            self._spans = spans
        return self._spans

    def _read_index(self) -> list[tuple[int, int]]:
        idx = index_path(self.path)
        with io.open_file(idx, "rb") as f:
            lines = f.read().decode("ascii", "replace").splitlines()
        head = lines[0].split() if lines else []
        if len(head) != 2 or head[0] != INDEX_VERSION or not head[1].isdigit() or int(head[1]) != len(lines) - 1:
            raise CorruptRecordError(idx, 0, None, f"not a {INDEX_VERSION} wds2idx index of {len(lines) - 1} samples")
        spans = []
        for n, line in enumerate(lines[1:], 1):
            parts = line.split()
            try:
                members = [(int(parts[i + 1]), int(parts[i + 2])) for i in range(0, len(parts), 4)]
            except (ValueError, IndexError):
                raise CorruptRecordError(idx, n, None, f"line {n + 1} is not '<ext> <offset> <size> <name>' "
                                                       "per member") from None
            if not members or len(parts) % 4:
                raise CorruptRecordError(idx, n, None, f"line {n + 1} is not '<ext> <offset> <size> <name>' per member")
            start = members[0][0] - BLOCK
            last_offset, last_size = members[-1]
            spans.append((start, last_offset + last_size + (-last_size % BLOCK) - start))
        return spans

    def _scan(self) -> list[tuple[int, int]]:
        spans, pos, size = [], 0, self._src.size()
        key, start = None, 0
        while pos + BLOCK <= size:
            block = bytes(self._src.read_at(pos, BLOCK))
            if block == bytes(BLOCK):
                break
            info = _parse_header(block, self.path, len(spans), pos)
            name = info.name.rsplit("/", 1)[-1].split(".", 1)[0]
            if name != key:
                if key is not None:
                    spans.append((start, pos - start))
                key, start = name, pos
            pos += BLOCK + info.size + (-info.size % BLOCK)
        if key is not None:
            spans.append((start, pos - start))
        return spans

    def __len__(self) -> int:
        return len(self._entries())

    def read_raw(self, i: int):
        """Sample ``i``'s bytes, read at random: one request for its extent (:meth:`ByteSource.record`)."""
        entries = self._entries()
        offset, size = entries[position(i, len(entries), self.path)]
        return self._src.record(offset, size).read(size)

    def _sequential(self, i: int):
        """Sample ``i``'s bytes for a scan in file order: a slice of the map, whose read-ahead serves scans."""
        offset, size = self._entries()[i]
        return self._src.read_at(offset, size)

    def prefetch(self, indices) -> int:
        entries = self._entries()
        return self._src.will_need(entries[position(i, len(entries), self.path)] for i in indices)

    def __getitem__(self, i: int) -> Sample:
        entries = self._entries()
        i = position(i, len(entries), self.path)
        return _FORMAT.decode(b"", self.read_raw(i), self.path, i, entries[i][0], self.verify)

    def iter_raw(self) -> Iterator:
        for i in range(len(self)):
            value = self._sequential(i)
            _members(memoryview(value), self.path, i, self._entries()[i][0])
            yield value

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield _FORMAT.decode(b"", self._sequential(i), self.path, i, self._entries()[i][0], self.verify)

    def close(self) -> None:
        self._src.close()


_FORMAT = WebDatasetFormat()
