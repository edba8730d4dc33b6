"""CIFAR-10 and CIFAR-100: the python pickles, the binary version, or either ``.tar.gz`` read in place.

All of CIFAR fits in memory (180 MB), so items carry their pixels inline as HWC uint8 arrays; a ``.tar.gz`` is
streamed once. Keys name the batch file and the row, ``data_batch_1/00042``, the same in every form.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gpufeed.errors import ConfigError, InputError, LabelError, SourceNotFound
from gpufeed.pipelines import safe_pickle
from gpufeed.pipelines.archive import ArchiveLimits, stream_tar
from gpufeed.pipelines.base import ClassInfo, InlineRef, Item, Skipped
from gpufeed.pipelines.sources import BaseSource, Root

SIDE = 32
#: A CIFAR image row: 1024 red bytes, then 1024 green, then 1024 blue, each plane 32x32 row-major.
PIXELS = 3 * SIDE * SIDE


@dataclasses.dataclass(frozen=True)
class Layout:
    """File names of one CIFAR release (``py`` pickles and ``bin`` records)."""

    py_dir: str
    bin_dir: str
    py_tgz: str
    bin_tgz: str
    splits: dict  # split -> batch names (without .bin)
    py_meta: str
    bin_meta: tuple  # label-name text files: (fine, coarse) or (names,)
    #: Label bytes before the pixels of a binary record: CIFAR-10 one (label), CIFAR-100 two (coarse, fine).
    label_bytes: int
    classes: int


LAYOUTS = {
    "cifar10": Layout("cifar-10-batches-py", "cifar-10-batches-bin", "cifar-10-python.tar.gz",
                      "cifar-10-binary.tar.gz",
                      {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
                      "batches.meta", ("batches.meta.txt",), 1, 10),
    "cifar100": Layout("cifar-100-python", "cifar-100-binary", "cifar-100-python.tar.gz",
                       "cifar-100-binary.tar.gz", {"train": ("train",), "test": ("test",)},
                       "meta", ("fine_label_names.txt", "coarse_label_names.txt"), 2, 100),
}


def hwc_from_planes(rows: np.ndarray) -> np.ndarray:
    """CIFAR rows ``(N, 3072)`` as one contiguous ``(N, 32, 32, 3)`` uint8 array."""
    return np.ascontiguousarray(rows.reshape(-1, 3, SIDE, SIDE).transpose(0, 2, 3, 1))


def planes_from_hwc(images: np.ndarray) -> np.ndarray:
    """The inverse of :func:`hwc_from_planes`: ``(N, 32, 32, 3)`` to CIFAR rows ``(N, 3072)``."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), PIXELS))


def _field(d: dict, name: str, where: str):
    """``d[name]`` whether the pickle was written with Python 2 (bytes keys) or Python 3 (str keys)."""
    for key in (name.encode(), name):
        if key in d:
            return d[key]
    raise InputError(where, f"has no {name!r} entry", "use the official CIFAR file")


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class _Batch:
    """One batch file: ``images`` NHWC uint8, ``labels`` (fine), ``coarse`` or ``None``, ``filenames``."""

    def __init__(self, name, images, labels, coarse, filenames, where):
        self.name, self.images, self.labels, self.coarse, self.filenames, self.where = (
            name, images, labels, coarse, filenames, where)


class CifarSource(BaseSource):
    def __init__(self, root: Root, on_error: str = "fail", dataset: str = "cifar10",
                 limits: ArchiveLimits = ArchiveLimits(), allow_incomplete: bool = False, **options):
        if options:
            raise ConfigError(f"unknown {dataset} source options: {', '.join(sorted(options))}")
        super().__init__(root, on_error)
        self.allow_incomplete = allow_incomplete
        self.name = dataset
        self.layout = lay = LAYOUTS[dataset]
        self.limits = limits
        self._batches: dict[str, _Batch] | None = None
        self._classes: ClassInfo | None = None
        path = root.path
        first = lay.splits["train"][0]
        candidates = []
        if root.isfile(path):
            candidates.append(("tgz", path))
        elif root.isdir(path):
            if root.isfile(root.join(path, first)):
                candidates.append(("py", path))
            if root.isfile(root.join(path, first + ".bin")):
                candidates.append(("bin", path))
            for kind, name in (("py", lay.py_dir), ("bin", lay.bin_dir), ("tgz", lay.py_tgz), ("tgz", lay.bin_tgz)):
                full = root.join(path, name)
                if (root.isfile if kind == "tgz" else root.isdir)(full):
                    candidates.append((kind, full))
        if not candidates:
            raise SourceNotFound(root, f"{dataset} data ({lay.py_dir}/, {lay.bin_dir}/, {lay.py_tgz} or {lay.bin_tgz})",
                                 "point SRC at the folder that holds them, or at the archive")
        self.kind, self.path = candidates[0]

    def splits(self) -> list[str]:
        return sorted({split for split, names in self.layout.splits.items()
                       if any(n in self._load() for n in names)})

    def classes(self) -> ClassInfo:
        self._load()
        return self._classes

    # -- reading ----------------------------------------------------------------------------------------------

    def _load(self) -> dict[str, _Batch]:
        if self._batches is None:
            files = self._files()
            lay = self.layout
            binary = any(n.endswith(".bin") for n in files)
            batches = {}
            for names in lay.splits.values():
                for name in names:
                    fname = name + ".bin" if binary else name
                    if fname in files:
                        data, where = files[fname]
                        batches[name] = (self._read_bin if binary else self._read_py)(name, data, where)
            if not batches:
                raise SourceNotFound(self.path, f"any {self.name} batch ({', '.join(lay.splits['train'])})")
            self._check_complete(batches)
            self._classes = self._read_meta(files, binary)
            self._batches = batches
        return self._batches

    def _check_complete(self, batches: dict) -> None:
        """Every batch file the dataset ships for a split that is here (CIFAR-10's train split is five):
        a missing one is an error, or with ``allow_incomplete`` a line in the summary's skipped list."""
        for split, names in self.layout.splits.items():
            missing = [n for n in names if n not in batches]
            if not missing or len(missing) == len(names):
                continue
            what = (f"{', '.join(missing)} (the {self.name} {split} split has {len(names)} batch files; "
                    f"{len(names) - len(missing)} are here)")
            if not self.allow_incomplete:
                raise SourceNotFound(self.path, what, "restore the missing file (the official archive has it), "
                                     "or add --allow-incomplete to convert only the batches that are here")
            self._skipped.append(Skipped(f"{self.root.url(self.path)}", f"missing {what}; converted without it "
                                         "(--allow-incomplete)"))

    def _files(self) -> dict[str, tuple[bytes, str]]:
        """``{file name: (bytes, where)}`` of the batch and meta files, from a folder or one pass of a tar.gz."""
        lay = self.layout
        wanted = {n for names in lay.splits.values() for n in names}
        wanted |= {n + ".bin" for n in wanted} | {lay.py_meta, *lay.bin_meta}
        root = self.root
        url = root.url(self.path)
        if self.kind == "tgz":
            out = {}
            for name, data in stream_tar(url, lambda n: n.rsplit("/", 1)[-1] in wanted, limits=self.limits,
                                         on_problem=self.problem):
                base = name.rsplit("/", 1)[-1]
                if base in out:
                    self.problem(LabelError(f"{url}::{name}", f"repeats {base}, already read from "
                                            f"{out[base][1]}", "use the official archive"))
                    continue
                out[base] = (data, f"{url}::{name}")
            return out
        return {name: (root.read(root.join(self.path, name)), root.url(root.join(self.path, name)))
                for name, is_dir in root.listdir(self.path) if not is_dir and name in wanted}

    def _read_py(self, name: str, data: bytes, where: str) -> _Batch:
        d = safe_pickle.load(data, where)
        if not isinstance(d, dict):
            raise InputError(where, f"holds a {type(d).__name__}, not a CIFAR batch dict", "use the official file")
        rows = _field(d, "data", where)
        if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != PIXELS:
            raise InputError(where, f"has 'data' of {getattr(rows, 'dtype', type(rows).__name__)} "
                             f"{getattr(rows, 'shape', '')}, not uint8 (N, {PIXELS})", "use the official file")
        n = len(rows)
        labels = np.asarray(_field(d, "labels" if self.name == "cifar10" else "fine_labels", where), np.int64)
        coarse = (np.asarray(_field(d, "coarse_labels", where), np.int64) if self.name == "cifar100" else None)
        filenames = [_text(f) for f in _field(d, "filenames", where)]
        for what, arr in (("labels", labels), ("coarse labels", coarse), ("filenames", filenames)):
            if arr is not None and len(arr) != n:
                raise InputError(where, f"has {len(arr)} {what} for {n} images", "use the official file")
        return _Batch(name, hwc_from_planes(rows), labels, coarse, filenames, where)

    def _read_bin(self, name: str, data: bytes, where: str) -> _Batch:
        lay = self.layout
        size = lay.label_bytes + PIXELS
        if len(data) % size:
            raise InputError(where, f"is {len(data)} bytes, not a whole number of {size}-byte records",
                             "the file is truncated: download it again")
        recs = np.frombuffer(data, np.uint8).reshape(-1, size)
        labels = recs[:, lay.label_bytes - 1].astype(np.int64)
        coarse = recs[:, 0].astype(np.int64) if lay.label_bytes == 2 else None
        n = len(recs)
        return _Batch(name, hwc_from_planes(recs[:, lay.label_bytes:]), labels, coarse,
                      [f"{name}_{i:05d}.png" for i in range(n)], where)

    def _read_meta(self, files: dict, binary: bool) -> ClassInfo:
        lay = self.layout
        if binary:
            texts = []
            for fname in lay.bin_meta:
                if fname not in files:
                    raise SourceNotFound(self.path, fname, "the label names come from it")
                texts.append([ln.strip() for ln in files[fname][0].decode("utf-8", "replace").splitlines()
                              if ln.strip()])
            fine, coarse = texts[0], (texts[1] if len(texts) > 1 else None)
        else:
            if lay.py_meta not in files:
                raise SourceNotFound(self.path, lay.py_meta, "the label names come from it")
            data, where = files[lay.py_meta]
            d = safe_pickle.load(data, where)
            if self.name == "cifar10":
                fine, coarse = [_text(x) for x in _field(d, "label_names", where)], None
            else:
                fine = [_text(x) for x in _field(d, "fine_label_names", where)]
                coarse = [_text(x) for x in _field(d, "coarse_label_names", where)]
        return ClassInfo(names=fine, coarse_names=coarse)

    # -- items ------------------------------------------------------------------------------------------------

    def _list(self, split: str) -> list[Item]:
        batches = self._load()
        classes = self.classes()
        n_fine, n_coarse = len(classes.names), len(classes.coarse_names or ())
        items = []
        for name in self.layout.splits[split]:
            b = batches.get(name)
            if b is None:
                continue
            for i in range(len(b.images)):
                label = int(b.labels[i])
                meta = {"source": b.where, "filename": b.filenames[i]}
                bad = not 0 <= label < n_fine
                if b.coarse is not None:
                    meta["coarse_label"] = int(b.coarse[i])
                    bad = bad or not 0 <= meta["coarse_label"] < n_coarse
                if bad:
                    self.problem(LabelError(f"{b.where}[{i}]", f"has label {label}"
                                            f"{'/' + str(meta['coarse_label']) if b.coarse is not None else ''}, "
                                            f"outside the {n_fine} classes of the meta file", "use the official file"))
                    continue
                items.append(Item(f"{name}/{i:05d}", label, InlineRef(b.images[i]), meta))
        return items
