"""Edge-case files written with gpufeed's format writers, and ``expected.json`` describing every file to check.

Run with the project's interpreter: ``python tests/interop/make_cases.py DATA_ROOT``. ``DATA_ROOT`` already
holds ``jpeg/`` and ``raw/`` (``gpufeed convert`` outputs); this adds ``edge/`` with what a conversion of
ImageNet never produces: several labels per image, payloads holding the RecordIO magic at aligned offsets
(split into cflag 1/2/3 parts), token sequences, a GZIP TFRecord shard, TensorFlow's 1-based labels and
normalised float pixels in Datum.float_data. ``expected.json`` is what gpufeed's own readers see in every
file; each consumer check compares the consumer's view with it, so the consumers run without gpufeed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import struct
import sys

import numpy as np

from gpufeed.formats import get_format
from gpufeed.formats import recordio, tfrecord, webdataset
from gpufeed.formats.base import Sample
from gpufeed.formats.caffe_datum import read_mean_binaryproto
from gpufeed.pipelines.synth import synth_jpeg

#: A JPEG comment segment (FF FE, u16 big-endian length counting itself) may hold any bytes, so the magic word
#: can be planted there without changing the decoded picture.
_COM = b"\xff\xfe"
_MAGIC = struct.pack("<I", recordio.MAGIC)
#: ImageRecordIter crops 224x224 out of these without resizing.
_SIDE = 256
_MULTI = 3
#: lrec of the fake record header planted after a JPEG's end: cflag 0, 8 bytes.
_FAKE_LENGTH = 8


def jpeg_with_magic(jpeg: bytes, value_offset: int) -> bytes:
    """``jpeg`` with the magic at two aligned and one unaligned offset of the record value in a comment, and after
    the end-of-image marker (where decoders stop reading) an aligned magic followed by what looks like the
    header of a whole 8-byte record: a reader that cuts the file into byte ranges and does not know about the
    escaping would take it for a record start. ``value_offset``: where the JPEG starts in the record value
    (after the IRHeader and labels)."""
    data_at = value_offset + 6
    pad = b"\0" * (-data_at % 4)
    comment = pad + _MAGIC + _MAGIC + b"ab" + _MAGIC + b"cd"
    out = jpeg[:2] + _COM + struct.pack(">H", len(comment) + 2) + comment + jpeg[2:]
    tail_pad = b"\0" * (-(value_offset + len(out)) % 4)
    return out + tail_pad + _MAGIC + struct.pack("<I", _FAKE_LENGTH) + bytes(_FAKE_LENGTH)


def _split_parts(rec_path: str) -> int:
    """How many record parts in ``rec_path`` carry cflag != 0 (proof that escaping happened)."""
    with open(rec_path, "rb") as f:
        data = f.read()
    pos = split = 0
    while pos < len(data):
        _, lrec = struct.unpack_from("<II", data, pos)
        split += (lrec >> 29) != 0
        pos += 8 + ((lrec & ((1 << 29) - 1)) + 3) // 4 * 4
    return split


#: Shards written with TensorFlow's 1-based labels: a consumer sees gpufeed's 0-based label plus this.
LABEL_OFFSETS = {"edge/tfrecord/tflabels-00000-of-00001": 1}


def write_edge(root: str) -> None:
    rng = np.random.default_rng(7)
    edge = os.path.join(root, "edge")
    shutil.rmtree(edge, ignore_errors=True)
    for sub in ("recordio", "tfrecord", "lmdb"):
        os.makedirs(os.path.join(edge, sub), exist_ok=True)
    images = [synth_jpeg(rng, _SIDE, _SIDE) for _ in range(6)]
    multi = [Sample(f"multi/{i}.jpg", [float(i % 5), float((i + 2) % 5), 7.0], images[i], "encoded", i,
                    {"format": "JPEG", "height": _SIDE, "width": _SIDE, "channels": 3}) for i in range(6)]
    # RecordIO: the JPEG starts after the 24-byte IRHeader and, with several labels, 4 bytes per label.
    multi[2] = Sample(multi[2].key, multi[2].label, jpeg_with_magic(images[2], 24 + 4 * _MULTI), "encoded", 2,
                      multi[2].meta)
    single = [Sample(f"single/{i}.jpg", i % 4, jpeg_with_magic(images[i], 24) if i % 2 else images[i],
                     "encoded", i, {"format": "JPEG"}) for i in range(6)]
    tokens = [Sample(f"tokens/{i}", i, np.arange(i * 10, i * 10 + 36, dtype=np.int32), "tokens", i)
              for i in range(4)]
    floats = [Sample(f"float/{i}", i, rng.standard_normal((8, 6, 3)).astype(np.float32), "raw", i)
              for i in range(3)]
    rio = get_format("recordio")
    for name, samples in (("multi", multi), ("magic", single), ("tokens", tokens)):
        with rio.writer(os.path.join(edge, "recordio", f"{name}.rec")) as w:
            for s in samples:
                w.write(s)
    for name in ("multi", "magic"):
        if not _split_parts(os.path.join(edge, "recordio", f"{name}.rec")):
            sys.exit(f"edge/recordio/{name}.rec holds no split record: the magic was not planted aligned")
    tfr = get_format("tfrecord")
    for name, samples, opts in (("multi-00000-of-00001", multi, {}), ("magic-00000-of-00001", single, {}),
                                ("tokens-00000-of-00001", tokens, {}),
                                ("tflabels-00000-of-00001", single, {"label_offset": 1}),
                                ("gzip-00000-of-00001.gz", single, {"compression": "gzip"})):
        with tfr.writer(os.path.join(edge, "tfrecord", name), **opts) as w:
            for s in samples:
                w.write(s)
    ldb = get_format("lmdb")
    for name, samples in (("multi_lmdb", multi), ("magic_lmdb", single), ("tokens_lmdb", tokens),
                          ("float_lmdb", floats)):
        with ldb.writer(os.path.join(edge, "lmdb", name)) as w:
            for s in samples:
                w.write(s)


def _sha(b) -> str:
    return hashlib.sha256(bytes(b)).hexdigest()


def _record(s: Sample) -> dict:
    payload = s.payload
    out = {"key": s.key, "index": int(s.index), "kind": s.kind,
           "labels": [float(x) for x in s.labels]}
    if s.kind == "encoded":
        out["sha256"] = _sha(payload)
        out["size"] = len(payload)
    elif s.kind == "raw":
        arr = np.ascontiguousarray(payload)
        out.update(shape=list(arr.shape), dtype=arr.dtype.name, sha256=_sha(arr.tobytes()))
    else:
        out["tokens"] = [int(x) for x in payload]
    for k in ("synset", "text"):
        if k in s.meta:
            out[k] = s.meta[k]
    return out


def _read_all(fmt: str, path: str, **opts) -> list[dict]:
    reader = get_format(fmt).reader(path, **opts)
    try:
        return [_record(s) for s in reader]
    finally:
        reader.close()


def describe(root: str) -> dict:
    """What gpufeed reads in every output under ``root``: paths relative to ``root``."""
    out = {"recordio": {}, "tfrecord": {}, "lmdb": {}, "webdataset": {}, "mean": {}, "classes": {}}
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    for rec in sorted(glob.glob(os.path.join(root, "*", "recordio", "*.rec"))):
        layout = recordio.read_sidecar(rec)
        out["recordio"][rel(rec)] = {"kind": layout.kind, "records": _read_all("recordio", rec)}
    for shard in sorted(glob.glob(os.path.join(root, "*", "tfrecord", "*-of-*"))):
        if shard.endswith(".idx"):
            continue
        gz = shard.endswith(".gz")
        out["tfrecord"][rel(shard)] = {"gzip": gz, "index": None if gz else rel(tfrecord.index_path(shard)),
                                       "label_offset": LABEL_OFFSETS.get(rel(shard), 0),
                                       "records": _read_all("tfrecord", shard)}
    for env in sorted(glob.glob(os.path.join(root, "*", "lmdb", "*_lmdb"))):
        out["lmdb"][rel(env)] = {"records": _read_all("lmdb", env)}
    for tar in sorted(glob.glob(os.path.join(root, "*", "webdataset", "*.tar"))):
        out["webdataset"][rel(tar)] = {"index": rel(webdataset.index_path(tar)),
                                       "records": _read_all("webdataset", tar)}
    for mean in sorted(glob.glob(os.path.join(root, "*", "mean.binaryproto"))):
        m = read_mean_binaryproto(mean)
        out["mean"][rel(mean)] = {"shape": list(m.shape), "data": [float(x) for x in m.ravel()]}
    for classes in sorted(glob.glob(os.path.join(root, "*", "classes.txt"))):
        with open(classes) as f:
            out["classes"][rel(os.path.dirname(classes))] = {
                line.split("\t")[1]: int(line.split("\t")[0]) for line in f if line.strip()}
    return out


def main() -> None:
    root = os.path.abspath(sys.argv[1])
    write_edge(root)
    expected = describe(root)
    with open(os.path.join(root, "expected.json"), "w") as f:
        json.dump(expected, f)
    counts = {k: sum(len(v["records"]) for v in expected[k].values())
              for k in ("recordio", "tfrecord", "lmdb", "webdataset")}
    print(f"edge cases written; expected.json lists {counts}")


if __name__ == "__main__":
    main()
