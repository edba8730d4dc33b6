"""Golden bytes: files written by the RecordIO and TFRecord writers, compared with bytes worked out by hand from
the specifications (dmlc-core recordio.cc, mxnet recordio.py, TensorFlow record_writer.cc, example.proto, DALI
tfrecord2idx), not with anything our own writers produce. CRC-32C values come from the ``crc32c`` package,
itself checked against the standard check value."""

from __future__ import annotations

import gzip

import crc32c
import numpy as np

from gpufeed.formats import get_format
from gpufeed.formats.base import Sample

MAGIC = bytes.fromhex("0a23d7ce")  # 0xced7230a little-endian


def test_crc32c_is_the_castagnoli_crc():
    assert crc32c.crc32c(b"123456789") == 0xE3069283


def masked(data: bytes) -> bytes:
    crc = crc32c.crc32c(data)
    return ((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF).to_bytes(4, "little")


def irheader(flag: int, label_f32_le: str, id_: int, rest: bytes) -> bytes:
    """The record value: IRHeader with id2 = CRC-32C of (header with id2 = 0) + rest, then rest."""
    head = flag.to_bytes(4, "little") + bytes.fromhex(label_f32_le) + id_.to_bytes(8, "little")
    crc = crc32c.crc32c(head + bytes(8) + rest)
    return head + crc.to_bytes(8, "little") + rest


def write(name, path, samples, **options):
    with get_format(name).writer(str(path), **options) as w:
        for s in samples:
            w.write(s)


def test_recordio_single_label_record(tmp_path):
    write("recordio", tmp_path / "g.rec", [Sample("cat/a.jpg", 3, b"JPEGDATA!", index=5)])
    value = irheader(0, "00004040", 5, b"JPEGDATA!")  # 3.0f = 0x40400000
    assert len(value) == 33
    expected = MAGIC + bytes.fromhex("21000000") + value + bytes(3)  # lrec = 33, cflag 0; pad 33 -> 36
    assert (tmp_path / "g.rec").read_bytes() == expected
    assert (tmp_path / "g.idx").read_bytes() == b"5\t0\n"
    assert (tmp_path / "g.lst").read_bytes() == b"5\t3.000000\tcat/a.jpg\n"


def test_recordio_multi_label_and_offsets(tmp_path):
    write("recordio", tmp_path / "m.rec", [Sample("x", [1.0, 2.5], b"ab", index=0),
                                           Sample("y", 7, b"abcd", index=1)])
    labels = bytes.fromhex("0000803f") + bytes.fromhex("00002040")  # 1.0f, 2.5f
    v0 = irheader(2, "00000000", 0, labels + b"ab")  # flag = 2 labels, label field 0
    v1 = irheader(0, "0000e040", 1, b"abcd")  # 7.0f
    r0 = MAGIC + len(v0).to_bytes(4, "little") + v0 + bytes(-len(v0) % 4)
    r1 = MAGIC + len(v1).to_bytes(4, "little") + v1
    assert (tmp_path / "m.rec").read_bytes() == r0 + r1
    assert (tmp_path / "m.idx").read_bytes() == b"0\t0\n1\t%d\n" % len(r0)
    assert (tmp_path / "m.lst").read_bytes() == b"0\t1.000000\t2.500000\tx\n1\t7.000000\ty\n"


def test_recordio_escapes_an_aligned_magic(tmp_path):
    # value = 24-byte header, "AB\0\0", magic at value offset 28 (aligned), "CD", an unaligned magic, "E"
    tail = b"AB\0\0" + MAGIC + b"CD" + MAGIC + b"E"
    write("recordio", tmp_path / "e.rec", [Sample("e", 1, tail, index=0)])
    value = irheader(0, "0000803f", 0, tail)
    assert value[28:32] == MAGIC
    first = MAGIC + ((1 << 29) | 28).to_bytes(4, "little") + value[:28]  # cflag 1, bytes before the magic
    rest = value[32:]  # "CD" + unaligned magic + "E": 7 bytes, left alone
    last = MAGIC + ((3 << 29) | len(rest)).to_bytes(4, "little") + rest + bytes(1)  # cflag 3, pad to 8
    assert (tmp_path / "e.rec").read_bytes() == first + last
    assert get_format("recordio").reader(str(tmp_path / "e.rec"))[0].payload == tail


def test_recordio_magic_at_the_start_of_the_value(tmp_path):
    # A header whose first word is the magic cannot come from a Sample; frame the value directly.
    from gpufeed.formats.recordio import frame

    value = MAGIC + b"12345678"
    assert frame(value) == (MAGIC + (1 << 29).to_bytes(4, "little")  # empty first part
                            + MAGIC + ((3 << 29) | 8).to_bytes(4, "little") + b"12345678")


def test_recordio_tokens(tmp_path):
    write("recordio", tmp_path / "t.rec", [Sample("ptb/0", 0, np.array([1, 258, -1], np.int32), kind="tokens",
                                                  index=0)])
    ids = bytes.fromhex("01000000" "02010000" "ffffffff")
    value = irheader(0, "00000000", 0, ids)
    assert (tmp_path / "t.rec").read_bytes() == MAGIC + (36).to_bytes(4, "little") + value


# tf.train.Example for Sample("k", 0, [1, 2], kind="tokens"), map entries sorted by key (deterministic):
# Example{1: Features{1: entry...}}, entry = {1: key string, 2: Feature}, Feature bytes_list=1 / int64_list=3,
# lists hold field 1 (int64 packed).
_ENTRIES = [
    "0a0c" "0a036b6579" "1205" "0a03" "0a016b",  # "key": bytes_list [b"k"]
    "0a0e" "0a056c6162656c" "1205" "1a03" "0a0100",  # "label": int64_list [0]
    "0a0f" "0a066c656e677468" "1205" "1a03" "0a0102",  # "length": int64_list [2]
    "0a10" "0a06746f6b656e73" "1206" "1a04" "0a020102",  # "tokens": int64_list [1, 2]
]
_EXAMPLE = bytes.fromhex("0a41" + "".join(_ENTRIES))


def test_tfrecord_tokens_record_and_dali_index(tmp_path):
    assert len(_EXAMPLE) == 67
    path = tmp_path / "train-00000-of-00001"
    write("tfrecord", path, [Sample("k", 0, np.array([1, 2], np.int32), kind="tokens", index=0)])
    length = (67).to_bytes(8, "little")
    record = length + masked(length) + _EXAMPLE + masked(_EXAMPLE)
    assert path.read_bytes() == record
    assert (tmp_path / "train-00000-of-00001.idx").read_bytes() == b"0 83\n"  # 12 + 67 + 4


def test_tfrecord_gzip_is_gzip_of_the_same_records(tmp_path):
    path = tmp_path / "train-00000-of-00001.gz"
    samples = [Sample("k", 0, np.array([1, 2], np.int32), kind="tokens", index=i) for i in range(2)]
    write("tfrecord", path, samples)
    length = (67).to_bytes(8, "little")
    record = length + masked(length) + _EXAMPLE + masked(_EXAMPLE)
    assert gzip.decompress(path.read_bytes()) == record * 2
    assert not (tmp_path / "train-00000-of-00001.gz.idx").exists()


def test_tfrecord_masked_crc_of_a_known_value():
    from gpufeed.formats.tfrecord import masked_crc

    crc = 0xE3069283  # crc32c(b"123456789")
    assert masked_crc(b"123456789") == ((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)
