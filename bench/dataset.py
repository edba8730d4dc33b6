"""Benchmark datasets in every format, built with a process pool (no Ray: the GPU machine has none).

Images are synthesised (:func:`gpufeed.pipelines.synth.synth_jpeg`, photo-like content) and go through the
same :func:`~gpufeed.pipelines.transforms.make_sample` and format encoders as ``gpufeed convert``, so the
records are what conversion writes. Two shapes:

* ``image="imagenet"``: JPEGs (q90) at ImageNet's typical geometry (500x375 either way round, 1 in 50 at
  1600x1200), stored as they are or resized (``resize``: shorter side, JPEG q95); records average ~117 KB,
  like ImageNet's ~110 KB and MLPerf Storage's ResNet-50 records (114,660 bytes);
* ``image="cifar"``: 32x32 RGB pixels stored raw (3,072 bytes), like CIFAR-10;
* ``image="ptb"``: Penn Treebank language-model windows, 36 token ids (``seq_len`` 35 + 1) of a 10,000-word
  vocabulary with Zipf's word frequencies, the records ``gpufeed convert ptb`` writes (``kind="tokens"``).

``size``/``center_crop``/``encode`` store the ImageNet-like images as ``gpufeed convert --size HxW
--center-crop --encode raw`` would (the inference recipes: a stored centre crop leaves a loader only a decode,
raw pixels not even that).

Workers synthesise and encode (the CPU work); the parent only frames and appends, one writer per format
(one ``.rec``, one LMDB environment, ``shards`` TFRecord files). ``DST/bench_dataset.json`` lists the outputs
for :mod:`gpufeed.bench.read`.

Example::

    info = build_dataset("/data/bench", ["recordio", "lmdb", "tfrecord"], n=2000, workers=8)
    info["formats"]["lmdb"]["paths"]   # ['/data/bench/lmdb/train_lmdb']
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import time

from gpufeed.errors import ConfigError
from gpufeed.formats import FORMATS, format_class, parse_formats
from gpufeed.machine import usable_cores

IMAGES = ("imagenet", "cifar", "ptb")
MANIFEST = "bench_dataset.json"

#: ImageNet-1k train: ~1000 classes; CIFAR-10: 10; PTB windows carry label 0, as gpufeed convert ptb writes.
_CLASSES = {"imagenet": 1000, "cifar": 10, "ptb": 1}
#: Penn Treebank's vocabulary (Mikolov's preprocessing) and the language models' unrolled length.
PTB_VOCAB = 10_000
PTB_SEQ_LEN = 35
#: A tail of multi-megapixel photos as ImageNet has; at q90 a 500x375 synthetic photo is ~100 KB and a
#: 1600x1200 one ~980 KB, so 1 in 50 large gives ImageNet's mean record size.
_LARGE_EVERY = 50
_LARGE_HW = (1200, 1600)
_COMMON_HW = (375, 500)
_CIFAR_HW = (32, 32)
#: Samples per task sent to a worker: big enough to amortise pickling, small enough to balance.
_CHUNK = 32


def _geometry(i: int) -> tuple[int, int]:
    h, w = _LARGE_HW if i % _LARGE_EVERY == _LARGE_EVERY - 1 else _COMMON_HW
    return (h, w) if i % 2 == 0 else (w, h)


def _make(task):
    """Worker: synthesise and encode samples ``start..end`` for every format (deterministic per index)."""
    import numpy as np

    from gpufeed.formats import get_format
    from gpufeed.pipelines.base import InlineRef, Item
    from gpufeed.pipelines.transforms import make_sample

    start, end, image, store, seed, formats = task
    fmts = [get_format(f) for f in formats]
    options = store_options(image, **store)
    out = []
    for i in range(start, end):
        rng = np.random.default_rng([seed, i])
        label = i % _CLASSES[image]
        if image == "cifar":
            data = rng.integers(0, 256, size=(*_CIFAR_HW, 3), dtype=np.uint8)
            key = f"{label}/{i:08d}.png"
        elif image == "ptb":
            data = ((rng.zipf(1.2, PTB_SEQ_LEN + 1) - 1) % PTB_VOCAB).astype(np.int32)
            key = f"train/{i:08d}"
        else:
            from gpufeed.pipelines.synth import synth_jpeg

            data = synth_jpeg(rng, *_geometry(i), quality=90)
            key = f"n{label:08d}/n{label:08d}_{i}.JPEG"
        sample = make_sample(Item(key=key, label=label, ref=InlineRef(data), meta={"source": f"synth:{i}"}),
                             options, i)
        payload = sample.payload
        size = len(payload) if isinstance(payload, bytes) else payload.nbytes
        out.append((size, [f.encode(sample) for f in fmts]))
    return start, out


def store_options(image: str, resize: int | None = None, size: tuple[int, int] | None = None,
                  center_crop: bool = False, encode: str | None = None):
    """The :class:`~gpufeed.pipelines.transforms.ImageOptions` a benchmark dataset is stored with: CIFAR raw;
    ImageNet-like images passed through as captured, or transformed and encoded (JPEG q95 or raw)."""
    from gpufeed.pipelines.transforms import ImageOptions

    if image in ("cifar", "ptb"):
        return ImageOptions(encode="raw")
    if not (resize or size or center_crop) and encode in (None, "pass"):
        return ImageOptions(encode="pass", validate=False)
    return ImageOptions(resize=resize, size=size, center_crop=center_crop, encode=encode or "jpeg", quality=95)


def store_flags(resize: int | None = None, size: tuple[int, int] | None = None, center_crop: bool = False,
                encode: str | None = None) -> str | None:
    """The ``gpufeed convert`` flags that store images as a benchmark dataset's ``store`` does, or None for
    images kept as captured."""
    flags = ([f"--resize {resize}"] if resize else []) + ([f"--size {size[0]}x{size[1]}"] if size else []) + (
        ["--center-crop"] if center_crop else []) + ([f"--encode {encode}"] if encode == "raw" else [])
    return " ".join(flags) or None


def output_path(out: str, fmt: str, shard: int = 0, shards: int = 1) -> str:
    """Where ``build_dataset`` puts format ``fmt`` (the path its reader takes)."""
    from gpufeed.formats import format_class
    from gpufeed.formats.base import PER_SPLIT
    from gpufeed.formats.naming import shard_name

    f = format_class(fmt).for_conversion(shards=None if shards == 1 else shards)
    if shards > 1 and f.layout == PER_SPLIT:  # one output per shard of a format made one per split (an LMDB)
        return os.path.join(out, fmt, shard_name("train", shard, shards))
    return f.output_path(out, "train", shard, shards)


def build_dataset(out: str, formats=FORMATS, n: int = 1000, image: str = "imagenet",
                  resize: int | None = None, seed: int = 0, workers: int | None = None, shards: int = 1,
                  size: tuple[int, int] | None = None, center_crop: bool = False, encode: str | None = None) -> dict:
    """Write ``n`` synthetic samples to every format in ``formats`` under ``out``; return (and store as
    ``out/bench_dataset.json``) what was written: per format its reader paths, files, bytes and mean record
    size, plus the mean stored sample size. ``resize``, ``size``, ``center_crop`` and ``encode`` are
    ``gpufeed convert``'s options of those names (ImageNet-like images only)."""
    from gpufeed.formats import get_format

    if image not in IMAGES:
        raise ConfigError(f"image={image!r} is not one of {', '.join(IMAGES)}")
    if n < 1 or shards < 1 or shards > n:
        raise ConfigError(f"need n >= 1 and 1 <= shards <= n, got n={n}, shards={shards}")
    store = {"resize": resize, "size": tuple(size) if size else None, "center_crop": center_crop, "encode": encode}
    if image != "imagenet" and (resize or size or center_crop or encode):
        raise ConfigError(f"resize, size, center_crop and encode apply to image='imagenet'; {image} samples are "
                          "stored as they are (CIFAR: 32x32 raw pixels; ptb: token ids)")
    if encode not in (None, "pass", "jpeg", "raw"):
        raise ConfigError(f"encode={encode!r}: use pass, jpeg or raw")
    if encode == "pass" and (resize or size or center_crop):
        raise ConfigError("encode='pass' keeps the captured bytes; resize, size and center_crop need jpeg or raw")
    formats = list(dict.fromkeys(formats))
    for f in formats:
        get_format(f)
    workers = workers or usable_cores()
    t0 = time.perf_counter()
    writers = {}
    try:
        for f in formats:
            os.makedirs(os.path.join(out, f), exist_ok=True)
        per_shard = -(-n // shards)
        tasks = [(s, min(s + _CHUNK, n), image, store, seed, formats) for s in range(0, n, _CHUNK)]
        payload_bytes = 0
        written = {f: [] for f in formats}
        shard = -1
        pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else _InProcess()
        try:
            for _start, results in pool.imap(_make, tasks):
                for size, records in results:
                    index = records[0].index
                    if index // per_shard != shard:
                        for f, w in writers.items():
                            written[f].extend(w.close())
                        shard = index // per_shard
                        writers = {f: get_format(f).writer(output_path(out, f, shard, shards)) for f in formats}
                    payload_bytes += size
                    for f, rec in zip(formats, records):
                        writers[f].write_encoded(rec)
            # Workers told to finish, not terminated: a terminated pool hung two full test runs (a worker left
            # waiting on the task queue's lock while the parent joined it, with Ray up in the parent).
            pool.close()
            pool.join()
        finally:
            pool.terminate()  # after an error; nothing left to stop after the join
        for f, w in writers.items():
            written[f].extend(w.close())
        writers = {}
    finally:
        for w in writers.values():
            w.abort()
    info = {"out": os.path.abspath(out), "n": n, "image": image, "resize": resize, "seed": seed, "shards": shards,
            "store": store_flags(**store), **({"vocab": PTB_VOCAB, "seq_len": PTB_SEQ_LEN} if image == "ptb" else {}),
            "sample_bytes": payload_bytes / n, "build_seconds": time.perf_counter() - t0, "formats": {}}
    for f in formats:
        files = [dataclasses.asdict(w) for w in written[f]]
        data = sum(w.bytes for w in written[f] if w.role == "data")
        info["formats"][f] = {"paths": [os.path.abspath(output_path(out, f, s, shards)) for s in range(shards)],
                              "files": files, "data_bytes": data, "total_bytes": sum(w.bytes for w in written[f]),
                              "record_bytes": data / n}
    with open(os.path.join(out, MANIFEST), "w") as fh:
        json.dump(info, fh, indent=2, default=str)
    return info


def load_dataset_info(out: str, split: str | None = None) -> dict:
    """What :func:`build_dataset` wrote under ``out``, or the same description of a ``gpufeed convert``
    output (read from its ``manifest.json``; ``split`` defaults to ``train``), so the benchmarks run on the
    files people actually train from."""
    from gpufeed.errors import SourceNotFound

    path = os.path.join(out, MANIFEST)
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    converted = os.path.join(out, "manifest.json")
    if os.path.exists(converted):
        with open(converted) as fh:
            return _from_convert_manifest(out, json.load(fh), split)
    raise SourceNotFound(path, "benchmark dataset manifest (or a gpufeed convert manifest.json)",
                         "build one with `gpufeed bench dataset OUT`, or point at a `gpufeed convert` output")


def dataset_fields(info: dict, fmt: str) -> dict:
    """The dataset part of a benchmark row, from :func:`load_dataset_info`'s ``info``."""
    from gpufeed.bench.results import dataset_ram_ratio

    f = info["formats"][fmt]
    return {"image": info["image"], "resize": info["resize"], "store": info.get("store"), "n_samples": info["n"],
            "sample_bytes": info["sample_bytes"], "record_bytes": f["record_bytes"],
            "total_bytes": f["total_bytes"], "dataset_ram_ratio": dataset_ram_ratio(f["total_bytes"])}


def _from_convert_manifest(out: str, m: dict, split: str | None) -> dict:
    splits = m["splits"]
    split = split or ("train" if "train" in splits else sorted(splits)[0])
    if split not in splits:
        raise ConfigError(f"{out}: no split {split!r} in manifest.json; it holds {', '.join(sorted(splits))}")
    n = splits[split]["written"]
    options = m.get("options", {})
    dataset = str(options.get("dataset", ""))
    image = "cifar" if dataset.startswith("cifar") else "ptb" if dataset == "ptb" else "imagenet"
    info = {"out": os.path.abspath(out), "n": n, "image": image, "resize": options.get("resize"),
            "seed": options.get("seed"),
        "split": split, "source": "gpufeed convert", "formats": {},
        "store": store_flags(options.get("resize"), tuple(options["size"]) if options.get("size") else None,
                             bool(options.get("center_crop")), options.get("encode"))}

    def in_split(rel: str) -> bool:
        name = os.path.basename(os.path.dirname(rel) if rel.endswith("data.mdb") else rel)
        return name.startswith((f"{split}.", f"{split}_", f"{split}-"))

    sample_bytes = []
    for fmt in m["formats"]:
        files = [f for f in m["files"] if f["path"].startswith(fmt + "/") and in_split(f["path"])]
        data = [f for f in files if f["role"] == "data"]
        if not data or n == 0:
            continue
        reader_path = format_class(fmt)().reader_path
        rel = sorted(reader_path(f["path"]) for f in data)
        data_bytes = sum(f["bytes"] for f in data)
        info["formats"][fmt] = {"relpaths": rel, "paths": [os.path.join(info["out"], r) for r in rel],
                                "files": files, "data_bytes": data_bytes,
                                "total_bytes": sum(f["bytes"] for f in files), "record_bytes": data_bytes / n}
        sample_bytes.append(data_bytes / n)
    if image == "ptb":
        info.update(_ptb_fields(out, options))
    if not info["formats"]:
        raise ConfigError(f"{out}: manifest.json lists no data files for split {split!r}")
    info["sample_bytes"] = min(sample_bytes)
    info["shards"] = max(len(f["relpaths"]) for f in info["formats"].values())
    return info


def _ptb_fields(out: str, options: dict) -> dict:
    """A converted Penn Treebank's vocabulary size (``vocab.txt``, one token per line) and window length."""
    vocab = os.path.join(out, "vocab.txt")
    if not os.path.exists(vocab):
        raise ConfigError(f"{vocab} is missing: the token ids of {out} need the vocabulary gpufeed convert ptb "
                          "writes beside manifest.json; convert again")
    with open(vocab, encoding="utf-8") as fh:
        words = sum(1 for _ in fh)
    return {"vocab": words, "seq_len": options.get("seq_len") if options.get("ptb_mode", "window") == "window"
            else None}


class _InProcess:
    """``Pool``'s ``imap`` in this process, for ``workers=1`` (no fork, easy to profile)."""

    @staticmethod
    def imap(fn, tasks):
        return map(fn, tasks)

    def close(self) -> None:
        pass

    join = terminate = close


def add_arguments(parser) -> None:
    parser.add_argument("out", metavar="OUT", help="directory to write the dataset under")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats (default: all)")
    parser.add_argument("-n", type=int, default=2000, help="number of samples")
    parser.add_argument("--image", choices=IMAGES, default="imagenet",
                        help="imagenet: ~110 KB JPEG records; cifar: 3 KB raw 32x32 pixels; ptb: windows of 36 "
                             "token ids (Penn Treebank for a language model)")
    parser.add_argument("--resize", type=int, default=None, help="store JPEGs resized to this shorter side")
    parser.add_argument("--size", default=None, metavar="HxW", help="store images at exactly this size")
    parser.add_argument("--center-crop", action="store_true", help="cut the centre square before resizing")
    parser.add_argument("--encode", choices=("pass", "jpeg", "raw"), default=None,
                        help="how images are stored (default: pass as captured; jpeg q95 when resized)")
    parser.add_argument("--shards", type=int, default=1, help="files per format")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same dataset, byte for byte")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")


def run(args) -> int:
    from gpufeed.pipelines.image_options import parse_size

    info = build_dataset(args.out, list(parse_formats(args.formats)), n=args.n, image=args.image,
                         resize=args.resize, seed=args.seed, workers=args.workers, shards=args.shards,
                         size=parse_size(args.size) if args.size else None, center_crop=args.center_crop,
                         encode=args.encode)
    print(f"{info['n']} samples ({info['sample_bytes'] / 1e3:.1f} KB each) in {info['build_seconds']:.1f} s:")
    for f, d in info["formats"].items():
        print(f"  {f:<9} {d['data_bytes'] / 1e6:9.1f} MB  {d['record_bytes'] / 1e3:7.1f} KB/record  {d['paths'][0]}")
    return 0
