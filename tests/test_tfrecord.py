"""TFRecord specifics: the ImageNet Example keys, the label convention, interoperation with the ``tfrecord``
package, GZIP, shards without an index, and the framing helpers convert reuses."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from tfrecord import example_pb2

from gpufeed.errors import CorruptRecordError, ConfigError
from gpufeed.formats import get_format
from gpufeed.formats.base import Sample
from gpufeed.formats.tfrecord import TFRecordFormat

fmt = get_format("tfrecord")
JPEG = b"\xff\xd8\xff\xe0" + bytes(range(200))


def imagenet_sample(label=0, index=0):
    return Sample(f"n01440764/n01440764_{index}.JPEG", label, JPEG, index=index,
                  meta={"synset": "n01440764", "text": "tench, Tinca tinca", "height": 375, "width": 500,
                        "channels": 3})


def write(path, samples, **options):
    with fmt.writer(str(path), **options) as w:
        for s in samples:
            w.write(s)


def test_imagenet_feature_keys_and_types(tmp_path):
    write(tmp_path / "train-00000-of-00001", [imagenet_sample(5)])
    payload = next(iter(fmt.reader(str(tmp_path / "train-00000-of-00001")).iter_raw()))
    feat = example_pb2.Example.FromString(bytes(payload)).features.feature
    kinds = {k: v.WhichOneof("kind") for k, v in feat.items()}
    assert kinds == {"image/encoded": "bytes_list", "image/format": "bytes_list", "image/class/label": "int64_list",
                     "image/class/synset": "bytes_list", "image/class/text": "bytes_list",
                     "image/height": "int64_list", "image/width": "int64_list", "image/channels": "int64_list",
                     "image/colorspace": "bytes_list", "image/filename": "bytes_list"}
    assert feat["image/class/label"].int64_list.value == [5]
    assert feat["image/format"].bytes_list.value == [b"JPEG"]
    assert feat["image/colorspace"].bytes_list.value == [b"RGB"]
    assert feat["image/encoded"].bytes_list.value == [JPEG]


def test_label_offset_one_gives_tensorflow_labels_and_reads_back_zero_based(tmp_path):
    path = tmp_path / "validation-00000-of-00001"
    write(path, [imagenet_sample(0), imagenet_sample(999, 1)], label_offset=1)
    r = fmt.reader(str(path))
    feat = example_pb2.Example.FromString(bytes(r.read_raw(1))).features.feature
    assert feat["image/class/label"].int64_list.value == [1000]
    assert [s.label for s in r] == [0, 999]
    write(tmp_path / "f", [imagenet_sample(3)], label_offset=0)
    assert TFRecordFormat(label_offset=1).writer(str(tmp_path / "g")).label_offset == 1
    with pytest.raises(ConfigError):
        fmt.encode(Sample("x", [0.5, 1.0], b"x"), label_offset=1)


def test_the_tfrecord_package_reads_our_shards_with_our_index(tmp_path):
    import tfrecord

    path = tmp_path / "train-00000-of-00001"
    write(path, [imagenet_sample(i, i) for i in range(4)])
    got = list(tfrecord.tfrecord_loader(str(path), str(path) + ".idx",
                                        {"image/class/label": "int", "image/encoded": "byte"}, shard=(0, 1)))
    assert [int(g["image/class/label"][0]) for g in got] == [0, 1, 2, 3]
    assert all(bytes(g["image/encoded"]) == JPEG for g in got)


def test_we_read_the_tfrecord_packages_files_and_index_them_ourselves(tmp_path):
    import tfrecord

    path = str(tmp_path / "theirs.tfrecord")
    w = tfrecord.TFRecordWriter(path)
    for i in range(3):
        w.write({"image/encoded": (JPEG, "byte"), "image/format": (b"JPEG", "byte"),
                 "image/class/label": (i, "int")})
    w.close()
    r = fmt.reader(path)
    assert len(r) == 3  # no .idx beside it: built by scanning the record headers
    assert r[2].label == 2 and r[2].payload == JPEG
    assert [s.label for s in r] == [0, 1, 2]


def test_damage_the_tfrecord_package_misses_is_caught(tmp_path):
    import tfrecord

    path = tmp_path / "train-00000-of-00001"
    write(path, [imagenet_sample(0)])
    data = bytearray(path.read_bytes())
    data[data.find(JPEG) + 50] ^= 0xFF
    path.write_bytes(data)
    theirs = next(tfrecord.tfrecord_loader(str(path), None, {"image/encoded": "byte"}))
    assert bytes(theirs["image/encoded"]) != JPEG  # wrong image, no error: CRCs not checked
    with pytest.raises(CorruptRecordError, match="payload's CRC"):
        list(fmt.reader(str(path)))


def test_gzip_shards_are_sequential_only(tmp_path):
    write(tmp_path / "train.gz", [imagenet_sample(i, i) for i in range(3)])
    write(tmp_path / "plain", [imagenet_sample(i, i) for i in range(3)], compression="gzip")
    for name in ("train.gz", "plain"):
        r = fmt.reader(str(tmp_path / name), compression="gzip" if name == "plain" else None)
        assert [s.label for s in r] == [0, 1, 2]
        with pytest.raises(TypeError, match="GZIP"):
            len(r)
    assert fmt.output_files(str(tmp_path / "train.gz")) == [str(tmp_path / "train.gz")]
    with pytest.raises(ConfigError):
        fmt.writer(str(tmp_path / "z"), compression="zstd")


def test_dali_index_matches_tfrecord2idx(tmp_path):
    path = tmp_path / "train-00000-of-00002"
    write(path, [imagenet_sample(i, i) for i in range(5)])
    expected, data, pos = [], path.read_bytes(), 0
    while pos < len(data):  # what DALI's tfrecord2idx does: offset, then 8 + 4 + length + 4
        (length,) = struct.unpack_from("<q", data, pos)
        expected.append(f"{pos} {12 + length + 4}")
        pos += 12 + length + 4
    assert (tmp_path / "train-00000-of-00002.idx").read_text().splitlines() == expected


def test_not_an_example_raises_corrupt_record(tmp_path):
    with pytest.raises(CorruptRecordError, match="tf.train.Example"):
        fmt.decode(b"", b"\xff\xff\xff", "f", 3, 10)
    with pytest.raises(CorruptRecordError, match="image/encoded"):
        fmt.decode(b"", example_pb2.Example().SerializeToString(), "f", 0, 0)


def test_raw_and_tokens_layout(tmp_path):
    path = tmp_path / "t"
    write(path, [Sample("w/0", 0, np.arange(36, dtype=np.int32), kind="tokens"),
                 Sample("r/0", 2, np.ones((2, 2, 1), np.float32), kind="raw")])
    r = fmt.reader(str(path))
    tok = example_pb2.Example.FromString(bytes(r.read_raw(0))).features.feature
    assert tok["tokens"].int64_list.value == list(range(36)) and tok["length"].int64_list.value == [36]
    assert tok["key"].bytes_list.value == [b"w/0"]
    raw = example_pb2.Example.FromString(bytes(r.read_raw(1))).features.feature
    assert raw["image/format"].bytes_list.value == [b"RAW"] and raw["image/dtype"].bytes_list.value == [b"float32"]
    assert raw["image/channels"].int64_list.value == [1]


def test_empty_gzip_shard_reads_empty_but_an_empty_file_is_damage(tmp_path):
    write(tmp_path / "e.gz", [])
    assert list(fmt.reader(str(tmp_path / "e.gz"))) == []
    (tmp_path / "lost.gz").write_bytes(b"")
    with pytest.raises(CorruptRecordError, match="empty"):
        list(fmt.reader(str(tmp_path / "lost.gz")))


def test_values_an_example_cannot_hold_are_input_errors():
    from gpufeed.errors import InputError

    with pytest.raises(InputError, match="int64"):
        fmt.encode(Sample("big", 2 ** 70, JPEG))
    with pytest.raises(InputError, match="int64"):
        fmt.encode(Sample("t", 0, np.array([2 ** 64 - 1], np.uint64), kind="tokens"))
