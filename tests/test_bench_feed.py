"""gpufeed bench feed: the MLPerf-Storage-style search for the accelerators one disk keeps busy."""

from __future__ import annotations

import pytest

from gpufeed.bench import feed, report
from gpufeed.bench.report_analysis import _gpus_fed
from gpufeed.bench.results import load_results
from gpufeed.cli import main


@pytest.mark.parametrize("capacity, expected, tried, top", [(5, 5, [1, 2, 4, 8, 6, 5], 8), (0, 0, [1], 8),
                                                            (64, 8, [1, 2, 4, 8], 8), (64, 6, [1, 2, 4, 6], 6),
                                                            (5, 5, [1, 2, 4, 6, 5], 6)])
def test_search_doubles_then_bisects(capacity, expected, tried, top):
    """With a disk that feeds exactly ``capacity`` accelerators, the search finds it and tries few N, the top
    (``--max-gpus`` or what the dataset can test cold) included."""
    def run(cfg, n):
        return {"gpus": n, "min_au": 0.95 if n <= capacity else 0.5, "au": [], "mb_per_s": 0.0, "cpu_busy": 0.2}

    calls = []
    found = feed.search({}, top, log=calls.append, run=run)
    assert found["gpus_fed"] == expected and [t["gpus"] for t in found["tried"]] == sorted(tried)
    assert found["capped_at_max"] == (capacity >= top) and not found["cpu_limited"] and len(calls) == len(tried)


def test_bench_feed_on_an_emulated_tier_writes_a_row_the_report_shows(tmp_path):
    from gpufeed.bench.dataset import build_dataset

    ds = str(tmp_path / "ds")
    build_dataset(ds, ["tfrecord"], n=64, workers=1, resize=64)
    results = str(tmp_path / "feed.jsonl")
    assert main(["bench", "feed", ds, "--tier", "essd-pl1@100", "--results", results, "--batch-size", "8",
                 "--steps", "2", "--warmup-steps", "1", "--max-gpus", "2", "--threads", "4", "--allow-invalid"]) == 0
    (row,) = load_results(results)
    assert row["bench"] == "feed" and row["format"] == "tfrecord" and row["tier_limits"]["size_gib"] == 100
    assert 0 <= row["gpus_fed"] <= 2 and row["tried"] and all(0 < t["min_au"] <= 1.01 for t in row["tried"])
    assert isinstance(row["cpu_limited"], bool) and row["params"]["accelerator"] == "h200"
    text = report.render_markdown(report.Report("t", "s", [report.Section("a", report.answer([row]))]),
                                  "/nonexistent", "x")
    assert "Accelerators fed per disk" in text and "| essd-pl1" in text


@pytest.mark.parametrize("accounting,readers", [("requests", 1), ("device", 1), ("requests", 2)])
def test_every_read_is_charged_to_an_emulated_tier_even_from_the_page_cache(tmp_path, accounting, readers):
    """MLPerf Storage's datasets are several times memory: a rank that reads its share round again, or a record
    the page cache holds, must still cost the emulated disk a read (bench feed charges every request), from the
    rank itself or from its reader processes."""
    from gpufeed.bench.dataset import build_dataset, load_dataset_info
    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.read import dataset_paths
    from gpufeed.bench.tiers import get_profile
    from gpufeed.formats import get_format

    ds = str(tmp_path / "ds")
    build_dataset(ds, ["tfrecord"], n=32, workers=1, resize=64, shards=2)
    paths = dataset_paths(load_dataset_info(ds), ds, "tfrecord")
    assert len(paths) == 2  # the ranks read records of both files as one run
    smallest = 1 << 30
    for path in paths:
        with get_format("tfrecord").reader(path) as reader:
            smallest = min(smallest, *(len(reader.read_raw(i)) for i in range(len(reader))))
    # 2 ranks of 16 records each read 1 + 5 batches of 8: every record three times.
    cfg = {**feed.files_config("tfrecord", paths), "batch": 8, "step_s": 0.001, "steps": 5, "warmup": 1,
           "threads": 4, "readers": readers, "seed": 0}
    with Throttle.emulate(get_profile("ultra").limits(20), accounting=accounting, state_dir=str(tmp_path)) as t:
        got = feed.run_n(cfg, 2)
        stats = t.stats()
    assert len(got["au"]) == 2
    # Every batch's bytes were counted: 5 timed batches of 8 per rank.
    assert got["mb_per_s"] > 0
    charged_every_read = stats["requests"] >= 2 * 6 * 8 and stats["bytes_read"] >= 2 * 6 * 8 * smallest
    # The control: device accounting charges only what the kernel fetched, so the page cache serves re-reads free.
    assert charged_every_read == (accounting == "requests"), (stats, smallest)
    # No batch is read past the last step (the loop had started a seventh, never consumed).
    assert got["batches_read"] == [6, 6]


def test_on_a_real_mount_the_search_stops_where_reads_would_come_from_the_page_cache(tmp_path, capsys):
    from gpufeed.bench.dataset import build_dataset

    ds = str(tmp_path / "ds")
    build_dataset(ds, ["tfrecord"], n=64, workers=1, resize=64)
    results = str(tmp_path / "feed.jsonl")
    common = ["bench", "feed", ds, "--tier", f"here={ds}", "--results", results, "--steps", "2",
              "--warmup-steps", "1", "--max-gpus", "8", "--threads", "2"]
    # 64 records, 3 batches of 8 per accelerator: two accelerators read cold, a third would re-read.
    assert main(common + ["--batch-size", "8"]) == 0
    (row,) = load_results(results)
    assert row["cold_max_gpus"] == 2 and max(t["gpus"] for t in row["tried"]) <= 2 and row["params"]["cold"]
    if row["gpus_fed"] == 2:  # (two steps of a few small records: AU near 0.9 either way on a busy machine)
        assert row["capped_at_max"] and "holds records for 2 accelerators" in capsys.readouterr().out
    capped = dict(row, gpus_fed=2, capped_at_max=True, first_failing=None)
    text = report.render_markdown(report.Report("t", "s", [report.Section("a", report.answer([capped]))]),
                                  "/nonexistent", "x")
    assert "search stopped at 2: the dataset holds records for 2 to read cold, the disk may feed more" in text
    assert main(common + ["--batch-size", "32"]) == 2
    err = capsys.readouterr().err
    assert ds in err and "64 records are fewer than one accelerator's 96 cold reads" in err


@pytest.mark.parametrize("failing_mb, expected", [(366.0, "served 366 of its 620 MB/s"), (600.0, None)])
def test_a_failure_under_the_emulated_disks_caps_is_not_blamed_on_the_disk(failing_mb, expected):
    # ESSD PL2 of 1,000 GiB (620 MB/s, 51,800 IOPS) and 118 KB records, as measured on the GPU machine.
    row = {"tier_limits": {"mb_per_s": 620.0, "iops": 51800}, "record_bytes": 118_400, "first_failing": 1,
           "gpus_fed": 0, "tried": [{"gpus": 1, "min_au": 0.66, "mb_per_s": failing_mb, "cpu_busy": 0.08}]}
    said = feed.caps_shortfall(row)
    assert (said is None) if expected is None else (expected in said and "the disk may feed more" in said)
    text = report.render_markdown(report.Report("t", "s", [report.Section("a", _gpus_fed([
        dict(row, bench="feed", tier="essd-pl2", format="tfrecord", params={"task": "train"})]))]), "/n", "x")
    assert (expected in text) if expected else "the disk may feed more" not in text
    assert feed.caps_shortfall(dict(row, tier_limits=None)) is None  # a real mount: no caps to compare


def test_an_accelerator_has_a_reader_process_per_6000_records_per_s_it_consumes(tmp_path, capsys):
    from gpufeed.bench.accelerator import get_profile

    for task, want in (("train", 1), ("infer", 3)):
        profile = get_profile("h200").task(task)
        assert feed.readers_for(profile.step_time(profile.batch), profile.batch) == want
    assert main(["bench", "feed", str(tmp_path), "--readers", "4", "--threads", "2", "--results",
                 str(tmp_path / "r")]) != 0
    assert "--readers 4 share --threads 2 reads in flight" in capsys.readouterr().err


_RANKS_UNDER_A_HANDLER = """
import signal, sys
from gpufeed.bench import feed
from gpufeed.bench.dataset import build_dataset, load_dataset_info
from gpufeed.bench.read import dataset_paths
if __name__ == "__main__":
    ds = sys.argv[1]
    build_dataset(ds, ["tfrecord"], n=64, workers=1, resize=64, shards=2)
    paths = dataset_paths(load_dataset_info(ds), ds, "tfrecord")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what a Ray driver installs
    cfg = {**feed.files_config("tfrecord", paths), "batch": 8, "step_s": 0.001, "steps": 5, "warmup": 1,
           "threads": 4, "readers": 3, "seed": 0}
    for _ in range(40):
        assert feed.run_n(cfg, 2)["batches_read"] == [6, 6]
    print("done")
"""


def test_ranks_end_their_reader_pools_whatever_sigterm_handler_the_caller_has(tmp_path):
    """The emulated ranks fork reader pools and terminate them at the end. Forked under a caller whose SIGTERM
    handler raises SystemExit (a Ray driver's), a reader waiting on its task queue outlived the terminate and
    the rank waited for it for good: within 14-34 runs here, and a whole test session once. The ranks now give
    SIGTERM its default before forking."""
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(_RANKS_UNDER_A_HANDLER)
    try:
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ds")], capture_output=True, text=True,
                              timeout=60)  # ~5 s
    except subprocess.TimeoutExpired:
        pytest.fail("a rank waited for its terminated reader pool")
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr
