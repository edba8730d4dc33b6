"""Synthetic datasets written in the real on-disk layouts: ``gpufeed synth imagenet|cifar10|cifar100|ptb OUT``.

The point is to exercise the same code paths as the real downloads, so the files copy the originals' shape:

- ImageNet: ``train/<wnid>/<wnid>_<n>.JPEG`` and flat ``val/ILSVRC2012_val_%08d.JPEG`` (tree), or
  ``ILSVRC2012_img_train.tar`` (a tar of per-class tars) and ``ILSVRC2012_img_val.tar`` (archives), with the
  devkit (``meta.mat`` holding a ``synsets`` struct array whose ILSVRC2012_IDs are *not* in wnid order, and
  ``ILSVRC2012_validation_ground_truth.txt``), ``LOC_synset_mapping.txt`` and ``LOC_val_solution.csv``.
  JPEGs have photo-like content (smooth colour fields, lighting gradients, shapes, texture), so they compress
  like photos (~100 KB at 500x375, quality 90), and ImageNet's spread of sizes. A few known bad files are
  planted (a CMYK JPEG, a PNG named ``.JPEG``, a truncated JPEG, a grayscale JPEG) and listed in ``synth.json``.
- CIFAR: pickles byte-compatible with the official Python 2 files (protocol 2, ``str`` keys that Python 3
  loads as ``bytes`` with ``encoding='bytes'`` and as ``str`` with ``encoding='latin1'``, as torchvision does),
  the binary records, and both ``.tar.gz`` downloads.
- Penn Treebank: ``simple-examples/data/ptb.{train,valid,test}.txt`` with a Zipf vocabulary, ``<unk>`` and
  ``N``, and ``simple-examples.tgz``.

Everything is a pure function of the seed: the same arguments give the same bytes.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import struct
import tarfile

import numpy as np

from gpufeed.errors import ConfigError

LAYOUTS = ("tree", "archives", "both")
CIFAR_FORMS = ("python", "binary", "targz")

CIFAR10_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR100_COARSE = (
    "aquatic_mammals", "fish", "flowers", "food_containers", "fruit_and_vegetables",
    "household_electrical_devices", "household_furniture", "insects", "large_carnivores",
    "large_man-made_outdoor_things", "large_natural_outdoor_scenes", "large_omnivores_and_herbivores",
    "medium_mammals", "non-insect_invertebrates", "people", "reptiles", "small_mammals", "trees", "vehicles_1",
    "vehicles_2")
CIFAR100_FINE = tuple("""apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus
butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch crab crocodile cup
dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo keyboard lamp lawn_mower leopard lion
lizard lobster man maple_tree motorcycle mountain mouse mushroom oak_tree orange orchid otter palm_tree pear
pickup_truck pine_tree plain plate poppy porcupine possum rabbit raccoon ray road rocket rose sea seal shark
shrew skunk skyscraper snail snake spider squirrel streetcar sunflower sweet_pepper table tank telephone
television tiger tractor train trout tulip turtle wardrobe whale willow_tree wolf woman worm""".split())

#: (probability, (width, height) choices): ImageNet is mostly ~500x375 photos, portrait or landscape, with
#: some small images and ~3% large ones; "huge" stands for the few multi-megapixel originals (up to 3888x2592).
#: This mix averages ~120 KB per JPEG, near the real mean (~110 KB): benchmarks move realistic bytes per image.
SIZE_MIX = (
    (0.84, ((500, 375), (375, 500), (500, 333), (333, 500), (500, 400), (500, 500))),
    (0.13, ((250, 188), (160, 120), (300, 225), (500, 120))),
    (0.025, ((1600, 1200), (1200, 1600))),
    (0.005, ((2592, 1944), (3888, 2592))),
)
#: Noise amplitude that makes 500x375 quality-90 JPEGs land near the real ImageNet mean (~110 KB).
TEXTURE_SIGMA = 22.0
_TILE = 256

MAT_HEADER = b"MATLAB 5.0 MAT-file, Platform: GLNXA64, Created on: Tue May  1 00:00:00 2012".ljust(116)

_WORDS = ("red", "spotted", "common", "great", "lesser", "striped", "golden", "wild", "grey", "crested", "tench",
          "finch", "heron", "terrier", "beetle", "lizard", "kettle", "barrow", "lantern", "spaniel", "warbler",
          "jay", "otter", "cannon", "sloop", "teapot", "mantis", "gecko", "toucan", "canoe")


# -- images -----------------------------------------------------------------------------------------------------


def _texture(rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal((_TILE, _TILE, 3), dtype=np.float32) * TEXTURE_SIGMA)


def photo_like(rng: np.random.Generator, height: int, width: int, texture: np.ndarray | None = None) -> np.ndarray:
    """An HxWx3 uint8 image that compresses like a photo: not flat colour, not white noise."""
    import cv2

    # Colour fields and mid-scale detail are built at 1/24 scale and upscaled once: full-size passes are the cost.
    gh, gw = max(2, height // 24), max(2, width // 24)
    lo = rng.uniform(0, 255, (int(rng.integers(2, 6)), int(rng.integers(2, 6)), 3)).astype(np.float32)
    grid = cv2.resize(lo, (gw, gh), interpolation=cv2.INTER_CUBIC)
    grid += rng.uniform(-35, 35, (gh, gw, 3)).astype(np.float32)
    grid += (np.linspace(-1, 1, gh, dtype=np.float32)[:, None] * np.float32(rng.uniform(-40, 40))
             + np.linspace(-1, 1, gw, dtype=np.float32)[None, :] * np.float32(rng.uniform(-40, 40)))[:, :, None]
    img = cv2.resize(grid, (width, height), interpolation=cv2.INTER_LINEAR)
    for _ in range(int(rng.integers(2, 6))):
        colour = tuple(float(c) for c in rng.uniform(0, 255, 3))
        centre = (int(rng.integers(0, width)), int(rng.integers(0, height)))
        axes = (int(rng.integers(width // 16 + 1, width // 3 + 2)),
                int(rng.integers(height // 16 + 1, height // 3 + 2)))
        if rng.random() < 0.6:
            cv2.ellipse(img, centre, axes, float(rng.uniform(0, 180)), 0, 360, colour, -1, cv2.LINE_AA)
        else:
            cv2.rectangle(img, (centre[0] - axes[0], centre[1] - axes[1]), (centre[0] + axes[0], centre[1] + axes[1]),
                          colour, -1, cv2.LINE_AA)
    texture = _texture(rng) if texture is None else texture
    oy, ox = int(rng.integers(0, _TILE)), int(rng.integers(0, _TILE))
    reps = (-(-(height + oy) // _TILE), -(-(width + ox) // _TILE), 1)
    img += np.tile(texture, reps)[oy:oy + height, ox:ox + width]
    return np.clip(img, 0, 255, out=img).astype(np.uint8)


def synth_jpeg(rng: np.random.Generator, height: int, width: int, quality: int = 90,
               texture: np.ndarray | None = None) -> bytes:
    """A baseline JPEG of photo-like content (``texture``: a reusable noise tile, to save time in bulk)."""
    import cv2

    ok, buf = cv2.imencode(".jpg", photo_like(rng, height, width, texture), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"OpenCV could not encode a {width}x{height} JPEG")
    return buf.tobytes()


def _image_size(rng: np.random.Generator) -> tuple[int, int]:
    """``(height, width)`` drawn from :data:`SIZE_MIX`."""
    r, acc = rng.random(), 0.0
    for p, choices in SIZE_MIX:
        acc += p
        if r < acc:
            break
    w, h = choices[int(rng.integers(0, len(choices)))]
    return h, w


def _bad_file(kind: str, rng: np.random.Generator, texture: np.ndarray) -> bytes:
    """The known ImageNet oddities, real bytes of each."""
    import cv2
    from PIL import Image

    pixels = photo_like(rng, 375, 500, texture)
    if kind == "cmyk":
        out = io.BytesIO()
        Image.fromarray(pixels[:, :, ::-1]).convert("CMYK").save(out, "JPEG", quality=90)
        return out.getvalue()
    if kind == "png":
        return cv2.imencode(".png", pixels)[1].tobytes()
    if kind == "gray":
        gray = cv2.cvtColor(pixels, cv2.COLOR_BGR2GRAY)
        return cv2.imencode(".jpg", gray, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
    if kind == "truncated":
        whole = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
        return whole[: len(whole) * 3 // 5]
    raise ValueError(kind)


BAD_KINDS = ("cmyk", "png", "truncated", "gray")
#: What each planted file is, and whether a conversion can keep it (ILSVRC2012 train holds CMYK JPEGs, a PNG
#: named .JPEG and grayscale JPEGs, which a converter must read; a truncated JPEG cannot be converted whole).
_BAD_WORDS = {"cmyk": ("a CMYK JPEG", True), "png": ("a PNG named .JPEG", True), "gray": ("a grayscale JPEG", True),
              "truncated": ("a truncated JPEG", False)}


def describe_planted(planted: dict) -> str:
    """``synth_imagenet``'s ``bad_files`` in words: which will be converted and which skipped."""
    if not planted:
        return "no awkward files planted"
    kinds = [_BAD_WORDS[k] for k in sorted(set(planted.values()), key=BAD_KINDS.index)]
    kept = [w for w, ok in kinds if ok]
    lost = [w for w, ok in kinds if not ok]
    parts = [f"{', '.join(kept)} (converted)"] if kept else []
    parts += [f"{', '.join(lost)} (skipped under --on-error skip)"] if lost else []
    return f"{len(planted)} awkward file{'s' * (len(planted) > 1)} planted: " + "; ".join(parts)


# -- ImageNet ---------------------------------------------------------------------------------------------------


def _wnids(rng: np.random.Generator, n: int) -> list[str]:
    """Sorted, unique, real-looking WordNet ids (``n`` + 8 digits, the range ILSVRC2012 uses)."""
    nums = rng.choice(np.arange(1_440_000, 15_100_000), size=n, replace=False)
    return sorted(f"n{int(x):08d}" for x in nums)


def _words(rng: np.random.Generator) -> str:
    a, b, c = (str(w) for w in rng.choice(_WORDS, 3, replace=False))
    return f"{a} {b}, {b} {c}"


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    # Fixed owner and time: the same seed gives the same archive bytes.
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o644, "", ""
    return info


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _targz(path: str, files: list[tuple[str, bytes]]) -> None:
    """A gzip'd tar whose bytes depend only on ``files`` (gzip's header time fixed at 0)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in files:
            _add(tar, name, data)


def _meta_mat(wnids: list[str], texts: list[str], ids: dict[str, int], per_class: int) -> bytes:
    """``meta.mat`` in the devkit's structure: leaves first (IDs 1..N), then parent synsets with children."""
    import scipy.io

    fields = ("ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images")
    n = len(wnids)
    leaves = sorted(wnids, key=lambda w: ids[w])
    # Two parents of half the leaves each and one root above them, as the real hierarchy nests leaves.
    halves = [leaves[: (n + 1) // 2], leaves[(n + 1) // 2:]] if n > 1 else [leaves]
    rows = [(ids[w], w, texts[wnids.index(w)], f"synthetic class {w}", 0, np.zeros((1, 0), np.uint16), 0, per_class)
            for w in leaves]
    parent_ids = []
    for k, half in enumerate(halves):
        pid = n + 1 + k
        parent_ids.append(pid)
        rows.append((pid, f"n{9_000_000 + k:08d}", f"synthetic group {k}", "a group of synthetic classes",
                     len(half), np.array([[ids[w] for w in half]], np.uint16), 1, per_class * len(half)))
    rows.append((n + 1 + len(halves), "n00001740", "entity", "that which is perceived to have its own existence",
                 len(parent_ids), np.array([parent_ids], np.uint16), 2, per_class * n))
    synsets = np.empty((len(rows), 1), dtype=[(f, object) for f in fields])
    for i, (sid, wnid, words, gloss, nch, children, height, ntrain) in enumerate(rows):
        synsets[i, 0] = (np.array([[sid]], np.uint16), np.array([wnid]), np.array([words]), np.array([gloss]),
                         np.array([[nch]], np.uint16), children, np.array([[height]], np.uint8),
                         np.array([[ntrain]], np.uint16))
    out = io.BytesIO()
    scipy.io.savemat(out, {"synsets": synsets})
    # savemat stamps the current time into the 116-byte text header; a fixed one keeps the bytes seed-only.
    return MAT_HEADER + out.getvalue()[len(MAT_HEADER):]


def _fresh_or_ours(out: str) -> None:
    """``out`` is new, empty, or an earlier ``gpufeed synth`` output (its ``synth.json``): synthetic data takes
    the dataset's real file names (``ILSVRC2012_img_train.tar``, ``data_batch_1``, ``ptb.train.txt``), so
    anywhere else it would overwrite a user's dataset with noise (a real ImageNet tar was replaced)."""
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out):
        raise ConfigError(f"{out} is not a folder; give a new or empty folder for the synthetic dataset")
    names = sorted(os.listdir(out))
    if not names:
        return
    try:
        with open(os.path.join(out, "synth.json"), "rb") as f:
            if isinstance(json.loads(f.read(1 << 20)), dict):
                return
    except (OSError, ValueError):
        pass
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise ConfigError(f"{out} holds {shown} and no synth.json, so it is not an earlier gpufeed synth output: "
                      "synthetic data takes the real dataset's file names and would overwrite yours; give a new or "
                      "empty folder")


def synth_imagenet(out: str, classes: int = 10, per_class: int = 20, val_per_class: int = 5, seed: int = 0,
                   layout: str = "tree", bad_files: bool = True) -> dict:
    """Write a small ILSVRC2012 into ``out``; returns (and writes as ``synth.json``) what was written."""
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if classes < 1 or per_class < 1 or val_per_class < 0:
        raise ConfigError("imagenet synth needs classes >= 1, per_class >= 1 and val_per_class >= 0")
    _fresh_or_ours(out)
    rng = np.random.default_rng([seed, 0])
    wnids = _wnids(rng, classes)
    texts = [_words(rng) for _ in wnids]
    # Devkit ILSVRC2012_IDs follow WordNet order, not wnid order: a permutation keeps readers honest.
    ids = {w: int(i) + 1 for w, i in zip(wnids, rng.permutation(classes))}
    texture = _texture(rng)

    bad = {}
    if bad_files:
        for k, kind in enumerate(BAD_KINDS):
            bad[(k % classes, k // classes)] = kind
    tree = layout in ("tree", "both")
    archives = layout in ("archives", "both")
    os.makedirs(out, exist_ok=True)
    train_tar = tarfile.open(os.path.join(out, "ILSVRC2012_img_train.tar"), "w", format=tarfile.GNU_FORMAT) \
        if archives else None
    planted, total_bytes, count = {}, 0, 0
    try:
        for c, wnid in enumerate(wnids):
            numbers = sorted(int(x) for x in np.random.default_rng([seed, 1, c]).choice(
                np.arange(1, max(15_000, 2 * per_class)), per_class, replace=False))
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w", format=tarfile.GNU_FORMAT) as ctar:
                for i, num in enumerate(numbers):
                    img_rng = np.random.default_rng([seed, 2, c, i])
                    name = f"{wnid}_{num}.JPEG"
                    kind = bad.get((c, i))
                    if kind:
                        data = _bad_file(kind, img_rng, texture)
                        planted[f"{wnid}/{name}"] = kind
                    else:
                        huge = (c, i) == (0, per_class - 1) and per_class >= 10
                        h, w = (1944, 2592) if huge else _image_size(img_rng)
                        data = synth_jpeg(img_rng, h, w, texture=texture)
                    total_bytes += len(data)
                    count += 1
                    if tree:
                        _write(os.path.join(out, "train", wnid, name), data)
                    _add(ctar, name, data)
            if train_tar is not None:
                _add(train_tar, f"{wnid}.tar", inner.getvalue())
    finally:
        if train_tar is not None:
            train_tar.close()

    # Validation images are numbered across classes in a shuffled order, as in the real release.
    val_classes = np.repeat(np.arange(classes), val_per_class)
    val_classes = val_classes[np.random.default_rng([seed, 3]).permutation(len(val_classes))]
    truth, solution = [], ["ImageId,PredictionString"]
    val_tar = tarfile.open(os.path.join(out, "ILSVRC2012_img_val.tar"), "w", format=tarfile.GNU_FORMAT) \
        if archives else None
    try:
        for j, c in enumerate(val_classes, 1):
            img_rng = np.random.default_rng([seed, 4, j])
            h, w = _image_size(img_rng)
            data = synth_jpeg(img_rng, h, w, texture=texture)
            name = f"ILSVRC2012_val_{j:08d}.JPEG"
            total_bytes += len(data)
            count += 1
            if tree:
                _write(os.path.join(out, "val", name), data)
            if val_tar is not None:
                _add(val_tar, name, data)
            truth.append(f"{ids[wnids[c]]}\n")
            solution.append(f"ILSVRC2012_val_{j:08d},{wnids[c]} 0 0 {w - 1} {h - 1} ")
    finally:
        if val_tar is not None:
            val_tar.close()

    meta = _meta_mat(wnids, texts, ids, per_class)
    ground_truth = "".join(truth).encode()
    devkit = [("ILSVRC2012_devkit_t12/data/meta.mat", meta),
              ("ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt", ground_truth)]
    if tree:
        for name, data in devkit:
            _write(os.path.join(out, name), data)
    if archives:
        _targz(os.path.join(out, "ILSVRC2012_devkit_t12.tar.gz"), devkit)
    _write(os.path.join(out, "LOC_synset_mapping.txt"), "".join(f"{w} {t}\n" for w, t in zip(wnids, texts)).encode())
    _write(os.path.join(out, "LOC_val_solution.csv"), ("\n".join(solution) + "\n").encode())
    summary = {"dataset": "imagenet", "seed": seed, "layout": layout, "classes": classes, "per_class": per_class,
               "val_per_class": val_per_class, "images": count, "image_bytes": total_bytes,
               "wnids": wnids, "ilsvrc2012_ids": ids, "bad_files": planted}
    _write(os.path.join(out, "synth.json"), json.dumps(summary, indent=1).encode())
    return summary


# -- CIFAR ------------------------------------------------------------------------------------------------------


class _Py2Pickler(pickle._Pickler):
    """Writes pickles as Python 2's cPickle wrote the official CIFAR files.

    ``bytes`` become Python 2 ``str`` opcodes (BINSTRING), which Python 3 loads as ``bytes`` under
    ``encoding='bytes'`` and as ``str`` under ``encoding='latin1'`` (torchvision); numpy is named
    ``numpy.core.multiarray``, which numpy 1 and 2 both resolve.
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_str(self, obj: bytes) -> None:
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str

    def save_global(self, obj, name=None):
        spelled = {id(np.ndarray.__reduce__(np.zeros(1))[0]): b"numpy.core.multiarray\n_reconstruct\n",
                   id(np.ndarray): b"numpy\nndarray\n", id(np.dtype): b"numpy\ndtype\n"}.get(id(obj))
        if spelled is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + spelled)
        self.memoize(obj)


def py2_pickle(obj) -> bytes:
    out = io.BytesIO()
    _Py2Pickler(out, protocol=2).dump(obj)
    return out.getvalue()


def cifar_images(rng: np.random.Generator, labels: np.ndarray, classes: int) -> np.ndarray:
    """``(N, 32, 32, 3)`` uint8 images: smooth colour fields with a class-dependent tint, plus texture.

    Vectorised (a 4x4 colour grid interpolated to 32x32 by two matrix products) so 60,000 take a second.
    """
    n = len(labels)
    grid = rng.uniform(0, 255, (n, 4, 4, 3)).astype(np.float32)
    pos = np.linspace(0, 3, 32, dtype=np.float32)
    weights = np.maximum(0, 1 - np.abs(pos[:, None] - np.arange(4, dtype=np.float32)[None, :]))  # 32x4 linear
    img = np.einsum("ij,njkc,lk->nilc", weights, grid, weights, optimize=True)
    tint = np.random.default_rng(classes).uniform(-60, 60, (classes, 3)).astype(np.float32)
    img += tint[labels][:, None, None, :]
    img += rng.standard_normal(img.shape, dtype=np.float32) * 12
    return np.clip(img, 0, 255).astype(np.uint8)


def _cifar(out: str, fine_names, coarse_names, per_class: int, test_per_class: int, seed: int, forms) -> dict:
    from gpufeed.pipelines.sources_cifar import LAYOUTS as CIFAR_LAYOUTS, planes_from_hwc

    forms = tuple(forms)
    unknown = set(forms) - set(CIFAR_FORMS)
    if unknown or not forms:
        raise ConfigError(f"CIFAR forms must be among {CIFAR_FORMS}, not {forms!r}")
    _fresh_or_ours(out)
    hundred = coarse_names is not None
    lay = CIFAR_LAYOUTS["cifar100" if hundred else "cifar10"]
    k = len(fine_names)
    rng = np.random.default_rng([seed, 100 if hundred else 10])
    splits = {}
    for split, per in (("train", per_class), ("test", test_per_class)):
        labels = np.repeat(np.arange(k), per)[rng.permutation(k * per)]
        # CIFAR-100's real fine->coarse map is irregular; five fine classes per coarse one is the shape of it.
        splits[split] = (labels, labels % 20 if hundred else None, cifar_images(rng, labels, k))

    def batches():
        """(batch name, split, row slice, batch_label) in the official file order."""
        for split, names in lay.splits.items():
            n = len(splits[split][0])
            bounds = np.linspace(0, n, len(names) + 1).astype(int)
            word = "training" if split == "train" else "testing"
            for b, name in enumerate(names):
                yield name, split, slice(bounds[b], bounds[b + 1]), f"{word} batch {b + 1} of {len(names)}"

    py, binary = [], []
    for name, split, rows, batch_label in batches():
        labels, coarse, images = (x[rows] if x is not None else None for x in splits[split])
        fnames = [f"{fine_names[l]}_s_{int(i):06d}.png".encode() for l, i in zip(labels, range(rows.start, rows.stop))]
        data = planes_from_hwc(images)
        if hundred:
            d = {b"filenames": fnames, b"batch_label": batch_label.encode(), b"fine_labels": labels.tolist(),
                 b"coarse_labels": coarse.tolist(), b"data": data}
            recs = np.concatenate([coarse[:, None].astype(np.uint8), labels[:, None].astype(np.uint8), data], 1)
        else:
            d = {b"batch_label": batch_label.encode(), b"labels": labels.tolist(), b"data": data,
                 b"filenames": fnames}
            recs = np.concatenate([labels[:, None].astype(np.uint8), data], 1)
        py.append((name, py2_pickle(d)))
        binary.append((name + ".bin", recs.tobytes()))
    if hundred:
        py.append((lay.py_meta, py2_pickle({b"fine_label_names": [n.encode() for n in fine_names],
                                             b"coarse_label_names": [n.encode() for n in coarse_names]})))
        binary += [("fine_label_names.txt", "".join(f"{n}\n" for n in fine_names).encode()),
                   ("coarse_label_names.txt", "".join(f"{n}\n" for n in coarse_names).encode())]
    else:
        per_batch = len(splits["train"][0]) // len(lay.splits["train"])
        py.append((lay.py_meta, py2_pickle({b"num_cases_per_batch": per_batch,
                                             b"label_names": [n.encode() for n in fine_names], b"num_vis": 3072})))
        binary.append(("batches.meta.txt", "".join(f"{n}\n" for n in fine_names).encode() + b"\n"))
    readme = (b"<html><body>Synthetic CIFAR written by gpufeed synth in the official layout.</body></html>\n")
    py.append(("readme.html", readme))
    binary.append(("readme.html", readme))
    written = []
    for form, folder, files in (("python", lay.py_dir, py), ("binary", lay.bin_dir, binary)):
        if form in forms:
            for name, data in files:
                _write(os.path.join(out, folder, name), data)
            written.append(folder)
        if "targz" in forms:
            tgz = lay.py_tgz if form == "python" else lay.bin_tgz
            _targz(os.path.join(out, tgz), [(f"{folder}/{name}", data) for name, data in files])
            written.append(tgz)
    summary = {"dataset": "cifar100" if hundred else "cifar10", "seed": seed, "per_class": per_class,
               "test_per_class": test_per_class, "train": len(splits["train"][0]), "test": len(splits["test"][0]),
               "written": written}
    _write(os.path.join(out, "synth.json"), json.dumps(summary, indent=1).encode())
    return summary


def synth_cifar10(out: str, per_class: int = 100, test_per_class: int = 20, seed: int = 0,
                  forms=CIFAR_FORMS) -> dict:
    """CIFAR-10 in the official layouts (``forms``: ``python``, ``binary`` folders and/or both ``targz``)."""
    return _cifar(out, CIFAR10_NAMES, None, per_class, test_per_class, seed, forms)


def synth_cifar100(out: str, per_class: int = 10, test_per_class: int = 2, seed: int = 0,
                   forms=CIFAR_FORMS) -> dict:
    """CIFAR-100 in the official layouts, fine and coarse labels."""
    return _cifar(out, CIFAR100_FINE, CIFAR100_COARSE, per_class, test_per_class, seed, forms)


# -- Penn Treebank -----------------------------------------------------------------------------------------------


def _vocabulary(rng: np.random.Generator, size: int) -> list[str]:
    syllables = ["ba", "ko", "ri", "te", "mu", "sa", "lo", "ne", "di", "fa", "pe", "gu", "ha", "zi", "wo", "ca",
                 "ter", "ing", "ed", "s", "tion", "al", "er", "st"]
    words = set()
    while len(words) < size:
        words.add("".join(rng.choice(syllables, int(rng.integers(1, 4)))))
    return sorted(words)


def synth_ptb(out: str, train_tokens: int = 50_000, vocab: int = 2_000, seed: int = 0) -> dict:
    """PTB-like text: lowercased tokens from a Zipf distribution, ``N`` for numbers, ``<unk>`` for rare words.

    Written as ``simple-examples/data/ptb.{train,valid,test}.txt`` (each line `` word word \\n`` as in the
    originals) and ``simple-examples.tgz``; valid and test are a tenth of train each, with every word outside
    train's vocabulary replaced by ``<unk>``.
    """
    if vocab < 10 or train_tokens < 100:
        raise ConfigError("ptb synth needs vocab >= 10 and train_tokens >= 100")
    _fresh_or_ours(out)
    rng = np.random.default_rng([seed, 200])
    words = ["the", "<unk>", "N", *_vocabulary(rng, vocab - 3)]
    ranks = np.arange(1, len(words) + 1, dtype=np.float64)
    p = 1 / ranks ** 1.05
    p /= p.sum()
    texts, train_words = {}, None
    for split, n_tokens in (("train", train_tokens), ("valid", train_tokens // 10), ("test", train_tokens // 10)):
        toks = np.array(words, dtype=object)[rng.choice(len(words), n_tokens, p=p)]
        if train_words is None:
            train_words = set(toks)
        else:
            toks = np.array([t if t in train_words else "<unk>" for t in toks], dtype=object)
        lengths = rng.poisson(21, size=n_tokens // 5 + 1) + 1
        lines, start = [], 0
        for length in lengths:
            if start >= n_tokens:
                break
            lines.append(" " + " ".join(toks[start:start + length]) + " \n")
            start += length
        texts[split] = "".join(lines).encode()
    files = [(f"./simple-examples/data/ptb.{s}.txt", texts[s]) for s in ("train", "valid", "test")]
    for name, data in files:
        _write(os.path.join(out, name[2:]), data)
    _targz(os.path.join(out, "simple-examples.tgz"), files)
    summary = {"dataset": "ptb", "seed": seed, "vocab": len(train_words), "train_tokens": train_tokens}
    _write(os.path.join(out, "synth.json"), json.dumps(summary, indent=1).encode())
    return summary


# -- command line -----------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("dataset", choices=("imagenet", "cifar10", "cifar100", "ptb"),
                        help="the dataset whose on-disk layout to write")
    parser.add_argument("out", metavar="OUT", help="folder to write (created)")
    parser.add_argument("--classes", type=int, default=10, help="imagenet: number of classes")
    parser.add_argument("--per-class", type=int, default=None,
                        help="images per class in train (imagenet default 20, cifar10 100, cifar100 10)")
    parser.add_argument("--val-per-class", type=int, default=None,
                        help="images per class in val/test (imagenet default 5, cifar10 20, cifar100 2)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same files, byte for byte")
    parser.add_argument("--layout", choices=LAYOUTS, default="tree",
                        help="imagenet: extracted tree, original archives, or both")
    parser.add_argument("--no-bad-files", action="store_true",
                        help="imagenet: leave out the CMYK / PNG-as-JPEG / truncated / grayscale files")
    parser.add_argument("--forms", default=",".join(CIFAR_FORMS), help="cifar: comma-separated python,binary,targz")
    parser.add_argument("--tokens", type=int, default=50_000, help="ptb: training tokens")
    parser.add_argument("--vocab", type=int, default=2_000, help="ptb: vocabulary size")


def run(args) -> int:
    def opt(value, default):
        return default if value is None else value

    if args.dataset == "imagenet":
        s = synth_imagenet(args.out, args.classes, opt(args.per_class, 20), opt(args.val_per_class, 5), args.seed,
                           args.layout, not args.no_bad_files)
        print(f"wrote {s['images']} images ({s['image_bytes'] / 1e6:.1f} MB; {describe_planted(s['bad_files'])}) "
              f"in the {args.layout} layout to {args.out}")
    elif args.dataset in ("cifar10", "cifar100"):
        fn = synth_cifar10 if args.dataset == "cifar10" else synth_cifar100
        d = (100, 20) if args.dataset == "cifar10" else (10, 2)
        s = fn(args.out, opt(args.per_class, d[0]), opt(args.val_per_class, d[1]), args.seed,
               tuple(f for f in args.forms.split(",") if f))
        print(f"wrote {args.dataset}: {s['train']} train / {s['test']} test images as {', '.join(s['written'])} "
              f"in {args.out}")
    else:
        s = synth_ptb(args.out, args.tokens, args.vocab, args.seed)
        print(f"wrote Penn Treebank-like text ({s['train_tokens']} train tokens, {s['vocab']} words) to {args.out}")
    return 0
