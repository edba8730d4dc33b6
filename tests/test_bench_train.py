"""gpufeed bench train on this CPU machine: the emulated accelerator, fed from real datasets in every format.

No GPU here and no torchvision: the CUDA path runs on the GPU machine (scripts/gpu_bench.sh); these tests run
the same loop, DataLoader, transforms and result rows with the emulated H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

import pytest

from gpufeed.bench import train, train_models
from gpufeed.bench.accelerator import PROFILES, get_profile
from gpufeed.errors import ConfigError
from gpufeed.formats import FORMATS
from gpufeed.pipelines.loader import region_decode_on

N = 48


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from gpufeed.bench.dataset import build_dataset

    out = tmp_path_factory.mktemp("bench-train") / "ds"
    build_dataset(str(out), n=N, workers=2)
    return str(out)


def _parse(argv):
    from gpufeed.bench import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["train", *argv])


def test_profiles_scale_with_batch():
    h200 = get_profile("h200")
    assert h200.train.images_per_s == pytest.approx(4697, rel=0.01)
    assert h200.infer.images_per_s == pytest.approx(15929, rel=1e-6)
    assert h200.train.step_time(128) == pytest.approx(0.0545 / 2)
    with pytest.raises(ConfigError, match="no infer measurement"):
        get_profile("a100-mlperf").task("infer")
    with pytest.raises(ConfigError, match="choose one of"):
        get_profile("p100")
    assert {"h200", "h100-mlperf", "a100-mlperf"} <= set(PROFILES)


def test_timed_loop_au_and_waits():
    accel = train_models.EmulatedAccelerator("h200", "train", batch=8)
    run = train.timed_loop(train.synthetic_batches(accel, 8, 224, 0), accel.step, accel.synchronize, 8, steps=5,
                           warmup=1)
    figures = run.figures(compute_step_s=accel.step_s)
    assert len(run.waits_s) == 5
    assert 0.5 < figures["au"] <= 1.0
    assert figures["images_per_s"] == pytest.approx(8 * 5 / run.wall_s)

    def slow_batches():
        while True:
            import time

            time.sleep(accel.step_s)
            yield None, None

    starved = train.timed_loop(slow_batches(), accel.step, accel.synchronize, 8, steps=5, warmup=1)
    assert starved.figures(accel.step_s)["au"] < 0.7
    assert np.median(starved.waits_s) >= accel.step_s * 0.9


def test_a_loop_that_ate_batches_made_before_its_window_is_rated_at_what_the_workers_made():
    """The loop took 8 samples a step; the workers made half as many over the same steps (the rest were batches
    they had made before the window, two a worker): the run's rate and AU are what they made, the loop's kept
    beside them. Where the workers kept up (made >= taken), the loop's rate stands."""
    accel = train_models.EmulatedAccelerator("h200", "train", batch=8)
    made = [0]

    def batches():
        while True:
            made[0] += 4
            yield None, None

    run = train.timed_loop(batches(), accel.step, accel.synchronize, 8, steps=10, warmup=1, made=lambda: made[0])
    f = run.figures(compute_step_s=accel.step_s)
    assert run.made_per_s == pytest.approx(40 / run.wall_s) and run.taken_per_s == pytest.approx(80 / run.wall_s)
    assert f["images_per_s"] == pytest.approx(run.made_per_s) and f["made_per_s"] == f["images_per_s"]
    assert f["au"] == pytest.approx(f["au_taken"] / 2) and f["taken_per_s"] == pytest.approx(80 / run.wall_s)
    kept_up = dataclasses.replace(run, made_per_s=run.taken_per_s * 1.3)
    assert kept_up.images_per_s == pytest.approx(run.taken_per_s)
    assert kept_up.figures(accel.step_s)["au"] == pytest.approx(f["au_taken"])
    assert dataclasses.replace(run, made_per_s=None).images_per_s == run.taken_per_s


def test_a_row_whose_loop_ate_batches_made_before_says_the_workers_limit_it():
    """Two inference ranks on 64 cores: each loop took 15,769 img/s, hardly waiting, while the workers made 6,100:
    no resource near its ceiling, the loader limits it (never "the batches came in time")."""
    from gpufeed.bench.bottleneck import BESIDE, limit

    row = {"params": {"gpus": 2, "task": "infer", "cold": True}, "record_bytes": 118_000, "total_per_s": 12_200,
           "compute_step_s": 0.0325,
           "metrics": {"au": {"median": 0.386}, "made_per_s": {"median": 6_100.0}, "taken_per_s": {"median": 15_769.0},
                       "step_ms": {"median": 32.6}, "disk_read_mb_per_s": {"median": 1_300.0}},
           "resources": {"disk_read_mb_per_s": 1_300.0, "disk_ceiling": {"mb_per_s": 1_513.0}, "cpu_busy": 0.63,
                         "cores": 64, "wait_share": 0.046, "main_thread_busy": 0.5}}
    found = limit(row)
    assert found["resource"] is None and found["resource"] != BESIDE
    assert found["text"].startswith("the workers made 6,100 img/s over the timed steps and the loop took 15,769, "
                                    "the rest from batches made before them; no resource at 90%")
    assert found["text"].endswith("the loader itself limits this run, not the disk")
    # A resource at its ceiling is named, the workers' rate beside it.
    row["resources"]["cpu_busy"] = 0.95
    found = limit(row)
    assert found["resource"] == "cpu" and found["text"].startswith("CPU: 95% of 64 cores busy (the workers made")


def test_emulated_grid_writes_rows_for_every_format(dataset, tmp_path):
    from gpufeed.bench.results import REQUIRED, load_results

    results = tmp_path / "train.jsonl"
    args = _parse([dataset, "--results", str(results), "--batch-size", "8", "--steps", "2", "--warmup-steps", "1",
                   "--repeats", "1", "--warmup", "0", "--workers", "1"])
    assert args._bench_module.run(args) == 0
    rows = load_results(str(results))
    assert all(k in r for r in rows for k in REQUIRED)
    kinds = {(r["params"]["task"], r["format"]) for r in rows}
    assert kinds == {(t, f) for t in ("train", "infer") for f in ("synthetic", *FORMATS)}
    for r in rows:
        assert r["bench"] == "train" and r["params"]["accelerator_mode"] == "emulated"
        assert r["metrics"]["au"]["median"] > 0 and len(r["samples"]["data_wait_ms"]) == 2
        if r["format"] == "synthetic":
            assert r["tier"] == "memory" and r["metrics"]["au"]["median"] == pytest.approx(1.0)
        else:
            assert r["tier"] == "host" and r["mode"] == "measured" and r["params"]["cold"] is True
            assert r["n_samples"] == N and r["sample_bytes"] > 10_000 and r["valid"] is True
            # What each shared resource did over the timed steps, beside its ceiling.
            res = r["resources"]
            assert 0.0 <= res["cpu_busy"] <= 1.0 and res["cores"] >= 1 and res["decodes_per_s"]["cpu"] > 0
            assert res["disk_read_mb_per_s"] >= 0 and res["disk_ceiling"]["mb_per_s"] > 0
            assert res["disk_ceiling"]["source"] == "measured cold on this machine"
            assert res["disk_ceiling"]["pattern"].endswith("_qd1")  # one worker, one rank: one read in flight
            assert "limit" in r
    # The CPU path needs neither a GPU nor torchvision.
    assert "torchvision" not in sys.modules


def test_read_ahead_on_and_off_are_rows_side_by_side(dataset, tmp_path):
    from gpufeed.bench.results import load_results

    results = tmp_path / "train.jsonl"
    args = _parse([dataset, "--results", str(results), "--batch-size", "8", "--steps", "2", "--warmup-steps", "1",
                   "--repeats", "1", "--warmup", "0", "--workers", "1", "--task", "infer", "--formats", "lmdb",
                   "--read-ahead", "on,off"])
    assert args._bench_module.run(args) == 0
    rows = [r for r in load_results(str(results)) if r["format"] == "lmdb"]
    assert [r["params"]["read_ahead"] for r in rows] == [True, False]
    # Each beside the disk's ceiling at its own depth: a batch of 8 asked at once, one record at a time.
    assert [r["resources"]["disk_ceiling"]["pattern"].rsplit("_", 1)[1] for r in rows] == ["qd8", "qd1"]


def test_a_later_tasks_batch_the_dataset_cannot_fill_stops_the_run_before_anything_is_measured(tmp_path):
    """300 records fill training's batch of 256 and not inference's 512: the run stops before the synthetic
    baseline, not after training's whole grid, naming the batch."""
    from gpufeed.bench.dataset import build_dataset

    dst = str(tmp_path / "ds")
    build_dataset(dst, ["lmdb", "tfrecord"], n=300, workers=1, size=(32, 32))
    results = str(tmp_path / "r.jsonl")
    args = _parse([dst, "--results", results, "--task", "train,infer", "--steps", "1", "--warmup-steps", "0",
                   "--repeats", "1", "--warmup", "0", "--workers", "0", "--no-cold"])
    with pytest.raises(ConfigError, match=r"lmdb.*: 300 samples is fewer than one batch of 512; build a larger"):
        args._bench_module.run(args)
    assert not os.path.exists(results)


def test_configuration_errors(dataset, tmp_path):
    results = str(tmp_path / "r.jsonl")
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        args = _parse([dataset, "--results", results, "--decode", "gpu", "--accelerator", "emulated"])
        args._bench_module.run(args)
    with pytest.raises(ConfigError, match="unknown accelerator profile"):
        args = _parse([dataset, "--results", results, "--profile", "p100"])
        args._bench_module.run(args)
    # Found before anything is measured (the synthetic baseline included): no row written.
    with pytest.raises(ConfigError, match="fewer than one batch"):
        args = _parse([dataset, "--results", results, "--formats", "lmdb", "--task", "train", "--steps", "1",
                       "--repeats", "1", "--warmup", "0", "--workers", "0"])
        args._bench_module.run(args)
    assert not os.path.exists(results)
    with pytest.raises(SystemExit):
        _parse([dataset, "--results", results, "--task", "fly"])
    for argv, text in ((["--model", "cifar-resnet18", "--accelerator", "emulated"], "runs on a CUDA GPU"),
                       (["--model", "cifar-resnet18", "--decode", "hw"], "reads CIFAR's stored pixels"),
                       (["--augment-on", "gpu"], "is for the CIFAR models"),
                       (["--cuda-graph", "--task", "train"], "captures a CUDA image model's inference step"),
                       (["--cuda-graph", "--accelerator", "emulated"], "captures a CUDA image model's inference"),
                       (["--cpu-share", "0.7", "--decode", "cpu,hw"], "for --decode hybrid"),
                       (["--cpu-share", "1.2", "--decode", "hybrid"], "between 0 and 1"),
                       (["--cpu-share", "rates", "--decode", "hw"], "for --decode hybrid"),
                       # The loader's own rules (LoaderOptions), spelled as this command's flags.
                       (["--decode-threads", "0"], "--decode-threads 0: need at least 1"),
                       (["--worker-nice", "20"], "--worker-nice 20: a niceness from 0"),
                       (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
                       (["--workers", "-1"], "--workers -1: must be 0"),
                       (["--trace", str(tmp_path / "t"), "--accelerator", "emulated"], "--trace records what a real"),
                       (["--trace", str(tmp_path / "t"), "--trace-steps", "0"], "--trace-steps 0: at least 1"),
                       (["--trace", os.path.join(dataset, "bench_dataset.json")], "bench_dataset.json: cannot make")):
        with pytest.raises(ConfigError, match=text):
            train.options_from_args(_parse([dataset, "--results", results, *argv]))
    # With --decode auto (the default) a share applies to the rows where auto picks hybrid.
    assert train.options_from_args(_parse([dataset, "--results", results, "--cpu-share", "0.7"])).cpu_share == 0.7
    # nvidia-smi beside the timed windows, unless the run leaves it out.
    assert train.options_from_args(_parse([dataset, "--results", results])).gpu_sample
    assert not train.options_from_args(_parse([dataset, "--results", results, "--no-gpu-sample"])).gpu_sample


def test_without_torch_the_command_says_what_to_install(monkeypatch, tmp_path, capsys):
    from gpufeed.cli import main

    monkeypatch.setitem(sys.modules, "torch", None)  # as if it were not installed: `import torch` fails
    rc = main(["bench", "train", str(tmp_path), "--results", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'gpufeed[gpu]'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_ptb_lstm_reads_token_windows_from_every_format(tmp_path, ray_local):
    """The language model's input: Penn Treebank converted by gpufeed (every format), read back as windows
    (inputs ids[:-1], targets ids[1:]) with the vocabulary from vocab.txt, and one real training step of the
    2-layer LSTM on them (on the CPU here; on CUDA in the benchmark)."""
    import torch

    from gpufeed.bench.dataset import load_dataset_info
    from gpufeed.cli import main
    from gpufeed.pipelines.loader import Loader
    from gpufeed.pipelines.synth import synth_ptb

    synth_ptb(str(tmp_path / "src"), train_tokens=3000, vocab=200, seed=1)
    out = tmp_path / "out"
    assert main(["convert", "ptb", str(tmp_path / "src"), "--to", "lmdb,recordio,tfrecord", "--out", str(out),
                 "--seq-len", "12", "--workers", "1", "--no-progress"]) == 0
    info = load_dataset_info(str(out))
    vocab = len((out / "vocab.txt").read_text().splitlines())
    assert info["image"] == "ptb" and info["seq_len"] == 12 and info["vocab"] == vocab
    model = train_models.CudaLstm("train", vocab, device="cpu", seed=0)
    first = None
    for fmt in ("lmdb", "recordio", "tfrecord"):
        ld = Loader(info["formats"][fmt]["paths"], format=fmt, batch_size=8, augment="tokens", workers=1,
                    device="cpu", window=13, vocab=vocab, seed=2)
        x, y = next(iter(ld))
        ld.close()
        assert x.shape == y.shape == (8, 12) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
        first = x if first is None else first
        assert torch.equal(x, first), fmt  # the same windows in the same order from every format
    before = [p.detach().clone() for p in model.model.parameters()]
    model.step(x, y)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.model.parameters()))
    # A model whose vocabulary is smaller than the data's ids is refused naming the record, not a CUDA assert.
    with pytest.raises(ConfigError, match="are outside the model.s vocabulary of 3"):
        next(iter(Loader(info["formats"]["tfrecord"]["paths"], batch_size=8, augment="tokens", workers=0,
                         device="cpu", vocab=3)))


def test_ptb_benchmark_dataset_and_refusals(tmp_path, dataset):
    from gpufeed.bench.dataset import build_dataset, load_dataset_info
    from gpufeed.pipelines.loader import Loader

    info = build_dataset(str(tmp_path / "p"), n=40, image="ptb", workers=1)
    assert info["vocab"] == 10_000 and info["seq_len"] == 35 and info["sample_bytes"] == 36 * 4
    ld = Loader(info["formats"]["lmdb"]["paths"], batch_size=20, augment="tokens", workers=0, device="cpu",
                window=36, vocab=10_000)
    x, y = next(iter(ld))
    assert x.shape == (20, 35) and int(x.max()) < 10_000
    results = str(tmp_path / "r.jsonl")
    for argv, text in ((["--model", "ptb-lstm", "--accelerator", "emulated"], "runs on a CUDA GPU"),
                       (["--model", "ptb-lstm", "--decode", "hw"], "need no decoding"),
                       (["--model", "ptb-lstm", "--image-size", "32"], "--image-size is for the image models")):
        with pytest.raises(ConfigError, match=text):
            train.options_from_args(_parse([str(tmp_path / "p"), "--results", results, *argv]))
    # Without --model, the model that reads the dataset (it then needs a GPU here, and says so).
    assert train.options_from_args(_parse([str(tmp_path / "p"), "--results", results])).model == "ptb-lstm"
    with pytest.raises(ConfigError, match="--model ptb-lstm runs on a CUDA GPU"):
        train.options_from_args(_parse([str(tmp_path / "p"), "--results", results, "--accelerator", "emulated"]))
    # A model pointed at the wrong kind of dataset is told which model reads it.
    opts = train.TrainOptions(model="ptb-lstm", accelerator="auto")
    with pytest.raises(ConfigError, match="holds imagenet samples and --model ptb-lstm reads ptb"):
        train.run_benchmark(dataset, ["lmdb"], [], opts)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):  # 'auto' finds no GPU here
        train.run_benchmark(str(tmp_path / "p"), ["lmdb"], [], opts)
    with pytest.raises(ConfigError, match="augment='tokens' reads token records"):
        images = load_dataset_info(dataset)["formats"]["lmdb"]["paths"]
        next(iter(Loader(images, batch_size=2, augment="tokens", workers=0, device="cpu")))


def test_warm_up_lasts_its_seconds_after_its_steps():
    """A real GPU's loop warms up for at least warmup_s after its warm-up steps (clocks rise in about a
    second): here a 20 ms step with 1 warm-up step and 0.2 s keeps warming up for ~10 steps."""
    import time

    stepped = []

    def step(x, y):
        time.sleep(0.02)
        stepped.append(time.perf_counter())

    run = train.timed_loop(iter(lambda: (None, None), 1), step, lambda: None, 4, steps=3, warmup=1, warmup_s=0.2)
    assert len(stepped) - 3 >= 8 and stepped[-3] - stepped[0] >= 0.2 and len(run.waits_s) == 3
    # The warm-up's seconds give way to the epoch: the timed steps end within the first of 6 batches.
    stepped.clear()
    train.timed_loop(iter(lambda: (None, None), 1), step, lambda: None, 4, steps=3, warmup=1, warmup_s=0.2,
                     epoch_batches=6)
    assert len(stepped) == 6


def test_a_cold_run_longer_than_an_epoch_is_refused(dataset, tmp_path):
    """A cold run reads each record once: warm-up + timed steps past the first epoch would read the page cache
    (and time the epoch's restart), so the run is refused with the numbers and the fixes."""
    results = str(tmp_path / "r.jsonl")
    args = _parse([dataset, "--results", results, "--formats", "tfrecord", "--task", "train", "--batch-size", "8",
                   "--steps", str(N), "--warmup-steps", "1", "--repeats", "1", "--warmup", "0", "--workers", "0"])
    with pytest.raises(ConfigError, match=rf"{N} records make {N // 8} batches of 8, fewer than the 1 warm-up \+ "
                                          rf"{N} timed steps.*gpufeed bench dataset -n.*--no-cold"):
        args._bench_module.run(args)
    assert not os.path.exists(results)  # refused before the synthetic baseline was measured
    args = _parse([dataset, "--results", results, "--formats", "tfrecord", "--task", "train", "--batch-size", "8",
                   "--steps", str(N), "--warmup-steps", "1", "--repeats", "1", "--warmup", "0", "--workers", "0",
                   "--no-cold"])
    assert args._bench_module.run(args) == 0


@pytest.mark.slow
def test_ranks_measure_every_configuration_in_step(tmp_path):
    """--gpus N: N DistributedDataParallel ranks (gloo on the CPU here, NCCL on GPUs), each reading its share of
    the format; a configuration is reported once every rank has measured it, with the slowest rank's AU and
    every rank's figures."""
    from gpufeed.bench.dataset import build_dataset
    from gpufeed.bench.tiers import TierSpec

    dst = str(tmp_path / "p")
    info = build_dataset(dst, ["lmdb", "tfrecord"], n=64, image="ptb", workers=1)
    opts = train.TrainOptions(tasks=("train",), model="ptb-lstm", batch_size=4, steps=3, warmup_steps=1, repeats=1,
                              workers=1, gpus=2, vocab=info["vocab"], seq_len=info["seq_len"])
    got = []
    train.run_ranks(2, ("cuda", dst, info, ["lmdb", "tfrecord"], [TierSpec("host", path=dst)], opts), got.append,
                    device_kind="cpu")
    assert [(cells[0].tier, cells[0].fmt) for cells in got] == [(None, "synthetic"), (0, "lmdb"), (0, "tfrecord")]
    assert all(len(cells) == 2 and cells[0].key == cells[1].key for cells in got)
    row = train.rank_summary(got[1], "seq/s")
    assert [r["rank"] for r in row["ranks"]] == [0, 1] and row["total_per_s"] > row["median"] > 0
    assert row["metrics"]["au"]["median"] == pytest.approx(min(r["au"] for r in row["ranks"]))
    # A rank that cannot run says why, naming the rank's share; the others are stopped, nothing hangs.
    small = dataclasses.replace(opts, batch_size=40)
    with pytest.raises(ConfigError, match="rank failed: .*fewer than one batch of 40 for each of 2 ranks"):
        train.run_ranks(2, ("cuda", dst, info, ["lmdb"], [TierSpec("host", path=dst)], small), got.append,
                        device_kind="cpu")
    # An emulated tier: one device, made once and joined by both ranks, takes both ranks' reads.
    tiers = [TierSpec("ultra")]
    invalid_ok = dataclasses.replace(opts, allow_invalid=True)
    with train.shared_tiers(tiers, dst, allow_invalid=True) as shared:
        got.clear()
        train.run_ranks(2, ("cuda", dst, info, ["tfrecord"], tiers, invalid_ok, shared), got.append,
                        device_kind="cpu")
        from gpufeed.bench.emulate import Throttle

        stats = Throttle.attach(shared[0]["state"]).stats()
        state = shared[0]["state"]
    assert [(cells[0].tier, cells[0].fmt) for cells in got] == [(None, "synthetic"), (0, "tfrecord")]
    assert all(cell.validity == shared[0]["validity"] for cell in got[1])
    assert stats["requests"] > 0 and stats["bytes_read"] > 0 and not os.path.exists(state)
    with pytest.raises(ConfigError, match="--gpus runs real GPUs"):
        train.options_from_args(_parse([dst, "--results", str(tmp_path / "r.jsonl"), "--gpus", "2",
                                        "--accelerator", "emulated"]))


def test_the_answer_says_what_limits_the_closest_configuration():
    """Nothing reaches 90%: the recommendation says whether the disk, the CPU or the loader limits the closest."""
    from gpufeed.bench.report_analysis import _recommendation

    row = {"bench": "train", "format": "recordio", "tier": "local", "metrics": {"au": {"median": 0.74}},
           "params": {"decode": "hybrid", "workers": 15, "task": "train"},
           "limit": {"resource": "disk", "text": "disk: 1.17 of 1.16 GB/s"}}
    assert _recommendation([row], [row]).endswith("What its row measured: disk: 1.17 of 1.16 GB/s; the disk "
                                                  "limits it: a faster disk (the sizes below).")
    row["limit"] = {"resource": "cpu", "text": "CPU: 97% of 32 cores busy"}
    assert "the CPU limits it: more cores" in _recommendation([row], [row])


@pytest.mark.parametrize("resources, au, expected", [
    ({"disk_read_mb_per_s": 1620.0, "disk_ceiling": {"mb_per_s": 1700.0}, "cpu_busy": 0.4, "cores": 64},
     0.7, ("disk", "disk: 1.62 of 1.70 GB/s")),
    # The disk at its ceiling and the loop starved by it: the disk, said alone.
    ({"disk_read_mb_per_s": 1620.0, "disk_ceiling": {"mb_per_s": 1700.0}, "cpu_busy": 0.4, "cores": 64,
      "wait_share": 0.25}, 0.7, ("disk", "disk: 1.62 of 1.70 GB/s")),
    ({"disk_read_mb_per_s": 300.0, "disk_ceiling": {"mb_per_s": 5000.0}, "cpu_busy": 0.97, "cores": 32},
     0.6, ("cpu", "CPU: 97% of 32 cores busy")),
    ({"disk_read_mb_per_s": 300.0, "disk_ceiling": {"mb_per_s": 5000.0}, "cpu_busy": 0.2, "cores": 32,
      "decodes_per_s": {"hw": 12_000.0}, "engines_per_s": 13_000.0}, 0.8, ("engines", "JPEG engines: 12,000 of")),
    ({"disk_read_mb_per_s": 300.0, "disk_ceiling": {"mb_per_s": 5000.0}, "cpu_busy": 0.5, "cores": 32,
      "decodes_per_s": {"hw": 3_000.0}, "engines_per_s": 13_000.0}, 0.8, (None, "the loader itself limits")),
    ({"disk_read_mb_per_s": 300.0, "disk_ceiling": {"mb_per_s": 5000.0}, "cpu_busy": 0.2, "cores": 64,
      "main_thread_busy": 0.97}, 0.84, ("main thread", "the rank's main thread: 97% of one core")),
    ({"disk_read_mb_per_s": 4900.0, "disk_ceiling": {"mb_per_s": 5000.0}, "cpu_busy": 0.99}, 0.95, None),
    # 4 ranks' CPU workers decoding 13,100 img/s with only 79% of 64 vCPUs busy (hyper-threads): the cores'
    # measured decode ceiling says the CPU is the limit.
    ({"disk_read_mb_per_s": 0.0, "disk_ceiling": {"mb_per_s": 1750.0}, "cpu_busy": 0.79, "cores": 64,
      "node_cpu_decodes_per_s": 13_100.0, "cpu_decode_ceiling": {"img_per_s": 13_900.0}}, 0.89,
     ("cpu", "CPU decode: 13,100 of 13,900 img/s (every core decoding at once)")),
    ({"disk_read_mb_per_s": 300.0, "disk_ceiling": {"mb_per_s": 5000.0}, "cpu_busy": 0.4, "cores": 64,
      "node_cpu_decodes_per_s": 6_000.0, "cpu_decode_ceiling": {"img_per_s": 13_900.0}}, 0.8,
     (None, "CPU decode: 6,000 of 13,900 img/s")),
    # The loop waited a fifth of its time for batches: the loader starved it.
    ({"disk_read_mb_per_s": 300.0, "disk_ceiling": {"mb_per_s": 5000.0}, "cpu_busy": 0.5, "cores": 32,
      "wait_share": 0.2}, 0.75, (None, "the loop waited for its batches 20% of its time; no resource at 90%")),
])
def test_a_row_that_misses_its_au_names_the_resource_at_its_ceiling_or_the_loader(resources, au, expected):
    """Never the disk's fault unless the disk was at 90% of what it reads cold at that size and depth."""
    from gpufeed.bench.bottleneck import limit

    found = limit({"metrics": {"au": {"median": au}}, "resources": resources})
    if expected is None:
        assert found is None
    else:
        assert found["resource"] == expected[0] and expected[1] in found["text"]
        if expected[0] is None:
            assert "disk: 0.30 of 5.00 GB/s" in found["text"] and "not the disk" in found["text"]


def test_resources_set_every_ranks_cpu_decodes_beside_the_cores_ceiling():
    """A row's CPU decodes are the slowest rank's img/s times its CPU share; on the node, every rank's."""
    from gpufeed.bench.bottleneck import resources

    row = {"median": 3_000.0, "params": {"decode": "hybrid", "gpus": 4},
           "metrics": {"cpu_share": {"median": 0.75}, "cpu_busy": {"median": 0.6}}}
    r = resources(row, None, 13_000.0, 64, {"img_per_s": 12_000.0})
    assert r["decodes_per_s"] == {"cpu": 2_250.0, "hw": 750.0} and r["node_cpu_decodes_per_s"] == 9_000.0
    assert r["cpu_decode_ceiling"] == {"img_per_s": 12_000.0}
    hw = resources({**row, "params": {"decode": "hw", "gpus": 4}}, None, 13_000.0, 64, {"img_per_s": 12_000.0})
    assert "cpu_decode_ceiling" not in hw and "node_cpu_decodes_per_s" not in hw


def test_the_cores_decode_ceiling_is_measured_once_per_task_and_kept(dataset, tmp_path, monkeypatch):
    """Every core decoding the dataset's own records at once, as the DataLoader workers do: a positive rate,
    measured once for training crops and once for centre crops, then read back from the user cache."""
    from gpufeed.bench.cpuceiling import CEILINGS_FILE, decode_ceiling
    from gpufeed.bench.dataset import load_dataset_info

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = load_dataset_info(dataset)["formats"]["recordio"]["paths"][0]
    train_ceiling = decode_ceiling("recordio", path, True, seconds=0.5, processes=2)
    assert train_ceiling["img_per_s"] > 0 and train_ceiling["processes"] == 2
    assert decode_ceiling("recordio", path, True, seconds=0.5, processes=2) == train_ceiling  # kept
    assert decode_ceiling("recordio", path, False, seconds=0.5, processes=2)["measured"]
    assert len(json.load(open(tmp_path / "cache" / "gpufeed" / CEILINGS_FILE))) == 2
    # The workers decoding each crop's box alone have a ceiling of their own, kept beside the other.
    if region_decode_on(None):
        boxes = decode_ceiling("recordio", path, True, seconds=0.5, processes=2, region=True)
        assert boxes["region_decode"] is True and boxes != train_ceiling
        assert len(json.load(open(tmp_path / "cache" / "gpufeed" / CEILINGS_FILE))) == 3


def test_the_cores_decode_ceilings_side_by_side_from_the_command_line(dataset, tmp_path, monkeypatch, capsys):
    """``python -m gpufeed.bench.cpuceiling DST`` measures anew (never a kept figure) each task, whole JPEGs and,
    where nvImageCodec is installed, boxes alone; each figure printed and appended to --results."""
    from gpufeed.bench import cpuceiling

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    results = tmp_path / "out" / "ceilings.jsonl"
    assert cpuceiling.main([dataset, "--seconds", "0.3", "--processes", "2", "--results", str(results)]) == 0
    rows = [json.loads(line) for line in open(results)]
    settings = (False, True) if region_decode_on(None) else (False,)
    assert [(r["task"], r["region_decode"]) for r in rows] == [(t, s) for t in ("train", "eval") for s in settings]
    assert all(r["img_per_s"] > 0 and r["processes"] == 2 for r in rows)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(rows) and printed[0].startswith("train whole JPEG")


def test_a_cold_row_served_from_the_page_cache_says_so_instead_of_naming_a_limit():
    """Two ranks at 3,000 img/s each of 118 KB records need 708 MB/s; a row marked cold whose disk read 50 MB/s
    meanwhile was served from the page cache: no resource is named, the measurement is."""
    from gpufeed.bench.bottleneck import device_share, limit

    row = {"params": {"cold": True, "gpus": 2}, "record_bytes": 118_000, "total_per_s": 6_000,
           "metrics": {"au": {"median": 0.84}, "disk_read_mb_per_s": {"median": 50.0}},
           "resources": {"disk_read_mb_per_s": 50.0, "disk_ceiling": {"mb_per_s": 1300.0}, "cpu_busy": 0.2}}
    assert abs(device_share(row) - 50e6 / (6_000 * 118_000)) < 1e-9
    found = limit(row)
    assert found["resource"] == "page cache" and found["text"].startswith("not a cold measurement: the disk read 7%")
    row["metrics"]["disk_read_mb_per_s"]["median"] = 700.0  # cold: the disk's own figures decide
    assert limit(row)["resource"] is None
    assert device_share({**row, "params": {"cold": False}}) is None


def test_the_defaults_fit_a_small_dataset_and_the_model_comes_from_it(dataset, tmp_path, capsys):
    """`bench dataset` (small by default) then `bench train` with its defaults runs: the warm-up and timed
    steps are fitted to the batches a cold run holds; given steps are kept (and refused when too many). The
    model is the one that reads what the dataset holds."""
    from gpufeed.bench.results import load_results

    results = tmp_path / "train.jsonl"
    args = _parse([dataset, "--results", str(results), "--batch-size", "8", "--repeats", "1", "--warmup", "0",
                   "--workers", "1", "--task", "train", "--formats", "tfrecord"])
    assert args._bench_module.run(args) == 0
    assert ("the dataset holds 6 batches per rank, 2 of them read ahead by the workers: 1 warm-up and 3 timed steps"
            in capsys.readouterr().err)
    rows = load_results(str(results))
    assert {(r["params"]["steps"], r["params"]["warmup_steps"]) for r in rows} == {(3, 1)}
    with pytest.raises(ConfigError, match="fewer than the 10 warm-up \\+ 50 timed steps"):
        args = _parse([dataset, "--results", str(results), "--batch-size", "8", "--steps", "50", "--repeats",
                       "1", "--warmup", "0", "--workers", "1", "--task", "train", "--formats", "tfrecord"])
        args._bench_module.run(args)
    assert train.options_from_args(_parse([dataset, "--results", str(results)])).model == "resnet50"
    assert train._model_for(str(tmp_path / "nothing-here")) == "resnet50"


def test_fitted_steps_leave_room_for_the_traced_steps():
    """A cold run's fitted warm-up and timed steps leave the --trace steps their batches (each record read once)."""
    from gpufeed.pipelines.loader import PREFETCH_FACTOR

    opts = train.TrainOptions(tasks=("train",), batch_size=8, workers=1, fit_steps=True, cold=True)
    info = {"n": 8 * (50 + PREFETCH_FACTOR)}  # 50 batches beside the ones the worker holds ahead
    plain = train._fitted_steps(opts, info, lambda _m: None)
    said = []
    traced = train._fitted_steps(dataclasses.replace(opts, trace="t", trace_steps=4), info, said.append)
    assert (plain.warmup_steps, plain.steps) == (10, 40)
    assert (traced.warmup_steps, traced.steps) == (10, 36) and said[0].endswith(
        "10 warm-up and 36 timed steps, 4 traced (a larger dataset, `gpufeed bench dataset -n`, measures more)")


def test_hybrid_rows_record_the_split_the_loader_held(monkeypatch):
    """A hybrid row says which split fed it: the loader's default fixed share for the task (or the one given)
    as ``cpu_share_fixed``, nothing where the measured rates set it, as in every hybrid row before. On a node of
    64 cores (the 4-GPU machine's), as the loader there would split."""
    import gpufeed.machine

    monkeypatch.setattr(gpufeed.machine, "usable_cores", lambda: 64)

    def fixed(task, **kw):
        return train.TrainOptions(**kw).params(task, "hybrid", {}).get("cpu_share_fixed")

    assert fixed("train", workers=15, region_decode=False) == 0.75
    assert fixed("train", workers=15, gpus=4, region_decode=False) == 0.75
    assert fixed("infer", workers=15, gpus=4) == 0.6
    assert fixed("train", workers=15, cpu_share=0.8) == 0.8
    assert fixed("train", workers=15, cpu_share="rates") is None
    assert fixed("train", workers=4) is None  # too few workers for the fixed share: the rates' split
    # A training rank whose workers carry it, each on a core: one rank, or 2 sharing the 64 cores; not 3 x 20 or
    # 4 x 15 decoding whole JPEGs, and never inference.
    assert fixed("train", workers=32) == fixed("train", workers=31, gpus=2) == 1.0
    assert (fixed("train", workers=20, gpus=3, region_decode=False)
            == fixed("train", workers=15, gpus=4, region_decode=False) == 0.75)
    # Decoding each crop's box alone (where nvImageCodec is installed), 15 workers carry 1 to 4 ranks' training.
    if region_decode_on(None):
        assert fixed("train", workers=15) == fixed("train", workers=15, gpus=2) == 1.0
        assert fixed("train", workers=20, gpus=3) == fixed("train", workers=15, gpus=4) == 1.0
    assert fixed("infer", workers=32) == fixed("infer", workers=31, gpus=2) == 0.6
    assert "cpu_share_fixed" not in train.TrainOptions(workers=15).params("train", "hw", {})


def test_decode_auto_is_chosen_for_each_task():
    """--decode auto runs each task on the path the loader would choose for it (training may take the CPU path where
    inference takes the engines too), each path once."""
    opts = train.TrainOptions(decodes=("auto", "hw", "cpu"), auto_decodes=(("train", "cpu"), ("infer", "hybrid")))
    assert opts.decodes_for("train") == ("cpu", "hw") and opts.decodes_for("infer") == ("hybrid", "hw", "cpu")
    assert train.TrainOptions(decodes=("hw",)).decodes_for("train") == ("hw",)


def test_read_ahead_auto_is_the_loaders_default_for_the_ranks():
    """--read-ahead auto (the default) runs as the loader would for that many ranks, and the rows say which."""
    assert train._read_aheads(("auto",), 1) == ("off",)
    assert train._read_aheads(("auto",), 4) == ("on",)
    assert train._read_aheads(("auto", "on", "off"), 2) == ("on", "off")


def test_the_loaders_settings_are_flags_of_bench_train_made_from_loader_options():
    """bench train's --workers, --decode-threads, --decode-priority, --cpu-share, --worker-nice, --loop-cores,
    --run-ahead, --region-decode and --in-order come from LoaderOptions' fields (one declaration: a new such setting
    is a new flag), and parse into its values."""
    import dataclasses

    from gpufeed.pipelines.loader import RATES, LoaderOptions

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    flags = {a.dest for a in parser._actions}
    declared = [f.name for f in dataclasses.fields(LoaderOptions) if "cli" in f.metadata]
    assert set(declared) == {"workers", "decode_threads", "decode_priority", "cpu_share", "worker_nice", "loop_cores",
                             "run_ahead", "region_decode", "in_order"}
    assert set(declared) <= flags
    args = parser.parse_args(["dst", "--results", "r", "--workers", "7", "--decode-threads", "3", "--decode-priority", "-1",
                              "--cpu-share", RATES, "--worker-nice", "5", "--loop-cores", "1", "--run-ahead", "0"])
    assert (args.workers, args.decode_threads, args.decode_priority, args.cpu_share, args.worker_nice,
            args.loop_cores, args.run_ahead) == (7, 3, -1, RATES, 5, 1, 0)
    assert parser.parse_args(["dst", "--results", "r", "--cpu-share", "0.6"]).cpu_share == 0.6
    defaults = parser.parse_args(["dst", "--results", "r"])
    assert (defaults.workers, defaults.cpu_share, defaults.worker_nice, defaults.decode_threads,
            defaults.loop_cores, defaults.run_ahead) == (None, None, None, 2, None, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["dst", "--results", "r", "--cpu-share", "half"])
    assert parser.parse_args(["dst", "--results", "r", "--run-ahead", "off"]).run_ahead == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["dst", "--results", "r", "--run-ahead", "fast"])
    assert defaults.region_decode is None
    assert [parser.parse_args(["dst", "--results", "r", "--region-decode", v]).region_decode
            for v in ("on", "off", "auto")] == [True, False, None]
    with pytest.raises(SystemExit):
        parser.parse_args(["dst", "--results", "r", "--region-decode", "yes"])
    assert defaults.in_order is None
    assert [parser.parse_args(["dst", "--results", "r", "--in-order", v]).in_order
            for v in ("on", "off", "auto")] == [True, False, None]


def test_a_row_says_where_its_batches_were_handed_out_as_made():
    """--in-order off: the row's params say in_order False and its label "out of order"; in order (the default,
    and every row before the setting) says nothing, so earlier rows keep their configurations."""
    from gpufeed.bench.report_rows import loader_label

    off = train.TrainOptions(workers=15, in_order=False).params("train", "cpu", {})
    assert off["in_order"] is False and loader_label({"params": off}).startswith("cpu, ")
    assert "out of order" in loader_label({"params": off})
    for opts in (train.TrainOptions(workers=15), train.TrainOptions(workers=15, in_order=True)):
        assert "in_order" not in opts.params("train", "cpu", {})
    assert "in_order" not in train.TrainOptions(workers=0, in_order=False).params("train", "cpu", {})  # no workers


def test_the_disks_ceiling_is_measured_at_the_reads_the_loader_keeps_in_flight():
    """A record per worker of every rank; reading ahead, each worker asks for its whole batch at once, so the
    ceiling is measured as deep as the device queues (its nr_requests; 256 where it does not say, and at most),
    never shallower than without read-ahead. Measured at 60 (15 workers x 4 ranks, reading ahead), 4 H200 ranks
    read 1.62 GB/s from a disk whose ceiling said 1.43."""
    from gpufeed.bench.results import disk_info
    from gpufeed.bench.train import READ_AHEAD_DEPTH, TrainOptions, ceiling_depth

    four = TrainOptions(workers=15, gpus=4)
    assert ceiling_depth(four, "train", "off", 256) == ceiling_depth(four, "train", None, None) == 60
    assert ceiling_depth(four, "train", "on", 256) == ceiling_depth(four, "infer", "on", None) == READ_AHEAD_DEPTH
    assert ceiling_depth(four, "train", "on", 10_000) == READ_AHEAD_DEPTH
    assert ceiling_depth(four, "train", "on", 32) == 60
    assert ceiling_depth(TrainOptions(workers=1, batch_size=8), "train", "on", 256) == 8
    queue = disk_info(os.getcwd()).get("queue_requests")
    assert queue is None or queue >= 1


def test_a_resource_at_its_ceiling_while_the_batches_came_in_time_says_what_relieving_it_wins():
    """4 H200s training (session 12): the disk read at its measured ceiling, yet each rank's loop waited 1% of its
    time and its steps ran 63.5 ms against 56.6 alone: the row names the disk and says that a faster one wins back
    at most the 1%, the rest being the steps'."""
    from gpufeed.bench.bottleneck import limit

    row = {"metrics": {"au": {"median": 0.888}, "step_ms": {"median": 63.5}}, "compute_step_s": 0.0566,
           "params": {"gpus": 4, "task": "train"},
           "resources": {"disk_read_mb_per_s": 1617.0, "disk_ceiling": {"mb_per_s": 1434.0}, "cpu_busy": 0.5,
                         "cores": 64, "wait_share": 0.011}}
    found = limit(row)
    assert found["resource"] == "disk"
    assert found["text"] == ("disk: 1.62 of 1.43 GB/s; yet the batches came in time (the loop waited for them 1% of "
                             "its time, and each step took 63.5 ms against the model's 56.6 ms alone): most of the AU "
                             "went to steps slowed beside the loader's work, so relieving the disk alone wins back at "
                             "most the 1% the loop waited")
    starved = {**row, "resources": {**row["resources"], "wait_share": 0.09}}
    assert limit(starved)["text"] == "disk: 1.62 of 1.43 GB/s"
    # Read faster than a ceiling measured at a record per worker (rows before the deeper ceilings): said so.
    shallow = {**starved["resources"], "disk_ceiling": {"mb_per_s": 1434.0, "pattern": "rand_116k_qd60"}}
    assert limit({**starved, "resources": shallow})["text"] == (
        "disk: 1.62 of 1.43 GB/s (more than the ceiling measured at qd60: the loader kept more reads in flight, so "
        "the disk may read faster still)")
    near = {**shallow, "disk_read_mb_per_s": 1480.0}
    assert limit({**starved, "resources": near})["text"] == "disk: 1.48 of 1.43 GB/s"


def test_a_row_whose_batches_came_in_time_says_its_steps_were_slowed_beside_the_loader():
    """4 H200s, hybrid: the loop waited 1.1% of its time, yet AU 0.889: the rest went to steps that ran longer than
    the model's alone. The row says so and does not call it a loader that failed to feed (nor the disk)."""
    from gpufeed.bench.bottleneck import BESIDE, limit, row_limit

    row = {"metrics": {"au": {"median": 0.889}, "step_ms": {"median": 66.67}}, "compute_step_s": 0.05928,
           "resources": {"disk_read_mb_per_s": 1290.8, "disk_ceiling": {"mb_per_s": 1512.6}, "cpu_busy": 0.5,
                         "cores": 64, "decodes_per_s": {"cpu": 2880.0, "hw": 960.0}, "engines_per_s": 13_000.0,
                         "main_thread_busy": 0.66, "wait_share": 0.011}}
    found = limit(row)
    assert found["resource"] == BESIDE
    assert found["text"].startswith("the batches came in time (the loop waited for them 1% of its time, and each "
                                    "step took 66.7 ms against the model's 59.3 ms alone): the loader's work beside "
                                    "the model slowed its steps, not the feeding; no resource at 90% of its ceiling "
                                    "(disk: 1.29 of 1.51 GB/s; CPU: 50% of 64 cores busy;")
    assert found["text"].endswith("so a faster disk would not help")
    # A report reads a row written by an earlier build (its stored text) the way this build does.
    assert row_limit({**row, "limit": {"resource": None, "text": "the loader itself limits this run"}}) == found
    assert row_limit({"limit": {"resource": "disk", "text": "disk"}}) == {"resource": "disk", "text": "disk"}
    # With the rank's main thread's wait for a core and its GPU's kernel time (the model alone's beside it), the
    # row says that the GPU went without work while the thread had its core.
    r = {**row["resources"], "main_thread_waited": 0.003, "gpu_busy": 0.78, "gpu_busy_alone": 0.95}
    assert ("alone; its main thread waited for a core 0% of its time; the GPU ran kernels 78% of the time against "
            "95% with the model alone): the loader's work") in limit({**row, "resources": r})["text"]
    # Several ranks: a step waits in the all-reduce for the latest rank, and that wait counts as kernel time.
    ranked = {**row, "resources": r, "params": {**row.get("params", {}), "gpus": 4}}
    assert ("the GPU ran kernels 78% of the time against 95% with the model alone (a rank's all-reduce waiting for "
            "the others counts as kernel time)): the loader's work beside the model slowed its steps (each of the 4 "
            "ranks waits in the gradients' all-reduce for whichever rank came late; --trace DIR records where), not "
            "the feeding;") in limit(ranked)["text"]
    # A model run as one CUDA graph: the loop waits while the GPU runs, and the row says so beside the wait.
    waited = {**row, "resources": {**row["resources"], "wait_share": 0.91}, "params": {"cuda_graph": True}}
    assert limit(waited)["text"].startswith("the loop waited for its batches 91% of its time (the model ran as one "
                                            "CUDA graph: the GPU ran while the loop waited, so not all of that was "
                                            "lost); no resource at 90%")
    assert "CUDA graph" not in limit({**waited, "params": {}})["text"]
    # Inference ranks never meet: nothing of an all-reduce in their rows.
    inferred = limit({**ranked, "params": {"gpus": 4, "task": "infer"}})["text"]
    assert "all-reduce waiting" not in inferred and "gradients" not in inferred
    assert ("95% with the model alone): the loader's work beside the model slowed its steps (each of the 4 ranks runs "
            "its own steps: inference has no all-reduce), not the feeding;") in inferred


def test_several_training_ranks_lose_each_step_to_the_latest_ranks_wait():
    """Training ranks meet in the all-reduce every step, so each step lasts at least the longest of the ranks'
    waits for their batches: the row keeps each rank's wait and, run by run, the share of the time some rank waited
    (step by step, the longest wait). Where that explains the loss, the row says the loader limited the run, not
    the steps beside it (4 H200s: the slowest rank waited 5% yet AU 0.61)."""
    from gpufeed.bench.bottleneck import BESIDE, limit
    from gpufeed.bench.train_loop import LoopRun

    def cell(waits):
        run = LoopRun(batch=256, steps=4, wall_s=0.4, waits_s=waits)
        return train.Cell("train", 0, "cpu", None, "recordio", [run], 0.056, {}, {})

    # Each rank late on another step: each waited 0.05 s of 0.4 s, some rank 0.2 s.
    cells = [cell([0.05 if s == r else 0.0 for s in range(4)]) for r in range(4)]
    row = train.rank_summary(cells, "img/s")
    assert [r["wait_share"] for r in row["ranks"]] == [pytest.approx(0.125)] * 4
    assert row["metrics"]["any_rank_wait_share"]["median"] == pytest.approx(0.5)
    # All late on the same step: the step waited once.
    same = train.rank_summary([cell([0.05, 0, 0, 0]) for _ in range(4)], "img/s")
    assert same["metrics"]["any_rank_wait_share"]["median"] == pytest.approx(0.125)
    # Runs that do not line up (another number of steps) give no figure rather than a wrong one.
    odd = [cell([0.0] * 4), train.Cell("train", 0, "cpu", None, "recordio",
                                      [LoopRun(batch=256, steps=3, wall_s=0.3, waits_s=[0.0] * 3)], 0.056, {}, {})]
    assert "any_rank_wait_share" not in train.rank_summary(odd, "img/s")["metrics"]

    base = {"metrics": {"au": {"median": 0.611}, "step_ms": {"median": 90.7}}, "compute_step_s": 0.0564,
            "params": {"gpus": 4, "task": "train"},
            "resources": {"disk_read_mb_per_s": 1340.0, "disk_ceiling": {"mb_per_s": 1720.0}, "cpu_busy": 0.63,
                          "cores": 64, "wait_share": 0.05}}
    assert limit(base)["resource"] == BESIDE  # the rank's own wait alone: its steps look slowed
    late = {**base, "resources": {**base["resources"], "any_rank_wait_share": 0.36}}
    found = limit(late)
    assert found["resource"] is None
    assert found["text"].startswith("the loop waited for its batches 5% of its time, and some rank waited for its "
                                    "batch 36% of the time (each step's all-reduce waits for the latest rank); no "
                                    "resource at 90% of its ceiling")
    assert found["text"].endswith("the loader itself limits this run, not the disk")
    # Less than the steps' own loss: still the steps, with the ranks' waits said.
    some = {**base, "resources": {**base["resources"], "any_rank_wait_share": 0.12}}
    assert limit(some)["resource"] == BESIDE
    assert "(the loop waited for them 5% of its time, and some rank waited for its batch 12% of the time" in (
        limit(some)["text"])
    # Inference ranks never meet: their own waits are all that count.
    infer = {**late, "params": {"gpus": 4, "task": "infer"}}
    assert "some rank" not in limit(infer)["text"]
    # A resource at its ceiling: what relieving it wins back is the ranks' waits, not the slowest rank's own.
    disk = {**base, "resources": {**some["resources"], "disk_read_mb_per_s": 1700.0}}
    assert limit(disk)["resource"] == "disk"
    assert limit(disk)["text"].endswith("so relieving the disk alone wins back at most the 12% the ranks waited")


def test_a_row_says_where_even_the_disks_ceiling_would_not_feed_its_ranks():
    """4 H200s training cold from 118 KB records need 4 x 4,532 img/s x 118 KB = 2.14 GB/s; a disk whose ceiling is
    1.66 GB/s feeds each rank at most 77.5% AU however good the loader: the row says so after what limited it now,
    rounded down (never "90%" for 89.96%). Not where the ceiling would do, the records came from the page cache,
    or the row was not cold."""
    from gpufeed.bench.bottleneck import disk_bound, limit

    row = {"metrics": {"au": {"median": 0.574}, "step_ms": {"median": 97.0}}, "compute_step_s": 0.0563,
           "params": {"gpus": 4, "task": "train", "cold": True, "image_size": 224}, "median": 0.574 * 4532.0,
           "record_bytes": 118_100,
           "total_per_s": 4 * 0.574 * 4532.0,
           "resources": {"disk_read_mb_per_s": 1160.0, "disk_ceiling": {"mb_per_s": 1660.0}, "cpu_busy": 0.65,
                         "cores": 64, "wait_share": 0.16, "any_rank_wait_share": 0.48}}
    assert disk_bound(row)["au"] == pytest.approx(1660 / (4 * 4532 * 0.1181))
    found = limit(row)
    assert found["resource"] is None
    # And what stored size would do: 118.1 KB x 0.775 (rounded down), with the option that stores the photos so.
    assert found["text"].endswith("the loader itself limits this run, not the disk; even read at its ceiling (1.66 "
                                  "GB/s) the disk feeds each of 4 ranks at most 77.5% AU: 4 x 4,532 img/s of 118 KB "
                                  "records need 2.14 GB/s; records of 91 KB or less would need no more than its "
                                  "ceiling (`gpufeed convert ... --resize 256` stores each photo's shorter side at 256)")
    # Records already stored at 256 or smaller, stored another way, or not images: the size alone, no option.
    for stored in ({"resize": 256}, {"resize": 160}, {"store": "--size 224x224 --center-crop"}, {"image_size": None}):
        text = limit({**row, "params": {**row["params"], **stored}})["text"]
        assert text.endswith("records of 91 KB or less would need no more than its ceiling"), stored
    assert "--resize 256" in limit({**row, "params": {**row["params"], "resize": 320}})["text"]
    edge = {**row, "resources": {**row["resources"], "disk_ceiling": {"mb_per_s": 0.8999 * 2140.8}}}
    assert "at most 89.9% AU" in limit(edge)["text"]
    one = {**row, "params": {**row["params"], "gpus": 1}, "total_per_s": row["median"],
           "resources": {**row["resources"], "disk_ceiling": {"mb_per_s": 400.0}, "disk_read_mb_per_s": 300.0}}
    assert "the disk feeds one rank at most 74.7% AU: 4,532 img/s of 118 KB records need 0.54 GB/s" in limit(one)["text"]
    roomy = {**row, "resources": {**row["resources"], "disk_ceiling": {"mb_per_s": 2400.0}}}
    assert "even read at its ceiling" not in limit(roomy)["text"]
    assert disk_bound({**row, "params": {**row["params"], "cold": False}}) is None
    cached = {**row, "metrics": {**row["metrics"], "disk_read_mb_per_s": {"median": 10.0}}}
    assert disk_bound(cached) is None and "even read at its ceiling" not in limit(cached)["text"]


def test_a_disk_kept_busy_below_its_ceiling_says_the_loaders_reads_came_too_few_at_once():
    """4 H200s from 15 workers a rank (session 18): the disk was busy 100% of the time while it read 1.49 of the
    1.87 GB/s measured at queue depth 256. No resource was at its ceiling, and the loader limits the run, but the row
    says the disk was kept busy by too few reads at once, not "not the disk". Not where the disk idled, nor where it
    read at its ceiling (then the disk is named)."""
    from gpufeed.bench.bottleneck import limit

    row = {"metrics": {"au": {"median": 0.698}, "step_ms": {"median": 81.0}}, "compute_step_s": 0.0565,
           "params": {"gpus": 4, "task": "train"}, "median": 3162.0,
           "resources": {"disk_read_mb_per_s": 1494.0, "disk_busy": 1.0,
                         "disk_ceiling": {"mb_per_s": 1872.7, "pattern": "rand_116k_qd256"}, "cpu_busy": 0.68,
                         "cores": 64, "wait_share": 0.175, "any_rank_wait_share": 0.43}}
    found = limit(row)
    assert found["resource"] is None
    # A row before the reads in flight were measured: fewer at once or smaller, not which.
    assert found["text"].endswith("(disk: 1.49 of 1.87 GB/s; CPU: 68% of 64 cores busy): the loader itself limits "
                                  "this run: its reads kept the disk busy 100% of the time below the ceiling "
                                  "measured at qd256: they came fewer at once or smaller than that measurement's")
    # Measured: 48 reads in flight against the ceiling's 256, of 118 KB: too few at once.
    def said(in_flight, request_kb):
        return limit({**row, "resources": {**row["resources"], "disk_reads_in_flight": in_flight,
                                           "disk_read_request_kb": request_kb}})["text"]
    assert said(48.3, 118.2).endswith("the loader itself limits this run: its reads kept the disk busy 100% of the "
                                      "time with 48 reads in flight on average, of 118 KB, too few at once to reach "
                                      "the ceiling measured at qd256; more workers a rank keep more reads in flight")
    assert said(200.0, 60.0).endswith("with 200 reads in flight on average, of 60 KB, smaller than the ceiling's "
                                      "119 KB reads")
    assert said(200.0, 118.0).endswith("with 200 reads in flight on average, of 118 KB, near the ceiling's depth "
                                       "and size, yet below it")
    idle = {**row, "resources": {**row["resources"], "disk_busy": 0.7}}
    assert limit(idle)["text"].endswith("the loader itself limits this run, not the disk")
    full = {**row, "resources": {**row["resources"], "disk_read_mb_per_s": 1800.0}}
    assert limit(full)["resource"] == "disk" and "too few at once" not in limit(full)["text"]


def test_a_row_of_ranks_fed_unevenly_says_so():
    """Ranks whose waits for their batches differ widely (one 42%, another 1%) were fed unevenly: the row says
    which and why it costs every rank. Not where the waits are close, where every rank waited, for inference
    ranks (they never meet) or where one rank alone ran."""
    from gpufeed.bench.bottleneck import limit, uneven_text

    row = {"metrics": {"au": {"median": 0.61}, "step_ms": {"median": 92.0}}, "compute_step_s": 0.0563,
           "params": {"gpus": 4, "task": "train"},
           "ranks": [{"rank": 0, "wait_share": 0.006}, {"rank": 1, "wait_share": 0.13},
                     {"rank": 2, "wait_share": 0.03}, {"rank": 3, "wait_share": 0.415}],
           "resources": {"disk_read_mb_per_s": 1440.0, "disk_ceiling": {"mb_per_s": 1660.0}, "cpu_busy": 0.64,
                         "cores": 64, "wait_share": 0.03, "any_rank_wait_share": 0.55}}
    said = ("the ranks were fed unevenly (rank 3 waited for its batches 42% of the time, rank 0 1%): each rank's "
            "workers make only its own batches, so where one rank's records cost more to read or decode, every rank "
            "waits for it")
    assert uneven_text(row) == said
    assert limit(row)["text"].endswith("the loader itself limits this run, not the disk; " + said)
    close = {**row, "ranks": [{"rank": k, "wait_share": w} for k, w in enumerate((0.01, 0.1, 0.15, 0.2))]}
    assert uneven_text(close) is None
    all_waited = {**row, "ranks": [{"rank": k, "wait_share": w} for k, w in enumerate((0.1, 0.2, 0.3, 0.4))]}
    assert uneven_text(all_waited) is None
    assert uneven_text({**row, "params": {"gpus": 4, "task": "infer"}}) is None
    assert uneven_text({**row, "ranks": row["ranks"][:1]}) is None
    assert uneven_text({k: v for k, v in row.items() if k != "ranks"}) is None


def test_a_paced_row_keeps_the_pacing_apart_from_waiting_for_batches():
    """A row whose loader paced the loop (run_ahead): the time held back for the GPU is said as such, never as the
    loop waiting for batches; a row from before bench train kept the two apart (no paced_share) says it cannot
    tell them apart instead of blaming the loader."""
    from gpufeed.bench.bottleneck import BESIDE, limit

    row = {"metrics": {"au": {"median": 0.659}, "step_ms": {"median": 101.0}, "paced_share": {"median": 0.21}},
           "compute_step_s": 0.0665, "params": {"gpus": 4, "run_ahead": 0},
           "resources": {"disk_read_mb_per_s": 1166.0, "disk_ceiling": {"mb_per_s": 1440.0}, "cpu_busy": 0.55,
                         "cores": 64, "main_thread_busy": 0.55, "wait_share": 0.01}}
    found = limit(row)
    assert found["resource"] == BESIDE and ("against the model's 66.5 ms alone; the loader held it back for its GPU "
                                            "21% of its time (run_ahead 0)): the loader's work") in found["text"]
    before = {**row, "metrics": {k: v for k, v in row["metrics"].items() if k != "paced_share"},
              "resources": {**row["resources"], "wait_share": 0.28}}
    text = limit(before)["text"]
    assert text.startswith("the loop waited 28% of its time for its batches or for its GPU (the loader paced it, "
                           "run_ahead 0, and this row does not tell the two apart)")
    assert "limits this run" not in text


def test_the_step_beside_load_experiment_times_the_step_with_k_processes_decoding(dataset):
    """bench/experiments/step_beside_load on the dataset's records (the emulated accelerator here: no GPU): one row
    per window, images decoded only while processes were told to, each row against the windows with none, and no
    decode process left once it returns."""
    import multiprocessing

    from gpufeed.bench.experiments.step_beside_load import default_loads, run
    from gpufeed.machine import reserved_cores

    lines = []
    rows = run(dataset, loads=[0, 2, 0], seconds=0.5, batch=32, accelerator="emulated", emit=lines.append)
    assert [r["processes"] for r in rows] == [0, 2, 0] and [json.loads(line) for line in lines] == rows
    assert rows[0]["decodes_per_s"] == rows[2]["decodes_per_s"] == 0 and rows[1]["decodes_per_s"] > 0
    assert all(r["images_per_s"] > 0 and r["step_ms"] > 0 and 0 < r["of_alone"] < 2 for r in rows)
    assert rows[1]["cpu_busy"] > 0 and rows[1]["accelerator_mode"] == "emulated"
    assert 0 <= rows[1]["main_thread_waited"] <= 1
    assert multiprocessing.active_children() == []
    assert default_loads(64) == [0, 15, 31, 47, 63, 0] and default_loads(1) == [0, 1, 0]
    # A core kept from the decode processes (and the loop's process pinned to it): they run on the others only,
    # at the niceness asked, and the loop's cores come back after.
    usable = os.sched_getaffinity(0)
    if len(reserved_cores(0)[1]) >= 2:
        kept, rest = reserved_cores(1)
        rows = run(dataset, loads=[0, 1], seconds=0.3, batch=32, accelerator="emulated", reserve=1, pin_loop=True,
                   nice=5, emit=lines.append)
        assert rows[1]["reserved"] == sorted(kept[0]) and rows[1]["decode_cores"] == len(rest)
        assert rows[1]["pin_loop"] and rows[1]["nice"] == 5
        assert rows[1]["decodes_per_s"] > 0 and os.sched_getaffinity(0) == usable
    with pytest.raises(SystemExit, match="leaves none of the"):
        run(dataset, loads=[0], seconds=0.1, batch=32, accelerator="emulated", reserve=len(usable))
    # The decoders as threads of the loop's own process (CPU decoding here; the engines need a GPU): they decode
    # only while told to, and none is left running after.
    import threading

    rows = run(dataset, loads=[0, 2, 0], seconds=0.3, batch=32, accelerator="emulated", threads="cpu",
               emit=lines.append)
    assert [r["in_process"] for r in rows] == ["cpu"] * 3 and rows[1]["decodes_per_s"] > 0
    assert rows[0]["decodes_per_s"] == rows[2]["decodes_per_s"] == 0
    assert multiprocessing.active_children() == [] and not any(t.name.startswith("decode-")
                                                              for t in threading.enumerate())
    # The engines' decoders as processes of their own need the model's GPU: refused, naming why, on the emulated one.
    with pytest.raises(SystemExit, match="--gpu-procs decodes on the model's GPU"):
        run(dataset, loads=[0, 1], seconds=0.1, batch=32, accelerator="emulated", gpu_procs=True)
    assert multiprocessing.active_children() == []


def test_the_epoch_edge_experiment_sets_flowing_epochs_beside_restarted_ones(dataset):
    """bench/experiments/epoch_edge: one row per way, each with the first-batch wait of every epoch after the
    first; the loader's workers are gone after it."""
    import multiprocessing

    from gpufeed.bench.experiments.epoch_edge import run

    lines = []
    rows = run(dataset, epochs=2, batch=8, workers=1, step_ms=5, emit=lines.append)
    assert [r["way"] for r in rows] == ["flow", "restart"] and [json.loads(line) for line in lines] == rows
    assert all(len(r["first_batch_wait_ms"]) == 1 and r["batches_per_epoch"] >= 2 for r in rows)
    assert multiprocessing.active_children() == []


def test_the_loader_cost_experiment_sets_the_whole_loader_beside_its_decode(dataset):
    """bench/experiments/loader_cost: per round, the CPU ms per image of the decode alone and of the loader (its
    workers' and its own process's), their ratio and the images the loader delivered; its workers are gone
    after it."""
    import multiprocessing

    from gpufeed.bench.experiments.loader_cost import run

    lines = []
    rows = run(dataset, batch=8, workers=1, images=16, rounds=2, emit=lines.append)
    assert [r["round"] for r in rows] == [0, 1] and [json.loads(line) for line in lines] == rows
    for r in rows:
        assert r["images"] >= 16 and r["decode_ms"] > 0 and r["workers_ms"] > 0
        assert r["loader_ms"] == pytest.approx(r["workers_ms"] + r["main_ms"], abs=1e-3)
        assert r["ratio"] == pytest.approx(r["loader_ms"] / r["decode_ms"], rel=0.01)
    assert multiprocessing.active_children() == []
