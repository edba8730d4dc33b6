"""Reads gpufeed's outputs with NVIDIA DALI's readers on the CPU: ``fn.readers.mxnet``, ``fn.readers.tfrecord``
(with gpufeed's ``.idx`` files), ``fn.readers.caffe`` and ``fn.readers.webdataset`` (with the shards' ``wds2idx``
indexes).

Run under an interpreter with nvidia-dali: ``python check_dali.py DATA_ROOT``; no GPU is needed (``device_id=None``
builds a CPU-only pipeline). Each file is read one sample per batch through one epoch; payload bytes, labels and
the reader's sample count (``epoch_size``, from the index) must match what gpufeed wrote, and encoded images
must decode with ``fn.decoders.image``. DALI's caffe reader reads pixels only from ``Datum.data`` (uint8), so
Datums that keep their payload in ``float_data`` (tokens, normalised pixels) are read with
``image_available=False`` (label only), and it hands raw Datums' CHW planes out unchanged under an HWC shape;
GZIP TFRecord shards are not readable by DALI and are left out.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import nvidia.dali as dali
import nvidia.dali.fn as fn
import nvidia.dali.tfrecord as tfrec
from nvidia.dali import pipeline_def

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Checks, dataset_of, sha256  # noqa: E402

_STR = tfrec.FixedLenFeature((), tfrec.string, "")


def _epoch(pipe_fn, what: str, c: Checks, want: int):
    """Every sample of one epoch: a list of tuples of numpy arrays, one per pipeline output."""
    pipe = pipe_fn(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1)
    pipe.build()
    size = pipe.epoch_size("r")
    c.equal(size, want, f"{what}: epoch_size")
    return [tuple(np.array(o[0]) for o in pipe.run()) for _ in range(size)]


def _check_image(c: Checks, where: str, data: np.ndarray, decoded: np.ndarray | None, w: dict) -> None:
    c.equal(sha256(data.tobytes()), w["sha256"], f"{where}: image bytes")
    if decoded is not None:
        c.check(decoded.ndim == 3 and decoded.shape[2] == 3 and decoded.size > 0,
                f"{where}: fn.decoders.image gives {decoded.shape}")


def check_mxnet(c: Checks, rel: str, spec: dict) -> None:
    rec = c.path(rel)
    encoded = spec["kind"] == "encoded"

    @pipeline_def
    def pipe():
        data, label = fn.readers.mxnet(path=[rec], index_path=[rec[:-4] + ".idx"], name="r")
        return (data, label, fn.decoders.image(data, device="cpu")) if encoded else (data, label)

    want = spec["records"]
    for w, out in zip(want, _epoch(pipe, rel, c, len(want))):
        where = f"{rel} id {w['index']}"
        c.equal(out[1].ravel().tolist(), w["labels"], f"{where}: labels")
        if spec["kind"] == "tokens":
            c.equal(np.frombuffer(out[0].tobytes(), "<i4").tolist(), w["tokens"], f"{where}: token ids")
        else:
            _check_image(c, where, out[0], out[2] if encoded else None, w)


def check_tfrecord(c: Checks, rel: str, spec: dict) -> None:
    want = spec["records"]
    kind = want[0]["kind"] if want else "encoded"
    if kind == "tokens":
        features = {"tokens": tfrec.VarLenFeature(tfrec.int64, -1), "key": _STR,
                    "label": tfrec.FixedLenFeature([1], tfrec.int64, -1)}
        names = ("tokens", "label", "key")
    else:
        features = {"image/encoded": _STR, "image/filename": _STR,
                    "image/class/label": tfrec.VarLenFeature(tfrec.int64, -1)}
        names = ("image/encoded", "image/class/label", "image/filename")

    @pipeline_def
    def pipe():
        ins = fn.readers.tfrecord(path=c.path(rel), index_path=c.path(spec["index"]), features=features,
                                  name="r")
        outs = tuple(ins[n] for n in names)
        if kind == "encoded":
            outs += (fn.decoders.image(ins["image/encoded"], device="cpu"),)
        return outs

    offset = spec["label_offset"]
    for i, (w, out) in enumerate(zip(want, _epoch(pipe, rel, c, len(want)))):
        where = f"{rel} record {i}"
        c.equal(out[2].tobytes().decode(), w["key"], f"{where}: key / image/filename")
        if kind == "tokens":
            c.equal(out[0].tolist(), w["tokens"], f"{where}: tokens")
            c.equal(out[1].ravel().tolist(), [int(x) for x in w["labels"]], f"{where}: label")
            continue
        c.equal(out[1].ravel().tolist(), [int(x) + offset for x in w["labels"]], f"{where}: image/class/label")
        _check_image(c, where, out[0], out[3] if kind == "encoded" else None, w)


def check_caffe(c: Checks, rel: str, spec: dict) -> None:
    want = spec["records"]
    pixels = all(w["kind"] == "encoded" or w["kind"] == "raw" and w["dtype"] == "uint8" for w in want)
    encoded = all(w["kind"] == "encoded" for w in want)

    @pipeline_def
    def pipe():
        if not pixels:
            return fn.readers.caffe(path=c.path(rel), image_available=False, name="r")
        data, label = fn.readers.caffe(path=c.path(rel), name="r")
        return (data, label, fn.decoders.image(data, device="cpu")) if encoded else (data, label)

    for w, out in zip(want, _epoch(pipe, rel, c, len(want))):
        where = f"{rel} {w['index']:08d}_{w['key']}"
        label = out[-1 if not pixels else 1].ravel().tolist()
        c.equal(label, [int(w["labels"][0])], f"{where}: label")
        truth = c.class_label(dataset_of(rel), w["key"])
        if truth is not None:
            c.equal(label, [truth], f"{where}: label against classes.txt")
        if not pixels:
            continue
        if encoded:
            _check_image(c, where, out[0], out[2], w)
        else:
            # DALI's CaffeParser copies Datum.data as it is and labels it (height, width, channels), but Caffe
            # (CVMatToDatum) stores CHW planes: the tensor holds the BGR planes, as any Caffe-made raw LMDB.
            h, wd, ch = w["shape"]
            c.equal(list(out[0].shape), [h, wd, ch], f"{where}: shape DALI gives (height, width, channels)")
            planes = out[0].reshape(ch, h, wd)
            rgb = np.ascontiguousarray(planes.transpose(1, 2, 0)[..., ::-1])
            c.equal(sha256(rgb.tobytes()), w["sha256"], f"{where}: bytes = the image's BGR CHW planes")


def check_webdataset(c: Checks, rel: str, spec: dict) -> None:
    """``fn.readers.webdataset`` with the shard's ``wds2idx`` index: each sample's payload member (``.jpg`` /
    ``.png`` bytes, or a ``.npy`` of raw pixels) and its ``.cls`` label text."""
    want = spec["records"]
    raw = bool(want) and want[0]["kind"] == "raw"
    encoded = bool(want) and want[0]["kind"] == "encoded"

    @pipeline_def
    def pipe():
        payload, label = fn.readers.webdataset(paths=[c.path(rel)], index_paths=[c.path(spec["index"])],
                                               ext=["npy" if raw else "jpg;png", "cls"],
                                               missing_component_behavior="error", name="r")
        return (payload, label, fn.decoders.image(payload, device="cpu")) if encoded else (payload, label)

    for i, (w, out) in enumerate(zip(want, _epoch(pipe, rel, c, len(want)))):
        where = f"{rel} sample {i}"
        c.equal([int(out[1].tobytes())], [int(x) for x in w["labels"]], f"{where}: .cls label")
        truth = c.class_label(dataset_of(rel), w["key"])
        if truth is not None:
            c.equal([int(out[1].tobytes())], [truth], f"{where}: label against classes.txt")
        if raw:
            import io

            arr = np.load(io.BytesIO(out[0].tobytes()), allow_pickle=False)
            c.equal([list(arr.shape), arr.dtype.name], [w["shape"], w["dtype"]], f"{where}: .npy shape and dtype")
            c.equal(sha256(np.ascontiguousarray(arr).tobytes()), w["sha256"], f"{where}: .npy pixels")
        else:
            _check_image(c, where, out[0], out[2] if encoded else None, w)


def main() -> None:
    c = Checks("dali", sys.argv[1])
    exp = c.expected
    for rel, spec in exp["recordio"].items():
        c.run(f"fn.readers.mxnet {rel} ({len(spec['records'])} records, {spec['kind']})", check_mxnet, c, rel,
              spec)
    for rel, spec in exp["tfrecord"].items():
        if spec["gzip"]:
            print(f"skip fn.readers.tfrecord {rel}: DALI does not read GZIP TFRecord")
            continue
        c.run(f"fn.readers.tfrecord {rel} ({len(spec['records'])} records)", check_tfrecord, c, rel, spec)
    for rel, spec in exp["lmdb"].items():
        c.run(f"fn.readers.caffe {rel} ({len(spec['records'])} entries)", check_caffe, c, rel, spec)
    for rel, spec in exp.get("webdataset", {}).items():
        c.run(f"fn.readers.webdataset {rel} ({len(spec['records'])} samples)", check_webdataset, c, rel, spec)
    c.finish(f"nvidia-dali {dali.__version__}, CPU pipelines")


if __name__ == "__main__":
    main()
