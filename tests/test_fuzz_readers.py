"""Property-based fuzzing of every format's reader and record decoder (hypothesis).

Random bytes and mutated valid files go in; the only outcomes allowed are records identical to what was
written, or a gpufeed error. No other exception, no hang (hypothesis deadline), no allocation driven by a
damaged length field (tracemalloc peak bounded by the input size). LMDB files are read in a forked child so
that a crash inside the C library fails the test instead of ending the session. A longer, coverage-guided run
lives in fuzz/atheris_readers.py.
"""

from __future__ import annotations

import os
import shutil
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forked import in_child
from gpufeed.errors import GpufeedError
from gpufeed.formats import FORMATS, get_format
from gpufeed.formats.base import Sample

MAGIC = struct.pack("<I", 0xCED7230A)
FUZZ = settings(max_examples=60, deadline=3000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
NAMES = {"recordio": "f.rec", "tfrecord": "f-00000-of-00001", "lmdb": "f_lmdb", "webdataset": "f-000000.tar"}


def samples():
    rng = np.random.default_rng(5)
    out = [Sample(f"img/{i}.jpg", i, b"\xff\xd8\xff" + rng.integers(0, 256, 60 + 7 * i, dtype=np.uint8).tobytes()
                  + MAGIC, index=i) for i in range(3)]
    out.append(Sample("multi/3.jpg", [1.0, 4.0], b"\xff\xd8\xffmulti" + MAGIC * 2, index=3))
    return out


def data_file(name, path):
    from gpufeed.formats import get_format

    return get_format(name).data_file(path)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One valid output per format, and its records as written."""
    base = tmp_path_factory.mktemp("fuzz")
    out = {}
    for name in FORMATS:
        path = str(base / NAMES[name])
        with get_format(name).writer(path) as w:
            for s in samples():
                w.write(s)
        out[name] = path
    return out


def read_all(name, path, use_mmap=True):
    """Every record, sequentially and (indexed formats) at random; plain values to compare."""
    opts = {} if name == "lmdb" or use_mmap else {"use_mmap": False}
    with get_format(name).reader(path, **opts) as r:
        seq = [(s.key, tuple(float(x) for x in s.labels), bytes(s.payload)) for s in r]
        rand = [(s.key, tuple(float(x) for x in s.labels), bytes(s.payload)) for s in (r[i] for i in range(len(r)))]
    return seq, rand


def expected():
    return [(s.key, tuple(float(x) for x in s.labels), bytes(s.payload)) for s in samples()]


def identical_or_gpufeed_error(name, path, use_mmap=True):
    try:
        seq, rand = read_all(name, path, use_mmap)
    except GpufeedError:
        return
    assert seq == expected(), "damaged input was read as different data"
    assert rand == expected(), "damaged input was read at random as different data"


def copy_output(name, src, dst_dir):
    dst = os.path.join(dst_dir, os.path.basename(src))
    if os.path.isdir(src):
        shutil.copytree(src, dst)
    else:
        for f in get_format(name).output_files(src):
            if os.path.exists(f):
                shutil.copy(f, os.path.join(dst_dir, os.path.basename(f)))
    return dst


mutation = st.lists(st.tuples(st.sampled_from(["flip", "set", "delete", "insert", "truncate"]),
                              st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4)


def mutate(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for op, where, value in ops:
        if not buf:
            break
        at = int(where * len(buf))
        if op == "flip":
            buf[at] ^= 1 << (value % 8)
        elif op == "set":
            buf[at] = value
        elif op == "delete":
            del buf[at:at + 1 + value % 16]
        elif op == "insert":
            buf[at:at] = bytes([value]) * (1 + value % 8)
        else:
            del buf[at:]
    return bytes(buf)


@pytest.mark.parametrize("name", FORMATS)
@FUZZ
@given(ops=mutation, use_mmap=st.booleans())
def test_mutated_data_file(name, written, tmp_path_factory, ops, use_mmap):
    work = str(tmp_path_factory.mktemp("m"))
    path = copy_output(name, written[name], work)
    target = data_file(name, path)
    with open(target, "rb") as f:
        original = f.read()
    with open(target, "wb") as f:
        f.write(mutate(original, ops))
    if name == "lmdb":
        in_child(identical_or_gpufeed_error, name, path, timeout=60)
    else:
        identical_or_gpufeed_error(name, path, use_mmap)
    shutil.rmtree(work)


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "lmdb"])
@FUZZ
@given(ops=mutation, which=st.integers(0, 3))
def test_mutated_index_and_side_files(name, written, tmp_path_factory, ops, which):
    work = str(tmp_path_factory.mktemp("i"))
    path = copy_output(name, written[name], work)
    sides = [f for f in get_format(name).output_files(path)[1:] if os.path.exists(f)
             and not f.endswith(".json")]
    target = sides[which % len(sides)]
    with open(target, "rb") as f:
        original = f.read()
    with open(target, "wb") as f:
        f.write(mutate(original, ops))
    identical_or_gpufeed_error(name, path)
    shutil.rmtree(work)


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "lmdb"])
@FUZZ
@given(data=st.binary(max_size=2048) | st.builds(lambda a, b: a + MAGIC + b, st.binary(max_size=64),
                                                   st.binary(max_size=64)),
       use_mmap=st.booleans())
def test_random_bytes_as_a_data_file(name, tmp_path_factory, data, use_mmap):
    work = tmp_path_factory.mktemp("r")
    path = str(work / NAMES[name])
    with open(path, "wb") as f:
        f.write(data)
    tracemalloc.start()
    try:
        with get_format(name).reader(path, use_mmap=use_mmap) as r:
            for _ in r:
                pass
            for i in range(len(r) if r._has_index() else 0):
                r[i]
    except GpufeedError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 64 * len(data) + (8 << 20), f"{peak} bytes allocated reading {len(data)} bytes"


def test_huge_length_fields_allocate_nothing(tmp_path):
    """Lengths claiming terabytes, in files of a few bytes, read through plain reads (no memory map)."""
    from gpufeed.formats.tfrecord import masked_crc

    length = struct.pack("<Q", 1 << 40)
    tf = tmp_path / "huge-00000-of-00001"
    tf.write_bytes(length + struct.pack("<I", masked_crc(length)) + b"tiny")
    rec = tmp_path / "huge.rec"
    rec.write_bytes(MAGIC + struct.pack("<I", (1 << 29) - 1) + b"tiny")
    gz = tmp_path / "huge.gz"
    import gzip

    gz.write_bytes(gzip.compress(tf.read_bytes()))
    for name, path in (("tfrecord", tf), ("recordio", rec), ("tfrecord", gz)):
        tracemalloc.start()
        with pytest.raises(GpufeedError, match="truncated"):
            list(get_format(name).reader(str(path), use_mmap=False))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 4 << 20  # the first read piece, however large the length field says


@pytest.mark.parametrize("name", FORMATS)
@FUZZ
@given(value=st.binary(max_size=512) | st.builds(lambda a, b: a + b, st.sampled_from(
    [b"\n", b"\x0a\x05", b"\x08\x03\x10\x01\x18\x01", b"\x00\x00\x00\x00\x00\x00\x80\x3f"]), st.binary(max_size=64)))
def test_decode_random_values(name, value):
    fmt = get_format(name)
    try:
        s = fmt.decode(b"00000001_x", value, "fuzz", 1, 0)
    except GpufeedError:
        return
    assert s.kind in ("encoded", "raw", "tokens")


@FUZZ
@given(ops=mutation)
def test_mutated_gzip_shard(tmp_path_factory, ops):
    work = tmp_path_factory.mktemp("gz")
    path = str(work / "f.gz")
    with get_format("tfrecord").writer(path) as w:
        for s in samples():
            w.write(s)
    with open(path, "rb") as f:
        original = f.read()
    with open(path, "wb") as f:
        f.write(mutate(original, ops))
    try:
        with get_format("tfrecord").reader(path) as r:
            got = [(s.key, tuple(float(x) for x in s.labels), bytes(s.payload)) for s in r]
    except GpufeedError:
        return
    assert got == expected()
