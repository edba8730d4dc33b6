"""Reads gpufeed's RecordIO with MXNet itself: ``mx.recordio.MXIndexedRecordIO`` and ``mx.io.ImageRecordIter``.

Run under an interpreter with mxnet 1.9.1 (numpy < 1.24) and OpenCV: ``python check_mxnet.py DATA_ROOT``
(scripts/interop.sh builds it). Every record of every ``.rec`` is read through its ``.idx`` and unpacked;
image records are decoded with ``recordio.unpack_img`` and iterated with ``ImageRecordIter`` (3x224x224,
``label_width`` = the number of labels), whose labels must come out in file order.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import mxnet as mx
from mxnet import recordio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Checks, dataset_of, sha256  # noqa: E402

_IRHEADER = 24


def check_indexed(c: Checks, rel: str, spec: dict) -> None:
    rec = c.path(rel)
    idx = rec[:-4] + ".idx"
    reader = recordio.MXIndexedRecordIO(idx, rec, "r")
    want = spec["records"]
    c.equal(len(reader.keys), len(want), f"{rel}: number of .idx keys")
    lst = {}
    with open(rec[:-4] + ".lst") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            lst[int(parts[0])] = (parts[1:-1], parts[-1])
    for w in want:
        s = reader.read_idx(w["index"])
        header, payload = recordio.unpack(s)
        where = f"{rel} key {w['index']}"
        c.equal(header.id, w["index"], f"{where}: IRHeader id")
        labels = w["labels"]
        if len(labels) > 1 or header.flag:
            c.equal(header.flag, len(labels), f"{where}: IRHeader flag (label count)")
            c.equal([float(x) for x in np.asarray(header.label).ravel()], labels, f"{where}: labels")
        else:
            c.equal(float(header.label), labels[0], f"{where}: label")
        c.equal([float(x) for x in lst[w["index"]][0]], labels, f"{where}: .lst labels")
        if spec["kind"] == "tokens":
            c.equal(np.frombuffer(payload, "<i4").tolist(), w["tokens"], f"{where}: token ids")
            continue
        c.equal(sha256(payload), w["sha256"], f"{where}: payload bytes")
        if spec["kind"] != "encoded":
            continue
        c.equal(lst[w["index"]][1], w["key"], f"{where}: .lst path")
        truth = c.class_label(dataset_of(rel), w["key"])
        if truth is not None:
            c.equal(labels, [float(truth)], f"{where}: label against classes.txt")
        _, img = recordio.unpack_img(s, iscolor=1)  # colour, as ImageRecordIter and im2rec's default decode
        c.check(img is not None and img.ndim == 3 and img.shape[2] == 3 and img.size > 0,
                f"{where}: unpack_img decodes (got {None if img is None else img.shape})")
    # Reading sequentially (no .idx) must give the same records in the same order.
    seq = recordio.MXRecordIO(rec, "r")
    ids = []
    while True:
        s = seq.read()
        if s is None:
            break
        ids.append(recordio.unpack(s)[0].id)
    c.equal(ids, [w["index"] for w in want], f"{rel}: ids read sequentially")
    reader.close()
    seq.close()


def check_iter(c: Checks, rel: str, spec: dict) -> None:
    rec = c.path(rel)
    want = spec["records"]
    width = max(len(w["labels"]) for w in want)
    batch = 4
    # resize=256 (shorter side) lets pass-through sets with images smaller than 224 through the centre crop.
    it = mx.io.ImageRecordIter(path_imgrec=rec, path_imgidx=rec[:-4] + ".idx", data_shape=(3, 224, 224), resize=256,
                               batch_size=batch, label_width=width, shuffle=False, preprocess_threads=1)
    # The default round_batch fills the last batch from the start and reports the fill in ``pad``
    # (with round_batch=False, mxnet 1.9.1 reports pad=0 and leaves the tail of the last batch undefined).
    labels = []
    for b in it:
        data = b.data[0]
        c.equal(tuple(data.shape), (batch, 3, 224, 224), f"{rel}: ImageRecordIter batch shape")
        lab = b.label[0].asnumpy().reshape(batch, -1)
        labels.extend(lab[: batch - b.pad].tolist())
    c.equal(labels, [w["labels"] for w in want], f"{rel}: ImageRecordIter labels in file order")


def check_parts(c: Checks, rel: str, spec: dict) -> None:
    """Without an ``.idx``, ImageRecordIter cuts the file into byte ranges and finds record starts by scanning
    aligned words for the magic followed by cflag 0 or 1: records split at an escaped magic word must be found
    whole, each exactly once, however the file is cut."""
    rec = c.path(rel)
    want = sorted(tuple(w["labels"]) for w in spec["records"])
    width = len(want[0]) if want else 1
    for parts in range(2, len(want) + 1):
        got = []
        for part in range(parts):
            it = mx.io.ImageRecordIter(path_imgrec=rec, data_shape=(3, 224, 224), resize=256, batch_size=1,
                                       label_width=width, shuffle=False, preprocess_threads=1, num_parts=parts,
                                       part_index=part)
            got.extend(tuple(b.label[0].asnumpy().ravel().tolist()) for b in it)
        c.equal(sorted(got), want, f"{rel}: labels read in {parts} byte-range parts without the .idx")


def main() -> None:
    c = Checks("mxnet", sys.argv[1])
    for rel, spec in c.expected["recordio"].items():
        c.run(f"MXIndexedRecordIO {rel} ({len(spec['records'])} records, {spec['kind']})", check_indexed, c,
              rel, spec)
        if spec["kind"] == "encoded":
            c.run(f"ImageRecordIter {rel}", check_iter, c, rel, spec)
        if rel.startswith("edge/") and spec["kind"] == "encoded":
            c.run(f"ImageRecordIter {rel} in byte-range parts", check_parts, c, rel, spec)
    c.finish(f"mxnet {mx.__version__}, numpy {np.__version__}")


if __name__ == "__main__":
    main()
