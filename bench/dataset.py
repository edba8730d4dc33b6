"""Benchmark datasets in every format, made by ``gpufeed convert`` itself from a synthetic source.

:func:`build_dataset` converts ``synthetic KIND:N:SEED`` (:mod:`gpufeed.pipelines.sources_synthetic`:
ImageNet-like JPEGs of ~117 KB, CIFAR-like 32x32 pixels, or Penn Treebank windows) with the conversion engine,
in local processes (no Ray: the GPU machines have none), records in index order, so the records are exactly
what conversion writes, in the layout it writes them. ``resize``, ``size``, ``center_crop`` and ``encode``
store the ImageNet-like images as ``gpufeed convert --resize N``, ``--size HxW --center-crop`` and
``--encode raw`` would (the inference recipes: a stored centre crop leaves a loader only a decode, raw pixels
not even that); as captured, they are passed through unchecked.

``DST/bench_dataset.json`` describes the outputs for the benchmarks (:func:`load_dataset_info`, which reads
a ``gpufeed convert`` output's ``manifest.json`` the same way).

Example::

    info = build_dataset("/data/bench", ["recordio", "lmdb", "tfrecord"], n=2000, workers=8)
    info["formats"]["lmdb"]["paths"]   # ['/data/bench/lmdb/train_lmdb']
"""

from __future__ import annotations

import json
import os
import shlex
import time

from gpufeed.errors import ConfigError
from gpufeed.formats import FORMATS, format_class, parse_formats
from gpufeed.machine import usable_cores
from gpufeed.pipelines.sources_synthetic import KINDS as IMAGES

MANIFEST = "bench_dataset.json"


def store_options(image: str, resize: int | None = None, size: tuple[int, int] | None = None,
                  center_crop: bool = False, encode: str | None = None, quality: int | None = None):
    """The :class:`~gpufeed.pipelines.image_options.ImageOptions` a benchmark dataset is stored with: CIFAR raw;
    ImageNet-like images passed through as captured, or transformed and encoded (JPEG at ``quality``, default
    im2rec's 95, or raw)."""
    from gpufeed.pipelines.image_options import DEFAULT_QUALITY, ImageOptions

    if image == "ptb":
        return ImageOptions(encode=None)  # token ids: nothing to encode
    if image == "cifar":
        return ImageOptions(encode="raw")
    if not (resize or size or center_crop or quality) and encode in (None, "pass"):
        return ImageOptions(encode="pass", validate=False)
    return ImageOptions(resize=resize, size=size, center_crop=center_crop, encode=encode or "jpeg",
                        quality=quality or DEFAULT_QUALITY)


def store_flags(resize: int | None = None, size: tuple[int, int] | None = None, center_crop: bool = False,
                encode: str | None = None, quality: int | None = None) -> str | None:
    """The ``gpufeed convert`` flags that store images as a benchmark dataset's ``store`` does, or None for
    images kept as captured. ``--quality`` where JPEGs are written at another than im2rec's 95."""
    from gpufeed.pipelines.image_options import DEFAULT_QUALITY

    flags = ([f"--resize {resize}"] if resize else []) + ([f"--size {size[0]}x{size[1]}"] if size else []) + (
        ["--center-crop"] if center_crop else []) + ([f"--encode {encode}"] if encode == "raw" else []) + (
        [f"--quality {quality}"] if quality and quality != DEFAULT_QUALITY and encode != "raw" else [])
    return " ".join(flags) or None


def build_dataset(out: str, formats=FORMATS, n: int = 1000, image: str = "imagenet",
                  resize: int | None = None, seed: int = 0, workers: int | None = None, shards: int | None = None,
                  size: tuple[int, int] | None = None, center_crop: bool = False, encode: str | None = None,
                  quality: int | None = None, overwrite: bool = False, progress: bool = False) -> dict:
    """Convert ``n`` synthetic samples of ``image`` (its ``seed``) to every format in ``formats`` under
    ``out``, in ``shards`` shards (``gpufeed convert --shards``: files, for the formats that write one per
    shard; by default as many as conversion cuts the samples into); return (and store as
    ``out/bench_dataset.json``) what was written: per format its reader paths, files, bytes and mean record
    size. ``resize``, ``size``, ``center_crop``, ``encode`` and ``quality`` are ``gpufeed convert``'s options of
    those names (ImageNet-like images only; ``quality`` re-encodes the JPEGs even where nothing else changes). A dataset already built with the same options is kept as it is; one
    built otherwise is replaced only with ``overwrite`` (the files its manifest lists).

    Like the command line, it converts in local processes started from a fork server, which run a script's
    main module again: call it under ``if __name__ == "__main__":``."""
    from gpufeed.convert.engine import convert
    from gpufeed.convert.options import ConvertOptions
    from gpufeed.convert.progress import Progress

    if image not in IMAGES:
        raise ConfigError(f"image={image!r} is not one of {', '.join(IMAGES)}")
    if n < 1 or shards is not None and not 1 <= shards <= n:
        raise ConfigError(f"need n >= 1 and 1 <= shards <= n, got n={n}, shards={shards}")
    store = {"resize": resize, "size": tuple(size) if size else None, "center_crop": center_crop, "encode": encode,
             "quality": quality}
    if image != "imagenet" and (resize or size or center_crop or encode or quality):
        raise ConfigError(f"resize, size, center_crop, encode and quality apply to image='imagenet'; {image} samples "
                          "are stored as they are (CIFAR: 32x32 raw pixels; ptb: token ids)")
    if encode not in (None, "pass", "jpeg", "raw"):
        raise ConfigError(f"encode={encode!r}: use pass, jpeg or raw")
    if encode == "pass" and (resize or size or center_crop or quality):
        raise ConfigError("encode='pass' keeps the captured bytes; resize, size, center_crop and quality need jpeg "
                          "(or raw, without quality)")
    if quality is not None and (encode == "raw" or not 1 <= quality <= 100):
        raise ConfigError(f"quality={quality}: a JPEG quality from 1 to 100, for JPEG records (not encode='raw')")
    options = ConvertOptions(dataset="synthetic", src=f"{image}:{n}:{seed}", formats=tuple(dict.fromkeys(formats)),
                             out=out, image=store_options(image, **store), workers=workers or usable_cores(),
                             shards=shards, shuffle=False, overwrite=overwrite, progress=progress,
                             local_start=True, executor="pool")
    t0 = time.perf_counter()
    convert(options, Progress(progress))
    info = load_dataset_info(out, described=False)
    info.update(n=n, image=image, resize=resize, seed=seed, store=store_flags(**store),
                build_seconds=time.perf_counter() - t0)
    with open(os.path.join(out, MANIFEST), "w") as fh:
        json.dump(info, fh, indent=2, default=str)
    return info


def load_dataset_info(out: str, split: str | None = None, described: bool = True) -> dict:
    """What :func:`build_dataset` wrote under ``out``, or the same description of a ``gpufeed convert``
    output (read from its ``manifest.json``; ``split`` defaults to ``train``), so the benchmarks run on the
    files people actually train from. ``described=False``: from the manifest, whatever ``bench_dataset.json``
    says."""
    from gpufeed.errors import SourceNotFound

    path = os.path.join(out, MANIFEST)
    if described and os.path.exists(path):
        from gpufeed import io

        with io.open_file(path) as fh:  # a regular file only: a FIFO there blocked `bench read`
            return json.load(fh)
    from gpufeed.convert import manifest as convert_manifest

    try:
        doc = convert_manifest.load(out)
    except ValueError as e:
        raise ConfigError(f"{convert_manifest.path(out)}: {e}; not a gpufeed convert manifest: give the --out of a "
                          "gpufeed convert run") from None
    if doc is not None:
        return _from_convert_manifest(out, doc, split)
    raise SourceNotFound(path, "benchmark dataset manifest (or a gpufeed convert manifest.json)",
                         "build one with `gpufeed bench dataset OUT`, or point at a `gpufeed convert` output")


def formats_of(info: dict, asked, dst: str) -> list[str]:
    """The formats a benchmark reads from ``info``'s dataset (at ``dst``): ``asked`` (``--formats``' text or a
    list), each checked to be there, or every format the dataset holds where nothing is asked."""
    if not asked:
        return list(info["formats"])
    formats = list(parse_formats(asked) if isinstance(asked, str) else dict.fromkeys(asked))
    missing = [f for f in formats if f not in info["formats"]]
    if missing:
        raise ConfigError(f"{dst} has no {', '.join(missing)} dataset (it holds {', '.join(info['formats'])}); "
                          f"{_rebuild_advice(info, formats, missing, dst)}")
    return formats


def _rebuild_advice(info: dict, formats: list[str], missing: list[str], dst: str) -> str:
    """How to get the ``missing`` formats: a benchmark dataset is built again as it was (its samples, image kind,
    storage and seed), with the formats it holds and those asked, replacing the files it lists (the command
    refuses to replace them otherwise); a ``gpufeed convert`` output is the user's and is never replaced."""
    if not os.path.exists(os.path.join(dst, MANIFEST)):
        return (f"it is a `gpufeed convert` output: convert the same source with `--to {','.join(missing)}` into "
                f"another destination and point at that, or leave {', '.join(missing)} out of --formats")
    every = list(dict.fromkeys([*info["formats"], *formats]))
    flags = [f"--formats {','.join(every)}", f"-n {info['n']}"]
    if info.get("image", "imagenet") != "imagenet":
        flags.append(f"--image {info['image']}")
    if info.get("store"):
        flags.append(info["store"])
    if info.get("seed"):
        flags.append(f"--seed {info['seed']}")
    return (f"build it again with them all: `gpufeed bench dataset {shlex.quote(dst)} {' '.join(flags)} "
            "--overwrite`")


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
    if dataset == "synthetic":
        from gpufeed.pipelines.sources_synthetic import parse_spec

        image = parse_spec(str(options["src"]))[0]
    else:
        image = "cifar" if dataset.startswith("cifar") else "ptb" if dataset == "ptb" else "imagenet"
    info = {"out": os.path.abspath(out), "n": n, "image": image, "resize": options.get("resize"),
            "seed": options.get("seed"),
        "split": split, "source": "gpufeed convert", "formats": {},
        "store": store_flags(options.get("resize"), tuple(options["size"]) if options.get("size") else None,
                             bool(options.get("center_crop")), options.get("encode"),
                             options.get("quality") if options.get("encode") not in (None, "pass") else None)}

    stored = splits[split].get("stored_bytes") or {}  # counted by the workers (gpufeed since 2026-11-26)
    sample_bytes = []
    for fmt in m["formats"]:
        owner = format_class(fmt)()  # the format says which of its files belong to the split
        files = [f for f in m["files"] if owner.owned_split(f["path"]) == split]
        data = [f for f in files if f["role"] == "data"]
        if not data or n == 0:
            continue
        reader_path = owner.reader_path
        rel = sorted(reader_path(f["path"]) for f in data)
        data_bytes = sum(f["bytes"] for f in data)
        info["formats"][fmt] = {"relpaths": rel, "paths": [os.path.join(info["out"], r) for r in rel],
                                "files": files, "data_bytes": data_bytes,
                                "total_bytes": sum(f["bytes"] for f in files), "record_bytes": data_bytes / n}
        sample_bytes.append(stored[fmt] / n if fmt in stored else data_bytes / n)
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
    parser.add_argument("--quality", type=int, default=None,
                        help="JPEG quality of the stored images (default: 95, im2rec's; re-encodes images kept as "
                             "captured)")
    parser.add_argument("--shards", type=int, default=None,
                        help="shards, as gpufeed convert --shards (default: conversion's, ~1,250 samples each)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same dataset, byte for byte")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a dataset built in OUT with other options (the files its manifest lists)")


def run(args) -> int:
    from gpufeed.pipelines.image_options import parse_size

    info = build_dataset(args.out, list(parse_formats(args.formats)), n=args.n, image=args.image,
                         resize=args.resize, seed=args.seed, workers=args.workers, shards=args.shards,
                         size=parse_size(args.size) if args.size else None, center_crop=args.center_crop,
                         encode=args.encode, quality=args.quality, overwrite=args.overwrite, progress=True)
    print(f"{info['n']} samples ({info['sample_bytes'] / 1e3:.1f} KB each) in {info['build_seconds']:.1f} s:")
    for f, d in info["formats"].items():
        where = d["paths"][0] if len(d["paths"]) == 1 else f"{len(d['paths'])} files: {d['paths'][0]} ..."
        print(f"  {f:<10} {d['data_bytes'] / 1e6:9.1f} MB  {d['record_bytes'] / 1e3:7.1f} KB/record  {where}")
    return 0
