"""The split sinks with real files: the LMDB sink's spools (real LMDB), each record carrying the check its
worker computed, mapped, verified and handed to the writer without a copy; the single ``.rec`` assembled
from fragments, one at a time or several per disk flush."""

import os

import pytest

from gpufeed.convert.worker import file_entry
from gpufeed.formats.assembly import LmdbSink, SpoolWriter, spool_records
from gpufeed.errors import ConfigError, CorruptRecordError, OutputError
from gpufeed.formats.base import EncodedRecord
from gpufeed.formats.lmdb import LMDBFormat, record_check


def _records(n, start=0):
    return [EncodedRecord(b"%08d_class/img%d.JPEG" % (i, i), bytes([i % 251]) * (100 + 37 * i), i, f"img{i}", ())
            for i in range(start, start + n)]


def _spool(path, records):
    w = SpoolWriter(str(path))
    for r in records:
        w.write_encoded(r)
    return w.close()


def test_spool_round_trip_carries_each_records_check(tmp_path):
    recs = _records(5)
    written = _spool(tmp_path / "s", recs)
    assert written.records == 5
    with spool_records(str(tmp_path / "s"), 5) as got:
        assert [(k, bytes(v), c) for k, v, c in got] == [(r.key, r.value, record_check(r.key, r.value))
                                                       for r in recs]


@pytest.mark.parametrize("damage, match", [
    ("flip", "record 2 .*CRC does not match"),
    ("truncate", "runs past its end"),
    ("header", "ends inside a record header"),
])
def test_a_damaged_spool_is_refused_naming_it_and_the_fix(tmp_path, damage, match):
    path = tmp_path / "train-lmdb-00003"
    _spool(path, _records(4))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        offset = sum(12 + 20 + 100 + 37 * i for i in range(2)) + 12 + 30  # inside record 2's value
        data[offset] ^= 0x40
    elif damage == "truncate":
        del data[-10:]
    else:
        data += b"\0" * 5
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match=match) as e:
        with spool_records(str(path), 4):
            pass
    assert str(path) in str(e.value)
    # The sink removes it and says so: the next run sees the shard's spool gone and converts the shard again.
    (tmp_path / "out" / "lmdb").mkdir(parents=True)
    sink = LmdbSink(str(tmp_path / "state"), str(tmp_path / "out"), "train").open([])
    with pytest.raises(OutputError, match=r"train-lmdb-00003: damaged \(record .*it was removed: rerun the same "
                                          r"command to convert that shard again"):
        sink.commit(str(path), [{"path": str(path), "records": 4}])
    assert not path.exists()
    sink.close()


def test_a_spool_with_other_than_its_workers_count_is_refused(tmp_path):
    _spool(tmp_path / "s", _records(3))
    with pytest.raises(CorruptRecordError, match="holds 3 records, not the 4"):
        with spool_records(str(tmp_path / "s"), 4):
            pass
    _spool(tmp_path / "empty", [])
    with spool_records(str(tmp_path / "empty"), 0) as got:
        assert got == []


def test_sink_commits_spools_into_the_same_lmdb_as_the_writer(tmp_path):
    recs = _records(9)
    for shard, part in enumerate((recs[:4], recs[4:4], recs[4:])):
        _spool(tmp_path / f"train-lmdb-{shard:05d}", part)
    (tmp_path / "out" / "lmdb").mkdir(parents=True)
    sink = LmdbSink(str(tmp_path / "state"), str(tmp_path / "out"), "train").open([])
    for shard, n in enumerate((4, 0, 5)):
        spool = str(tmp_path / f"train-lmdb-{shard:05d}")
        assert sink.commit(spool, [{"path": spool, "records": n}])["records"] == sum((4, 0, 5)[:shard + 1])
    sink.finish()
    reader = LMDBFormat().reader(str(tmp_path / "out" / "lmdb" / "train_lmdb"))
    assert [bytes(v) for v in reader.iter_raw()] == [r.value for r in recs]
    assert os.path.exists(tmp_path / "out" / "lmdb" / "train_lmdb" / "data.mdb")


def test_write_checked_refuses_keys_out_of_order(tmp_path):
    w = LMDBFormat().writer(str(tmp_path / "x_lmdb"))
    a, b = _records(2)
    w.write_checked([(b.key, b.value, record_check(b.key, b.value))])
    with pytest.raises(ConfigError, match="increasing key order"):
        w.write_checked([(a.key, a.value, record_check(a.key, a.value))])
    w.abort()


def _fragments(tmp_path, sizes):
    """RecordIO fragments as workers spool them for a single ``.rec``: ``[(spool, files)]`` per shard."""
    from gpufeed.formats.assembly import RecordIOSink
    from gpufeed.formats import get_format

    fmt, start, batch = get_format("recordio", single=True), 0, []
    for shard, n in enumerate(sizes):
        spool = str(tmp_path / f"train-recordio-{shard:05d}.rec")
        w = RecordIOSink.spool_writer(fmt, spool)
        for r in _records(n, start):
            w.write_encoded(r._replace(key=b"%d" % r.index, labels=(float(r.index % 3),)))
        files = [file_entry(f) for f in w.close()]
        batch.append((spool, files))
        start += n
    return batch


def _commit_rec(tmp_path, name, sizes, batches):
    """Commit the fragments of ``sizes`` in ``batches`` (shards per commit_many call); the files and the
    journal fields of every shard."""
    from gpufeed.formats.assembly import RecordIOSink

    work = tmp_path / name
    work.mkdir()
    frags = _fragments(work, sizes)
    sink = RecordIOSink(str(work / "state"), str(work / "out"), "train").open([])
    fields = []
    for n in batches:
        fields += sink.commit_many(frags[:n])
        frags = frags[n:]
    sink.finish()
    out = work / "out" / "recordio"
    return {p.name: p.read_bytes() for p in out.iterdir()}, fields


def test_rec_fragments_committed_in_one_batch_equal_one_at_a_time(tmp_path):
    sizes = (4, 0, 5, 3)
    one, fields_one = _commit_rec(tmp_path, "one", sizes, (1, 1, 1, 1))
    many, fields_many = _commit_rec(tmp_path, "many", sizes, (3, 1))
    assert one == many and one["train.rec"]
    # Each shard's journal entry holds the lengths and counts after that shard, whatever the batch.
    assert fields_one == fields_many
    assert [f["records"] for f in fields_many] == [4, 4, 9, 12]
    assert fields_many[-1]["lengths"][".rec"] == len(many["train.rec"])


def _memory_folder(tmp_path):
    """A folder on another filesystem than ``tmp_path``'s: where memory spools live (``/dev/shm``)."""
    from gpufeed.convert.sinks import MEMORY_ROOT

    if not os.path.isdir(MEMORY_ROOT) or os.stat(MEMORY_ROOT).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip(f"{MEMORY_ROOT} is not a filesystem of its own here")
    import tempfile

    return tempfile.mkdtemp(dir=MEMORY_ROOT, prefix="gpufeed-test-")


@pytest.mark.parametrize("where", ["same filesystem", "memory spool"])
def test_a_fragment_is_appended_by_the_kernel_within_and_across_filesystems(tmp_path, where):
    """A spool in memory appended to the ``.rec`` on the disk: Linux refuses copy_file_range across
    filesystems (EXDEV), and the copy must stay in the kernel anyway (sendfile), not stream through Python."""
    import shutil

    from gpufeed.formats.assembly import append_file, kernel_copy

    folder = _memory_folder(tmp_path) if where == "memory spool" else str(tmp_path)
    try:
        src = os.path.join(folder, "frag.rec")
        data = os.urandom(3 << 20) + b"tail"
        with open(src, "wb") as f:
            f.write(data)
        with open(tmp_path / "whole.rec", "w+b") as dst:
            dst.write(b"head")
            dst.flush()
            with open(src, "rb") as f:
                assert kernel_copy(f.fileno(), dst.fileno(), len(data)) == len(data)
            dst.seek(0, os.SEEK_END)
            assert append_file(src, dst) == len(data)
            assert dst.tell() == 4 + 2 * len(data)
        assert (tmp_path / "whole.rec").read_bytes() == b"head" + data + data
    finally:
        if folder != str(tmp_path):
            shutil.rmtree(folder)


def test_the_kernel_copy_says_how_much_it_copied_of_a_file_shorter_than_asked(tmp_path):
    """What append_file compares with the spool's size, to refuse a spool that shrank under the copy."""
    from gpufeed.formats.assembly import kernel_copy

    src = tmp_path / "frag.rec"
    src.write_bytes(b"x" * 1000)
    with open(src, "rb") as f, open(tmp_path / "out.rec", "w+b") as dst:
        assert kernel_copy(f.fileno(), dst.fileno(), 4000) == 1000


@pytest.mark.parametrize("where", ["beside the .rec", "memory spools"])
def test_rec_fragments_synced_on_another_thread_while_the_next_are_appended_equal_one_commit_each(tmp_path, where):
    """The driver appends on one thread and syncs on another (engine._Committer): the files and the journal
    fields are those of committing each shard in turn; from memory spools the ``.rec``'s writes are in flight
    when append_many returns, and the sync waits for them."""
    import pathlib
    import shutil
    import threading

    from gpufeed.formats.assembly import RecordIOSink

    sizes = (4, 0, 5, 3, 7, 2)
    one, fields_one = _commit_rec(tmp_path, "one", sizes, (1,) * len(sizes))
    work = tmp_path / "two"
    work.mkdir()
    if where == "memory spools":
        folder = _memory_folder(tmp_path)
        frags = _fragments(pathlib.Path(folder), sizes)
    else:
        folder, frags = None, _fragments(work, sizes)
    sink = RecordIOSink(str(work / "state"), str(work / "out"), "train").open([])
    if folder is not None and sink._direct is None:
        pytest.skip("the disk here does not take O_DIRECT")
    fields, syncing = [], None
    for frag in frags:
        fields += sink.append_many([frag])  # beside the sync of the fragments before
        if folder is not None:  # gone once appended, as the driver drops them: the writers hold their own
            for path in sink.spool_files(frag[0]):
                os.remove(path)
        if syncing is not None:
            syncing.join()  # one sync at a time, as the driver's syncing thread
        syncing = threading.Thread(target=sink.sync)
        syncing.start()
    syncing.join()
    sink.finish()
    if folder is not None:
        shutil.rmtree(folder)
    out = work / "out" / "recordio"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == one and fields == fields_one
    assert sink.sync_s > 0


def _direct_or_skip(path, end=0, chunk=None, depth=None):
    from gpufeed.formats.assembly import DirectAppend

    direct = DirectAppend.open(str(path), end, chunk=chunk, depth=depth)
    if direct is None:
        pytest.skip(f"{path}'s filesystem does not take O_DIRECT here")
    return direct


def _fragment_files(tmp_path, sizes, rand=os.urandom):
    """Files of ``sizes`` random bytes, their concatenation, and an empty ``whole.rec`` to append them to."""
    frags = []
    for i, n in enumerate(sizes):
        frags.append(tmp_path / f"f{i}.rec")
        frags[-1].write_bytes(rand(n))
    rec = tmp_path / "whole.rec"
    rec.write_bytes(b"")
    return frags, b"".join(f.read_bytes() for f in frags), rec


@pytest.mark.parametrize("chunk,depth", [(None, None), (8192, 1), (8192, 8)])
def test_fragments_appended_past_the_page_cache_are_the_bytes_in_order_and_a_reopen_goes_on(tmp_path, chunk,
                                                                                             depth):
    """DirectAppend writes block-aligned spans (the last partial block rewritten with what follows it, the
    file padded past its length between flushes): the file is the fragments in order, cut to its length, also
    when reopened at a journalled length mid-block, as a resume does, and for an empty fragment; in its default
    chunks and in chunks of two blocks (a fragment then spans many, each write carrying a part block), one write
    at a time or eight in flight, each flushed fragment on the disk in order before the next."""
    sizes = (1, 0, 4095, 4096, 4097, 10_000, (3 << 20) + 5, 7)
    frags, whole, rec = _fragment_files(tmp_path, sizes)
    direct = _direct_or_skip(rec, chunk=chunk, depth=depth)
    for f in frags[:5]:
        assert direct.append(str(f)) == f.stat().st_size
        direct.flush()
        assert rec.stat().st_size >= direct.end and rec.read_bytes()[:direct.end] == whole[:direct.end]
    direct.close(cut=False)  # killed: the padding stays, the journal holds the length
    journalled = sum(sizes[:4])  # a commit before the last one: the resume cuts the file back to it
    with open(rec, "r+b") as f:
        f.truncate(journalled)
    direct = _direct_or_skip(rec, journalled, chunk, depth)
    for f in frags[4:]:  # unflushed between them: the closing flush writes what is still carried
        direct.append(str(f))
    direct.close()
    assert rec.read_bytes() == whole



def test_sealed_appends_waited_for_on_another_thread_hold_every_byte_up_to_their_end(tmp_path):
    """The sink's commit: appends sealed on one thread (the last partial block written there, the spans left in
    flight) and waited for and synced on another while the next are appended, which rewrite that block. After
    each wait every byte up to the sealed length is on the file, as the journal line written then promises."""
    import queue
    import random
    import threading

    from gpufeed.formats.assembly import wait_all

    rng = random.Random(7)
    sizes = [0, 1, 4095, 4096, 8191, 3] + [rng.randrange(60_000) for _ in range(40)]
    frags, whole, rec = _fragment_files(tmp_path, sizes, rng.randbytes)
    direct = _direct_or_skip(rec, chunk=8192, depth=4)
    sealed, checked = queue.Queue(), []

    def sync():
        while (item := sealed.get()) is not None:
            futures, end = item
            wait_all(futures)
            os.fsync(direct.fd)
            with open(rec, "rb") as f:
                checked.append(f.read(end) == whole[:end])

    syncing = threading.Thread(target=sync)
    syncing.start()
    try:
        for i, f in enumerate(frags):
            direct.append(str(f))
            if i % 3 == 2:
                sealed.put((direct.seal(), direct.end))
        sealed.put((direct.seal(), direct.end))
    finally:
        sealed.put(None)
        syncing.join()
    direct.close()
    assert len(checked) == len(frags) // 3 + 1 and all(checked)
    assert rec.read_bytes() == whole


_REFUSED_WRITE = """
import json, resource, signal, sys
from gpufeed.errors import OutputError
from gpufeed.formats.assembly import RecordIOSink

work, frags = sys.argv[1], json.loads(sys.argv[2])
sink = RecordIOSink(work + "/state", work + "/out", "train").open([])
if sink._direct is None:
    print("no O_DIRECT")
    sys.exit(0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
try:
    for frag in frags:
        sink.append_many([frag])
        sink.sync()
except OutputError as e:
    print("OutputError:", e)
finally:
    sink.close()
"""


def test_a_write_the_disk_refuses_on_a_writer_thread_fails_the_commit_naming_the_output(tmp_path):
    """A ``.rec`` write past the page cache that fails on one of the writers' threads (here: past the process's
    file size limit, EFBIG, standing in for a full disk) fails the commit's sync with the output's name and the
    fix, before anything is journalled; nothing waits forever for it."""
    import json
    import shutil
    import subprocess
    import sys

    folder = _memory_folder(tmp_path)
    try:
        frags = _fragments(__import__("pathlib").Path(folder), (60, 60, 60))
        proc = subprocess.run([sys.executable, "-c", _REFUSED_WRITE, str(tmp_path), json.dumps(frags)],
                              capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(folder)
    if proc.stdout.strip() == "no O_DIRECT":
        pytest.skip("the disk here does not take O_DIRECT")
    partial = tmp_path / "state" / "partial" / "train.rec"
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(f"OutputError: {partial}: cannot be written (File too large); this process "
                                          "may not write a file past "), proc.stdout
    assert proc.stdout.strip().endswith("raise the limit (`ulimit -f unlimited`), then rerun the same command to "
                                        "resume"), proc.stdout


def test_a_source_removed_once_appended_and_a_streamed_source_are_written_whole(tmp_path):
    """The writers read a local source through descriptors of their own, so the sink may drop a spool as soon
    as :meth:`append` returns, before its spans are written; many spans queued at once (more than the writers'
    queue holds: the appending thread waits for the oldest); a source from another filesystem (an fsspec URL)
    is read here in chunks and comes out the same."""
    import fsspec

    frags, whole, rec = _fragment_files(tmp_path, (5, 50_000, 4096 * 9 + 3, 0, 123_457))
    direct = _direct_or_skip(rec, chunk=8192, depth=2)
    for f in frags:
        direct.append(str(f))
        f_bytes = f.read_bytes()
        f.unlink()
        f.write_bytes(f_bytes)  # the same name, another file: the writers still read the first
    url = f"memory://direct-{os.getpid()}/f.rec"
    streamed = os.urandom(3 * 8192 + 77)
    with fsspec.open(url, "wb") as f:
        f.write(streamed)
    assert direct.append(url) == len(streamed)
    direct.close()
    assert rec.read_bytes() == whole + streamed
    fsspec.filesystem("memory").rm(url)


def test_a_spool_cut_short_before_its_spans_are_written_is_an_error_naming_it(tmp_path):
    """A spool shorter when a writer reads it than when it was planned (changed under the run): the flush
    raises, naming the spool and the fix; nothing is taken from the changed file unnoticed."""
    import threading

    (frag,), _, rec = _fragment_files(tmp_path, (64 * 8192,))
    direct = _direct_or_skip(rec, chunk=32 * 8192, depth=1)
    gate = threading.Event()
    direct._pool.submit(gate.wait)  # the one writer busy: both spans of the fragment wait in line
    direct.append(str(frag))
    os.truncate(frag, 8192)
    gate.set()
    with pytest.raises(OutputError, match=f"{frag}: .* bytes read of .*the spool was changed: rerun the same"):
        direct.flush()
    direct.close(cut=False)


def test_a_rec_from_memory_spools_is_written_past_the_page_cache_to_the_same_bytes(tmp_path):
    """Spools on another filesystem than the .rec (memory): DirectAppend; beside it: copy_file_range. The
    files and journal fields are the same, also when a batch ends mid-block and the next carries it on."""
    import shutil

    from gpufeed.formats.assembly import RecordIOSink

    sizes = (4, 0, 5, 3, 1)
    disk, fields_disk = _commit_rec(tmp_path, "disk", sizes, (2, 1, 2))
    folder = _memory_folder(tmp_path)
    try:
        frags = _fragments(__import__("pathlib").Path(folder), sizes)
        work = tmp_path / "mem"
        sink = RecordIOSink(str(work / "state"), str(work / "out"), "train").open([])
        direct = sink._direct
        if direct is None:
            pytest.skip("the disk here does not take O_DIRECT")
        fields = sink.commit_many(frags[:2]) + sink.commit_many(frags[2:3]) + sink.commit_many(frags[3:])
        assert direct.appended == 4  # every non-empty fragment past the page cache
        sink.finish()
        assert {p.name: p.read_bytes() for p in (work / "out" / "recordio").iterdir()} == disk
        assert fields == fields_disk
    finally:
        shutil.rmtree(folder)
