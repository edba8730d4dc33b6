"""The LMDB sink's spool files (real files, real LMDB): each record carries the check its worker computed,
the sink maps the spool, verifies every check and hands the records to the writer without copying them."""

import os

import pytest

from gpufeed.convert.sinks import LmdbSink, SpoolWriter, spool_records
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
