"""The node-scale conversion benchmark in a tiny configuration, so it cannot rot (figures: docs/convert.md)."""

from __future__ import annotations

import json
import os

import pytest

from gpufeed.bench.experiments.convert_node import main, roles_table, run, table


def test_tiny_node_run_puts_convert_next_to_the_limit_loop(tmp_path, capsys):
    results = tmp_path / "rows.jsonl"
    rows = run(60, 6, 1, str(tmp_path / "work"),
               ("limit", "tfrecord", "limit-write1", "limit", "pass-recordio", "cp", "recordio-cluster"), pass_n=20,
               results=str(results))
    by_run = {r["run"]: r for r in rows}
    assert by_run["tfrecord"]["of_limit_bracketed"] > 0  # against the limit runs either side
    assert by_run["limit"]["images_per_second"] > 0 and by_run["limit"]["hardware_scaling"] > 0
    assert by_run["limit"]["cpu_ms_per_image"] > 0
    # The limit loop writing what it encodes: one copy of every image, in fsync'd files; the tfrecord
    # conversion (one format) is set against it.
    written = by_run["limit-write1"]
    assert written["copies"] == 1 and written["images_per_second"] > 0 and written["of_limit"] > 0
    assert 60 * 2000 < written["bytes_written"] < 60 * 200_000  # 60 JPEGs at 256 px
    assert by_run["tfrecord"]["of_limit_write"] > 0
    # What reached the disk, where the benchmark's folder has a block device under it (not on tmpfs).
    if "disk_written_bytes" in written:
        assert written["disk_written_bytes"] >= written["bytes_written"] * 0.9
        assert "disk_read_bytes" in by_run["tfrecord"] and 0 <= by_run["tfrecord"]["disk_busy"] <= 1
    conv = by_run["tfrecord"]
    # The machine's CPU per image, and the workers' shard time: CPU, waiting for a core, the rest.
    assert conv["cpu_ms_per_image"] > 0 and 0 < conv["workers_cpu_share"] <= 1.5
    assert 0 <= conv["workers_run_queue_share"] < 1
    # Per image, for the shards the local processes ran and those Ray's workers ran.
    line = conv["timeline"]
    ran = {w: line[f"{w}_shards"] for w in ("local", "ray") if f"{w}_shards" in line}
    assert sum(ran.values()) == 1 and all(line[f"{w}_cpu_ms_per_sample"] > 0 for w in ran)
    # Of the shard's wall time: reading the inputs, and closing the outputs (the TFRecord shard's fsync).
    w = next(iter(ran))
    assert 0 < line[f"{w}_read_ms_per_sample"] < line[f"{w}_wall_ms_per_sample"]
    assert 0 < line[f"{w}_close_ms_per_sample"] < line[f"{w}_wall_ms_per_sample"]
    # Writing the records (the TFRecord shard's, as the kernel takes them), and how often the converting
    # thread slept or took a page fault: what its wall time beyond CPU and core waits went to.
    assert 0 < line[f"{w}_write_ms_per_sample"] < line[f"{w}_wall_ms_per_sample"]
    assert line[f"{w}_sleeps_per_sample"] >= 0 and line[f"{w}_page_faults_per_sample"] > 0
    # What stalled on the machine meanwhile (Linux's pressure stall information), for the loop and the run.
    assert 0 <= conv["cpu_steal"] < 1 and 0 <= by_run["limit"]["cpu_steal"] < 1  # a virtual machine's host
    if os.path.exists("/proc/pressure/memory"):
        for row in (conv, by_run["limit"]):
            assert row["pressure_cpu_some_s"] >= 0 and row["pressure_memory_full_s"] >= 0
    # The machine's CPU by process role: the driver's and the role that ran the shard are there, and the
    # roles with what no role holds add up to the machine's figure.
    by_role = conv["cpu_ms_per_image_by_role"]
    assert by_role["driver"] > 0 and by_role["local processes" if "local" in ran else "ray workers"] > 0
    assert abs(sum(by_role.values()) - conv["cpu_ms_per_image"]) < 0.01 * conv["cpu_ms_per_image"] + 0.01
    assert conv["images"] == 60 and 0 < conv["of_limit"] and conv["target"] == 0.90
    tl = conv["timeline"]
    # The local processes (--executor pool, the default) convert every shard; Ray, starting beside them,
    # takes none.
    ray_ready = tl.get("ray_ready", tl["shards_done"])
    assert tl["shards_converted_locally"] == ran["local"] == 1 and "ray" not in ran
    assert 0 < tl["listed"] <= ray_ready <= tl["shards_done"] <= tl["sinks_done"] <= tl["total"]
    # How long free workers waited because the split sinks' commits had fallen behind (the commit window).
    assert 0 <= tl["held_by_commit_window_s"] < conv["seconds"]
    # Worker-seconds with no shard, as the workers ramped up, in the middle, and after the last shard started.
    assert all(tl[f"idle_worker_s_{k}"] >= 0 for k in ("ramp", "middle", "last_wave"))
    assert tl["shard_s_max"] >= tl["shard_s_p90"] >= tl["shard_s_p50"] > 0  # how ragged the last wave could end
    assert 0 < conv["first_shard_started_s"] < conv["seconds"]
    assert conv["driver_anon_rss_mib"][0] > 0
    assert by_run["pass-recordio"]["images"] == 20 and by_run["pass-recordio/cp"]["ratio"] > 0
    # Through a Ray runtime started beforehand: no Ray start in the conversion, no local processes.
    cluster = by_run["recordio-cluster"]
    assert cluster["images"] == 60 and cluster["of_limit"] > 0 and "ray_ready" in cluster["timeline"]
    assert not cluster["timeline"].get("shards_converted_locally")
    assert [json.loads(line)["run"] for line in results.read_text().splitlines()] == [r["run"] for r in rows]
    text = table(rows)
    assert "of the limit runs either side" in text
    assert "| convert tfrecord |" in text and "| pass-through to recordio / cp |" in text
    assert "| convert (standing Ray) recordio |" in text
    # The commits: copying, apart from waiting; and the driver's CPU, its main thread's apart.
    assert " s waiting for writes and fsyncs, " in text and " s of it on a core" in text and " s of it starting writeback" in text
    assert "; the driver's CPU " in text and " s, its main thread's " in text
    assert "| limit writing 1 copy, 1 processes |" in text and "of the limit writing as many copies" in text
    capsys.readouterr()
    main(["--table", str(results)])
    assert capsys.readouterr().out.strip() == f"{text}\n{roles_table(rows)}"
    assert "| tfrecord |" in roles_table(rows)


def test_a_conversion_between_two_limit_runs_is_compared_with_their_mean():
    from gpufeed.bench.experiments.convert_node import _bracket

    rows = [{"run": "limit", "images_per_second": 100.0}, {"run": "tfrecord", "images_per_second": 90.0,
            "of_limit": 0.9}, {"run": "limit", "images_per_second": 80.0}, {"run": "lmdb", "images_per_second": 70.0,
            "of_limit": 0.875}]
    _bracket(rows)
    assert rows[1]["of_limit_bracketed"] == 1.0 and "of_limit_bracketed" not in rows[3]


def test_rows_of_different_calls_are_not_set_against_each_other():
    """A results file gathering several calls: a conversion's limit runs either side, and the writing loop it
    is set against, come from its own call."""
    from gpufeed.bench.experiments.convert_node import _against_writes, _bracket

    rows = [{"call": 1, "run": "limit", "images_per_second": 100.0},
            {"call": 1, "run": "limit-write3", "images_per_second": 80.0, "of_limit": 0.8},
            {"call": 1, "run": "limit", "images_per_second": 100.0},
            {"call": 2, "run": "limit", "images_per_second": 50.0},
            {"call": 2, "run": "all", "formats": "lmdb,recordio,tfrecord", "images_per_second": 40.0,
             "of_limit": 0.8},
            {"call": 2, "run": "limit", "images_per_second": 30.0}]
    _bracket(rows)
    _against_writes(rows)
    assert rows[1]["of_limit_bracketed"] == 0.8 and rows[4]["of_limit_bracketed"] == 1.0
    assert "of_limit_write" not in rows[4]  # call 1's writing loop is not call 2's
    rows[1]["call"] = 2  # the same rows as one call: the writing loop before it counts
    _against_writes(rows)
    assert rows[4]["of_limit_write"] == 0.5


def test_a_comparison_build_runs_each_conversion_beside_this_one(tmp_path):
    """--compare: each conversion runs with another build's gpufeed and with this one, on the same cold files,
    the build going first alternating from pair to pair. Here the other build's folder is empty (the same
    gpufeed is imported): the pairing is what is tested."""
    other = tmp_path / "other"
    other.mkdir()
    rows = run(40, 4, 1, str(tmp_path / "work"), ("tfrecord", "pass-recordio", "cp"), pass_n=10,
               compare=str(other))
    assert [(r["run"], r.get("build")) for r in rows] == [
        ("tfrecord", "compare"), ("tfrecord", "current"), ("pass-recordio", "current"),
        ("pass-recordio", "compare"), ("cp", None), ("pass-recordio/cp", "current"),
        ("pass-recordio/cp", "compare")]
    assert [r.get("pair_position") for r in rows if r["run"] in ("tfrecord", "pass-recordio")] == [0, 1, 0, 1]
    assert all(r["images"] == 40 for r in rows if r["run"] == "tfrecord")
    assert "| (compare build) convert tfrecord |" in table(rows)


def test_the_memory_sampler_sees_both_halves_of_a_run_under_a_second():
    import subprocess
    import sys
    import time

    from gpufeed.bench.experiments.convert_node import _RssSampler

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(32 << 20); time.sleep(0.4)"])
    rss = _RssSampler(proc.pid, t0)
    rss.start()
    proc.wait()
    wall = time.perf_counter() - t0
    rss.join()
    first, second = rss.halves(wall)
    # the interpreter's heap from the first half; the 32 MiB buffer by the second
    assert first > 1 << 20 and second > 32 << 20
    assert all(t < wall for t, _ in rss.samples)


def test_imagenet_layout_subsets_and_warm_runs(tmp_path):
    """ImageNet's train tree converted as users type it (`convert imagenet`), a run on the corpus's first K
    files (hard links, the same inodes) and warm runs compared only with limit runs of the same scope."""

    from gpufeed.bench.experiments.convert_node import parse_run

    assert parse_run("all@450000+warm") == ("all", 450000, True) and parse_run("limit") == ("limit", None, False)
    work = tmp_path / "work"
    rows = run(40, 4, 1, str(work), ("limit", "recordio@20+warm", "limit@20+warm", "recordio"),
               layout="imagenet", mix="imagenet")
    wnids = sorted(os.listdir(work / "src" / "train"))
    assert len(wnids) == 40 and all(w.startswith("n") and len(w) == 9 for w in wnids)
    first = work / "src" / "train" / wnids[0]
    assert os.listdir(first) == [f"{wnids[0]}_1.JPEG"]
    sub = [os.path.join(d, n) for d, _, names in os.walk(work / "src-20") for n in names]
    assert len(sub) == 20 and os.stat(sub[0]).st_nlink == 2
    warm, cold = rows[1], rows[3]
    assert warm["images"] == 20 and warm["scope"] == "20 warm" and warm["cache"].startswith("warm")
    assert cold["images"] == 40 and cold["scope"] == "40"
    # The warm conversion against the warm limit run after it only; the cold one against the cold limit.
    # (The rows' rates are rounded to 0.1 img/s, the ratio is taken before: equal to within that rounding.)
    assert "of_limit" not in warm and rows[3]["of_limit"] == pytest.approx(
        cold["images_per_second"] / rows[0]["images_per_second"], abs=0.002)
    assert "[20 files, warm]" in table(rows) and rows[0]["layout"] == rows[0]["mix"] == "imagenet"
    # Another corpus replaces this one and the subset trees made for it; nothing else in the work folder.
    (work / "src-notes").mkdir()
    run(30, 3, 1, str(work), ("limit",), layout="imagenet", mix="imagenet")
    assert not (work / "src-20").exists() and not (work / "src-20.complete").exists()
    assert (work / "src-notes").is_dir()


def test_disk_depth_reads_each_file_once(tmp_path):
    from gpufeed.bench.experiments.disk_depth import run as depth_run, table as depth_table

    for i in range(30):
        (tmp_path / f"f{i:02d}.bin").write_bytes(os.urandom(5000 + i))
    rows = depth_run(str(tmp_path), depths=(2, 4), modes=("buffered",), seconds=5.0)
    # All 30 files read by the first run (5 s is ample), none left for a second.
    assert [r["files"] for r in rows] == [30] and rows[0]["bytes"] == sum(5000 + i for i in range(30))
    assert "| buffered | 2 | 30 |" in depth_table(rows)


def test_the_node_benchmark_removes_only_trees_it_made(tmp_path):
    """Its corpus, subset trees and output folder are removed and rebuilt only with the marker it leaves beside
    each; a folder of the same name it did not make is named and left as it is, and a tree a killed run left
    half made (its `.making` marker) is made again."""
    work = tmp_path / "work"
    run(12, 3, 1, str(work), ("limit",))
    assert (work / "src.complete").exists()
    mine = work / "src-6"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=f"{mine} is in the way and was not made by this benchmark"):
        run(12, 3, 1, str(work), ("limit@6",))
    assert (mine / "notes.txt").read_text() == "keep me"
    (mine / "notes.txt").unlink()
    mine.rmdir()
    (work / "out").mkdir()
    (work / "out" / "mine.rec").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="out is in the way"):
        run(12, 3, 1, str(work), ("limit",))
    assert (work / "out" / "mine.rec").read_bytes() == b"x"
    (work / "out" / "mine.rec").unlink()
    (work / "out").rmdir()
    half = work / "src-6"  # a killed run's: its marker says so
    (half / "x").mkdir(parents=True)
    (work / "src-6.making").touch()
    rows = run(12, 3, 1, str(work), ("limit@6",))
    assert rows[0]["scope"] == "6" and not (half / "x").exists() and (work / "src-6.complete").exists()
    assert not (work / "out").exists() and not (work / "out.making").exists()
    # Another corpus: its own trees go, with their markers.
    run(10, 2, 1, str(work), ("limit",))
    assert not (work / "src-6").exists() and not (work / "src-6.complete").exists()


def test_record_write_costs_each_part_and_leaves_no_spool():
    """A record's write into a memory spool and its parts (framing, SHA-256, the bytes' write), with one process
    and with two at once; every spool it wrote is removed."""
    from gpufeed.bench.experiments.record_write import PARTS, run

    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    rows = run([1, 2], record_kb=4, shards=1, emit=lambda line: None)
    assert [(r["processes"], r["part"]) for r in rows] == [(p, part) for p in (1, 2) for part in PARTS]
    assert all(0 < r["us_min"] <= r["us_per_record"] <= r["us_max"] for r in rows)
    if os.path.isdir("/dev/shm"):
        assert {n for n in os.listdir("/dev/shm") if n.startswith("gpufeed-record-write-")} <= before
