"""A tiny `gpufeed bench read` on every format, emulated and measured, cold and warm, with and without
decoding, through torch's DataLoader and the no-torch pool; plus the Ray-free dataset builder."""

from __future__ import annotations

import os
import sys

import pytest

from gpufeed.bench.dataset import build_dataset, load_dataset_info
from gpufeed.bench.results import load_results
from gpufeed.cli import main
from gpufeed.errors import ConfigError
from gpufeed.formats import FORMATS, get_format


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "ds"
    build_dataset(str(out), FORMATS, n=24, image="imagenet", workers=2)
    return str(out)


def test_build_dataset_writes_every_format(imagenet_like, tmp_path):
    info = load_dataset_info(imagenet_like)
    assert info["n"] == 24 and 50_000 < info["sample_bytes"] < 400_000
    for fmt in FORMATS:
        d = info["formats"][fmt]
        reader = get_format(fmt).reader(d["paths"][0])
        samples = list(reader)
        assert len(samples) == 24 and samples[5].labels[0] == 5
        assert bytes(samples[0].payload[:2]) == b"\xff\xd8"  # JPEG as stored
        assert d["record_bytes"] >= info["sample_bytes"]
        if hasattr(reader, "close"):
            reader.close()
    cifar = build_dataset(str(tmp_path / "c"), ["tfrecord", "lmdb"], n=10, image="cifar", workers=1, shards=2)
    # Made by the conversion engine: an LMDB per split, a TFRecord file per shard.
    assert cifar["sample_bytes"] == 3072 and len(cifar["formats"]["lmdb"]["paths"]) == 1
    assert len(cifar["formats"]["tfrecord"]["paths"]) == 2
    again = build_dataset(str(tmp_path / "c2"), ["tfrecord"], n=10, image="cifar", workers=2, shards=2)
    for a, b in zip(cifar["formats"]["tfrecord"]["files"], again["formats"]["tfrecord"]["files"]):
        assert a["sha256"] == b["sha256"]  # deterministic whatever the worker count


def test_bench_read_emulated_and_measured(imagenet_like, tmp_path):
    results = tmp_path / "read.jsonl"
    rc = main(["bench", "read", imagenet_like, "--tier", "ultra", "--tier", f"host={os.path.dirname(imagenet_like)}",
               "--results", str(results), "--samples", "12", "--batch-size", "4", "--workers", "0,1",
               "--grid", "full", "--repeats", "1", "--warmup", "0", "--host-seconds", "0.1", "--allow-invalid"])
    assert rc == 0
    rows = load_results(str(results))
    assert len(rows) == 2 * len(FORMATS) * 2 * 2 * 2  # tiers x formats x modes x workers x cache
    for r in rows:
        assert r["bench"] == "read" and r["format"] in FORMATS and r["n_samples"] == 24
        assert r["mode"] == ("emulated" if r["tier"] == "ultra" else "measured")
        assert r["profile"] == ("ultra" if r["tier"] == "ultra" else None)
        assert r["median"] > 0 and r["metric"] == "samples_per_s" and r["record_bytes"] > 0
        m = r["metrics"]
        assert m["read_p99_ms"]["median"] >= m["read_p50_ms"]["median"] > 0
        if r["params"]["cache"] == "cold":
            assert r["cold_verified"], r
            assert m["device_fraction"]["median"] >= 0.9
        else:
            assert r["warm_verified"], r
        if r["mode"] == "emulated" and r["params"]["cache"] == "cold":
            assert m["iops"]["median"] > 0 and m["mean_request_kib"]["median"] > 0
    assert "tier_limits" in rows[0] and rows[0]["machine"]["cpu"]


def test_default_grid_is_quick_with_a_line_per_configuration(imagenet_like, tmp_path, capsys):
    """With defaults, one cold run per tier x format x mode at one worker count, each announced with the time
    spent and what is left; --max-seconds ends a run early, the figures coming from what it read."""
    results = tmp_path / "read.jsonl"
    rc = main(["bench", "read", imagenet_like, "--tier", "ultra", "--results", str(results), "--samples", "12",
               "--batch-size", "4", "--host-seconds", "0.1", "--allow-invalid", "--max-seconds", "0.0001"])
    assert rc == 0
    rows = load_results(str(results))
    assert len(rows) == len(FORMATS) * 2
    assert {r["params"]["cache"] for r in rows} == {"cold"} and len({r["params"]["workers"] for r in rows}) == 1
    assert all(r["params"]["grid"] == "quick" and r["repeats"] == 1 for r in rows)
    # The first batch already passes the deadline: 4 samples read, not 12.
    assert all(r["metrics"]["samples"]["median"] == 4 for r in rows), [r["metrics"]["samples"] for r in rows]
    err = capsys.readouterr().err
    n = 2 * len(FORMATS)
    assert f"[1/{n}] ultra " in err and f"[{n}/{n}] ultra " in err and "left)" in err


def test_a_tier_the_host_cannot_emulate_stops_the_command_before_the_first_run(imagenet_like, tmp_path, capsys):
    """Every tier's figures are known before anything runs: nvme (150,000 IOPS) after ultra on this machine's
    disk stops the command at once, not after measuring ultra's configurations (issue: 12 runs, then the error
    and no table)."""
    results = tmp_path / "read.jsonl"
    rc = main(["bench", "read", imagenet_like, "--tier", "ultra", "--tier", "nvme", "--results", str(results),
               "--samples", "4", "--batch-size", "4", "--host-seconds", "0.1"])
    err = capsys.readouterr().err
    assert rc == 2 and "not clearly faster than profile nvme" in err and "[1/" not in err
    assert not results.exists() or not load_results(str(results))


def test_build_and_read_without_torch_or_ray(tmp_path):
    """The GPU machine has no Ray and a CPU box may have no torch: both paths must work with neither."""
    import json
    import subprocess

    results = tmp_path / "read.jsonl"
    code = f"""
import sys
sys.modules["torch"] = None  # import torch / import ray now raise ImportError
sys.modules["ray"] = None
from gpufeed.bench.dataset import build_dataset
from gpufeed.cli import main
build_dataset({str(tmp_path / "ds")!r}, ["recordio", "lmdb"], n=8, workers=2)
sys.exit(main(["bench", "read", {str(tmp_path / "ds")!r}, "--results", {str(results)!r}, "--samples", "8",
               "--workers", "2", "--modes", "decode", "--cache", "cold", "--repeats", "1", "--warmup", "0"]))
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    rows = load_results(str(results))
    assert len(rows) == 2
    for row in rows:
        assert row["params"]["loader"] == "pool" and row["params"]["crop"] == 224 and row["cold_verified"]
        assert row["tier"] == "host" and row["mode"] == "measured"
        assert row["versions"]["python"] and json.dumps(row)


def test_bench_modules_do_not_import_ray_or_torch(tmp_path):
    import subprocess

    code = ("import sys; import gpufeed.bench.cli, gpufeed.bench.read, gpufeed.bench.dataset, "
            "gpufeed.bench.convert_bench, gpufeed.bench.emulate, gpufeed.bench.results, gpufeed.bench.hostdisk; "
            "print('ray' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_bench_read_runs_on_a_gpufeed_convert_output(tmp_path, ray_local):
    """The benchmarks take the files people train from: a `gpufeed convert` output described by its manifest."""
    from gpufeed.pipelines.synth import synth_imagenet

    src = tmp_path / "src"
    synth_imagenet(str(src), classes=2, per_class=6, val_per_class=1, bad_files=False)
    out = tmp_path / "out"
    assert main(["convert", "imagenet", str(src), "--to", ",".join(FORMATS), "--out", str(out),
                    "--resize", "64", "--shard-size", "5", "--workers", "1", "--no-progress"]) == 0
    info = load_dataset_info(str(out))
    assert info["n"] == 12 and set(info["formats"]) == set(FORMATS)
    assert len(info["formats"]["tfrecord"]["relpaths"]) >= 2 and len(info["formats"]["recordio"]["relpaths"]) == 1
    results = tmp_path / "read.jsonl"
    assert main(["bench", "read", str(out), "--tier", f"host={tmp_path}", "--results", str(results),
                 "--samples", "6", "--batch-size", "3", "--workers", "0", "--modes", "raw", "--cache", "warm",
                 "--repeats", "1", "--warmup", "0", "--host-seconds", "0.1", "--allow-invalid"]) == 0
    rows = load_results(str(results))
    assert {r["format"] for r in rows} == set(FORMATS) and all(r["n_samples"] == 12 for r in rows)
    # A format it lacks: the user's conversion is never to be replaced, so no --overwrite in the advice.
    from gpufeed.bench.dataset import formats_of

    with pytest.raises(ConfigError, match=r"has no recordio dataset \(it holds lmdb\); it is a `gpufeed convert` "
                                          r"output: convert the same source with `--to recordio` into another") as e:
        formats_of({**info, "formats": {"lmdb": info["formats"]["lmdb"]}}, "recordio", str(out))
    assert "--overwrite" not in str(e.value)


def test_the_advice_for_a_format_a_dataset_lacks_works_when_followed(tmp_path):
    """A benchmark dataset stored small (--size, --center-crop, --quality, one format): the command the error gives
    builds it again as it was, keeping the format it held, with the one asked; followed as written, it runs (the
    bare command would refuse: the folder holds a dataset made with other options)."""
    import shlex

    from gpufeed.bench.dataset import formats_of

    out = str(tmp_path / "a dataset")  # a space: the command quotes the path
    build_dataset(out, ["recordio"], n=6, workers=1, size=(64, 64), center_crop=True, quality=75, seed=3)
    before = load_dataset_info(out)
    with pytest.raises(ConfigError) as e:
        formats_of(before, "lmdb", out)
    command = str(e.value).split("`")[1]
    assert command == (f"gpufeed bench dataset '{out}' --formats recordio,lmdb -n 6 --size 64x64 --center-crop "
                       "--quality 75 --seed 3 --overwrite")
    mine = os.path.join(out, "my notes.txt")  # a file gpufeed did not write: the advised --overwrite keeps it
    with open(mine, "w") as fh:
        fh.write("kept")
    assert main(shlex.split(command)[1:] + ["--workers", "1"]) == 0
    with open(mine) as fh:
        assert fh.read() == "kept"
    after = load_dataset_info(out)
    assert formats_of(after, "lmdb", out) == ["lmdb"] and set(after["formats"]) == {"recordio", "lmdb"}
    assert (after["n"], after["store"], after["seed"]) == (6, before["store"], 3)


def test_every_benchmark_takes_the_formats_the_dataset_holds_unless_told(imagenet_like):
    """bench read, feed and train read --formats one way: each asked format checked to be in DST, naming what it
    holds; without --formats, every format it holds."""
    from gpufeed.bench.dataset import formats_of

    info = load_dataset_info(imagenet_like)
    assert formats_of(info, None, imagenet_like) == list(info["formats"])
    assert formats_of(info, "lmdb,tfrecord", imagenet_like) == ["lmdb", "tfrecord"]
    assert formats_of(info, ["recordio", "recordio"], imagenet_like) == ["recordio"]
    partial = {**info, "formats": {"lmdb": info["formats"]["lmdb"]}}
    with pytest.raises(ConfigError, match=r"has no recordio dataset \(it holds lmdb\); build it again with them "
                                          r"all: `gpufeed bench dataset .* --formats lmdb,recordio -n 24 --overwrite`"):
        formats_of(partial, "recordio", imagenet_like)
    with pytest.raises(ConfigError, match="unknown parquet"):
        formats_of(info, "parquet", imagenet_like)


def test_a_ceiling_patterns_name_says_its_request_size_and_queue_depth():
    """A disk ceiling's pattern name (what rows keep) reads back as the request size and queue depth it was made
    from; a name that does not say one gives None for it."""
    from gpufeed.bench.hostdisk import pattern_shape, random_pattern

    assert pattern_shape(random_pattern(116 * 1024, 256)) == (116 * 1024, 256)
    assert pattern_shape("seq_1m") == (None, None) and pattern_shape(None) == (None, None)
