"""PyTorch datasets over any gpufeed format, shard-aware for DistributedDataParallel.

``MapDataset`` serves indexed outputs (RecordIO with ``.idx``, LMDB, TFRecord with its index) to a
``DataLoader`` with any sampler; ``IterableDataset`` streams records in file order, split across DDP ranks
and DataLoader workers. Both give :class:`~gpufeed.formats.base.Sample` objects, or whatever ``transform``
makes of them (e.g. decode + crop + ``(tensor, label)``); without a transform pass ``collate_fn=list``.

torch is imported only inside these classes, so ``import gpufeed.formats`` never pulls it in. Readers are
opened lazily in each process, so a dataset built in the parent works in forked or spawned workers.

Example::

    ds = MapDataset("lmdb", ["out/lmdb/train_lmdb"], transform=to_tensor_and_label)
    loader = torch.utils.data.DataLoader(ds, batch_size=256, shuffle=True, num_workers=8)
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from gpufeed.draw import mixed
from gpufeed.errors import ConfigError, GpufeedError, WorkerError


@contextlib.contextmanager
def relayed():
    """Around a dataset's work in a DataLoader worker: a gpufeed error leaves it as a :class:`WorkerError`
    naming the error's type and message, which torch can hand to the main process intact (in the main
    process itself, errors pass unchanged)."""
    try:
        yield
    except GpufeedError as e:
        data = sys.modules.get("torch.utils.data")  # imported already wherever a DataLoader runs
        if isinstance(e, WorkerError) or data is None or data.get_worker_info() is None:
            raise
        raise WorkerError(f"{type(e).__name__}: {e}") from e


def _dist_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values win; otherwise torch.distributed's when initialised; otherwise one process."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")
    return rank, world_size


def _as_paths(paths: str | os.PathLike | Sequence[str]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ConfigError("no input paths given to the dataset")
    return paths


class _Readers:
    """One reader per path, (re)opened in whichever process uses them."""

    def __init__(self, format_name: str, paths: list[str], options: dict):
        from gpufeed.formats import get_format

        self.format_name, self.paths, self.options = format_name, paths, options
        self.format = get_format(format_name)
        self._pid = None
        self._readers = None

    def __getstate__(self):
        return {"format_name": self.format_name, "paths": self.paths, "options": self.options,
                "format": self.format, "_pid": None, "_readers": None}

    def get(self, j: int):
        if self._pid != os.getpid():
            self._readers = [None] * len(self.paths)
            self._pid = os.getpid()
        if self._readers[j] is None:
            self._readers[j] = self.format.reader(self.paths[j], **self.options)
        return self._readers[j]

    def close(self) -> None:
        """Close the readers this process opened (an LMDB environment keeps its file mapped until then, so
        page-cache eviction between benchmark runs needs this)."""
        if self._readers is not None and self._pid == os.getpid():
            for reader in self._readers:
                if reader is not None:
                    reader.close()
        self._readers = None
        self._pid = None


class ConcatIndex:
    """Several files' records as one run: record ``g`` of the run is record ``k`` of file ``j``
    (:meth:`locate`), the files taken in order with ``counts[j]`` records each."""

    def __init__(self, counts: Sequence[int]):
        self.starts = [0]
        for n in counts:
            self.starts.append(self.starts[-1] + n)

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, g: int) -> tuple[int, int]:
        j = bisect.bisect_right(self.starts, g) - 1
        return j, g - self.starts[j]


#: Where each rank's turn in each round of the deal falls (:class:`RankShare`) is drawn from the round's number
#: and this: the same in every process and run.
DEAL_SEED = 20261127


class RankShare:
    """The global record numbers rank ``rank`` of ``world_size`` reads, as a sequence in file order: records are
    dealt in rounds of ``world_size`` consecutive ones, one to each rank, each round starting at a place drawn from
    its number (:func:`gpufeed.draw.mixed`), the last, short round to the ranks whose turn falls in it (none with
    ``even``: every share then holds ``total // world_size``). The shares are disjoint and together every
    record; nothing is stored, so a billion records cost no memory. Dealt with the same turn every round (records
    ``r, r + w, ...``), anything laid out with a period that shares a factor with the rank count fell to the same
    ranks: a benchmark dataset whose every 50th photo was large gave all of them to ranks 1 and 3 of 4, which
    decoded 29% more a sample, and every rank trained at their pace (results/gpu-ranks-h200x4.txt, session 17)."""

    def __init__(self, total: int, rank: int, world_size: int, even: bool = False):
        self.rank, self.world_size = rank, world_size
        rounds = total // world_size
        self._len = rounds + (1 if not even and dealt_at(rank, world_size, rounds) < total else 0)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self._len:
            raise IndexError(f"record {i} of a rank's share of {self._len}")
        return dealt_at(self.rank, self.world_size, i)


def dealt_at(k: int, n: int, round_: int) -> int:
    """The position that taker ``k`` of ``n`` gets in round ``round_`` of the deal (records ``round_ * n`` to
    ``round_ * n + n - 1``): its place in the round a rotation drawn from the round's number (:class:`RankShare`)."""
    return round_ * n + (0 if n == 1 else (k + mixed(round_ ^ DEAL_SEED)) % n)


def dealt(k: int, n: int, start: int = 0, stop: int | None = None) -> Iterator[int]:
    """The positions in ``[start, stop)`` (no end without ``stop``) that taker ``k`` of ``n`` gets in the deal of
    :class:`RankShare`, ascending: one a round."""
    round_ = start // n
    while stop is None or round_ * n < stop:
        g = dealt_at(k, n, round_)
        if g >= start and (stop is None or g < stop):
            yield g
        round_ += 1


def _make_map_dataset_class():
    import torch.utils.data

    class MapDataset(torch.utils.data.Dataset):
        """Records of ``paths`` (one output each: a ``.rec``, a TFRecord shard, an LMDB directory) as one
        indexed dataset. With DDP, rank ``r`` of ``w`` sees its share of the records (:class:`RankShare`: one of
        each ``w`` consecutive records, which one drawn), the shares disjoint and together every record;
        ``even=True`` trims every rank to the same length (like ``DistributedSampler(drop_last=True)``) so no
        rank waits on a collective the others have left. A DataLoader fetches a batch through :meth:`__getitems__`,
        which with ``read_ahead`` starts every record's read before the first is used; with
        ``batch_transform``, ``batch_transform(count, samples)`` makes the whole batch from the records as they
        are read (the DataLoader's collate then takes it as it is), where ``transform`` makes one sample."""

        def __init__(self, format_name: str, paths, transform: Callable | None = None, rank: int | None = None,
                     world_size: int | None = None, even: bool = False, read_ahead: bool = False,
                     batch_transform: Callable | None = None, **reader_options):
            self._readers = _Readers(format_name, _as_paths(paths), reader_options)
            self.batch_transform = batch_transform
            if not self._readers.format.indexed:
                raise ConfigError(f"format {format_name!r} has no index; use gpufeed.formats.torch.IterableDataset")
            self.transform = transform
            self.read_ahead = read_ahead
            self.rank, self.world_size = _dist_rank_world(rank, world_size)
            self._index = ConcatIndex([len(self._readers.get(j)) for j in range(len(self._readers.paths))])
            total = len(self._index)
            self._share = RankShare(total, self.rank, self.world_size, even)
            self._len = len(self._share)

        def __len__(self) -> int:
            return self._len

        def _locate(self, i: int) -> tuple[int, int]:
            """Dataset index ``i`` -> (reader, record position in it)."""
            if not -self._len <= i < self._len:
                raise IndexError(f"index {i} out of range for a dataset of {self._len} records")
            return self._index.locate(self._share[i % self._len])

        def __getitem__(self, i: int):
            with relayed():
                j, k = self._locate(i)
                sample = self._readers.get(j)[k]
                return self.transform(sample) if self.transform is not None else sample

        def __getitems__(self, indices) -> list:
            """A whole batch, as a DataLoader worker asks for it, each record read and transformed in order;
            with ``read_ahead``, every record's read is started first
            (:meth:`~gpufeed.formats.base.Reader.prefetch`), so the disk serves the batch at its queue depth."""
            with relayed():
                located = [self._locate(i) for i in indices]
                if self.read_ahead:
                    by_reader: dict[int, list[int]] = {}
                    for j, k in located:
                        by_reader.setdefault(j, []).append(k)
                    for j, ks in by_reader.items():
                        self._readers.get(j).prefetch(ks)
                if self.batch_transform is not None:
                    return self.batch_transform(len(located), (self._readers.get(j)[k] for j, k in located))
                if self.transform is None:
                    return [self._readers.get(j)[k] for j, k in located]
                return [self.transform(self._readers.get(j)[k]) for j, k in located]

        def close(self) -> None:
            """Close this process's readers; they reopen on the next access."""
            self._readers.close()

    return MapDataset


def _make_iterable_dataset_class():
    import torch.utils.data

    class IterableDataset(torch.utils.data.IterableDataset):
        """Records of ``paths`` in file order, split over DDP ranks x DataLoader workers.

        With at least as many files as readers (ranks x workers), reader ``k`` of ``n`` reads whole files (pure
        sequential reads), one of each ``n`` files in order. Otherwise records of the concatenated stream are
        dealt the same way, one of each ``n`` to each reader: indexed formats seek straight to their share, the
        others scan and skip. Which reader gets which place in each round is drawn from the round's number
        (:func:`dealt`), so nothing laid out with a period falls to the same readers.
        """

        def __init__(self, format_name: str, paths, transform: Callable | None = None, rank: int | None = None,
                     world_size: int | None = None, **reader_options):
            self._readers = _Readers(format_name, _as_paths(paths), reader_options)
            self.transform = transform
            self.rank, self.world_size = _dist_rank_world(rank, world_size)

        def _split(self) -> tuple[int, int]:
            info = torch.utils.data.get_worker_info()
            workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
            return self.rank * workers + worker, self.world_size * workers

        def __iter__(self) -> Iterator:
            k, n = self._split()
            paths = self._readers.paths
            with relayed():
                for sample in self._samples(k, n, paths):
                    yield self.transform(sample) if self.transform is not None else sample

        def _samples(self, k: int, n: int, paths: list[str]):
            if len(paths) >= n:
                for j in dealt(k, n, 0, len(paths)):
                    yield from self._readers.get(j)
                return
            offset = 0
            for j in range(len(paths)):
                reader = self._readers.get(j)
                if reader._has_index():
                    count = len(reader)
                    for g in dealt(k, n, offset, offset + count):
                        yield reader[g - offset]
                else:
                    mine = dealt(k, n, offset)
                    want, count = next(mine), 0
                    for count, sample in enumerate(reader, 1):
                        if offset + count - 1 == want:
                            yield sample
                            want = next(mine)
                offset += count

    return IterableDataset


_CLASSES: dict = {}


def __getattr__(name: str):
    """Build the torch-derived classes on first access, so importing this module does not import torch."""
    factories = {"MapDataset": _make_map_dataset_class, "IterableDataset": _make_iterable_dataset_class}
    if name not in factories:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _CLASSES:
        cls = factories[name]()
        cls.__module__ = __name__
        cls.__qualname__ = name
        _CLASSES[name] = cls
        globals()[name] = cls
    return _CLASSES[name]
