"""The Writer and Reader contracts that every on-disk format implements, stated once.

A :class:`Sample` is what flows from sources through transforms into writers, and what readers give back.
Each format module (``recordio``, ``lmdb``, ``tfrecord``) turns a sample into one record (:meth:`Format.encode`)
and back (:meth:`Format.decode`), and frames records into files (:class:`Writer`, :class:`Reader`). Keeping
``encode`` separate from the framing lets conversion workers do the CPU work (protobuf, headers) in parallel
while a single process only frames and appends, which is how LMDB and a single ``.rec`` are written.

Example::

    from gpufeed.formats import get_format
    from gpufeed.formats.base import Sample

    fmt = get_format("tfrecord")
    with fmt.writer("out/train-00000-of-00001") as w:
        w.write(Sample(key="cat/1.jpg", label=3, payload=jpeg_bytes, kind="encoded", index=0))
    reader = fmt.reader("out/train-00000-of-00001")
    assert reader[0].label == 3

Writers are atomic: they write under a temporary name next to the target and rename on :meth:`Writer.close`;
on an exception inside ``with`` they remove what they wrote. Readers verify what they read (magic numbers,
lengths, CRCs) and raise :class:`gpufeed.errors.CorruptRecordError` naming file, record and byte offset.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, NamedTuple, Union

import numpy as np

# What a sample carries (Sample.kind): "encoded" image bytes (JPEG/PNG as stored), "raw" pixels as an HWC
# numpy array (uint8, or float16/float32 when normalised), or "tokens": a 1-D int32 array of token ids.

Label = Union[int, float, Sequence[float]]

#: Image files are recognised by their first bytes, never by name (ImageNet ships a PNG named ``.JPEG``).
JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_OTHER_MAGICS = ((b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"),
                 (b"MM\x00*", "TIFF"))


def sniff_image_format(data: bytes) -> str | None:
    """The image format from the first bytes (``"JPEG"``, ``"PNG"``, ``"WEBP"``, ``"GIF"``...), or ``None``."""
    if data[:3] == JPEG_MAGIC:
        return "JPEG"
    if data[:8] == PNG_MAGIC:
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for magic, name in _OTHER_MAGICS:
        if data[:len(magic)] == magic:
            return name
    return None


@dataclasses.dataclass
class Sample:
    """One training example.

    ``key`` is stable and unique within a split (the source's relative path, e.g.
    ``n01440764/n01440764_10026.JPEG``); ``index`` is the sample's 0-based position in its split's output
    order (Caffe key prefix, IRHeader ``id``, ``.idx`` key). ``label`` is one class index, or a sequence
    for multi-label data. ``meta`` holds what the source knows: ``source`` (path/URL), ``synset``, ``text``
    (human-readable class), ``height``, ``width``, ``channels``, ``format`` (``"JPEG"``, ``"PNG"``), and for
    CIFAR-100 ``coarse_label``.
    """

    key: str
    label: Label
    payload: Union[bytes, np.ndarray]
    kind: str = "encoded"
    index: int = 0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def labels(self) -> tuple[float, ...]:
        """The label(s) as a tuple, whether the sample has one label or several."""
        if isinstance(self.label, (int, float, np.integer, np.floating)):
            return (self.label,)
        return tuple(self.label)

    @property
    def is_multilabel(self) -> bool:
        return not isinstance(self.label, (int, float, np.integer, np.floating))


def label_key(labels) -> tuple[float, ...]:
    """Labels as one comparable value (:attr:`Sample.labels`, or label fields of a side file such as a list):
    ``(3.0,)`` whether a format stores 3, 3.0 or "3"."""
    return tuple(float(x) for x in labels)


class EncodedRecord(NamedTuple):
    """One sample serialised by :meth:`Format.encode`, ready to be framed by a :class:`Writer`.

    ``key`` is the record's key in its format (LMDB ``%08d_<path>``, RecordIO ``.idx`` key ``str(index)``,
    empty for TFRecord); ``value`` the record payload before framing. ``index``, ``name`` (the sample key,
    i.e. relative source path) and ``labels`` travel along for side files such as RecordIO's ``.lst``.
    ``kind``, ``shape`` and ``dtype`` describe the payload for formats whose records do not (RecordIO raw
    pixels and tokens keep them in a sidecar). Plain bytes and tuples: cheap to pickle across Ray.
    """

    key: bytes
    value: bytes
    index: int
    name: str
    labels: tuple
    kind: str = "encoded"
    shape: tuple = ()
    dtype: str = ""


@dataclasses.dataclass(frozen=True)
class WrittenFile:
    """What a writer produced: enough for a manifest and for ``gpufeed verify``."""

    path: str
    records: int
    bytes: int
    sha256: str
    role: str = "data"  # "data", "index", "list", "sidecar"
    #: A file assembled from parts each hashed as it was written (a single ``.rec``): ``(bytes, sha256)``
    #: of each part in order, and ``sha256`` is :func:`parts_digest` of them.
    parts: tuple = ()


def parts_digest(parts) -> str:
    """The checksum of a file assembled from, or hashed in, parts: SHA-256 over each part's size and
    SHA-256, in order (a hash list; ``gpufeed verify`` checks each part's byte range)."""
    import hashlib

    h = hashlib.sha256()
    for size, sha in parts:
        h.update(b"%d:%s\n" % (size, sha.encode()))
    return h.hexdigest()


class Writer(abc.ABC):
    """Appends records to one output (a file, a shard with its index, or an LMDB environment).

    Use as a context manager, or call :meth:`close` (commit) / :meth:`abort` yourself.
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def write(self, sample: Sample) -> None:
        """Encode ``sample`` with this writer's format and append it."""
        self.write_encoded(self.format.encode(sample))

    @abc.abstractmethod
    def write_encoded(self, record: EncodedRecord) -> None:
        """Append one record already produced by :meth:`Format.encode` (cheap: framing and I/O only)."""

    @abc.abstractmethod
    def close(self) -> list[WrittenFile]:
        """Flush, fsync, rename to the final name(s); return every file written (data, index, ...)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Remove everything written so far; the final name(s) never appear."""

    format: ClassVar["Format"]


#: What a reader says to do about an output file that is missing, or is no file.
CONVERT_AGAIN = "convert the dataset again or fix the path"


def require_output(path: str, fix: str = CONVERT_AGAIN) -> None:
    """Before a reader opens the output file ``path``: :class:`~gpufeed.errors.ShardNotFound` where nothing is
    there, :class:`~gpufeed.errors.NotAFileError` where a FIFO, device, socket or folder is (links followed;
    opened, a FIFO blocked the reader without end and ``/dev/zero`` read without end)."""
    from gpufeed import io
    from gpufeed.errors import ShardNotFound

    if io.is_local(path):
        if io.regular_file_size(io.local_path(path), fix) is not None:
            return
    elif io.exists(path):
        return
    raise ShardNotFound(path, fix)


class Reader(abc.ABC):
    """Reads one output back. Indexed formats support ``len`` and ``reader[i]``; all support iteration.

    ``rank``/``world_size`` restrict the reader to a deterministic 1/world_size share of the records
    (record ``i`` belongs to rank ``i % world_size``), for DistributedDataParallel and parallel verify.
    """

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Sample]:
        """Sequential scan in file order, decoding each record into a :class:`Sample`."""

    def __len__(self) -> int:
        raise TypeError(f"{type(self).__name__} has no index; iterate it instead")

    def __getitem__(self, i: int) -> Sample:
        raise TypeError(f"{type(self).__name__} has no index; iterate it instead")

    def read_raw(self, i: int) -> bytes:
        """The undecoded record value at position ``i`` (benchmarks read this to exclude decoding)."""
        raise TypeError(f"{type(self).__name__} has no index; iterate it instead")

    def iter_raw(self) -> Iterator[bytes]:
        """Sequential scan of undecoded record values, with all integrity checks."""
        raise NotImplementedError

    def prefetch(self, indices: Sequence[int]) -> int:
        """Start reading the records at these positions from storage now, all at once, without waiting, so
        that reading them one by one next finds them in memory (a batch of cold records read at the disk's
        queue depth instead of one at a time). A hint only: readers that cannot tell where a record lies, or
        whose reads an emulated tier must charge one by one, do nothing. Returns the read-ahead hints given."""
        return 0

    def shard(self, rank: int, world_size: int) -> Iterator[Sample]:
        """Records ``rank, rank + world_size, ...`` in order."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        if self._has_index():
            for i in range(rank, len(self), world_size):
                yield self[i]
        else:
            for i, sample in enumerate(self):
                if i % world_size == rank:
                    yield sample

    def _has_index(self) -> bool:
        try:
            len(self)
        except TypeError:
            return False
        return True

    def close(self) -> None:
        """Release file handles / environments (readers also close when garbage-collected)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


#: Where a format's output goes: one output per shard, written by the worker that encodes the shard
#: (TFRecord, RecordIO with ``--shards``), or one per split, assembled from every shard in order by one
#: writer (LMDB, a single ``.rec``).
PER_SHARD, PER_SPLIT = "shard", "split"


class Format(abc.ABC):
    """A format: how one sample becomes one record, how records are framed into files, and where a
    conversion's output goes (:attr:`layout`, :meth:`output_path`, :meth:`parse_output`)."""

    name: ClassVar[str]
    #: True when :meth:`reader` supports ``len``/``[i]`` from an index.
    indexed: ClassVar[bool] = True
    #: :data:`PER_SHARD` or :data:`PER_SPLIT`.
    layout: str = PER_SHARD
    #: A per-split output assembled with a durable commit per shard, whose bytes follow the shards (an LMDB's
    #: transactions): its conversions keep shards of the usual size. One assembled by appending shard after
    #: shard is the same whatever their size, so a conversion cuts finer work for it.
    commits_per_shard: ClassVar[bool] = False

    def output_path(self, out: str, split: str, shard: int = 0, count: int = 1) -> str:
        """What the reader opens for a split's shard (a per-split output ignores ``shard`` and ``count``):
        ``out/<format>/<split>-00000-of-00008``; a directory or URL, local or fsspec."""
        from gpufeed.formats.naming import shard_name
        from gpufeed.io import join

        return join(out, self.name, shard_name(split, shard, count))

    #: True when :meth:`reader` needs a local path (an LMDB's memory map); a remote output is copied first.
    local_only: ClassVar[bool] = False

    def reader_path(self, relpath: str) -> str:
        """What :meth:`reader` opens for one of this format's data files (relative path): the file itself,
        or, for an output that is a directory (an LMDB environment), that directory."""
        return relpath

    def data_file(self, output: str) -> str:
        """The file that holds the records of one of this format's outputs (a path :meth:`output_path` names,
        or one its writer wrote): the output itself, or the data file inside an output that is a directory."""
        return output

    def parse_output(self, relpath: str) -> str | None:
        """The split of an output that :meth:`output_path` names (relative to the destination, ``/``-separated),
        or ``None`` when the path is not one of this format's outputs."""
        from gpufeed.formats.naming import parse_shard_name

        head, _, name = relpath.partition("/")
        parsed = parse_shard_name(name) if head == self.name and "/" not in name else None
        return parsed[0] if parsed and not parsed[3] else None

    #: A side file's suffix -> what replaces it in its data file's name (TFRecord's DALI index: ``.idx`` -> "").
    side_files: ClassVar[dict] = {}
    #: This format reads any plain file no other format claims (TFRecord: its shards have no extension).
    claims_other_files: ClassVar[bool] = False

    def claims(self, path: str) -> bool:
        """Whether ``path`` (a local file or folder) is one of this format's data files, by its name or what it
        holds: how a reader is chosen for paths given without a format (:func:`gpufeed.formats.format_of`)."""
        return False

    #: How CIFAR is stored when no encoding is asked for: as this format's ecosystem ships it.
    cifar_encode: ClassVar[str] = "png"
    #: Whether this format stores labels with an offset (``--label-offset``: TFRecord's 1..1000).
    takes_label_offset: ClassVar[bool] = False

    @classmethod
    def for_conversion(cls, shards: int | None = None, label_offset: int = 0) -> "Format":
        """This format configured as a conversion with these options writes it."""
        return cls()

    def assembler(self):
        """For an output that is one per split (:data:`PER_SPLIT`), the class that assembles it from every
        shard's spool in order (:class:`gpufeed.formats.assembly.SplitSink`); None where the workers write
        each shard's output themselves."""
        return None

    def part_of(self, path: str) -> str | None:
        """The output ``path`` is a file inside (an LMDB's ``data.mdb``), or None."""
        return None

    def listed_labels(self, out: str, relpath: str) -> tuple[str, dict] | None:
        """For a file of this format that lists the samples apart from its records (``relpath`` relative to the
        destination ``out``): the split it lists and how many samples it gives each label (:func:`label_key`).
        ``None`` for any other file (the default: a format with no such file)."""
        return None

    def owned_split(self, relpath: str) -> str | None:
        """The split of the output that ``relpath`` (relative to the destination, ``/``-separated) is a file of:
        its data file, or a file beside it (:meth:`output_files`); ``None`` when this format never writes that
        name. A conversion removes or overwrites nothing in a destination that no format claims so."""
        candidates = [relpath] + [relpath[:-len(s)] + d for s, d in self.side_files.items() if relpath.endswith(s)]
        for data in candidates:
            split = self.parse_output(data)
            if split is not None and relpath in self.output_files(data):
                return split
        return None

    @abc.abstractmethod
    def encode(self, sample: Sample) -> EncodedRecord:
        """Serialise ``sample`` into one record (key and payload before framing)."""

    @abc.abstractmethod
    def decode(self, key: bytes, value: bytes, path: str = "?", record_index: int | None = None,
               byte_offset: int | None = None) -> Sample:
        """Parse a record; raise ``CorruptRecordError(path, record_index, byte_offset, ...)`` if malformed."""

    @abc.abstractmethod
    def writer(self, path: str, **options) -> Writer:
        """A writer for the output at ``path`` (an fsspec URL or local path; LMDB needs a local path)."""

    @abc.abstractmethod
    def reader(self, path: str, **options) -> Reader:
        """A reader for the output at ``path``."""

    @abc.abstractmethod
    def output_files(self, path: str) -> list[str]:
        """Every file that makes up the output at ``path`` (data file, index, sidecars)."""
