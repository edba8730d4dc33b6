"""A tiny `gpufeed bench convert`: the real converter in a subprocess, on the session's Ray, on an emulated tier
(whose state must reach the Ray workers through runtime_env, so their source reads are charged) and on a
measured "mount"."""

from __future__ import annotations

from gpufeed.bench.results import load_results
from gpufeed.cli import main


def test_bench_convert_emulated_and_measured(ray_local, tmp_path):
    from gpufeed.pipelines.synth import synth_imagenet

    src = tmp_path / "imagenet"
    synth_imagenet(str(src), classes=2, per_class=4, val_per_class=1, bad_files=False)
    mount = tmp_path / "mnt"
    mount.mkdir()
    results = tmp_path / "convert.jsonl"
    rc = main(["bench", "convert", str(src), "--tier", "ultra", "--tier", f"local={mount}", "--results",
               str(results), "--formats", "tfrecord", "--workers", "1", "--repeats", "1", "--warmup", "0",
               "--address", ray_local.get_runtime_context().gcs_address, "--out", str(tmp_path / "out"),
               "--host-seconds", "0.1", "--allow-invalid", "--resize", "64"])
    assert rc == 0
    emulated, measured = load_results(str(results))
    for r in (emulated, measured):
        assert r["bench"] == "convert" and r["format"] == "tfrecord"
        assert r["n_samples"] == 10 and r["median"] > 0 and r["unit"] == "images/s"
        m = r["metrics"]
        assert m["cpu_user_s"]["median"] > 0 and 0 <= m["machine_iowait_share"]["median"] <= 1
        assert r["params"]["workers"] == 1 and "--resize 64" in r["params"]["command"]
    assert emulated["mode"] == "emulated" and emulated["profile"] == "ultra"
    m = emulated["metrics"]
    # The source was evicted and only Ray workers read the images: charged bytes covering them prove the
    # workers saw the tier.
    images = sum(p.stat().st_size for p in src.rglob("*.JPEG"))
    assert m["device_read_bytes"]["median"] >= 0.9 * images and m["device_written_bytes"]["median"] > 0
    assert m["emulated_wait_share"]["median"] > 0  # the emulated disk made the conversion wait
    assert measured["mode"] == "measured" and measured["tier_path"] == str(mount) and measured["profile"] is None
    assert (mount / "gpufeed-bench-src").is_dir()  # the source was copied onto the measured mount


def test_a_bad_input_stops_the_benchmark_naming_the_option_that_skips_it(ray_local, tmp_path, capsys):
    """The converter's advice (--on-error skip) is an option of `bench convert` too, passed through."""
    from gpufeed.pipelines.synth import synth_imagenet

    src = tmp_path / "imagenet"
    synth_imagenet(str(src), classes=2, per_class=4, val_per_class=1, bad_files=True)
    results = tmp_path / "convert.jsonl"
    args = ["bench", "convert", str(src), "--results", str(results), "--formats", "recordio", "--workers", "1",
            "--repeats", "1", "--warmup", "0", "--address", ray_local.get_runtime_context().gcs_address,
            "--out", str(tmp_path / "out")]
    assert main(args) == 2
    assert "--on-error skip" in capsys.readouterr().err
    assert main([*args, "--on-error", "skip"]) == 0
    (row,) = load_results(str(results))
    assert row["params"]["on_error"] == "skip" and "--on-error skip" in row["params"]["command"]


def test_bench_convert_says_what_it_runs_and_writes_nothing_beside_the_source(ray_local, tmp_path, capsys,
                                                                            monkeypatch):
    """A line as each conversion starts (with the converter's own progress after it), and without --out a
    temporary folder in the working directory, removed at the end: nothing next to the user's dataset."""
    from gpufeed.pipelines.synth import synth_imagenet

    data = tmp_path / "datasets"
    src = data / "imagenet"
    synth_imagenet(str(src), classes=2, per_class=4, val_per_class=1, bad_files=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    results = tmp_path / "convert.jsonl"
    rc = main(["bench", "convert", str(src), "--results", str(results), "--formats", "tfrecord,recordio",
               "--workers", "1", "--repeats", "1", "--warmup", "0",
               "--address", ray_local.get_runtime_context().gcs_address])
    assert rc == 0
    err = capsys.readouterr().err
    assert "[1/2] host tfrecord w=1, run 1 of 1 (0 s so far)" in err and "[2/2] host recordio w=1, run 1 of 1" in err
    assert "  listed 10 inputs" in err  # the conversion's own lines, relayed
    assert sorted(p.name for p in data.iterdir()) == ["imagenet"]
    assert list(work.iterdir()) == []


def test_a_conversion_past_its_timeout_is_stopped_and_said(tmp_path):
    """The relayed output does not keep the benchmark waiting past --timeout for a conversion that hangs."""
    import sys
    import time

    import pytest

    from gpufeed.bench.convert_bench import run_convert
    from gpufeed.errors import GpufeedError

    t0 = time.monotonic()
    with pytest.raises(GpufeedError, match="ran past 1.0 s"):
        run_convert([sys.executable, "-c", "import time; print('working', flush=True); time.sleep(60)"],
                    str(tmp_path), 1, timeout=1.0)
    assert time.monotonic() - t0 < 20
