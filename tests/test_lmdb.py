"""Caffe LMDB: real environments written and read back, Datum and BlobProto bytes checked against the wire
format worked out by hand, map growth, compaction, determinism, resume, corruption, many processes."""

from __future__ import annotations

import hashlib
import json
import shutil
import multiprocessing
import os
import subprocess
import sys
import textwrap

import cv2
import lmdb
import numpy as np
import pytest

from forked import fork_map
from gpufeed.errors import ConfigError, CorruptRecordError, IncompleteOutputError, InputError
from gpufeed.formats import get_format
from gpufeed.formats.base import Sample
from gpufeed.formats.caffe_datum import decode_datum, make_key, read_mean_binaryproto, write_mean_binaryproto
from gpufeed.formats.lmdb import CHECKSUMS, OFFSETS, PAGES, SIDECAR
from gpufeed.formats.proto import caffe_pb2

FMT = get_format("lmdb")


def jpeg(rng, h=24, w=32) -> bytes:
    img = rng.integers(0, 256, (h, w, 3), np.uint8)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    return buf.tobytes()


def raw_values(path):
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        items = list(txn.cursor())
    env.close()
    return items


def write(path, samples, **opts):
    with FMT.writer(str(path), **opts) as w:
        for s in samples:
            w.write(s)
    return w


# -- bytes worked out by hand from the protobuf wire format (tag = field << 3 | wire type) ----------------

def test_golden_encoded_datum():
    s = Sample("a.jpg", 3, b"\xff\xd8\xff\xd9", "encoded", 0)
    # data: field 4, length-delimited (0x22), 4 bytes; label: field 5 varint (0x28) = 3;
    # encoded: field 7 varint (0x38) = 1. No channels/height/width, as Caffe's ReadFileToDatum.
    assert FMT.encode(s).value == b"\x22\x04\xff\xd8\xff\xd9" b"\x28\x03" b"\x38\x01"
    assert FMT.encode(s).key == b"00000000_a.jpg"


def test_golden_raw_datum():
    rgb = np.array([[[1, 2, 3], [4, 5, 6]]], np.uint8)  # 1x2 pixels, RGB
    value = FMT.encode(Sample("p.png", 300, rgb, "raw", 7)).value
    # channels=3 (08 03), height=1 (10 01), width=2 (18 02); data (22 06) = B plane 3 6, G plane 2 5,
    # R plane 1 4; label 300 = varint AC 02; encoded=false written explicitly (38 00).
    assert value == (b"\x08\x03\x10\x01\x18\x02" b"\x22\x06\x03\x06\x02\x05\x01\x04" b"\x28\xac\x02" b"\x38\x00")


def test_golden_tokens_datum():
    value = FMT.encode(Sample("s1", 0, np.array([1, 2], np.int32), "tokens", 0)).value
    # 1x1x2, label 0 present (28 00), float_data field 6 unpacked proto2 fixed32 (35) 1.0f and 2.0f LE.
    assert value == (b"\x08\x01\x10\x01\x18\x02" b"\x28\x00" b"\x35\x00\x00\x80\x3f" b"\x35\x00\x00\x00\x40"
                     b"\x38\x00")


def test_golden_mean_binaryproto(tmp_path):
    path = tmp_path / "mean.binaryproto"
    write_mean_binaryproto(str(path), np.array([[[0.5]], [[-2.0]]], np.float32))
    # num=1 (08 01), channels=2 (10 02), height=1 (18 01), width=1 (20 01); data field 5 packed (2a),
    # 8 bytes: 0.5f = 00 00 00 3f, -2.0f = 00 00 00 c0.
    assert path.read_bytes() == b"\x08\x01\x10\x02\x18\x01\x20\x01\x2a\x08\x00\x00\x00\x3f\x00\x00\x00\xc0"


def test_mean_binaryproto_round_trip_and_rgb_order(tmp_path, rng):
    mean = rng.random((3, 5, 4), np.float32) * 255
    write_mean_binaryproto(str(tmp_path / "m"), mean)
    np.testing.assert_array_equal(read_mean_binaryproto(str(tmp_path / "m")), mean)
    write_mean_binaryproto(str(tmp_path / "rgb"), mean, order="RGB")
    np.testing.assert_array_equal(read_mean_binaryproto(str(tmp_path / "rgb")), mean[::-1])
    with pytest.raises(ConfigError):
        write_mean_binaryproto(str(tmp_path / "bad"), np.zeros((4, 4)))


# -- real environments ---------------------------------------------------------------------------------

def test_round_trip_all_kinds(tmp_path, rng):
    img = rng.integers(0, 256, (9, 11, 3), np.uint8)
    norm = rng.standard_normal((4, 5, 3)).astype(np.float32)
    gray = rng.integers(0, 256, (6, 7), np.uint8)
    samples = [Sample(f"n0/{i}.JPEG", i % 4, jpeg(rng), "encoded", i) for i in range(20)]
    samples += [Sample("raw.png", 2, img, "raw", 20), Sample("norm", 1, norm, "raw", 21),
                Sample("gray", 5, gray, "raw", 22), Sample("tok", 9, np.arange(36, dtype=np.int32), "tokens", 23),
                Sample("multi.jpg", [4, 17, 250], jpeg(rng), "encoded", 24),
                Sample("multiraw", [1, 2], img, "raw", 25)]
    out = tmp_path / "train_lmdb"
    files = write(out, samples)
    assert sorted(os.listdir(out)) == sorted([CHECKSUMS, OFFSETS, PAGES, SIDECAR, "data.mdb"])
    r = FMT.reader(str(out))
    assert len(r) == len(samples)
    for i, s in enumerate(samples):
        got = r[i]
        assert (got.key, got.index, got.kind) == (s.key, s.index, s.kind)
        if s.kind == "encoded":
            assert got.payload == s.payload
        else:
            np.testing.assert_array_equal(got.payload.reshape(np.asarray(s.payload).shape), s.payload)
        assert tuple(got.labels) == tuple(float(x) for x in s.labels)
    assert [s.key for s in r] == [s.key for s in samples]
    assert [s.key for s in r.shard(1, 4)] == [s.key for s in samples[1::4]]
    assert r.read_raw(3) == FMT.encode(samples[3]).value
    assert list(r.iter_raw())[5] == FMT.encode(samples[5]).value
    assert r[-1].key == "multiraw"
    with pytest.raises(IndexError):
        r[len(samples)]
    assert files.committed_records == len(samples)


def test_raw_datum_is_bgr_chw_pixel_by_pixel(tmp_path):
    h, w = 3, 4
    img = np.zeros((h, w, 3), np.uint8)
    for y in range(h):
        for x in range(w):
            img[y, x] = (10 * y + x, 100 + 10 * y + x, 200 + 10 * y + x)  # R, G, B
    write(tmp_path / "db", [Sample("k.png", 0, img, "raw", 0)])
    (key, value), = raw_values(tmp_path / "db")
    d = caffe_pb2.Datum.FromString(value)
    assert (d.channels, d.height, d.width, d.HasField("encoded"), d.encoded) == (3, h, w, True, False)
    for c, base in enumerate((200, 100, 0)):  # planes B, G, R
        for y in range(h):
            for x in range(w):
                assert d.data[c * h * w + y * w + x] == base + 10 * y + x
    # The same bytes OpenCV's CVMatToDatum stores: a BGR Mat split into planes.
    bgr = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
    assert d.data == bgr.transpose(2, 0, 1).tobytes()


def test_encoded_field_always_present(tmp_path, rng):
    write(tmp_path / "db", [Sample("a.jpg", 1, jpeg(rng), "encoded", 0),
                            Sample("b", 0, rng.integers(0, 255, (2, 2, 3), np.uint8), "raw", 1),
                            Sample("c", 0, np.arange(3, dtype=np.int32), "tokens", 2)])
    datums = [caffe_pb2.Datum.FromString(v) for _, v in raw_values(tmp_path / "db")]
    assert [d.HasField("encoded") for d in datums] == [True, True, True]
    assert [d.encoded for d in datums] == [True, False, False]
    assert datums[0].HasField("label") and not datums[0].HasField("channels")


def test_keys_sort_in_write_order(tmp_path, rng):
    names = ["z/last.JPEG", "a/first.JPEG", "m/mid.JPEG"] * 4
    write(tmp_path / "db", [Sample(f"{n}{i}", 0, b"x", "encoded", i) for i, n in enumerate(names)])
    keys = [k for k, _ in raw_values(tmp_path / "db")]
    assert keys == [b"%08d_%s%d" % (i, n.encode(), i) for i, n in enumerate(names)]


def test_map_grows_from_a_tiny_map(tmp_path, rng):
    payload = rng.bytes(40_000)
    w = write(tmp_path / "db", [Sample(f"{i}", 0, payload, "encoded", i) for i in range(100)],
              initial_map_size=64 << 10, batch_records=16)
    stats = w.stats
    assert stats["map_grows"] >= 5 and stats["map_size"] >= stats["data_bytes"]
    assert len(FMT.reader(str(tmp_path / "db"))) == 100


def test_final_file_is_compacted(tmp_path, rng):
    samples = [Sample(f"{i}", 0, rng.bytes(100_000), "encoded", i) for i in range(60)]
    w = write(tmp_path / "db", samples, initial_map_size=64 << 10, batch_records=7)
    stats = json.loads((tmp_path / "db" / SIDECAR).read_text())["stats"]
    size = os.path.getsize(tmp_path / "db" / "data.mdb")
    assert stats["file_bytes"] == size == w.stats["file_bytes"]
    # 100 kB values live in overflow pages: at most one partly filled 4 KiB page each, plus the tree.
    assert stats["data_bytes"] <= size <= stats["data_bytes"] * 1.05 + (64 << 10)
    assert size < stats["map_size"]
    assert not (tmp_path / "db" / "lock.mdb").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["db"]


_WRITE_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    from gpufeed.formats import get_format
    from gpufeed.formats.base import Sample
    rng = np.random.default_rng(7)
    crash_after = int(sys.argv[2])
    w = get_format("lmdb").writer(sys.argv[1], initial_map_size=1 << 16, batch_records=10)
    for i in range(57):
        size = int(rng.integers(10, 5000))
        w.write(Sample(f"c{i % 3}/{i}.jpg", i % 3, rng.bytes(size), "encoded", i))
        if i + 1 == crash_after:
            import os; os._exit(3)
    w.close()
""")


def _run_writer(path, crash_after=0):
    return subprocess.run([sys.executable, "-c", _WRITE_SCRIPT, str(path), str(crash_after)],
                          capture_output=True, text=True)


def test_same_samples_give_identical_bytes_across_processes(tmp_path):
    digests = []
    for name in ("one", "two"):
        assert _run_writer(tmp_path / name).returncode == 0
        digests.append(hashlib.sha256((tmp_path / name / "data.mdb").read_bytes()).hexdigest())
        digests.append((tmp_path / name / CHECKSUMS).read_bytes())
    assert digests[0] == digests[2] and digests[1] == digests[3]


def test_resume_after_a_crash(tmp_path):
    assert _run_writer(tmp_path / "clean").returncode == 0
    assert _run_writer(tmp_path / "db", crash_after=35).returncode == 3
    assert not (tmp_path / "db").exists()
    work, = [p for p in tmp_path.iterdir() if p.name.startswith(".db.tmp-")]
    saved = (work / CHECKSUMS).read_bytes()
    assert len(saved) == 30 * 12
    (work / CHECKSUMS).write_bytes(saved[:20 * 12])  # as if the crash came between a commit and its CRCs
    w = FMT.writer(str(tmp_path / "db"), resume=True, initial_map_size=1 << 16, batch_records=10)
    assert w.committed_records == 30
    assert w.last_committed_key.startswith(b"00000029_")
    for key, value in raw_values(tmp_path / "clean")[30:]:
        w.write_encoded(FMT.encode(decode_datum(key, value))._replace(key=key, value=value))
    w.close()
    assert raw_values(tmp_path / "db") == raw_values(tmp_path / "clean")
    assert (tmp_path / "db" / CHECKSUMS).read_bytes() == (tmp_path / "clean" / CHECKSUMS).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean", "db"]


def test_writes_out_of_order_are_refused(tmp_path):
    w = FMT.writer(str(tmp_path / "db"))
    w.write(Sample("a", 0, b"x", "encoded", 5))
    with pytest.raises(ConfigError, match="increasing index order"):
        w.write(Sample("b", 0, b"x", "encoded", 5))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_abort_leaves_nothing(tmp_path, rng):
    with pytest.raises(RuntimeError):
        with FMT.writer(str(tmp_path / "db"), batch_records=2) as w:
            for i in range(5):
                w.write(Sample(str(i), 0, jpeg(rng), "encoded", i))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_urls_and_bad_samples_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="local path"):
        FMT.writer("s3://bucket/train_lmdb")
    with pytest.raises(ConfigError, match="local path"):
        FMT.reader("memory://train_lmdb")
    with pytest.raises(InputError, match="511"):
        make_key(0, "x" * 600)
    with pytest.raises(InputError, match="not an integer"):
        FMT.encode(Sample("a", 2.5, b"x", "encoded", 0))
    with pytest.raises(InputError, match="float32"):
        FMT.encode(Sample("a", 0, np.array([1 << 25], np.int64), "tokens", 0))


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_in_a_value_is_caught(tmp_path, rng):
    payloads = [rng.bytes(3000) for _ in range(5)]
    write(tmp_path / "db", [Sample(str(i), 0, p, "encoded", i) for i, p in enumerate(payloads)])
    data = tmp_path / "db" / "data.mdb"
    _flip(data, data.read_bytes().index(payloads[3][:64]) + 1000)
    r = FMT.reader(str(tmp_path / "db"))
    assert r[2].payload == payloads[2]
    with pytest.raises(CorruptRecordError) as e:
        r[3]
    assert e.value.record_index == 3 and "data.mdb" in e.value.path
    with pytest.raises(CorruptRecordError):
        list(r)
    assert FMT.reader(str(tmp_path / "db"), verify=False)[3].payload != payloads[3]


def test_caffe_made_environment_with_gaps_and_bad_datum(tmp_path):
    """An LMDB as convert_imageset leaves it when lines fail to load: no sidecar, gaps in the key prefixes."""
    env = lmdb.open(str(tmp_path / "caffe"), map_size=1 << 20)
    good = caffe_pb2.Datum(data=b"\xff\xd8\xff", label=4, encoded=True).SerializeToString()
    with env.begin(write=True) as txn:
        txn.put(b"00000000_a.JPEG", good)
        txn.put(b"00000002_c.JPEG", good)
        txn.put(b"00000003_d.JPEG", b"\x22\xff\xff")  # length runs past the end
    env.close()
    r = FMT.reader(str(tmp_path / "caffe"))
    assert len(r) == 3 and r[1].key == "c.JPEG" and r[1].index == 2 and r[1].label == 4
    with pytest.raises(CorruptRecordError) as e:
        r[2]
    assert e.value.record_index == 2


def test_sidecar_is_checked(tmp_path):
    write(tmp_path / "db", [Sample("a", 0, b"x", "encoded", 0)])
    sidecar = tmp_path / "db" / SIDECAR
    meta = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps(dict(meta, version=99)))
    with pytest.raises(ConfigError, match="newer gpufeed"):
        FMT.reader(str(tmp_path / "db"))
    sidecar.write_text(json.dumps(dict(meta, records=2)))
    with pytest.raises(IncompleteOutputError):
        len(FMT.reader(str(tmp_path / "db")))


_shared_reader = None


def _read_keys(args):
    start, stop = args
    return [(_shared_reader[i].key, _shared_reader[i].label) for i in range(start, stop)]


def _read_with(reader, i):
    return reader[i].key


def test_reader_in_several_processes(tmp_path, rng):
    global _shared_reader
    n = 40
    write(tmp_path / "db", [Sample(f"k{i}", i, jpeg(rng, 8, 8), "encoded", i) for i in range(n)])
    _shared_reader = FMT.reader(str(tmp_path / "db"))
    expected = [(f"k{i}", i) for i in range(n)]
    assert _read_keys((0, n)) == expected  # opened in the parent before the fork
    parts = fork_map(_read_keys, [(0, 13), (13, 27), (27, n)])
    assert sum(parts, []) == expected
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        keys = pool.starmap(_read_with, [(_shared_reader, i) for i in (0, 39)])
    assert keys == ["k0", "k39"]


def test_readers_share_an_environment_and_see_a_rewrite(tmp_path):
    write(tmp_path / "db", [Sample("old", 0, b"x", "encoded", 0)])
    a, b = FMT.reader(str(tmp_path / "db")), FMT.reader(str(tmp_path / "db"))
    assert a[0].key == b[0].key == "old"
    a.close()
    assert b[0].key == "old"
    write(tmp_path / "db", [Sample("new", 0, b"y", "encoded", 0), Sample("two", 0, b"z", "encoded", 1)])
    c = FMT.reader(str(tmp_path / "db"))
    assert [s.key for s in c] == ["new", "two"]
    b.close()
    c.close()


def test_empty_output(tmp_path):
    w = write(tmp_path / "db", [])
    assert w.stats["records"] == 0 and w.committed_records == 0
    r = FMT.reader(str(tmp_path / "db"))
    assert len(r) == 0 and list(r) == [] and list(r.shard(0, 2)) == []
    with pytest.raises(IndexError):
        r[0]


def test_damaged_key_and_truncated_file_are_caught(tmp_path, rng):
    write(tmp_path / "db", [Sample(f"dir/name_{i}.JPEG", i, jpeg(rng), "encoded", i) for i in range(3)])
    data = tmp_path / "db" / "data.mdb"
    whole = data.read_bytes()
    at = whole.index(b"dir/name_1.JPEG") + 4
    _flip(data, at)
    with pytest.raises(CorruptRecordError, match=f"LMDB page {at // 4096} does not match") as e:
        list(FMT.reader(str(tmp_path / "db")))
    assert e.value.byte_offset == at // 4096 * 4096
    # Without the page checks (an older sidecar), the record's own CRC covers its key.
    sidecar = tmp_path / "db" / SIDECAR
    sidecar.write_text(json.dumps({k: v for k, v in json.loads(sidecar.read_text()).items() if k != "pages"}))
    with pytest.raises(CorruptRecordError, match="CRC-32C of key and value") as e:
        list(FMT.reader(str(tmp_path / "db")))
    assert e.value.record_index == 1
    data.write_bytes(whole[:-4096])
    with pytest.raises(CorruptRecordError, match="truncated"):
        len(FMT.reader(str(tmp_path / "db")))


def test_float16_pixels_come_back_as_float16(tmp_path, rng):
    pixels = rng.standard_normal((4, 3, 3)).astype(np.float16)
    write(tmp_path / "db", [Sample("a", 0, pixels, "raw", 0)])
    got = FMT.reader(str(tmp_path / "db"))[0].payload
    assert got.dtype == np.float16 and np.array_equal(got, pixels)
    with pytest.raises(ConfigError, match="one pixel dtype"):
        write(tmp_path / "mixed", [Sample("a", 0, pixels, "raw", 0), Sample("b", 0, pixels.astype(np.float32), "raw", 1)])


def test_reads_and_writes_are_charged_to_tier_emulation(tmp_path, rng):
    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.tiers import Limits

    payloads = [rng.bytes(20_000) for _ in range(10)]
    limits = Limits(iops=1e9, bytes_per_s=1e12, latency_s=0.0, io_unit=4096)
    with Throttle.emulate(limits, accounting="requests", state_dir=tmp_path) as t:
        w = write(tmp_path / "db", [Sample(str(i), 0, p, "encoded", i) for i, p in enumerate(payloads)],
                  batch_records=4)
        assert t.stats()["bytes_written"] >= w.stats["data_bytes"] + w.stats["file_bytes"]
        t.reset_stats()
        r = FMT.reader(str(tmp_path / "db"))
        values = sum(len(v) for v in r.iter_raw())
        assert t.stats()["bytes_read"] >= values > sum(map(len, payloads))
        t.reset_stats()
        value = r.read_raw(3)
        assert t.stats()["bytes_read"] == len(value)
        r.close()


@pytest.mark.parametrize("sample", [
    Sample("f", 3, np.linspace(-2, 2, 2 * 3 * 3, dtype=np.float32).reshape(2, 3, 3), "raw", 0),
    Sample("m", [7, 1.5, 2], b"\xff\xd8\xff\xd9", "encoded", 0),
    Sample("u", [0, 4], np.arange(12, dtype=np.uint8).reshape(2, 2, 3), "raw", 0),
    Sample("t", 2, np.array([5, 0, 9999], np.int32), "tokens", 0)], ids=["float", "multi", "multiraw", "tokens"])
def test_datums_are_what_protobuf_itself_writes(sample):
    """float_data is built with numpy for speed: the bytes must equal protobuf's own serialization."""
    value = FMT.encode(sample).value
    reference = caffe_pb2.Datum.FromString(value)
    assert reference.SerializeToString() == value
    assert reference.HasField("encoded") and reference.encoded == (sample.kind == "encoded")


def test_keys_without_index_prefix_are_listed(tmp_path):
    env = lmdb.open(str(tmp_path / "plain"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        for name in (b"apple", b"banana", b"cherry"):
            txn.put(name, caffe_pb2.Datum(data=name, label=len(name), encoded=True).SerializeToString())
    env.close()
    r = FMT.reader(str(tmp_path / "plain"))
    assert [r[i].key for i in range(3)] == ["apple", "banana", "cherry"] and r[2].label == 6


def test_values_are_read_at_their_recorded_offsets_and_checked(tmp_path, rng):
    """gpufeed's LMDBs list each value's byte offset (one pread per value, inline or overflow); without
    that list (Caffe's LMDBs) the reader maps the file as before; a wrong offset is a CorruptRecordError."""
    big = [Sample(f"n0/{i}.JPEG", i % 3, rng.integers(0, 256, 9000 + 37 * i, np.uint8).tobytes(), "encoded", i)
           for i in range(30)]
    small = [Sample(f"t/{i}", 0, np.arange(i + 1, dtype=np.int32), "tokens", 30 + i) for i in range(40)]
    out = tmp_path / "train_lmdb"
    write(out, big + small)
    offsets = np.fromfile(out / OFFSETS, "<u8")
    data = (out / "data.mdb").read_bytes()
    values = [v for _, v in raw_values(out)]
    for value, off in zip(values, offsets):
        assert data[int(off):int(off) + len(value)] == value
    with FMT.reader(str(out)) as r:
        assert [bytes(r.read_raw(i)) for i in range(70)] == values
        assert [s.key for s in r] == [s.key for s in big + small]
    # Caffe's LMDBs have no offsets: the same values through the map.
    side = json.loads((out / SIDECAR).read_text())
    plain = tmp_path / "plain_lmdb"
    shutil.copytree(out, plain)
    (plain / OFFSETS).unlink()
    (plain / SIDECAR).write_text(json.dumps({k: v for k, v in side.items() if k != "offsets"}))
    with FMT.reader(str(plain)) as r:
        assert [bytes(r.read_raw(i)) for i in range(70)] == values
    # A damaged offsets list reads the wrong bytes, which the value CRCs catch.
    offsets[5] += 4
    offsets.astype("<u8").tofile(out / OFFSETS)
    with FMT.reader(str(out)) as r, pytest.raises(CorruptRecordError, match="record 5.*CRC-32C"):
        r.read_raw(5)
