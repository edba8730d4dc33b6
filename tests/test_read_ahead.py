"""A worker's read-ahead (worker._ReadAhead): local files and local archives' members are announced to the
kernel and read in the converting thread; remote inputs and every input under tier emulation are read by
threads. Either way each item's data, or its own error, comes back for that item, in order."""

from __future__ import annotations

import os
import tarfile

import fsspec
from gpufeed.convert.worker import _ReadAhead
from gpufeed.errors import InputError, SourceNotFound
from gpufeed.pipelines.base import FileRef, Item, TarMemberRef


def _files(tmp_path, n=5):
    items = []
    for i in range(n):
        p = tmp_path / f"{i:03d}.JPEG"
        p.write_bytes(bytes([i]) * (1000 + i))
        items.append(Item(p.name, i, FileRef(str(p))))
    return items


def _take_all(items, **kw):
    ra = _ReadAhead(items, lambda i: False, **kw)
    got = []
    try:
        for i, it in enumerate(items):
            try:
                got.append(ra.take(i, it))
            except (InputError, SourceNotFound) as e:
                got.append(e)
        threaded = ra._pool is not None
    finally:
        ra.close()
    return got, threaded


def test_local_files_are_left_to_the_kernel_and_read_in_order(tmp_path):
    items = _files(tmp_path)
    got, threaded = _take_all(items, depth=3)
    assert got == [bytes([i]) * (1000 + i) for i in range(5)]
    assert not threaded


def test_a_fifo_is_not_opened_ahead_and_its_read_names_it(tmp_path):
    """Opening a FIFO to announce it would wait for a writer: it is left alone, and its own read says what
    it is; the files around it are read."""
    items = _files(tmp_path, 3)
    fifo = tmp_path / "001.JPEG"
    fifo.unlink()
    os.mkfifo(fifo)
    got, _ = _take_all(items)
    assert got[0] == b"\0" * 1000 and got[2] == b"\2" * 1002
    assert isinstance(got[1], InputError) and str(fifo) in str(got[1]) and "FIFO" in str(got[1])


def test_a_missing_or_unreadable_file_is_that_items_error(tmp_path):
    items = _files(tmp_path, 4)
    os.remove(items[1].ref.url)
    os.chmod(items[2].ref.url, 0)
    got, _ = _take_all(items)
    assert isinstance(got[1], SourceNotFound) and items[1].ref.url in str(got[1])
    if os.geteuid() != 0:  # root reads it anyway
        assert isinstance(got[2], InputError) and items[2].ref.url in str(got[2])
    assert got[3] == b"\3" * 1003


def test_members_of_a_local_archive_are_announced_by_their_range(tmp_path):
    files = _files(tmp_path, 3)
    tar = tmp_path / "a.tar"
    with tarfile.open(tar, "w") as t:
        for it in files:
            t.add(it.ref.url, arcname=it.key)
    with tarfile.open(tar) as t:
        items = [Item(m.name, 0, TarMemberRef(str(tar), m.offset_data, m.size, m.name)) for m in t.getmembers()]
    got, threaded = _take_all(items)
    assert got == [bytes([i]) * (1000 + i) for i in range(3)] and not threaded


def test_remote_inputs_are_read_by_threads():
    fs = fsspec.filesystem("memory")
    items = []
    for i in range(3):
        fs.pipe(f"/read-ahead/{i}.JPEG", bytes([i]) * 10)
        items.append(Item(f"{i}", i, FileRef(f"memory://read-ahead/{i}.JPEG")))
    try:
        got, threaded = _take_all(items)
    finally:
        fs.rm("/read-ahead", recursive=True)
    assert got == [bytes([i]) * 10 for i in range(3)] and threaded


def test_under_tier_emulation_threads_read_so_its_delays_overlap_decoding(tmp_path):
    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.tiers import Limits

    items = _files(tmp_path, 3)
    fast = Limits(iops=1e6, bytes_per_s=1e10, latency_s=0.0, io_unit=4096)
    with Throttle.emulate(fast, accounting="requests", state_dir=str(tmp_path)) as t:
        got, threaded = _take_all(items)
        read = t.stats()["bytes_read"]
    assert got == [bytes([i]) * (1000 + i) for i in range(3)] and threaded
    assert read >= sum(1000 + i for i in range(3))  # the threads' reads went through the emulator
