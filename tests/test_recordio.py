"""RecordIO specifics: files from other tools (no sidecar, no .idx), random access by key, the sidecar checks,
and what the writer refuses."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from gpufeed.errors import ConfigError, CorruptRecordError, InputError, ShardNotFound
from gpufeed.formats import get_format
from gpufeed.formats.base import Sample
from gpufeed.formats.recordio import MAGIC, frame

fmt = get_format("recordio")


def im2rec_value(label: float, id_: int, payload: bytes) -> bytes:
    """What ``mxnet.recordio.pack(IRHeader(0, label, id_, 0), payload)`` returns."""
    return struct.pack("<IfQQ", 0, label, id_, 0) + payload


def test_reads_an_im2rec_file_without_sidecar_or_index(tmp_path):
    values = [im2rec_value(i, i, bytes([i]) * (10 + i)) for i in range(4)]
    (tmp_path / "plain.rec").write_bytes(b"".join(frame(v) for v in values))
    r = fmt.reader(str(tmp_path / "plain.rec"))
    got = list(r)
    assert [s.label for s in got] == [0, 1, 2, 3]
    assert [s.payload for s in got] == [bytes([i]) * (10 + i) for i in range(4)]
    assert [bytes(v) for v in r.iter_raw()] == values
    with pytest.raises(TypeError, match="no .idx"):
        len(r)
    assert [s.index for s in r.shard(1, 2)] == [1, 3]


def test_reads_an_im2rec_file_with_index_and_list(tmp_path):
    values = [im2rec_value(7 - i, 10 + i, b"img%d" % i) for i in range(3)]
    data, idx = b"", b""
    for i, v in enumerate(values):
        idx += b"%d\t%d\n" % (10 + i, len(data))
        data += frame(v)
    (tmp_path / "x.rec").write_bytes(data)
    (tmp_path / "x.idx").write_bytes(idx)
    (tmp_path / "x.lst").write_text("10\t7.000000\ta/0.jpg\n11\t6.000000\ta/1.jpg\n12\t5.000000\ta/2.jpg\n")
    r = fmt.reader(str(tmp_path / "x.rec"))
    assert len(r) == 3
    assert r.by_key(11).payload == b"img1"
    assert r.by_key("12").key == "a/2.jpg"
    with pytest.raises(KeyError):
        r.by_key(99)


def test_random_access_by_key_and_position(tmp_path):
    path = str(tmp_path / "k.rec")
    samples = [Sample(f"c/{i}.jpg", i, b"p%d" % i, index=100 + i) for i in range(5)]
    with fmt.writer(path) as w:
        for s in samples:
            w.write(s)
    r = fmt.reader(path)
    assert r.by_key(103).key == "c/3.jpg"
    assert r[-1].index == 104
    with pytest.raises(IndexError):
        r[5]


def test_random_reads_whole_records_whatever_the_index_order_and_size(tmp_path):
    """A record read at random is one pread of the extent up to the next offset; a record longer than that
    guess (the last one, past 256 KiB) reads on. The reader takes an .idx in any order, in file order."""
    sizes = [10, 300 << 10, 5, 400 << 10]  # the last record is longer than the first read of a last record
    values = [im2rec_value(i, i, bytes([65 + i]) * n) for i, n in enumerate(sizes)]
    data, offsets = b"", []
    for v in values:
        offsets.append(len(data))
        data += frame(v)
    (tmp_path / "o.rec").write_bytes(data)
    (tmp_path / "o.idx").write_bytes(b"".join(b"%d\t%d\n" % (i, offsets[i]) for i in [3, 1, 0, 2]))
    r = fmt.reader(str(tmp_path / "o.rec"))
    assert [bytes(r.read_raw(k)) for k in range(4)] == values
    assert [r[k].payload for k in (3, 1)] == [b"D" * sizes[3], b"B" * sizes[1]]


def test_sidecar_records_layout_and_is_checked(tmp_path):
    path = str(tmp_path / "raw.rec")
    with fmt.writer(path, params={"resize": 32}) as w:
        w.write(Sample("r", 1, np.zeros((4, 5, 3), np.uint8), kind="raw", index=0))
    side = json.loads((tmp_path / "raw.rec.json").read_text())
    assert (side["kind"], side["shape"], side["dtype"], side["records"]) == ("raw", [4, 5, 3], "uint8", 1)
    assert side["params"] == {"resize": 32} and side["gpufeed"]
    side["version"] = 99
    (tmp_path / "raw.rec.json").write_text(json.dumps(side))
    with pytest.raises(ConfigError, match="layout version 99"):
        fmt.reader(path)
    (tmp_path / "raw.rec.json").write_text("{not json")
    with pytest.raises(CorruptRecordError):
        fmt.reader(path)


def test_index_that_disagrees_with_the_data_raises(tmp_path):
    path = str(tmp_path / "i.rec")
    with fmt.writer(path) as w:
        for i in range(3):
            w.write(Sample(f"k{i}", i, b"abcdefgh", index=i))
    idx = (tmp_path / "i.idx").read_text().splitlines()
    (tmp_path / "i.idx").write_text("\n".join(idx[:2]) + "\n")
    with pytest.raises(CorruptRecordError, match="SHA-256 its .rec.json sidecar recorded"):
        len(fmt.reader(path))
    side = json.loads((tmp_path / "i.rec.json").read_text())
    del side["sha256"]
    (tmp_path / "i.rec.json").write_text(json.dumps(side))
    with pytest.raises(CorruptRecordError, match="index lists 2"):
        len(fmt.reader(path))
    (tmp_path / "i.lst").write_text("0\t0.000000\tk0\n")
    assert fmt.reader(path).layout.sha256 is None
    (tmp_path / "i.rec.json").unlink()
    (tmp_path / "i.idx").write_text("0\t0\n1\t4\n2\t48\n")
    with pytest.raises(CorruptRecordError):
        fmt.reader(path)[1]
    (tmp_path / "i.idx").write_text("0\t0\nbroken line\n")
    with pytest.raises(CorruptRecordError, match="line 2"):
        len(fmt.reader(path))


def test_writer_refuses_mixed_layouts_bad_names_and_repeated_indices(tmp_path):
    with fmt.writer(str(tmp_path / "w.rec")) as w:
        w.write(Sample("a", 0, np.zeros((2, 2, 3), np.uint8), kind="raw", index=0))
        with pytest.raises(ConfigError, match="one raw shape"):
            w.write(Sample("b", 0, np.zeros((3, 2, 3), np.uint8), kind="raw", index=1))
        with pytest.raises(InputError, match="tab or newline"):
            w.write_encoded(fmt.encode(Sample("a\tb", 0, np.zeros((2, 2, 3), np.uint8), kind="raw", index=2)))
        with pytest.raises(ConfigError, match="written twice"):
            w.write(Sample("c", 0, np.zeros((2, 2, 3), np.uint8), kind="raw", index=0))
    with pytest.raises(InputError, match="float32"):
        fmt.encode(Sample("big", 2 ** 24 + 1, b"x"))
    with pytest.raises(InputError, match="1-D integer"):
        fmt.encode(Sample("t", 0, np.zeros(3, np.float32), kind="tokens"))


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(ShardNotFound, match="convert the dataset again"):
        fmt.reader(str(tmp_path / "none.rec"))


def test_split_record_with_missing_continuation_raises(tmp_path):
    value = im2rec_value(0, 0, b"AB\0\0" + struct.pack("<I", MAGIC) + b"CD")
    framed = frame(value)
    first_part = framed[: 8 + 28]
    (tmp_path / "s.rec").write_bytes(first_part + frame(im2rec_value(1, 1, b"zz")))
    with pytest.raises(CorruptRecordError, match="does not continue"):
        list(fmt.reader(str(tmp_path / "s.rec")))


def test_a_list_file_gives_its_split_and_label_counts(tmp_path):
    """Format.listed_labels: a .lst of a single .rec or of a shard, its split and each label's count (labels as
    floats, one or several a line); None for the .rec, the .idx, or a .lst outside the format's folder."""
    (tmp_path / "recordio").mkdir()
    (tmp_path / "recordio" / "val.lst").write_text("0\t3\ta.jpg\n1\t3.000000\tb.jpg\n2\t1\t2\tc.jpg\n")
    (tmp_path / "recordio" / "train-00001-of-00004.lst").write_text("5\t0\td.jpg\n")
    assert fmt.listed_labels(str(tmp_path), "recordio/val.lst") == ("val", {(3.0,): 2, (1.0, 2.0): 1})
    assert fmt.listed_labels(str(tmp_path), "recordio/train-00001-of-00004.lst") == ("train", {(0.0,): 1})
    for other in ("recordio/val.rec", "recordio/val.idx", "lmdb/val.lst", "val.lst"):
        assert fmt.listed_labels(str(tmp_path), other) is None
    assert get_format("tfrecord").listed_labels(str(tmp_path), "recordio/val.lst") is None
