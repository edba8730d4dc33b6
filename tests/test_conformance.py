"""One conformance suite over every format in gpufeed.formats.FORMATS.

Each format adds only a fixture (where its output lives and which file holds its records); every test runs
for all of them. The bar: what was written reads back identical, sequentially and at random, and damage
(a truncated tail, any flipped byte) raises a gpufeed error and never returns different data.
"""

from __future__ import annotations

import os
import re
import struct

import cv2
import numpy as np
import pytest

from forked import fork_map, in_child
from gpufeed.errors import ConfigError, CorruptRecordError, GpufeedError, RecordTooLargeError
from gpufeed.formats import FORMATS, get_format
from gpufeed.formats.base import Sample

#: The dmlc RecordIO magic as it sits on disk; every format must carry it unharmed inside payloads.
MAGIC = struct.pack("<I", 0xCED7230A)


def output_path(name: str, directory) -> str:
    return str(directory / {"recordio": "train.rec", "tfrecord": "train-00000-of-00001",
                            "lmdb": "train_lmdb", "webdataset": "train-000000.tar"}[name])


def data_file(name: str, path: str) -> str:
    """The file holding the records, the one to damage."""
    from gpufeed.formats import get_format

    return get_format(name).data_file(path)


def jpeg(rng, h=24, w=32) -> bytes:
    img = (rng.random((h, w, 3)) * 255).astype(np.uint8)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    return buf.tobytes()


def image_samples(rng, n=6):
    return [Sample(key=f"n0000{i % 3}/img_{i}.JPEG", label=i % 3, payload=jpeg(rng), index=i,
                   meta={"synset": f"n0000{i % 3}", "format": "JPEG", "height": 24, "width": 32, "channels": 3})
            for i in range(n)]


def write(name, path, samples, **options):
    with get_format(name).writer(path, **options) as w:
        for s in samples:
            w.write(s)
    return path


def assert_same(got: Sample, want: Sample):
    assert got.key == want.key
    assert got.kind == want.kind
    assert tuple(float(x) for x in got.labels) == pytest.approx(tuple(float(x) for x in want.labels))
    if want.kind == "encoded":
        assert bytes(got.payload) == bytes(want.payload)
    else:
        assert got.payload.dtype == np.asarray(want.payload).dtype
        np.testing.assert_array_equal(got.payload, want.payload)


def read_everything(name, path):
    """All records sequentially and, for indexed formats, at random: both must agree."""
    fmt = get_format(name)
    with fmt.reader(path) as r:
        seq = list(r)
        raw = [bytes(v) for v in r.iter_raw()]
        if fmt.indexed:
            assert len(r) == len(seq)
            rand = [r[i] for i in reversed(range(len(r)))][::-1]
            for a, b in zip(seq, rand):
                assert_same(a, b)
            assert [bytes(r.read_raw(i)) for i in range(len(r))] == raw
    return seq


@pytest.fixture(params=FORMATS)
def fmt_name(request):
    return request.param


def test_round_trip(fmt_name, tmp_path, rng):
    samples = image_samples(rng)
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    got = read_everything(fmt_name, path)
    assert len(got) == len(samples)
    for g, s in zip(got, samples):
        assert_same(g, s)
    for f in get_format(fmt_name).output_files(path):
        assert os.path.exists(f), f


def test_writer_reports_files_and_hashes(fmt_name, tmp_path, rng):
    import hashlib

    w = get_format(fmt_name).writer(output_path(fmt_name, tmp_path))
    for s in image_samples(rng, 3):
        w.write(s)
    written = w.close()
    assert written and all(os.path.exists(f.path) for f in written)
    for f in written:
        if os.path.isfile(f.path):
            with open(f.path, "rb") as fh:
                assert hashlib.sha256(fh.read()).hexdigest() == f.sha256
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_abort_leaves_nothing(fmt_name, tmp_path, rng):
    path = output_path(fmt_name, tmp_path)
    with pytest.raises(RuntimeError):
        with get_format(fmt_name).writer(path) as w:
            w.write(image_samples(rng, 1)[0])
            raise RuntimeError("stop")
    assert os.listdir(tmp_path) == []


def test_empty_dataset(fmt_name, tmp_path):
    path = write(fmt_name, output_path(fmt_name, tmp_path), [])
    with get_format(fmt_name).reader(path) as r:
        assert list(r) == []
        assert list(r.iter_raw()) == []
        if get_format(fmt_name).indexed:
            assert len(r) == 0
            with pytest.raises(IndexError):
                r[0]


def test_multi_label(fmt_name, tmp_path, rng):
    samples = [Sample(key=f"m/{i}.jpg", label=[float(i), 3.0, 7.0][: i % 3 + 1] if i % 3 else [2.0, 5.0],
                      payload=jpeg(rng), index=i) for i in range(5)]
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    got = read_everything(fmt_name, path)
    for g, s in zip(got, samples):
        assert_same(g, s)


def test_payload_holding_recordio_magic(fmt_name, tmp_path, rng):
    # The magic at every alignment relative to the record, at the start, twice in a row and at the very end.
    payloads = [MAGIC, MAGIC * 3, b"\0" * 4 + MAGIC, MAGIC + b"x"]
    payloads += [bytes(k) + MAGIC + bytes(rng.integers(0, 256, 37, dtype=np.uint8)) + MAGIC for k in range(8)]
    payloads += [bytes(rng.integers(0, 256, 50, dtype=np.uint8)) + MAGIC]
    samples = [Sample(key=f"magic/{i}", label=i, payload=p, index=i) for i, p in enumerate(payloads)]
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    got = read_everything(fmt_name, path)
    assert [bytes(g.payload) for g in got] == payloads


def _check_truncations(fmt_name, path, target, whole):
    cuts = sorted({len(whole) - 1, len(whole) - 3, len(whole) - 700, len(whole) // 2, len(whole) - 4096})
    for cut in cuts:
        if cut <= 0:
            continue
        with open(target, "wb") as f:
            f.write(whole[:cut])
        with pytest.raises(GpufeedError):
            read_everything(fmt_name, path)


def test_truncated_tail_raises(fmt_name, tmp_path, rng):
    samples = image_samples(rng, 4)
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    target = data_file(fmt_name, path)
    whole = open(target, "rb").read()
    in_child(_check_truncations, fmt_name, path, target, whole)
    with open(target, "wb") as f:
        f.write(whole)
    read_everything(fmt_name, path)


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "lmdb"])
def test_truncated_at_a_record_boundary_raises(name, tmp_path, rng):
    samples = image_samples(rng, 4)
    path = write(name, output_path(name, tmp_path), samples)
    with get_format(name).reader(path) as r:
        sizes = [len(bytes(v)) for v in r.iter_raw()]
    whole = open(path, "rb").read()
    # Cut right after the third record: framing alone looks fine there, the index or sidecar must tell.
    trailer = {"tfrecord": 16, "recordio": 8 + (-sizes[-1] & 3), "webdataset": 1024}[name]  # framing, end marker
    one = len(whole) - (sizes[-1] + trailer) + (1024 if name == "webdataset" else 0)
    with open(path, "wb") as f:
        f.write(whole[:one])
    with pytest.raises(CorruptRecordError):
        list(get_format(name).reader(path))


def _reads_identical_or_raises(name, path, want):
    try:
        got = read_everything(name, path)
    except GpufeedError:
        return True
    assert len(got) == len(want)
    for g, s in zip(got, want):
        assert_same(g, s)
    return False


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "lmdb"])
def test_every_flipped_byte_raises(name, tmp_path, rng):
    samples = [Sample(key=f"f/{i}", label=i, payload=bytes(rng.integers(0, 256, 40 + i, dtype=np.uint8)) + MAGIC,
                      index=i) for i in range(3)]
    path = write(name, output_path(name, tmp_path), samples)
    whole = bytearray(open(path, "rb").read())
    for pos in range(len(whole)):
        damaged = bytearray(whole)
        damaged[pos] ^= 0x10
        with open(path, "wb") as f:
            f.write(damaged)
        assert _reads_identical_or_raises(name, path, samples), f"flip at byte {pos} went unnoticed"


def _check_flips(fmt_name, path, target, whole, samples):
    # Inside a payload every format must notice (LMDB pages carry no checksum: the Datum check must).
    for s in samples:
        at = bytes(whole).find(s.payload[100:140])
        assert at > 0
        for delta in (0, 17, 33):
            damaged = bytearray(whole)
            damaged[at + delta] ^= 0x01
            with open(target, "wb") as f:
                f.write(damaged)
            assert _reads_identical_or_raises(fmt_name, path, samples), "a flipped payload byte went unnoticed"
    # Anywhere else: raise, or read exactly what was written.
    for pos in np.random.default_rng(7).choice(len(whole), size=min(150, len(whole)), replace=False):
        damaged = bytearray(whole)
        damaged[pos] ^= 0x40
        with open(target, "wb") as f:
            f.write(damaged)
        _reads_identical_or_raises(fmt_name, path, samples)


def test_flipped_byte_never_gives_wrong_data(fmt_name, tmp_path, rng):
    samples = image_samples(rng, 3)
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    target = data_file(fmt_name, path)
    in_child(_check_flips, fmt_name, path, target, bytearray(open(target, "rb").read()), samples)


def test_huge_record(fmt_name, tmp_path):
    big = np.random.default_rng(3).integers(0, 256, 40 << 20, dtype=np.uint8).tobytes()
    samples = [Sample("small/0", 1, b"abc", index=0), Sample("huge/1", 2, big, index=1),
               Sample("small/2", 3, b"defg", index=2)]
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    with get_format(fmt_name).reader(path) as r:
        got = list(r)
    assert [g.key for g in got] == [s.key for s in samples]
    assert bytes(got[1].payload) == big


def test_recordio_refuses_records_of_2_29_bytes(tmp_path):
    fmt = get_format("recordio")
    with pytest.raises(RecordTooLargeError, match="over the format's limit"):
        fmt.encode(Sample("too/big", 0, bytes((1 << 29) - 24), index=0))
    with fmt.writer(str(tmp_path / "t.rec")) as w:
        with pytest.raises(RecordTooLargeError):
            w.write_encoded(fmt.encode(Sample("ok", 0, b"x", index=0))._replace(value=bytes(1 << 29)))
        w.write(Sample("fine", 0, b"y", index=1))
    assert [s.key for s in fmt.reader(str(tmp_path / "t.rec"))] == ["fine"]


def test_tokens(fmt_name, tmp_path, rng):
    seq_len = 35
    windows = [rng.integers(0, 10000, seq_len + 1).astype(np.int32) for _ in range(4)]
    sentence = np.array([17, 4, 9999, 0], dtype=np.int32)
    samples = [Sample(f"ptb.train/{i}", 0, w, kind="tokens", index=i) for i, w in enumerate(windows + [sentence])]
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    got = read_everything(fmt_name, path)
    for g, s in zip(got, samples):
        assert_same(g, s)
    inputs, targets = got[0].payload[:-1], got[0].payload[1:]
    assert len(inputs) == len(targets) == seq_len


@pytest.mark.parametrize("dtype", ["uint8", "float16", "float32"])
def test_raw_pixels(fmt_name, tmp_path, rng, dtype):
    if dtype == "uint8":
        imgs = [rng.integers(0, 256, (8, 6, 3)).astype(np.uint8) for _ in range(3)]
    else:
        imgs = [rng.standard_normal((8, 6, 3)).astype(dtype) for _ in range(3)]
    samples = [Sample(f"raw/{i}", i, img, kind="raw", index=i) for i, img in enumerate(imgs)]
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    got = read_everything(fmt_name, path)
    for g, s in zip(got, samples):
        assert_same(g, s)


def test_sharding(fmt_name, tmp_path, rng):
    samples = [Sample(f"s/{i}", i % 5, bytes([i]) * (i + 1), index=i) for i in range(10)]
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    with get_format(fmt_name).reader(path) as r:
        parts = [[s.key for s in r.shard(rank, 3)] for rank in range(3)]
    assert parts[0] == ["s/0", "s/3", "s/6", "s/9"]
    assert sorted(sum(parts, [])) == sorted(s.key for s in samples)
    with pytest.raises(ValueError):
        list(get_format(fmt_name).reader(path).shard(3, 3))


def _read_keys(args):
    reader, rank, world = args
    return [(s.key, bytes(s.payload)) for s in reader.shard(rank, world)]


def test_reader_in_many_processes(fmt_name, tmp_path, rng):
    samples = image_samples(rng, 9)
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    reader = get_format(fmt_name).reader(path)
    assert reader[0].key == samples[0].key  # opened in the parent before forking
    parts = fork_map(_read_keys, [(reader, r, 3) for r in range(3)])
    got = dict(sum(parts, []))
    assert got == {s.key: s.payload for s in samples}


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "lmdb"])
def test_fsspec_url(name, rng):
    import fsspec

    url = "memory://conformance/" + os.path.basename(output_path(name, __import__("pathlib").Path("/")))
    samples = image_samples(rng, 3)
    write(name, url, samples)
    with get_format(name).reader(url) as r:
        for g, s in zip(r, samples):
            assert_same(g, s)
        assert_same(r[2], samples[2])
    fsspec.filesystem("memory").rm("/conformance", recursive=True)


def test_reads_go_through_the_tier_emulator(fmt_name, tmp_path, rng):
    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.tiers import Limits

    samples = image_samples(rng, 4)
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    size = os.path.getsize(data_file(fmt_name, path))
    fast = Limits(iops=1e6, bytes_per_s=1e10, latency_s=0.0, io_unit=4096)
    with Throttle.emulate(fast, accounting="requests", state_dir=str(tmp_path)) as t:
        with get_format(fmt_name).reader(path) as r:
            got = list(r)
        read = t.stats()["bytes_read"]
    for g, s in zip(got, samples):
        assert_same(g, s)
    if fmt_name != "lmdb":  # LMDB reads through its map and charges pages faulted from disk, none when cached
        assert read >= size


@pytest.mark.parametrize("emulated", [False, True])
def test_one_reader_serves_many_threads(fmt_name, tmp_path, rng, emulated):
    """Random reads of one reader from 8 threads at once give every record intact, whether the file is mapped
    or read through handles (an emulated tier): a thread pool over one reader is how prefetching loaders use it."""
    import concurrent.futures
    import contextlib

    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.tiers import Limits

    samples = image_samples(rng, 24)
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    fast = Limits(iops=1e6, bytes_per_s=1e10, latency_s=0.0, io_unit=4096)
    scope = Throttle.emulate(fast, accounting="requests", state_dir=str(tmp_path)) if emulated else contextlib.nullcontext()
    with scope, get_format(fmt_name).reader(path) as r:
        order = [int(i) for i in np.random.default_rng(3).permutation(len(samples))] * 8
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: (i, r[i]), order))
    for i, g in got:
        assert_same(g, samples[i])


def _drop_cached(path: str) -> None:
    """The file's clean pages out of the page cache, even while a reader maps it (pages never touched through
    the map are not mapped in)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_prefetch_reads_a_batch_at_the_hint(fmt_name, tmp_path, rng):
    """A reader's prefetch has the kernel fetch the named records when it is called (/proc/self/io counts the
    bytes then, before any record is read), so reading them next costs the device nothing; records not named
    stay on disk."""
    from gpufeed.bench.cache import proc_io

    samples = [Sample(key=f"k{i}", label=i, payload=os.urandom(300_000), kind="encoded", index=i) for i in range(12)]
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    named = [1, 2, 3, 7, -2]  # not the first or last: opening an LMDB touches those through its map
    _drop_cached(data_file(fmt_name, path))
    with get_format(fmt_name).reader(path) as r:
        before = proc_io()["read_bytes"]
        assert r.prefetch(named) >= len(named)
        at_hint = proc_io()["read_bytes"] - before
        if at_hint == 0:
            pytest.skip("this filesystem keeps the file cached (tmpfs?): nothing to read ahead")
        for i in named:
            assert_same(r[i], samples[i])
        after = proc_io()["read_bytes"] - before - at_hint
    assert at_hint >= 0.9 * 300_000 * len(named)
    assert at_hint < 300_000 * (len(named) + 3)  # the named records, not the file
    assert after < 0.1 * at_hint


def test_a_cold_random_read_fetches_its_record_not_its_neighbours(fmt_name, tmp_path, rng):
    """Records read cold in a shuffled order (a training loop's reads, without prefetch) cost the device about
    their own bytes: no read-ahead of the records around each one, which a loader would throw away (the 4-GPU
    machine's disk read 1.7-2.1 times the records' bytes before)."""
    from gpufeed.bench.cache import proc_io

    size, n = 100_000, 400
    payload = os.urandom(size)  # one payload: the file's size, not its bytes, is what the reads see
    path = write(fmt_name, output_path(fmt_name, tmp_path),
                 (Sample(key=f"k{i}", label=i, payload=payload, kind="encoded", index=i) for i in range(n)))
    wanted = [int(i) for i in np.random.default_rng(5).permutation(np.arange(1, n - 1))[:150]]
    _drop_cached(data_file(fmt_name, path))
    with get_format(fmt_name).reader(path) as r:
        r[0], r[n - 1]  # opening touches the ends (an LMDB's meta pages): not part of the measure
        before = proc_io()["read_bytes"]
        for i in wanted:
            assert bytes(r[i].payload) == payload
        read = proc_io()["read_bytes"] - before
    if read == 0:
        pytest.skip("this filesystem keeps the file cached (tmpfs?): nothing is read from a device")
    assert read < 1.1 * size * len(wanted), f"{read / (size * len(wanted)):.2f}x the records' bytes"


def test_a_file_reader_holds_one_descriptor(fmt_name, tmp_path, rng):
    """A loader's worker may hold a thousand shards open: a mapped file reader keeps one descriptor of its own
    (the one random reads and their read-ahead hints go through) beside the one Python's memory map holds (a
    duplicate it keeps before Python 3.13), as many as before random reads had theirs."""
    if fmt_name == "lmdb":
        pytest.skip("an LMDB's descriptors are LMDB's own (its data and lock files)")
    path = write(fmt_name, output_path(fmt_name, tmp_path), image_samples(rng, 4))
    before = len(os.listdir("/proc/self/fd"))
    with get_format(fmt_name).reader(path) as r:
        r[2], list(r)
        assert len(os.listdir("/proc/self/fd")) - before <= 2
    assert len(os.listdir("/proc/self/fd")) == before


def test_prefetch_is_a_no_op_under_an_emulated_tier(fmt_name, tmp_path, rng):
    """An emulated tier charges and paces every read as it comes: a read-ahead behind its back would serve later
    reads from the page cache at the real disk's speed, so there is none."""
    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.tiers import Limits

    samples = image_samples(rng, 4)
    path = write(fmt_name, output_path(fmt_name, tmp_path), samples)
    fast = Limits(iops=1e6, bytes_per_s=1e10, latency_s=0.0, io_unit=4096)
    with Throttle.emulate(fast, accounting="requests", state_dir=str(tmp_path)):
        with get_format(fmt_name).reader(path) as r:
            assert r.prefetch(range(len(samples))) == 0
            assert_same(r[2], samples[2])


def test_advise_will_need_merges_touching_ranges_and_splits_long_ones(tmp_path):
    from gpufeed.formats._filebytes import WILL_NEED_PIECE, advise_will_need

    p = tmp_path / "f"
    p.write_bytes(b"\0" * (4 * WILL_NEED_PIECE))
    fd = os.open(p, os.O_RDONLY)
    try:
        # Two touching ranges and one inside them make one range of 1.5 pieces: two hints; a far one adds one.
        assert advise_will_need(fd, [(0, WILL_NEED_PIECE), (WILL_NEED_PIECE, WILL_NEED_PIECE // 2), (10, 20),
                                     (3 * WILL_NEED_PIECE, 100)]) == 3
        assert advise_will_need(fd, [(0, 0)]) == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_a_reader_given_a_file_beside_or_inside_an_output_names_what_to_open(fmt_name, tmp_path):
    """A TFRecord's DALI index, a .rec's .idx and .lst, an LMDB's data.mdb: each read as records would look
    damaged from its first byte; the reader names the output to open instead."""
    fmt = get_format(fmt_name)
    path = write(fmt_name, output_path(fmt_name, tmp_path), [Sample("a/0.jpg", 0, b"\xff\xd8\xff\x00", "encoded", 0)])
    beside = {"tfrecord": [path + ".idx"], "recordio": [path[:-4] + ".idx", path[:-4] + ".lst"],
              "lmdb": [os.path.join(path, "data.mdb")], "webdataset": [path + ".idx"]}[fmt_name]
    for side in beside:
        assert os.path.isfile(side)
        with pytest.raises(ConfigError, match=f"{re.escape(side)} is .*(not a|inside an LMDB)"):
            fmt.reader(side)


def test_format_lists_are_parsed_one_way():
    """Every command's --formats / --to list goes through gpufeed.formats.parse_formats."""
    from gpufeed.errors import ConfigError
    from gpufeed.formats import FORMATS, parse_formats

    assert parse_formats(" lmdb, recordio ,") == ("lmdb", "recordio")
    with pytest.raises(ConfigError, match=r"--formats 'lmdb,parquet': unknown parquet; choose from " + FORMATS[0]):
        parse_formats("lmdb,parquet")
    with pytest.raises(ConfigError, match="no format named"):
        parse_formats(",")
    with pytest.raises(ConfigError, match="unknown tfrecord; choose from lmdb"):
        parse_formats("tfrecord", allowed=["lmdb"])
