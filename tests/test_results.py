"""The results schema: rows carry machine, versions, tier and statistics; files round-trip; damage is named."""

from __future__ import annotations

import json
import os

import pytest

from gpufeed.bench.results import (REQUIRED, ResultWriter, load_results, machine_info, metrics_block, repeat, stat,
                                   summarize, versions)
from gpufeed.errors import ConfigError, CorruptRecordError


def _row(**kw):
    return {"bench": "read", "tier": "ssd", "mode": "emulated", "profile": "ssd", "format": "lmdb",
            "params": {"workers": 2}, **summarize("samples_per_s", "samples/s", [10.0, 12.0, 11.0]), **kw}


def test_summary_statistics():
    s = stat([10.0, 12.0, 11.0])
    assert s["median"] == 11.0 and s["spread"] == pytest.approx(2 / 11) and s["values"] == [10.0, 12.0, 11.0]
    assert stat([])["median"] is None
    m = metrics_block([{"a": 1.0, "b": 2.0}, {"a": 3.0}], {"a": "s", "b": "MB/s", "c": "x"})
    assert m["a"]["median"] == 2.0 and m["b"]["values"] == [2.0] and "c" not in m


def test_repeat_discards_warmup_and_runs_before_each():
    calls, prepared = [], []
    runs = repeat(lambda i: calls.append(i) or {"i": i}, repeats=3, warmup=2, before_each=lambda: prepared.append(1))
    assert calls == [0, 1, 2, 3, 4] and [r["i"] for r in runs] == [2, 3, 4] and len(prepared) == 5
    with pytest.raises(ConfigError):
        repeat(lambda i: {}, repeats=0)


def test_machine_and_versions(tmp_path):
    info = machine_info(str(tmp_path))
    assert info["logical_cores"] >= 1 and info["ram_bytes"] > 0 and info["cpu"]
    assert info["disk"]["fstype"] and info["disk"]["mount"]
    assert isinstance(info["gpus"], list)
    v = versions()
    assert v["python"] and v["numpy"] and "ray" in v and "torch" in v


def test_writer_round_trip(tmp_path):
    path = tmp_path / "r" / "results.jsonl"
    w = ResultWriter(str(path), data_path=str(tmp_path))
    full = w.write(_row(n_samples=100, total_bytes=1000))
    w.write(_row(format="tfrecord", valid=False, invalid_reason="host too slow"))
    rows = load_results(str(path))
    assert len(rows) == 2 and rows[0] == json.loads(json.dumps(full))
    for key in (*REQUIRED, "machine", "versions", "time", "schema", "valid", "dataset_ram_ratio"):
        assert key in rows[0]
    assert rows[0]["median"] == 11.0 and rows[0]["repeats"] == 3 and rows[0]["valid"] is True
    assert rows[1]["valid"] is False and rows[0]["machine"]["disk"]["path"] == str(tmp_path)
    assert load_results([str(path), str(path)])[2:] == rows


def test_writer_rejects_incomplete_rows(tmp_path):
    w = ResultWriter(str(tmp_path / "r.jsonl"))
    bad = _row()
    del bad["spread"]
    with pytest.raises(ConfigError, match="spread"):
        w.write(bad)
    with pytest.raises(ConfigError, match="mode"):
        w.write(_row(mode="guessed"))


def test_damaged_line_is_named(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultWriter(str(path)).write(_row())
    with open(path, "a") as f:
        f.write('{"bench": "read", trunc\n')
    with pytest.raises(CorruptRecordError, match="record 1"):
        load_results(str(path))


def test_nvidia_smi_readings_become_the_gpus_kernel_time_share_and_clock():
    """nvidia-smi's csv lines (no header, no units) averaged; lines that are not two numbers are skipped."""
    from gpufeed.bench.results import gpu_readings

    text = "92, 1980\n96, 1980\n[N/A], [N/A]\nNo devices were found\n70, 1965\n"
    got = gpu_readings(text)
    assert got["gpu_busy"] == pytest.approx((0.92 + 0.96 + 0.70) / 3) and got["gpu_sm_mhz"] == pytest.approx(1975)
    assert gpu_readings("") == {} and gpu_readings("Failed to initialize NVML\n") == {}


def test_a_window_samples_the_gpu_nvidia_smi_names_and_stops_its_sampler(tmp_path, monkeypatch):
    """A window given a GPU runs nvidia-smi for that GPU alone (-i, its UUID or PCI bus id) until it stops, and ends it;
    where nvidia-smi is not on the PATH the window simply has no GPU figures. The driver's tool is stood in for
    by a script that answers as it does (this machine has no GPU)."""
    import os
    import time

    from gpufeed.bench.results import ResourceWindow

    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert "gpu_busy" not in ResourceWindow(None, gpu="00000000:1B:00.0").stop()
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\nwhile true; do echo "80, 1980"; sleep 0.05; done\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    window = ResourceWindow(None, gpu="00000000:1B:00.0")
    time.sleep(0.4)
    proc = window.gpu.proc
    got = window.stop()
    assert got["gpu_busy"] == pytest.approx(0.8) and got["gpu_sm_mhz"] == pytest.approx(1980)
    assert proc.poll() is not None
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-i") + 1] == "00000000:1B:00.0" and "--query-gpu=utilization.gpu,clocks.sm" in args


def test_a_window_says_the_reads_in_flight_and_their_size_from_the_devices_counters(tmp_path):
    """Little's law on the block device's counters: 1,000 reads of 118 KB that took 96 s together over 2 s of wall
    time were 48 in flight on average. The counters are this machine's own (/sys/block/*/stat) where the tests'
    folder is on a block device, and a window over them gives both figures or, with no read, neither."""
    import os

    from gpufeed.bench.results import ResourceWindow, disk_counters, read_depth

    before = {"read_bytes": 0, "reads": 0, "read_ms": 0}
    after = {"read_bytes": 1000 * 118_000, "reads": 1000, "read_ms": 96_000}
    assert read_depth(before, after, 2.0) == {"disk_reads_in_flight": pytest.approx(48.0),
                                              "disk_read_request_kb": pytest.approx(118.0)}
    assert read_depth(before, before, 2.0) == {} and read_depth({"read_bytes": 0}, after, 2.0) == {}
    counters = disk_counters(str(tmp_path))
    if counters is None:
        pytest.skip("the tests' folder is on no block device here")
    assert counters["reads"] >= 0 and counters["read_ms"] >= 0
    window = ResourceWindow(str(tmp_path))
    path = tmp_path / "data"
    path.write_bytes(os.urandom(1 << 20))
    got = window.stop()
    assert "disk_busy" in got
    assert ("disk_reads_in_flight" in got) == ("disk_read_request_kb" in got)


def test_pressure_stall_totals_are_read_in_seconds_and_differenced():
    """/proc/pressure's ``total=`` is in microseconds, one line per kind; a run's rows carry the difference."""
    from gpufeed.bench.results import parse_pressure, pressure_delta, pressure_totals

    text = ("some avg10=1.50 avg60=0.20 avg300=0.05 total=2500000\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=125000\n")
    assert parse_pressure("memory", text) == {"memory_some": 2.5, "memory_full": 0.125}
    before = {"memory_some": 2.5, "memory_full": 0.125, "io_some": 1.0}
    after = {"memory_some": 4.0, "memory_full": 0.125}
    assert pressure_delta(before, after) == {"pressure_memory_some_s": 1.5, "pressure_memory_full_s": 0.0}
    # This machine's own counters, where its kernel keeps them: every kind read, none going backwards.
    now = pressure_totals()
    if os.path.exists("/proc/pressure/cpu"):
        assert "cpu_some" in now and "memory_full" in now and "io_some" in now
        assert all(v >= 0 for v in pressure_delta(now, pressure_totals()).values())
    else:
        assert now == {}
