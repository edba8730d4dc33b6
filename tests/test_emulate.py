"""The tier emulator: bucket arithmetic, latency overlap, sharing across processes, file wrapping, device
accounting (cache hits are free), gpufeed.io integration and a tiny self-test. Real files, real processes."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from gpufeed import io as gio
from gpufeed.bench.cache import evict
from gpufeed.bench.emulate import Throttle, self_test
from gpufeed.bench.tiers import PROFILES, Limits, get_profile, parse_tier
from gpufeed.errors import ConfigError, GpufeedError

KIB = 1024


def _limits(iops=1e9, mbps=1e12, latency=0.0, unit=4 * KIB):
    return Limits(iops=iops, bytes_per_s=mbps, latency_s=latency, io_unit=unit)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(4 << 20))
    return str(path)


def test_iops_cap_paces_requests(tmp_path):
    with Throttle.emulate(_limits(iops=2000), accounting="requests", state_dir=tmp_path, burst_s=0) as t:
        t0 = time.perf_counter()
        for _ in range(200):
            t.charge(4 * KIB)
        took = time.perf_counter() - t0
        assert t.stats()["requests"] == 200 and t.stats()["ops"] == 200
    assert took >= 0.09  # 200 ops at 2000/s; never faster (a busy machine may make it slower)


def test_request_costs_ceil_bytes_over_io_unit(tmp_path):
    with Throttle.emulate(_limits(unit=4 * KIB), accounting="requests", state_dir=tmp_path) as t:
        t.charge(4 * KIB + 1)
        t.charge(1)
        assert t.stats()["ops"] == 3


def test_bandwidth_cap(tmp_path):
    with Throttle.emulate(_limits(mbps=20e6, unit=1 << 20), accounting="requests", state_dir=tmp_path,
                          burst_s=0) as t:
        t0 = time.perf_counter()
        for _ in range(4):
            t.charge(1 << 20)
        took = time.perf_counter() - t0
    assert took >= 0.19  # 4 MiB at 20 MB/s


def test_latency_overlaps_across_concurrent_requests(tmp_path):
    with Throttle.emulate(_limits(latency=0.05), accounting="requests", state_dir=tmp_path) as t:
        t0 = time.perf_counter()
        t.charge(4 * KIB)
        serial = time.perf_counter() - t0
        threads = [threading.Thread(target=t.charge, args=(4 * KIB,)) for _ in range(8)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        parallel = time.perf_counter() - t0
    assert serial >= 0.05
    # 8 requests in flight at once overlap their latency: measured against 8 serial ones in the same run
    # (a ratio, not a wall-clock bound that a loaded machine could break).
    assert parallel < 0.75 * 8 * serial


def _charge_n(state, n, barrier):
    t = Throttle.attach(state)
    barrier.wait()
    for _ in range(n):
        t.charge(4 * KIB)


def test_buckets_are_shared_across_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    with Throttle.emulate(_limits(iops=1000), accounting="requests", state_dir=tmp_path, burst_s=0) as t:
        barrier = ctx.Barrier(3)
        procs = [ctx.Process(target=_charge_n, args=(t.path, 100, barrier)) for _ in range(2)]
        for p in procs:
            p.start()
        barrier.wait()
        t0 = time.perf_counter()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        took = time.perf_counter() - t0
        assert t.stats()["requests"] == 200
    # 200 ops at 1000/s from two processes take 0.2 s on one shared device (0.1 s if each had its own).
    assert took >= 0.18


def test_forked_child_uses_its_own_lock(tmp_path):
    with Throttle.emulate(_limits(iops=1000), accounting="requests", state_dir=tmp_path, burst_s=0) as t:
        t.charge(1)
        pid = os.fork()
        if pid == 0:
            try:
                child = Throttle.attach(t.path)
                ok = child is t and child._fd != -1
                for _ in range(50):
                    child.charge(1)
            finally:
                os._exit(0 if ok else 1)
        for _ in range(50):
            t.charge(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert t.stats()["requests"] == 101


def test_wrap_reads_and_writes_are_charged_and_bytes_intact(tmp_path, data_file):
    with Throttle.emulate(_limits(), accounting="requests", state_dir=tmp_path) as t:
        with gio.open_file(data_file, "rb") as f:
            assert f.read(10) == open(data_file, "rb").read(10)
            f.seek(1 << 20)
            got = f.read(100_000)
        assert got == open(data_file, "rb").read()[1 << 20:(1 << 20) + 100_000]
        assert t.stats()["bytes_read"] >= 100_010
        out = tmp_path / "w.bin"
        with gio.open_file(str(out), "wb") as f:
            f.write(b"x" * 50_000)
        assert out.read_bytes() == b"x" * 50_000
        assert t.stats()["bytes_written"] == 50_000
        with gio.open_file(data_file, "rb", buffering=0) as f:
            buf = bytearray(4096)
            assert f.readinto(buf) == 4096
    assert gio.throttle() is None  # environment restored


def test_device_accounting_charges_cold_reads_only(tmp_path, data_file):
    evict(data_file)
    with Throttle.emulate(_limits(), state_dir=tmp_path) as t:
        with gio.open_file(data_file, "rb") as f:
            while f.read(1 << 20):
                pass
        cold = t.stats()["bytes_read"]
        with gio.open_file(data_file, "rb") as f:
            while f.read(1 << 20):
                pass
        warm = t.stats()["bytes_read"] - cold
    assert cold >= 0.9 * (4 << 20)
    assert warm < 0.05 * (4 << 20)


def test_child_processes_inherit_the_tier(tmp_path, data_file):
    code = ("import gpufeed.io as g; f = g.open_file(%r); f.read(65536); f.close(); "
            "print(type(g.throttle()).__name__)" % data_file)
    import subprocess
    import sys

    with Throttle.emulate(_limits(), accounting="requests", state_dir=tmp_path) as t:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip() == "Throttle"
        assert t.stats()["bytes_read"] >= 65536


def test_bad_limits_and_missing_state(tmp_path):
    with pytest.raises(ConfigError):
        Throttle.create(str(tmp_path / "s"), _limits(iops=0))
    with pytest.raises(GpufeedError, match="not found"):
        Throttle(str(tmp_path / "nope"))


def test_profiles_and_tier_specs(tmp_path):
    assert {"nvme", "essd-pl1", "ssd", "ultra", "essd-pl0", "gp3", "pd-balanced"} <= set(PROFILES)
    ultra = get_profile("ultra").limits(100)
    assert ultra.iops == 1800 + 8 * 100 and ultra.bytes_per_s == (100 + 0.15 * 100) * 1e6
    assert get_profile("ultra").limits(10_000).iops == 5000  # capped
    assert all(p.source for p in PROFILES.values())
    spec = parse_tier("ssd@2000")
    assert spec.mode == "emulated" and spec.limits.iops == 25000
    real = parse_tier(f"fast={tmp_path}")
    assert real.mode == "measured" and real.profile is None and real.row_fields()["profile"] is None
    with pytest.raises(ConfigError, match="choose one of"):
        parse_tier("floppy")
    with pytest.raises(ConfigError, match="not a directory"):
        parse_tier(f"x={tmp_path}/missing")


def test_tiny_self_test(tmp_path):
    # Timing is for `gpufeed bench tiers --self-test`; here: every pattern runs and no profile is exceeded
    # beyond the bucket's burst slack (load on a shared machine can only make the emulator slower).
    results = self_test(get_profile("ultra").limits(), str(tmp_path), seconds=0.3)
    assert [r["pattern"] for r in results] == ["rand_4k_qd1", "rand_4k_qd32", "seq_1m"]
    assert [r["saturated"] for r in results] == [False, True, True]
    for r in results:
        assert r["emulated"] > 0 and r["expected"] > 0 and r["unthrottled"] > 0
        assert r["error"] < 0.25, r
    assert not os.listdir(tmp_path)  # its test file and state files are removed


def test_mmap_reads_are_charged_per_page_fault(tmp_path):
    """LMDB with readahead off faults a value in page by page, each a dependent read: a cold 64 KiB value is
    ~16 requests in a row, a cached one nothing (the reader calls gpufeed.io.charge after each get)."""
    import lmdb

    db = str(tmp_path / "db")
    env = lmdb.open(db, map_size=16 << 20)
    with env.begin(write=True) as txn:
        # Opening the environment reads its first pages through read(), with readahead: the filler keeps
        # the value under test beyond that window.
        txn.put(b"a", os.urandom(2 << 20))
        txn.put(b"k", os.urandom(64 * KIB))
    env.close()
    evict(db)
    env = lmdb.open(db, readonly=True, lock=False, readahead=False)
    with Throttle.emulate(_limits(latency=0.002), state_dir=tmp_path) as t:
        with env.begin() as txn:
            t0 = time.perf_counter()
            value = txn.get(b"k")
            gio.charge(len(value))
            cold = time.perf_counter() - t0
            requests = t.stats()["requests"]
            value = txn.get(b"k")
            gio.charge(len(value))
            assert t.stats()["requests"] == requests  # cached: free
    env.close()
    assert requests >= 12 and cold >= requests * 0.002
