"""ImageNet (ILSVRC2012) in every layout it is found in, and generic image-folder / list-file datasets.

Labels are the index in the sorted wnid list, the convention of torchvision and of most converted copies.
``ILSVRC2012_validation_ground_truth.txt`` holds devkit ``ILSVRC2012_ID`` values, which follow WordNet order,
not wnid order: they are mapped through ``meta.mat`` (``ILSVRC2012_ID -> WNID -> sorted index``).
"""

from __future__ import annotations

import csv
import io
import math
import operator
import os
import posixpath
import re

from gpufeed.errors import ConfigError, InputError, LabelError, SourceNotFound, make_readable
from gpufeed.pipelines.archive import (ArchiveLimits, has_undecodable, index_ahead, index_tar, printable,
                                       stream_tar)
from gpufeed.pipelines.base import ClassInfo, FileRef, Item, ListedItems, MemberRun, Skipped, TarMemberRef
from gpufeed.pipelines.pooled import in_order, pieces, threads
from gpufeed.pipelines.sources import BaseSource, Root, read_named

#: What torchvision's ImageFolder accepts; anything else in a class folder is reported, not read.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
DEVKIT_DIR = "ILSVRC2012_devkit_t12"
DEVKIT_TAR = "ILSVRC2012_devkit_t12.tar.gz"
META_MAT = "meta.mat"
GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
SYNSET_MAPPING = "LOC_synset_mapping.txt"
LOC_VAL_SOLUTION = "LOC_val_solution.csv"
VAL_LABELS = "val_labels.txt"
#: The Kaggle copy of ILSVRC2012 nests the extracted tree here, with the LOC_* files at the top.
KAGGLE_TREE = "ILSVRC/Data/CLS-LOC"


EXPECTED = ("an ImageNet layout: train/ and val/ folders (train/<wnid>/*.JPEG), or ILSVRC2012_img_train.tar / "
            "ILSVRC2012_img_val.tar")


_NAME = operator.itemgetter(0)  # a tar index entry's name
#: Class folders one task of a source's pool walks (ImageNet's 1,000 make 125 tasks).
FOLDERS_PER_TASK = 8


def _stem(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[0] if "." in base else base


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


class _ImageSource(BaseSource):
    """Listing helpers shared by ImageNet and folder datasets."""

    def _tree_items(self, top: str, label_of: dict[str, int], meta_of, flat_file=None) -> ListedItems:
        """Items of ``top/<class>/**``; a class folder not in ``label_of`` is an unknown class.

        A file directly in ``top`` goes to ``flat_file(name)`` (flat ImageNet val) or is reported as unlabelled.
        The class folders are walked in the source's pool where it has one (a cold folder is a chain of reads).
        """
        items = ListedItems()
        entries = self.root.listdir(top)
        walked = in_order(self._listing_pool(), pieces, [self.root.join(top, cls) for cls, is_dir in entries
                                              if is_dir and cls in label_of], FOLDERS_PER_TASK, _walk_class, self.root,
                          told=self._telling(self.root.url(top), "class folders listed"))
        try:
            for cls, is_dir in entries:
                path = self.root.join(top, cls)
                if not is_dir:
                    item = flat_file(cls) if flat_file else self._unlabelled(path)
                    if item is not None:
                        items.append(item)
                    continue
                if cls not in label_of:
                    self.problem(LabelError(printable(self.root.url(path)), f"is a folder for the unknown class "
                                            f"{cls!r}", "remove it, or use a class list (devkit / "
                                            "LOC_synset_mapping.txt) that has it"))
                    continue
                meta, label = meta_of(cls), label_of[cls]
                walk, error = next(walked)
                if isinstance(error, InputError):  # a folder that cannot be listed: under skip, the class's left out
                    inside = "" if error.path == path else f"; inside {path}, all of which is left out with it"
                    self.problem(InputError(error.path, error.reason + (inside if self.on_error == "skip" else ""),
                                            f"{make_readable()}, or leave it out with --on-error skip"))
                    continue
                if error is not None:
                    raise error
                rels, plain = walk
                url = self.root.url(self.root.join(path, "x"))[:-1]  # "<folder>/", so that url + rel is the file's
                if plain:
                    items.add_files(f"{cls}/", url, label, meta, rels)
                    continue
                for rel in rels:
                    if rel.isascii() and _is_image(rel):
                        items.append(Item(f"{cls}/{rel}", label, FileRef(url + rel), meta))
                    else:
                        item = self._file_item(self.root.join(path, rel), f"{cls}/{rel}", label, meta)
                        if item is not None:
                            items.append(item)
        finally:
            walked.close()
        return items

    def _listing_pool(self):
        """The pool the source lists with: a conversion's processes for a local root (its lent :attr:`pool`, if
        any); for a remote one, threads of this process (:func:`~gpufeed.pipelines.pooled.threads`)."""
        return self.pool if self.root.local else threads()

    def _unlabelled(self, path: str) -> None:
        self.problem(LabelError(printable(self.root.url(path)), "is a file outside any class folder, so it has no "
                                "label", "move it into a class folder or delete it"))

    def _file_item(self, path: str, key: str, label, meta: dict) -> Item | None:
        url = self.root.url(path)
        if has_undecodable(key):
            self.problem(LabelError(printable(url), "has a file name that is not UTF-8, so it cannot be a stable key",
                                    "rename it with a UTF-8 name"))
            return None
        if not _is_image(key):
            self.problem(InputError(url, f"is not an image file (extensions read: {' '.join(IMAGE_EXTENSIONS)})",
                                    "delete it or give it an image extension"))
            return None
        return Item(key, label, FileRef(url), meta)


def _plain_images(names) -> bool:
    """Whether every name is plainly an image's (ASCII, with an image extension): the common case, checked in one
    comprehension, since per file this is a listing's cost (1.28 million in ImageNet's train split)."""
    return all([name.isascii() and name.lower().endswith(IMAGE_EXTENSIONS) for name in names])


def _walk_class(path: str, root: Root) -> tuple[list[str], bool]:
    """A class folder's files (relative paths, sorted), and whether they are :func:`_plain_images` (kept as their
    names; ``_file_item`` says what is wrong with a name otherwise); run in a pool's processes where the source
    has one."""
    rels = root.walk_files(path)
    return rels, _plain_images(rels)


class ImageNetSource(_ImageSource):
    name = "imagenet"

    LAYOUTS = ("auto", "tree", "archives")

    def __init__(self, root: Root, on_error: str = "fail", limits: ArchiveLimits = ArchiveLimits(),
                 layout: str = "auto", allow_incomplete: bool = False, **options):
        if options:
            raise ConfigError(f"unknown imagenet source options: {', '.join(sorted(options))}")
        self.allow_incomplete = allow_incomplete
        self._classes_listed = False  # True when the class list comes from the devkit or the synset mapping
        if layout not in self.LAYOUTS:
            raise ConfigError(f"imagenet layout must be one of {self.LAYOUTS}, not {layout!r}")
        super().__init__(root, on_error)
        self.limits = limits
        base = root.path
        self.train_dir = self.val_dir = self.train_tar = self.val_tar = None
        if root.isfile(base):
            name = posixpath.basename(base.replace("\\", "/"))
            if "train" in name and name.endswith(".tar"):
                self.train_tar = base
            elif "val" in name and name.endswith(".tar"):
                self.val_tar = base
            else:
                raise SourceNotFound(root, EXPECTED, f"{name} is neither {TRAIN_TAR} nor {VAL_TAR}")
            base = root.dirname(base)
        else:
            if not root.isdir(base):
                raise SourceNotFound(root, EXPECTED)
            tree = root.join(base, KAGGLE_TREE) if root.isdir(root.join(base, KAGGLE_TREE)) else base
            for split in ("train", "val") if layout != "archives" else ():
                if root.isdir(root.join(tree, split)):
                    setattr(self, f"{split}_dir", root.join(tree, split))
            # With both present, the extracted tree wins under "auto": reading files needs no index pass.
            for attr, fname in (("train_tar", TRAIN_TAR), ("val_tar", VAL_TAR)) if layout != "tree" else ():
                if getattr(self, attr.replace("tar", "dir")) is None and root.isfile(root.join(base, fname)):
                    setattr(self, attr, root.join(base, fname))
        if not (self.train_dir or self.val_dir or self.train_tar or self.val_tar):
            raise SourceNotFound(root, EXPECTED, "point SRC at the folder that holds them")
        self.base = base
        self._classes: ClassInfo | None = None
        self._id_to_wnid: dict[int, str] | None = None
        self._devkit_files: dict[str, bytes] | None = None
        self._class_meta: dict[str, dict] = {}
        self._val_ahead = None  # the val tar's index begun in the pool (expect)

    def splits(self) -> list[str]:
        return [s for s in ("train", "val") if getattr(self, f"{s}_dir") or getattr(self, f"{s}_tar")]

    def expect(self, splits: list[str]) -> None:
        """The val tar, listed after another split, is indexed in the listing's pool meanwhile (where the source has
        one), its spans side by side: 50,000 headers ~128 KB apart that otherwise are read only once the train
        split is listed, one after another."""
        pool = self._listing_pool()
        if pool is not None and self.val_tar and not self.val_dir and "val" in splits[1:]:
            self._val_ahead = index_ahead(self.root.url(self.val_tar), pool, limits=self.limits)

    # -- class list -------------------------------------------------------------------------------------------

    def _find(self, *names: str) -> str | None:
        for name in names:
            path = self.root.join(self.base, name)
            if self.root.isfile(path):
                return path
        return None

    def _devkit(self) -> dict[str, tuple[bytes, str]]:
        """``{file: (bytes, where)}`` of ``meta.mat`` and the validation ground truth, from a devkit folder or
        its ``.tar.gz``, when present."""
        if self._devkit_files is None:
            found = {}
            for fname in (META_MAT, GROUND_TRUTH):
                path = self._find(f"{DEVKIT_DIR}/data/{fname}", f"data/{fname}", fname)
                if path is not None:
                    found[fname] = (self.root.read(path), self.root.url(path))
            tar = self._find(DEVKIT_TAR)
            if len(found) < 2 and tar is not None:
                url = self.root.url(tar)
                wanted = {f"{DEVKIT_DIR}/data/{META_MAT}": META_MAT, f"{DEVKIT_DIR}/data/{GROUND_TRUTH}": GROUND_TRUTH}
                for name, data in stream_tar(url, lambda n: n in wanted, limits=self.limits, on_problem=self.problem):
                    found.setdefault(wanted[name], (data, f"{url}::{name}"))
            self._devkit_files = found
        return self._devkit_files

    def classes(self) -> ClassInfo:
        if self._classes is None:
            self._classes = self._load_classes()
            self._label_of = {w: i for i, w in enumerate(self._classes.names)}
        return self._classes

    def _load_classes(self) -> ClassInfo:
        meta = self._devkit().get(META_MAT)
        if meta is not None:
            wnids, texts, self._id_to_wnid = _read_meta_mat(*meta)
            self._classes_listed = True
            return ClassInfo(names=wnids, synsets=wnids, texts=texts)
        mapping = self._find(SYNSET_MAPPING)
        if mapping is not None:
            pairs = _read_synset_mapping(self.root.read(mapping), self.root.url(mapping))
            wnids = sorted(pairs)
            self._classes_listed = True
            return ClassInfo(names=wnids, synsets=wnids, texts=[pairs[w] for w in wnids])
        if self.train_dir:
            wnids = [n for n, is_dir in self.root.listdir(self.train_dir) if is_dir]
        elif self.train_tar:
            # Outer headers only; refused members are reported when the train split itself is listed.
            index = index_tar(self.root.url(self.train_tar), limits=self.limits, on_problem=lambda e: None)
            wnids = sorted(_stem(e.name) for e, _ in index if e.name.endswith(".tar"))
        elif self.val_dir and any(is_dir for _, is_dir in self.root.listdir(self.val_dir)):
            wnids = [n for n, is_dir in self.root.listdir(self.val_dir) if is_dir]
        else:
            labels = set(self._val_labels()[0].values())
            if labels and all(v.isdigit() for v in labels):
                return ClassInfo(names=[str(i) for i in range(max(int(v) for v in labels) + 1)])
            wnids = sorted(labels)
        if not wnids:
            raise SourceNotFound(self.root, "any ImageNet class (train/<wnid>/ folders or per-class tars)")
        return ClassInfo(names=wnids, synsets=wnids)

    def labels(self) -> dict[str, int]:
        """``{wnid: label}``."""
        self.classes()
        return self._label_of

    def _meta_of(self, wnid: str) -> dict:
        """The class's metadata, one dict shared by its items (Item.origin already names each file).

        A million items would otherwise carry a million copies; readers copy before adding to it.
        """
        if wnid not in self._class_meta:
            texts = self.classes().texts
            self._class_meta[wnid] = {"synset": wnid, "text": texts[self._label_of[wnid]]} if texts else \
                {"synset": wnid}
        return self._class_meta[wnid]

    # -- validation labels ------------------------------------------------------------------------------------

    def _val_labels(self) -> tuple[dict[str, str], str]:
        """``{file stem: wnid}`` for flat validation files, and where it came from."""
        found = self._devkit().get(GROUND_TRUTH)
        if found is not None:
            truth, where = found
            self.classes()
            if self._id_to_wnid is None:
                raise SourceNotFound(self.root, f"{DEVKIT_DIR}/data/{META_MAT}",
                                     f"{GROUND_TRUTH} holds devkit ILSVRC2012_IDs, which only meta.mat maps to wnids")
            out = {}
            for n, line in enumerate(truth.decode("ascii", "replace").split(), 1):
                try:
                    wnid = self._id_to_wnid[int(line)]
                except (KeyError, ValueError):
                    raise LabelError(where, f"line {n} holds {line!r}, which is no ILSVRC2012_ID in meta.mat",
                                     "use the ground truth and meta.mat of the same devkit") from None
                out[f"ILSVRC2012_val_{n:08d}"] = wnid
            return out, where
        solution = self._find(LOC_VAL_SOLUTION)
        if solution is not None:
            return _read_loc_solution(self.root.read(solution), self.root.url(solution)), LOC_VAL_SOLUTION
        plain = self._find(VAL_LABELS) or (self.val_dir and (
            self.root.join(self.val_dir, VAL_LABELS) if self.root.isfile(self.root.join(self.val_dir, VAL_LABELS))
            else None))
        if plain:
            return _read_plain_labels(self.root.read(plain), self.root.url(plain)), VAL_LABELS
        raise SourceNotFound(self.root, "labels for the flat val/ILSVRC2012_val_*.JPEG files",
                             f"add the devkit ({DEVKIT_DIR}/ or {DEVKIT_TAR}), {LOC_VAL_SOLUTION} or a "
                             f"{VAL_LABELS} of 'file wnid' lines")

    def _flat_label(self, key: str, origin: str, labels: dict[str, str], where: str):
        wnid = labels.get(_stem(key))
        if wnid is None:
            self.problem(LabelError(origin, f"has no label in {where}", "add it there or remove the file"))
            return None
        if wnid.isdigit():
            index, names = int(wnid), self.classes().names
            if index >= len(names):
                self.problem(LabelError(origin, f"has label {index} in {where}, outside 0..{len(names) - 1}",
                                        "fix the label file"))
                return None
            wnid = names[index]
        if wnid not in self.labels():
            self.problem(LabelError(origin, f"is labelled with the unknown synset {wnid!r} in {where}",
                                    "use a label file and class list of the same release"))
            return None
        return wnid

    # -- listing ----------------------------------------------------------------------------------------------

    def _list(self, split: str) -> list[Item]:
        folder, tar = getattr(self, f"{split}_dir"), getattr(self, f"{split}_tar")
        if folder:
            items = self._val_tree_items(folder) if split == "val" else self._tree_items(
                folder, self.labels(), self._meta_of)
        else:
            items = self._train_tar_items(tar) if split == "train" else self._val_tar_items(tar)
        if split == "train":
            self._check_complete(items)
        return items

    def _check_complete(self, items: list[Item]) -> None:
        """Every class the devkit (or the synset mapping) lists has training images: a class with none means
        a train folder or per-class tar is missing, an error unless ``allow_incomplete``."""
        classes = self.classes()
        if not self._classes_listed:
            return  # the classes were read from the training data itself
        if self.train_dir:  # a class folder whose images were all skipped is not a missing class
            present = {n for n, is_dir in self.root.listdir(self.train_dir) if is_dir}
        else:
            runs = items.runs() if isinstance(items, ListedItems) else [(None, items)]
            labels = {it.label for folder, run in runs if folder is None for it in run}
            labels.update(folder.label for folder, _ in runs if isinstance(folder, MemberRun))  # no Item made
            present = {classes.names[label] for label in labels}
        missing = [w for w in classes.names if w not in present]
        if not missing:
            return
        where = self.root.url(self.train_dir or self.train_tar)
        what = (f"training images of {len(missing)} of the {len(classes.names)} classes the devkit lists "
                f"({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''})")
        if not self.allow_incomplete:
            raise SourceNotFound(where, what, "restore their folders or per-class tars, or add --allow-incomplete "
                                 "to convert the classes that are here (the labels keep the devkit's numbering)")
        self._skipped.append(Skipped(where, f"no {what}; converted without them (--allow-incomplete)"))

    def _val_tree_items(self, folder: str) -> list[Item]:
        found = {}

        def flat_file(name: str) -> Item | None:
            if name == VAL_LABELS:
                return None
            if not found:
                found["labels"] = self._val_labels()
            labels, where = found["labels"]
            path = self.root.join(folder, name)
            wnid = self._flat_label(name, self.root.url(path), labels, where)
            return None if wnid is None else self._file_item(path, name, self.labels()[wnid], self._meta_of(wnid))

        return self._tree_items(folder, self.labels(), self._meta_of, flat_file)

    def _train_tar_items(self, tar: str) -> ListedItems:
        url = self.root.url(tar)
        label_of = self.labels()
        runs = []
        for outer, inner in index_tar(url, limits=self.limits, on_problem=self.problem,
                                      nested=lambda e: e.name.endswith(".tar"), pool=self._listing_pool(),
                                      told=self._telling(url, "class tars indexed")):
            if inner is None:
                self.problem(InputError(f"{url}::{outer.name}", "is not a per-class tar; "
                                        f"{TRAIN_TAR} holds only <wnid>.tar members", "remove it from the archive"))
                continue
            wnid = _stem(outer.name)
            if wnid not in label_of:
                self.problem(LabelError(f"{url}::{outer.name}", f"is a tar for the unknown synset {wnid!r}",
                                        "use a class list (devkit / LOC_synset_mapping.txt) that has it"))
                continue
            # The members are kept as their index's entries (ListedItems makes an Item of one where it is used).
            if not _plain_images([e.name for e in inner]):
                images = []
                for e in inner:
                    if _is_image(e.name):
                        images.append(e)
                    else:
                        self.problem(InputError(f"{url}::{outer.name}/{e.name}", "is not an image file",
                                                "remove it from the archive"))
                inner = images
            run = MemberRun(f"{wnid}/", url, label_of[wnid], self._meta_of(wnid), f"{outer.name}/")
            runs.append((run, sorted(inner, key=_NAME)))  # by name (a tar keeps its members in any order)
        items = ListedItems()
        for run, entries in sorted(runs, key=lambda r: r[0].key_prefix):  # prefixes end in "/": keys sort alike
            items.add_members(run, entries)
        return items

    def _val_tar_items(self, tar: str) -> list[Item]:
        url = self.root.url(tar)
        labels, where = self._val_labels()
        items = []
        ahead, self._val_ahead = self._val_ahead, None
        for e, _ in index_tar(url, limits=self.limits, on_problem=self.problem, pool=self._listing_pool(), ahead=ahead,
                              told=self._telling(url, "parts indexed")):
            origin = f"{url}::{e.name}"
            if not _is_image(e.name):
                self.problem(InputError(origin, "is not an image file", "remove it from the archive"))
                continue
            wnid = self._flat_label(e.name, origin, labels, where)
            if wnid is not None:
                items.append(Item(e.name, self.labels()[wnid], TarMemberRef(url, e.offset, e.size, e.name),
                                  self._meta_of(wnid)))
        return items


def _read_meta_mat(data: bytes, where: str) -> tuple[list[str], list[str], dict[int, str]]:
    """Sorted leaf wnids, their words, and ``{ILSVRC2012_ID: wnid}`` from the devkit's ``meta.mat``."""
    import scipy.io

    try:
        synsets = scipy.io.loadmat(io.BytesIO(data), squeeze_me=True)["synsets"]
        rows = [(int(s["ILSVRC2012_ID"]), str(s["WNID"]), str(s["words"]), int(s["num_children"]))
                for s in synsets.ravel()]
    except Exception as e:  # scipy raises many kinds on a damaged .mat
        raise InputError(where, f"is not a readable ILSVRC2012 meta.mat with a 'synsets' struct ({e})",
                         "use the devkit's data/meta.mat") from e
    leaves = sorted((wnid, words, sid) for sid, wnid, words, children in rows if children == 0)
    if not leaves:
        raise LabelError(where, "lists no leaf synsets (num_children == 0)", "use the devkit's data/meta.mat")
    ids: dict[int, str] = {}
    for wnid, _, sid in leaves:
        if sid in ids:
            raise LabelError(where, f"gives ILSVRC2012_ID {sid} to both {ids[sid]} and {wnid}",
                             "use the devkit's data/meta.mat")
        ids[sid] = wnid
    return [w for w, _, _ in leaves], [t for _, t, _ in leaves], ids


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LabelError(where, f"is not UTF-8 text ({e})", "save it as UTF-8") from e


def _read_synset_mapping(data: bytes, where: str) -> dict[str, str]:
    out = {}
    for n, line in enumerate(_decode(data, where).splitlines(), 1):
        if not line.strip():
            continue
        wnid, _, text = line.strip().partition(" ")
        if wnid in out:
            raise LabelError(where, f"line {n} repeats synset {wnid}", "keep one line per synset")
        out[wnid] = text.strip()
    return out


def _read_loc_solution(data: bytes, where: str) -> dict[str, str]:
    out = {}
    rows = csv.reader(io.StringIO(_decode(data, where)))
    header = next(rows, None)
    if header is None or [h.strip() for h in header[:2]] != ["ImageId", "PredictionString"]:
        raise LabelError(where, "does not start with the header 'ImageId,PredictionString'",
                         "use Kaggle's LOC_val_solution.csv")
    for n, row in enumerate(rows, 2):
        if not row:
            continue
        if len(row) < 2 or not row[1].split():
            raise LabelError(where, f"line {n} has no prediction string", "use Kaggle's LOC_val_solution.csv")
        if row[0] in out:
            raise LabelError(where, f"line {n} repeats image {row[0]}", "keep one line per image")
        out[_stem(row[0])] = row[1].split()[0]
    return out


def _read_plain_labels(data: bytes, where: str) -> dict[str, str]:
    """``file label`` lines, label a wnid or a sorted-wnid index; commas or whitespace separate."""
    out = {}
    for n, line in enumerate(_decode(data, where).splitlines(), 1):
        parts = line.replace(",", " ").split()
        if not parts:
            continue
        if len(parts) != 2:
            raise LabelError(where, f"line {n} is {line!r}, not 'file label'", "write one 'file label' per line")
        stem = _stem(parts[0])
        if stem in out:
            raise LabelError(where, f"line {n} repeats {parts[0]}", "keep one line per file")
        out[stem] = parts[1]
    return out


class FolderSource(_ImageSource):
    """``root/<class>/**`` (one split, ``train``), ``root/<split>/<class>/**``, or a list file.

    Classes are the sorted union of class folder names. A list file (``list_file=``) is an im2rec ``.lst``
    (``index<TAB>label[<TAB>label...]<TAB>path``) or a Caffe list (``path label``); its paths are relative to
    ``src``, its items keep the list's order, an im2rec list's index column is each item's ``list_index`` (the
    record id RecordIO stores, as im2rec does), and its stem names the split (``train.lst`` -> ``train``,
    ``mydata_val.lst`` -> ``mydata_val``, as im2rec names ``mydata_val.rec``) unless ``split`` names it.
    """

    name = "folder"
    SPLIT_NAMES = ("train", "val", "validation", "valid", "test")

    def __init__(self, root: Root, on_error: str = "fail", list_file: str | None = None, split: str | None = None,
                 **options):
        if options:
            raise ConfigError(f"unknown folder source options: {', '.join(sorted(options))}")
        super().__init__(root, on_error)
        if not root.isdir(root.path):
            raise SourceNotFound(root, "the image folder", "point SRC at root/<class>/* or root/<split>/<class>/*")
        self.list_file = list_file
        self.listed_order = bool(list_file)
        self._list_items: list[Item] | None = None
        self._classes: ClassInfo | None = None
        if list_file:
            self._splits = {split_of_list(list_file, split): None}
        else:
            dirs = [n for n, is_dir in root.listdir(root.path) if is_dir]
            if not dirs:
                raise SourceNotFound(root, "class folders (root/<class>/*)")
            if all(d in self.SPLIT_NAMES for d in dirs):
                self._splits = {d: root.join(root.path, d) for d in dirs}
            else:
                self._splits = {"train": root.path}

    def splits(self) -> list[str]:
        return sorted(self._splits)

    def classes(self) -> ClassInfo:
        if self._classes is None:
            if self.list_file:
                labels = {it.label for it in self._read_list() if isinstance(it.label, int)}
                self._classes = ClassInfo(names=[str(i) for i in range(max(labels, default=-1) + 1)])
            else:
                names = set()
                for top in self._splits.values():
                    names.update(n for n, is_dir in self.root.listdir(top) if is_dir)
                self._classes = ClassInfo(names=sorted(names))
        return self._classes

    def _list(self, split: str) -> list[Item]:
        if self.list_file:
            return self._read_list()
        label_of = {n: i for i, n in enumerate(self.classes().names)}
        return self._tree_items(self._splits[split], label_of, lambda cls: {})

    def _read_list(self) -> list[Item]:
        if self._list_items is not None:
            return self._list_items
        lf = self.list_file
        url = lf if ("://" in lf or os.path.isabs(lf)) else self.root.url(self.root.join(self.root.path, lf))
        try:
            text = _decode(read_named(url), url)
        except FileNotFoundError as e:
            raise SourceNotFound(url, "the list file") from e
        items = []
        indexes: dict[int, int] = {}
        first = True
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if first:
                self._check_first_path(url, line)
                first = False
            meta = {}
            if "\t" in line:
                parts = line.split("\t")
                rel, fields = parts[-1], parts[1:-1]
                index = _parse_index(parts[0])
                if index is None:
                    self.problem(LabelError(f"{url}:{n}", f"starts with {parts[0]!r}, not an im2rec index (an integer "
                                            f"0..2**64-1)", "fix the line"))
                    continue
                if index in indexes:
                    self.problem(LabelError(f"{url}:{n}", f"repeats the index {index} of line {indexes[index]}; "
                                            "im2rec indexes are the records' ids, one per line", "renumber the list"))
                    continue
                indexes[index] = n
                meta["list_index"] = index
            else:
                rel, _, lab = line.strip().rpartition(" ")
                fields = [lab]
            label = _parse_label(fields)
            if not rel or label is None:
                self.problem(LabelError(f"{url}:{n}", f"is {line!r}, not 'index<TAB>label<TAB>path' (im2rec) or "
                                        f"'path label' (Caffe) with an integer label 0..{MAX_LIST_CLASSES - 1} (or "
                                        "several finite ones)", "fix the line"))
                continue
            item = self._file_item(self.root.join(self.root.path, rel), rel, label, meta)
            if item is not None:
                items.append(item)
        if first:
            raise SourceNotFound(url, "a single line", "an im2rec .lst has index<TAB>label<TAB>path lines, a Caffe "
                                 "list 'path label' lines")
        self._list_items = items
        return items


    def _check_first_path(self, url: str, line: str) -> None:
        """A list whose first file is not under the root was given the wrong root: said once, not as one
        missing file per line."""
        rel = line.split("\t")[-1] if "\t" in line else line.strip().rpartition(" ")[0]
        if rel and not self.root.exists(self.root.join(self.root.path, rel)):
            raise SourceNotFound(self.root.join(self.root.path, rel), f"the first file {url} lists",
                                 f"its paths start from --root, now {self.root.path}: give the folder they are "
                                 "relative to")


#: A split name a list file gives (its stem, or --split): what every format puts in its file names.
SPLIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def split_of_list(list_file: str, split: str | None = None) -> str:
    """The split a list file converts to: ``split`` where given, else the list's stem, as im2rec names its
    ``.rec`` after its ``.lst`` (``train.lst`` -> ``train``, ``mydata_val.lst`` -> ``mydata_val``)."""
    name = split if split is not None else _stem(list_file)
    if not SPLIT_NAME.fullmatch(name) or name.endswith("."):
        where = "--split" if split is not None else f"the list file's name {list_file}"
        raise ConfigError(f"{where} gives the split name {name!r}; a split name is letters, digits, '_', '-' and '.' "
                          "(it names every output file): rename the list, or give --split NAME")
    return name


def _parse_index(text: str) -> int | None:
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if 0 <= value < 1 << 64 else None


#: The most classes a list file's labels may name (its class list has a line per class up to the largest
#: label): ImageNet-21k has 21,841, Google Landmarks v2 203,094. A label beyond is taken for an id in the
#: label column, not a class, rather than be written out as millions of class lines.
MAX_LIST_CLASSES = 1_000_000


def _parse_label(fields: list[str]):
    """One non-negative integer class below :data:`MAX_LIST_CLASSES`, or (im2rec multi-label) a tuple of
    finite floats; ``None`` if malformed."""
    try:
        values = [float(x) for x in fields]
    except ValueError:
        return None
    if not values or not all(math.isfinite(v) for v in values):
        return None
    if len(values) > 1:
        return tuple(values)
    if 0 <= values[0] < MAX_LIST_CLASSES and values[0] == int(values[0]):
        return int(values[0])
    return None
