"""What a dataset source yields: a deterministic list of :class:`Item` per split.

An item names its input without holding it (a file URL, or a member's byte range inside an archive), so the
list can be planned, shuffled and shipped to Ray workers cheaply; a worker fetches the bytes with
:func:`read_item`. Small datasets (CIFAR pixels, Penn Treebank windows) carry their data inline.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any, NamedTuple, Protocol, Union

import numpy as np

from gpufeed.formats.base import Label


@dataclasses.dataclass(frozen=True)
class FileRef:
    """A whole file, by fsspec URL or local path."""

    url: str


@dataclasses.dataclass(frozen=True)
class TarMemberRef:
    """A member of a tar archive read in place: ``size`` bytes at absolute ``offset`` of ``url``.

    For a tar inside a tar (``ILSVRC2012_img_train.tar``) the offset is already absolute in the outer file.
    ``member`` is the member's path inside the archive, for messages.
    """

    url: str
    offset: int
    size: int
    member: str


@dataclasses.dataclass(frozen=True, eq=False)
class InlineRef:
    """Data already in memory: HWC uint8 pixels (CIFAR) or a 1-D int32 token array (PTB)."""

    data: Union[bytes, np.ndarray]


@dataclasses.dataclass(frozen=True)
class SynthRef:
    """A synthetic input, made by whoever reads it from these three alone
    (:mod:`gpufeed.pipelines.sources_synthetic`)."""

    kind: str
    seed: int
    index: int


Ref = Union[FileRef, TarMemberRef, InlineRef, SynthRef]


@dataclasses.dataclass(frozen=True, eq=False)
class Item:
    """One input of a split, not yet read. ``key`` is stable and unique within the split."""

    key: str
    label: Label
    ref: Ref
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def origin(self) -> str:
        """Where the item comes from, for messages: a path, or ``archive.tar::member``."""
        ref = self.ref
        if isinstance(ref, FileRef):
            return ref.url
        if isinstance(ref, TarMemberRef):
            return f"{ref.url}::{ref.member}"
        return str(self.meta.get("source", self.key))


@dataclasses.dataclass(frozen=True)
class ClassInfo:
    """The class list of a dataset: ``names[i]`` is label ``i``. ``synsets``/``texts`` when known."""

    names: Sequence[str]
    synsets: Sequence[str] | None = None
    texts: Sequence[str] | None = None
    #: CIFAR-100 coarse class names (``coarse_label`` in item meta indexes these).
    coarse_names: Sequence[str] | None = None


@dataclasses.dataclass(frozen=True)
class Skipped:
    """An input left out while listing or converting, with why. Always reported, never silent."""

    origin: str
    reason: str


class Source(Protocol):
    """A dataset as it is shipped. Implementations live in :mod:`gpufeed.pipelines.sources`."""

    #: ``"imagenet"``, ``"cifar10"``, ``"cifar100"``, ``"ptb"``, ``"folder"``.
    name: str
    #: ``"image"`` (items are encoded image files or HWC pixel arrays) or ``"text"`` (token arrays).
    modality: str

    def splits(self) -> list[str]:
        """The splits present, named as the dataset names them (``train``, ``val``, ``test``, ``valid``)."""

    def expect(self, splits: list[str]) -> None:
        """The splits about to be listed, in this order (work for a later one may begin now)."""

    def items(self, split: str) -> Sequence[Item]:
        """Every item of ``split`` in a deterministic order (sorted by key): a list, or a :class:`ListedItems`."""

    def classes(self) -> ClassInfo:
        """The class list (for PTB: the vocabulary)."""

    def skipped(self) -> list[Skipped]:
        """Inputs that listing already had to leave out (unreadable members, unlabelled files)."""


def read_item(item: Item) -> Union[bytes, np.ndarray]:
    """The item's bytes (or inline array), read through fsspec. Implemented in :mod:`.sources`."""
    from gpufeed.pipelines.sources import read_ref

    return read_ref(item.ref)



class MemberRun(NamedTuple):
    """What the members of one tar inside an archive share in a :class:`ListedItems` (``add_members``): each is
    the item ``key_prefix + name`` at ``(offset, size)`` of ``url``, member ``member_prefix + name``."""

    key_prefix: str
    url: str
    label: Label
    meta: Mapping[str, Any]
    member_prefix: str


class ListedItems(Sequence):
    """Items in the order a listing found them, where most are the files of a few folders (or the members of a few
    tars inside an archive): a folder's files are kept as its listing's names (with the folder's key and URL
    prefixes, label and meta), a tar's members as its index's entries (:class:`MemberRun`), and an :class:`Item` is
    made for one only when it is asked for. A conversion's driver needs every key to plan, but each item only in
    its shard's worker: making 300,000 Items while listing took ~0.4 s of the run's start (2 cores), their keys
    alone 0.03 s; and handing out every shard of them as :class:`ItemBatch` es (:meth:`take`), gathered and
    pickled, 0.34-0.51 s, against 0.92-2.2 s for Items made beforehand. An item is made again each time it is
    asked for (Items compare by identity, so ``items[i] is items[i]`` is false): whoever keeps items holds the
    list of them it asked for."""

    def __init__(self):
        self._runs: list[tuple] = []  # ((key prefix, URL prefix, label, meta), names), or (None, items)
        self._ends: list[int] = []  # the position after each run
        self._keys: list[str] | None = None

    def add_files(self, key_prefix: str, url_prefix: str, label: Label, meta: Mapping[str, Any],
                  names: list[str]) -> None:
        """The files ``names`` of one folder: item keys ``key_prefix + name``, :class:`FileRef` URLs
        ``url_prefix + name``."""
        if names:
            self._add(((key_prefix, url_prefix, label, meta), names), len(names))

    def add_members(self, run: MemberRun, entries: list) -> None:
        """The members of one tar inside an archive: ``(name, offset, size)`` each (a tar index's entries)."""
        if entries:
            self._add((run, entries), len(entries))

    def append(self, item: Item) -> None:
        if self._runs and self._runs[-1][0] is None:
            self._runs[-1][1].append(item)
            self._ends[-1] += 1
            self._keys = None
        else:
            self._add((None, [item]), 1)

    def _add(self, run: tuple, n: int) -> None:
        self._runs.append(run)
        self._ends.append(len(self) + n)
        self._keys = None

    def keys(self) -> list[str]:
        """Every item's key, in order (made once)."""
        if self._keys is None:
            keys: list[str] = []
            for folder, names in self._runs:
                if folder is None:
                    keys += map(item_key, names)
                elif isinstance(folder, MemberRun):
                    prefix = folder.key_prefix
                    keys += [prefix + entry[0] for entry in names]
                else:
                    prefix = folder[0]
                    keys += [prefix + name for name in names]
            self._keys = keys
        return self._keys

    def url_prefixes(self) -> list[str]:
        """The URL prefix of each folder's files."""
        return [folder[1] for folder, _ in self._runs if folder is not None and not isinstance(folder, MemberRun)]

    def runs(self) -> list[tuple]:
        """``(folder, names)`` as listed: ``(None, items)``, a folder's ``((key prefix, URL prefix, label, meta),
        names)``, or a tar's ``(MemberRun, entries)``."""
        return list(self._runs)

    def loose(self) -> list[Item]:
        """The items listed one by one (not as a folder's files)."""
        return [it for folder, items in self._runs if folder is None for it in items]

    def _entry(self, i: int):
        """Item ``i`` as an :class:`ItemBatch` entry: the Item where it was listed as one, else its folder's
        ``(key prefix, URL prefix, label, meta)`` and its name."""
        r = bisect.bisect_right(self._ends, i)
        folder, names = self._runs[r]
        j = i - (self._ends[r - 1] if r else 0)
        return names[j] if folder is None else (folder, names[j])

    def take(self, positions) -> ItemBatch:
        """The items at ``positions`` (a shard's, in its order), made where they are used."""
        n = len(self)
        entries = []
        for i in (positions.tolist() if hasattr(positions, "tolist") else positions):
            if not 0 <= i < n:
                raise IndexError(f"item {i} of {n}")
            entries.append(self._entry(i))
        return ItemBatch(entries)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self.take(range(*i.indices(len(self)))))
        i = operator.index(i)
        return self.take([i + len(self) if i < 0 else i])[0]

    def __iter__(self):
        for folder, names in self._runs:
            if folder is None:
                yield from names
            else:
                yield from (_made((folder, name)) for name in names)


class ItemBatch(Sequence):
    """Items handed to a worker as ``(folder, name)`` pairs (:meth:`ListedItems.take`), each made into an
    :class:`Item` when asked for: the conversion's driver pickles every shard it hands out, in threads that share
    the GIL with its commits, and a pair pickles in a sixth of an Item's time (0.26 against 1.6 us, 2 cores; a
    folder's tuple once per batch). A worker that uses the items more than once makes them once
    (``list(batch)``)."""

    __slots__ = ("_entries",)

    def __init__(self, entries: list):
        self._entries = entries

    def __reduce__(self):
        return ItemBatch, (self._entries,)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [_made(e) for e in self._entries[i]]
        return _made(self._entries[i])

    def __iter__(self):
        return map(_made, self._entries)


def _made(entry) -> Item:
    if isinstance(entry, Item):
        return entry
    folder, name = entry
    if isinstance(folder, MemberRun):
        name, offset, size = name
        return Item(folder.key_prefix + name, folder.label,
                    TarMemberRef(folder.url, offset, size, folder.member_prefix + name), folder.meta)
    key_prefix, url_prefix, label, meta = folder
    return Item(key_prefix + name, label, FileRef(url_prefix + name), meta)


def take_items(items: Sequence[Item], positions) -> Sequence[Item]:
    """The items of ``items`` at ``positions`` (numpy's integers too): an :class:`ItemBatch` from a
    :class:`ListedItems`, else a list."""
    if isinstance(items, ListedItems):
        return items.take(positions)
    return [items[i] for i in positions]


def keys_of(items: Sequence[Item]) -> list[str]:
    """Every item's key, in order, without making a :class:`ListedItems`' items."""
    return items.keys() if isinstance(items, ListedItems) else list(map(item_key, items))


def item_size(item: Item) -> int:
    """The bytes reading ``item`` will take when known before reading (a tar member's header), else 0."""
    return item.ref.size if isinstance(item.ref, TarMemberRef) else 0


#: An item's key (for sorting and planning a listing of a million items without a Python step per item).
item_key = attrgetter("key")
_REF, _URL = attrgetter("ref"), attrgetter("url")


def all_local_files(items: Sequence[Item]) -> bool:
    """Whether every item is a whole local file (a :class:`FileRef` to a plain path or ``file://`` URL), tested
    without a Python step per item where none is a URL: a step each took 0.17 s for 300,000 ImageNet files."""
    from gpufeed.io import is_local

    if isinstance(items, ListedItems):  # a folder's URL prefix stands for its files'
        if any(isinstance(folder, MemberRun) for folder, _ in items.runs()):
            return False
        urls, items = items.url_prefixes(), items.loose()
    else:
        urls = []
    refs = list(map(_REF, items))
    if not set(map(type, refs)) <= {FileRef}:
        return False
    urls += map(_URL, refs)
    return "://" not in "\0".join(urls) or all(map(is_local, urls))


def needs_read(item: Item) -> bool:
    """False for data already in memory (CIFAR pixels, PTB tokens) or made where it is read (synthetic)."""
    return not isinstance(item.ref, (InlineRef, SynthRef))
