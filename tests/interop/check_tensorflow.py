"""Reads gpufeed's TFRecord shards with TensorFlow: ``tf.data.TFRecordDataset`` + ``tf.io.parse_single_example``.

Run under an interpreter with tensorflow-cpu: ``python check_tensorflow.py DATA_ROOT``. TensorFlow checks both
CRCs of every record. Image shards are parsed with the feature spec of the Inception/ResNet ImageNet input
pipelines (``image/encoded``, ``image/class/label`` as ``FixedLenFeature([1], int64)``, ...), JPEGs decoded
with ``tf.io.decode_jpeg`` and their size compared with ``image/height``/``image/width``; shards with several
labels per image parse ``image/class/label`` as a ``VarLenFeature``; token shards parse ``tokens``.
"""

from __future__ import annotations

import hashlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Checks, dataset_of  # noqa: E402

_STR = tf.io.FixedLenFeature([], tf.string, default_value="")
_INT = tf.io.FixedLenFeature([], tf.int64, default_value=-1)
#: The ImageNet spec of TensorFlow's image_processing.py / official ResNet input pipeline.
IMAGENET = {"image/encoded": _STR, "image/format": _STR, "image/class/label": tf.io.FixedLenFeature([1], tf.int64, -1),
            "image/class/synset": _STR, "image/class/text": _STR, "image/filename": _STR,
            "image/colorspace": _STR, "image/height": _INT, "image/width": _INT, "image/channels": _INT,
            "image/dtype": _STR}
TOKENS = {"tokens": tf.io.VarLenFeature(tf.int64), "length": _INT, "key": _STR,
          "label": tf.io.FixedLenFeature([1], tf.int64, -1)}


def check_shard(c: Checks, rel: str, spec: dict) -> None:
    want = spec["records"]
    ds = tf.data.TFRecordDataset(c.path(rel), compression_type="GZIP" if spec["gzip"] else "")
    kind = want[0]["kind"] if want else "encoded"
    multi = any(len(w["labels"]) > 1 for w in want)
    features = dict(TOKENS if kind == "tokens" else IMAGENET)
    if multi:
        features["image/class/label"] = tf.io.VarLenFeature(tf.int64)
    got = list(ds)
    c.equal(len(got), len(want), f"{rel}: number of records")
    offset = spec["label_offset"]
    for i, (serialized, w) in enumerate(zip(got, want)):
        ex = tf.io.parse_single_example(serialized, features)
        where = f"{rel} record {i}"
        if kind == "tokens":
            c.equal(tf.sparse.to_dense(ex["tokens"]).numpy().tolist(), w["tokens"], f"{where}: tokens")
            c.equal(int(ex["length"]), len(w["tokens"]), f"{where}: length")
            c.equal(ex["key"].numpy().decode(), w["key"], f"{where}: key")
            c.equal(ex["label"].numpy().tolist(), [int(x) for x in w["labels"]], f"{where}: label")
            continue
        lab = ex["image/class/label"]
        lab = (tf.sparse.to_dense(lab) if multi else lab).numpy().tolist()
        c.equal(lab, [int(x) + offset for x in w["labels"]], f"{where}: image/class/label")
        c.equal(ex["image/filename"].numpy().decode(), w["key"], f"{where}: image/filename")
        data = ex["image/encoded"].numpy()
        c.equal(hashlib.sha256(data).hexdigest(), w["sha256"], f"{where}: image/encoded bytes")
        if kind == "raw":
            h, wd, ch = (int(ex[k]) for k in ("image/height", "image/width", "image/channels"))
            c.equal([h, wd, ch], w["shape"], f"{where}: height/width/channels of raw pixels")
            c.equal(ex["image/dtype"].numpy().decode(), w["dtype"], f"{where}: image/dtype")
            continue
        if "synset" in w:
            c.equal(ex["image/class/synset"].numpy().decode(), w["synset"], f"{where}: image/class/synset")
        truth = c.class_label(dataset_of(rel), w["key"])
        if truth is not None:
            c.equal(lab, [truth + offset], f"{where}: label against classes.txt")
        # CIFAR is stored as PNG by default (as TFDS stores it), labelled image/format = PNG.
        fmt = b"PNG" if data.startswith(b"\x89PNG") else b"JPEG"
        c.equal(ex["image/format"].numpy(), fmt, f"{where}: image/format")
        # decode_image with channels=0 keeps the file's own channels: every stored image must give 3 (a gray
        # or CMYK JPEG kept by pass-through would give 1 or 4, and a batch would fail to stack).
        own = tf.io.decode_image(data, channels=0, expand_animations=False)
        c.equal(int(own.shape[-1]), 3, f"{where}: channels under decode_image(channels=0)")
        # decode_jpeg, as the ImageNet input pipelines call it for every record (it also accepts PNG in TF 2).
        img = tf.io.decode_jpeg(data, channels=3)
        h, wd = int(ex["image/height"]), int(ex["image/width"])
        if h >= 0:
            c.equal(list(img.shape[:2]), [h, wd], f"{where}: decoded size vs image/height, image/width")
        else:
            c.check(img.shape[0] > 0 and img.shape[1] > 0, f"{where}: decode_jpeg")


def main() -> None:
    c = Checks("tensorflow", sys.argv[1])
    for rel, spec in c.expected["tfrecord"].items():
        c.run(f"TFRecordDataset {rel} ({len(spec['records'])} records{', GZIP' if spec['gzip'] else ''})",
              check_shard, c, rel, spec)
    c.finish(f"tensorflow {tf.__version__}")


if __name__ == "__main__":
    main()
