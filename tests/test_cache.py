"""Page-cache eviction without root, proven by the bytes the kernel read (/proc/self/io)."""

from __future__ import annotations

import mmap
import os

import pytest

from gpufeed.bench.cache import cold_fraction, evict, files_under, proc_io
from gpufeed.errors import ConfigError

SIZE = 8 << 20


def _read_all(path) -> int:
    before = proc_io()["read_bytes"]
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    return proc_io()["read_bytes"] - before


@pytest.fixture
def tree(tmp_path):
    for name in ("a.bin", "sub/b.bin"):
        p = tmp_path / name
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(os.urandom(SIZE // 2))  # dirty pages: evict must fsync them first
    return tmp_path


def test_evict_makes_the_next_read_come_from_the_device(tree):
    files = files_under(str(tree))
    assert [os.path.relpath(f, tree) for f in files] == ["a.bin", "sub/b.bin"]
    assert evict(str(tree)) == SIZE
    cold = sum(_read_all(f) for f in files)
    warm = sum(_read_all(f) for f in files)
    assert cold_fraction(cold, SIZE) >= 0.9
    assert cold_fraction(warm, SIZE) <= 0.05


def test_evict_refuses_mapped_files(tree):
    path = str(tree / "a.bin")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        m[:1]
        with pytest.raises(ConfigError, match="memory-mapped"):
            evict(path)
    evict(path)


def test_evict_waits_for_another_process_that_maps_a_file_then_names_it(tree):
    """Another rank's reader or a closed loader's worker still exiting keeps its mapped pages: eviction waits a
    moment for it to go, and names the process that stays."""
    import subprocess
    import sys
    import time

    path = str(tree / "a.bin")
    code = ("import mmap, sys, time; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, "
            "access=mmap.ACCESS_READ); m[:1]; print('mapped', flush=True); time.sleep(float(sys.argv[2]))")
    child = subprocess.Popen([sys.executable, "-c", code, path, "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "mapped\n"
        with pytest.raises(ConfigError, match=f"memory-mapped by process {child.pid} \\(.*python"):
            evict(path, grace_s=0.3)
    finally:
        child.kill()
        child.wait()
    child = subprocess.Popen([sys.executable, "-c", code, path, "0.5"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "mapped\n"
    t0 = time.monotonic()
    assert evict(path) == SIZE // 2  # waited for it to exit
    assert time.monotonic() - t0 < 5
    child.wait()


def test_lmdb_environment_must_be_closed_first(tmp_path):
    import lmdb

    env = lmdb.open(str(tmp_path / "db"), map_size=64 << 20, readahead=False)
    with env.begin(write=True) as txn:
        for i in range(64):
            txn.put(b"%04d" % i, os.urandom(64 << 10))
    with pytest.raises(ConfigError, match="close the LMDB environment"):
        evict(str(tmp_path / "db"))
    env.close()
    evict(str(tmp_path / "db"))
    env = lmdb.open(str(tmp_path / "db"), readonly=True, lock=False, readahead=False)
    before = proc_io()["read_bytes"]
    with env.begin() as txn:
        total = sum(len(v) for _, v in txn.cursor())
    env.close()
    assert proc_io()["read_bytes"] - before >= 0.9 * total


def test_proc_io_of_self_and_thread():
    assert {"read_bytes", "write_bytes", "rchar"} <= set(proc_io())
    assert "read_bytes" in proc_io("thread-self")


def test_warm_reads_every_file_under_its_paths_once(tmp_path):
    from gpufeed.bench.cache import warm

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 3000)
    (tmp_path / "d" / "b").write_bytes(b"y" * (2 << 20))
    (tmp_path / "c").write_bytes(b"z" * 10)
    assert warm(str(tmp_path / "d"), str(tmp_path / "c"), threads=2) == 3000 + (2 << 20) + 10
