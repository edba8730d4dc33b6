"""gpufeed bench feed: the MLPerf-Storage-style search for the accelerators one disk keeps busy."""

from __future__ import annotations

import pytest

from gpufeed.bench import feed, report
from gpufeed.bench.results import load_results
from gpufeed.convert.cli import main


@pytest.mark.parametrize("capacity, expected, tried", [(5, 5, [1, 2, 4, 8, 6, 5]), (0, 0, [1]), (64, 8, [1, 2, 4, 8])])
def test_search_doubles_then_bisects(capacity, expected, tried):
    """With a disk that feeds exactly ``capacity`` accelerators, the search finds it and tries few N."""
    def run(cfg, n):
        return {"gpus": n, "min_au": 0.95 if n <= capacity else 0.5, "au": [], "mb_per_s": 0.0, "cpu_busy": 0.2}

    calls = []
    found = feed.search({}, 8, log=calls.append, run=run)
    assert found["gpus_fed"] == expected and [t["gpus"] for t in found["tried"]] == sorted(tried)
    assert found["capped_at_max"] == (capacity >= 8) and not found["cpu_limited"] and len(calls) == len(tried)


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
