"""gpufeed report: the answer, the published-finding check, the tables and plots, HTML in a real browser."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from gpufeed.bench import report
from gpufeed.bench.results import ResultWriter, load_results, summarize
from gpufeed.cli import main
from gpufeed.errors import ConfigError

GPU = "NVIDIA H200"


def _train(writer, tier, fmt, task, decode, images_per_s, demand, mode="measured", resize=None):
    lim = {"profile": tier, "mb_per_s": {"ultra": 140.0, "ssd": 300.0}.get(tier, 1000.0), "iops": 5000,
           "latency_ms": 2.0} if mode == "emulated" else None
    writer.write({"bench": "train", "tier": tier, "mode": mode, "profile": tier if mode == "emulated" else None,
                  "tier_limits": lim, "format": fmt, "sample_bytes": 17_600 if resize else 118_000,
                  "resize": resize,
                  "params": {"task": task, "decode": decode, "batch_size": 256 if task == "train" else 512,
                             "workers": 16, "accelerator": GPU, "accelerator_mode": "measured", "resize": resize},
                  **summarize("images_per_s", "img/s", [images_per_s * 0.99, images_per_s, images_per_s * 1.01]),
                  "metrics": {"au": {"unit": "fraction", "median": images_per_s / demand, "spread": 0.01,
                                     "values": [images_per_s / demand]},
                              "data_wait_p50_ms": {"unit": "ms", "median": 0.4, "spread": 0, "values": [0.4]},
                              "data_wait_p99_ms": {"unit": "ms", "median": 9.0, "spread": 0, "values": [9.0]}},
                  "samples": {"data_wait_ms": [0.3, 0.4, 0.5, 9.0, 30.0]}})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A results file shaped like a GPU run plus CPU-side convert and read benchmarks, with numbers chosen so
    each published claim gets a known verdict."""
    path = str(tmp_path_factory.mktemp("report") / "results.jsonl")
    w = ResultWriter(path)
    for task, demand in (("train", 4700.0), ("infer", 15900.0)):
        _train(w, "memory", "synthetic", task, None, demand, demand)
    _train(w, "nvme", "recordio", "train", "cpu", 4600.0, 4700.0)
    _train(w, "nvme", "lmdb", "train", "cpu", 2400.0, 4700.0)
    _train(w, "ultra", "recordio", "train", "cpu", 4580.0, 4700.0, mode="emulated")   # ~0.4%: insensitive
    _train(w, "ssd", "recordio", "train", "cpu", 4590.0, 4700.0, mode="emulated")
    _train(w, "nvme", "recordio", "infer", "cpu", 6800.0, 15900.0)
    _train(w, "nvme", "recordio", "infer", "gpu", 6100.0, 15900.0)
    _train(w, "ultra", "recordio", "infer", "cpu", 1300.0, 15900.0, mode="emulated")  # far more than 15%
    _train(w, "nvme", "recordio", "infer", "cpu", 14400.0, 15900.0, resize=160)
    for tier, images_per_s in (("nvme", 500.0), ("ssd", 400.0), ("ultra", 250.0)):  # +25% and +60%
        w.write({"bench": "convert", "tier": tier, "mode": "emulated", "profile": tier, "format": "recordio",
                 "params": {"workers": 2, "dataset": "imagenet", "resize": 256,
                            "command": f"-m gpufeed convert imagenet /mnt/{tier}/src --to recordio"},
                 **summarize("images_per_s", "images/s", [images_per_s]),
                 "metrics": {"wall_s": {"unit": "s", "median": 1000 / images_per_s, "spread": 0,
                                        "values": [1000 / images_per_s]}}})
    for workers, rate in ((1, 360.0), (16, 2900.0)):
        w.write({"bench": "read", "tier": "nvme", "mode": "measured", "profile": None, "format": "tfrecord",
                 "resize": None, "params": {"mode": "decode", "decode": True, "workers": workers, "cache": "warm"},
                 **summarize("samples_per_s", "samples/s", [rate]),
                 "metrics": {"mb_per_s": {"unit": "MB/s", "median": rate * 0.118, "spread": 0, "values": [1]},
                             "read_p50_ms": {"unit": "ms", "median": 0.12, "spread": 0, "values": [0.12]},
                             "read_p99_ms": {"unit": "ms", "median": 1.2, "spread": 0, "values": [1.2]}}})
    return path


def test_answer_names_what_passes_cores_and_bandwidth(results):
    rows = load_results(results)
    text = report.render_markdown(report.Report("t", "s", [report.Section("a", report.answer(rows))]), "/nonexistent",
                                  "x")
    assert "ResNet-50 train on NVIDIA H200" in text and "4,700 img/s" in text
    # The first screen: one recommendation (the slowest disk that passes) and the AU matrix per task.
    assert ("**Recommendation:** recordio on ultra* (cpu decode), 16 workers: AU 97.4%, the slowest disk measured that "
            "keeps it at >= 90%") in text
    assert "| format | stored | nvme | ssd* | ultra* |" in text and "| lmdb | as captured | 51.1% (cpu) |" in text
    assert "| recordio | as captured | **97.9% (cpu)** | **97.7% (cpu)** | **97.4% (cpu)** |" in text
    everything = report.render_markdown(report.Report("t", "s", [report.Section(
        "b", report.every_configuration(rows))]), "/nonexistent", "x")
    assert "below the mark: lmdb on nvme (cpu decode): AU 51.1%" in everything
    # Training: 0.9 * 4700 / (2900 / 16) per core (the read benchmark at the most workers measured, not one
    # worker alone, which is faster per core than a full machine) -> 24 cores.
    assert "about **24 cores**" in text and "2,900 img/s with 16 worker(s); one worker alone: 360 img/s" in text
    assert "Decoding with `gpu` (nvJPEG on the SMs) reached AU" in text and "16 DataLoader workers only" in text
    # Inference: the CPU-bound loop gives 6800 / 16 = 425 img/s per core -> 0.9 * 15900 / 425 -> 34 cores.
    assert "about **34 cores**" in text and "16 workers already kept it at AU 90.6%" in text
    assert "| ultra | 140 | profile cap |" in text
    assert "stored at --resize 160 vs 6,800 as captured (2.12x)" in text


def test_published_finding_verdicts(results):
    checks = report.finding_checks(load_results(results))
    assert [c.verdict for c in checks] == ["confirmed", "refuted", "confirmed", "refuted"], checks
    infer = checks[3]
    assert "far larger than published" in infer.detail and infer.measured.startswith("+4")
    noisy = [dict(r, spread=2.0) if r["bench"] == "convert" else r for r in load_results(results)]
    assert [c.verdict for c in report.finding_checks(noisy)[:2]] == ["inconclusive", "inconclusive"]
    empty = report.finding_checks([r for r in load_results(results) if r["bench"] != "convert"])
    assert [c.verdict for c in empty[:2]] == ["no data", "no data"]
    # the advice names the command that makes the missing rows, not a machine the user may not have
    assert "`gpufeed bench convert SRC --tier nvme=MOUNT --tier ssd`" in empty[0].detail, empty[0].detail


def test_conversion_on_an_emulated_tier_shows_what_the_disk_served():
    def block(v):
        return {"unit": "", "median": v, "spread": 0, "values": [v]}

    row = {"bench": "convert", "tier": "ultra", "mode": "emulated", "profile": "ultra", "format": "lmdb",
           "params": {"workers": 16}, **summarize("images_per_s", "images/s", [430.0]),
           "metrics": {"wall_s": block(40.0), "device_read_bytes": block(3.4e9), "device_written_bytes": block(1.8e9),
                       "emulated_wait_share": block(0.8)}}
    assert report.figure(row, "device_mb_per_s") == pytest.approx(130.0)  # reads and writes, against 140 MB/s
    assert report.figure({**row, "metrics": {"wall_s": block(40.0)}}, "device_mb_per_s") is None
    table = report.generic_table([row], "convert", "Conversion", None,
                                 extra=("machine_iowait_share", "emulated_wait_share", "device_mb_per_s"))
    assert table.columns[-3:] == ["emulated_wait_share", "device_mb_per_s", "vs baseline"]
    assert table.rows[0][-3:-1] == ["0.800", "130"]


def test_baseline_and_ratios(results):
    rows = load_results(results)
    assert report.choose_baseline(rows) == "nvme"
    assert report.choose_baseline(rows, "ultra") == "ultra"
    with pytest.raises(ConfigError, match="not a tier in these results"):
        report.choose_baseline(rows, "floppy")
    ratios = report.ratio_to_baseline(report.of_bench(rows, "train"), "nvme")
    ultra = next(r for r in rows if r["tier"] == "ultra" and r["params"]["task"] == "train")
    assert ratios[id(ultra)] == pytest.approx(4580 / 4600)


def test_html_is_one_self_contained_file_and_markdown_has_its_plots(results, tmp_path):
    from gpufeed.cli import main

    html_path = tmp_path / "report.html"
    assert main(["report", results, "-o", str(html_path)]) == 0
    html = html_path.read_text()
    assert html.count('src="data:image/png;base64,') >= 4
    assert not re.search(r'(src|href)="(?!data:)', html), "the report must not load anything from outside"
    for heading in ("The answer", "The published finding, checked", "Training and inference", "Reading",
                    "Conversion", "Which rows were emulated", "Machines and versions"):
        assert f"<h2>{heading}</h2>" in html
    assert 'class="verdict-refuted"' in html and 'class="verdict-confirmed"' in html

    md_path = tmp_path / "report.md"
    assert main(["report", results, "-o", str(md_path), "--baseline", "ssd"]) == 0
    md = md_path.read_text()
    pngs = sorted(os.listdir(tmp_path / "report_files"))
    assert pngs and all(f"](report_files/{p})" in md for p in pngs)
    assert "| vs ssd |" in md


def test_report_errors(results, tmp_path):
    from gpufeed.cli import main

    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["report", results, "-o", str(tmp_path / "report.pdf")]) == 2
    with pytest.raises(ConfigError, match="no result rows"):
        report.build_report([])


@pytest.mark.browser
def test_report_renders_in_headless_chromium(results, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/test.sh installs it with apt-get)")
    out = tmp_path / "report.html"
    report.write_report(load_results([results, _feed_rows(str(tmp_path / "feed.jsonl"))]), str(out))
    shot = tmp_path / "shot.png"
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--dump-dom", f"file://{out}"], capture_output=True, text=True, timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "The published finding, checked" in dom.stdout and dom.stdout.count("<img") >= 4
    # The first screen answers: the recommendation and the AU matrix come before any long list or table.
    page = dom.stdout
    first = min(page.index("Recommendation:"), page.index("AU of ResNet-50 train"))
    assert first < page.index("GPUs fed per disk") < page.index("Storage bandwidth")
    assert page.index("Storage bandwidth") < page.index("Every configuration measured</h2>")
    subprocess.run([*base, "--window-size=1200,3000", f"--screenshot={shot}", f"file://{out}"],
                   capture_output=True, timeout=90, check=True)
    from PIL import Image

    img = Image.open(shot).convert("L")
    assert img.size == (1200, 3000)
    # A rendered page: mostly white, with text, tables and plots drawing many distinct grey levels.
    assert sum(1 for count in img.histogram() if count) > 50
    assert img.getextrema()[0] < 60


def test_single_runs_show_no_spread():
    assert report.fmt_spread({"values": [5.0], "spread": 0.0}) == "1 run"
    assert report.fmt_spread({"values": [4.0, 5.0], "spread": 0.2}) == report.fmt_pct(0.2)


def test_the_report_cites_no_file_the_user_does_not_have(results, tmp_path):
    out = tmp_path / "r.md"
    assert main(["report", results, "-o", str(out)]) == 0
    text = out.read_text()
    assert "shared/" not in text and "TIERS.md" not in text and "PERFORMANCE.md" not in text


def test_smallest_disk_by_the_vendor_formulas():
    from gpufeed.bench.tiers import PROFILES

    pl1 = PROFILES["essd-pl1"]
    # Throughput decides: (300 - 120) / 0.5 = 360 GiB; IOPS would need (10000 - 1800) / 50 = 164 GiB.
    assert pl1.smallest_gib(300, 10_000) == 360
    assert pl1.smallest_gib(400, 1000) is None  # over PL1's 350 MB/s per disk, at any size
    assert PROFILES["essd-pl2"].smallest_gib(100, 1000) == 461  # PL2 is sold from 461 GiB
    assert PROFILES["ultra"].smallest_gib(80, 4674) == 360  # IOPS decides: (4674 - 1800) / 8
    assert PROFILES["gp3"].smallest_gib(200, 100) is None
    # gp3 sells performance: 552 MB/s = 527 MiB/s needs 2,108 IOPS (0.25 MiB/s per IOPS), the demand asks
    # 4,678; 4,678 IOPS need 10 GiB (500 per GiB).
    assert PROFILES["gp3"].provisioned_for(552, 4677.1) == (10.0, 4678.0, 527.0)
    assert PROFILES["gp3"].provisioned_for(1100, 1000) is None  # over 1,000 MiB/s
    assert PROFILES["essd-pl1"].provisioned_for(100, 100) is None  # sized, not provisioned


def test_provisioned_tier_specs():
    from gpufeed.bench.tiers import parse_tier
    from gpufeed.errors import ConfigError

    t = parse_tier("gp3@200:iops=6000,mbps=500")
    assert (t.limits.iops, t.limits.bytes_per_s) == (6000, 500 * 2**20)
    assert t.row_fields()["tier_limits"]["provisioned"] == {"iops": 6000, "mbps": 500}
    assert parse_tier("gp3@200").limits.iops == 3000  # the baseline
    for spec, text in (("gp3@2:iops=6000", "at least 12 GiB"), ("gp3@200:iops=6000,mbps=2000", "0.25 MiB/s per IOPS"),
                       ("gp3@200:iops=99999", "3,000-16,000 IOPS"), ("ultra@200:iops=6000", "no provisioned"),
                       ("gp3@200:speed=1", "is not iops=N or mbps=N")):
        with pytest.raises(ConfigError, match=text):
            parse_tier(spec)


def test_report_sizes_disks_for_1_to_8_gpus(results, tmp_path):
    out = tmp_path / "r.md"
    assert main(["report", results, "-o", str(out)]) == 0
    text = out.read_text()
    assert "## Disks sized as bought" in text and "| disk | 1 GPU | 2 GPUs | 4 GPUs | 8 GPUs | per-disk max |" in text
    # The fixture's train demand: 4,700 img/s of 118 KB = 555 MB/s: beyond ESSD PL1 at any size.
    assert "| essd-pl1 | - | - | - | - |" in text
    assert "Disks sized as bought: one NVIDIA H200 train" in text
    # gp3's baseline feeds none; bought performance feeds one, not four (over 1,000 MiB/s).
    assert "| gp3 | - | - | - | - |" in text
    row = next(line for line in text.splitlines() if line.startswith("| gp3, provisioned |"))
    assert "GiB + " in row.split("|")[2] and row.split("|")[4].strip() == "-"
    assert "gp3 of " in text and "provisioned with" in text
    # Never a disk too small to hold the dataset: ImageNet-1k at this stored size, whatever speed needs less.
    hold = 0
    for line in text.split("## Disks sized as bought")[1].splitlines():
        title = re.search(r"Smallest disk that holds ImageNet-1k \(([\d,]+) GiB", line)
        if title:
            hold = int(title[1].replace(",", ""))
            assert hold > 10
        for cell in line.split("|")[2:6]:
            m = re.match(r"\s*([\d,]+) GiB", cell)
            if m:
                assert int(m[1].replace(",", "")) >= hold, line


def test_cores_say_what_share_the_hybrid_path_left_to_the_cpus(results, tmp_path):
    rows = load_results(results)
    extra = tmp_path / "hybrid.jsonl"
    _train(ResultWriter(str(extra)), "nvme", "tfrecord", "train", "hybrid", 4650.0, 4700.0)
    hybrid = load_results(str(extra))[0]
    hybrid["metrics"]["cpu_share"] = {"unit": "fraction", "median": 0.31, "spread": 0, "values": [0.31]}
    text = report.render_markdown(report.Report("t", "s", [report.Section("a", report.answer(rows + [hybrid]))]),
                                  "/nonexistent", "x")
    assert ("Decoding with `hybrid` (CPU workers and the JPEG engines) reached AU 98.9% at best (tfrecord on nvme "
            "(hybrid decode)) with 16 DataLoader workers decoding 31.0% of each batch, plus the main process.") in text
    # A run that measured its CPU time says how many cores it kept busy.
    hybrid["metrics"]["cpu_cores"] = {"unit": "cores", "median": 7.24, "spread": 0, "values": [7.24]}
    text = report.render_markdown(report.Report("t", "s", [report.Section("a", report.answer(rows + [hybrid]))]),
                                  "/nonexistent", "x")
    assert "decoding 31.0% of each batch, plus the main process; 7.2 cores busy in all, measured." in text


def test_cifar_rows_get_their_own_section_and_leave_the_imagenet_answer_alone(results, tmp_path):
    """CIFAR runs (3 KB images, a fast ResNet-18) would otherwise join the ImageNet demand, image sizes and
    AU matrix; they are reported apart, CPU against GPU augmentation per worker count."""
    path = str(tmp_path / "cifar.jsonl")
    w = ResultWriter(path)

    def row(fmt, workers, on, rate, demand=40_000.0):
        synthetic = fmt == "synthetic"
        w.write({"bench": "train", "tier": "memory" if synthetic else "nvme", "mode": "measured", "profile": None,
                 "format": fmt, **({} if synthetic else {"image": "cifar", "sample_bytes": 3072}),
                 "params": {"task": "train", "decode": None if synthetic else "cpu", "batch_size": 512,
                            "workers": workers, "accelerator": GPU, "accelerator_mode": "measured",
                            "model": "cifar-resnet18", **({} if synthetic else {"augment_on": on})},
                 **summarize("images_per_s", "img/s", [rate]),
                 "metrics": {"au": {"unit": "fraction", "median": rate / demand, "spread": 0, "values": [rate / demand]},
                             "data_wait_p50_ms": {"unit": "ms", "median": 1.0, "spread": 0, "values": [1.0]}}})

    row("synthetic", 2, None, 40_000.0)
    row("tfrecord", 2, "cpu", 9_000.0)
    row("tfrecord", 2, "gpu", 36_000.0)
    row("lmdb", 16, "cpu", 39_000.0)
    both = load_results(results) + load_results(path)
    alone = report.build_report(load_results(results))
    mixed = report.build_report(both)
    md = lambda r: report.render_markdown(r, str(tmp_path / "a"), "a")  # noqa: E731
    text = md(mixed)
    assert "## CIFAR-10 into a CIFAR ResNet" in text
    assert "With 2 DataLoader worker(s): augmentation on the CPU: AU 22.5% at best (tfrecord); augmentation on " \
           "the GPU: AU 90.0% at best (tfrecord)." in text
    assert "cifar-resnet18 on NVIDIA H200 trains at 40,000 img/s" in text
    # The ImageNet answer is the same with or without the CIFAR rows.
    assert md(alone).split("## The answer")[1].split("\n## ")[0] == text.split("## The answer")[1].split("\n## ")[0]
    only = md(report.build_report(load_results(path)))
    assert "## CIFAR-10 into a CIFAR ResNet" in only and "## The answer" not in only


def test_ptb_rows_say_how_many_workers_and_cores_feed_the_language_model(results, tmp_path):
    """Penn Treebank runs get a section of their own: the LSTM's demand in windows, tokens and disk bytes per
    second, and per worker count whether every format keeps it fed, with the cores and memory it took."""
    path = str(tmp_path / "ptb.jsonl")
    w = ResultWriter(path)

    def row(fmt, workers, rate, cores=None, mem=None, demand=2_000.0):
        synthetic = fmt == "synthetic"
        extra = {name: {"unit": u, "median": v, "spread": 0, "values": [v]}
                 for name, u, v in (("cpu_cores", "cores", cores), ("loader_mem_mb", "MB", mem)) if v is not None}
        w.write({"bench": "train", "tier": "memory" if synthetic else "nvme", "mode": "measured", "profile": None,
                 "format": fmt, **({} if synthetic else {"image": "ptb", "sample_bytes": 144, "record_bytes": 176}),
                 "params": {"task": "train", "decode": None if synthetic else "cpu", "batch_size": 20, "seq_len": 35,
                            "workers": workers, "accelerator": GPU, "accelerator_mode": "measured",
                            "model": "ptb-lstm"},
                 **summarize("sequences_per_s", "seq/s", [rate]),
                 "metrics": {"au": {"unit": "fraction", "median": rate / demand, "spread": 0, "values": [rate / demand]},
                             "data_wait_p50_ms": {"unit": "ms", "median": 0.1, "spread": 0, "values": [0.1]},
                             **extra}})

    row("synthetic", 2, 2_000.0, cores=1.0)
    row("tfrecord", 2, 1_960.0, cores=1.6, mem=310.0)
    row("lmdb", 2, 1_500.0, cores=1.8, mem=290.0)
    row("tfrecord", 16, 1_990.0, cores=3.5, mem=2400.0)
    row("lmdb", 16, 1_980.0, cores=3.9, mem=2300.0)
    text = report.render_markdown(report.build_report(load_results(path)), str(tmp_path / "p"), "p")
    assert "## Penn Treebank into an LSTM language model" in text and "## The answer" not in text
    assert ("ptb-lstm (train, batch 20 windows of 35 tokens) on NVIDIA H200 consumes 2,000 windows/s (70,000 "
            "tokens/s at the median) when its batches are already on the device: 352.0 KB/s of records of 176 B.") in text
    assert "moved by" not in text  # one baseline, no run above AU 100%: no noise sentence
    assert ("Train with 2 DataLoader worker(s): 1 of 2 formats keep it at AU >= 90.0% (lowest 75.0%, lmdb), using "
            "1.60-1.80 cores in all and 310.0 MB in the workers.") in text
    assert "Train with 16 DataLoader worker(s): every format keeps it fed (lowest AU 99.0%, lmdb)" in text
    row("synthetic", 2, 2_400.0, cores=1.0)  # a second command's baseline, 20% faster
    row("lmdb", 2, 2_100.0, cores=1.8, mem=290.0, demand=2_000.0)
    text = report.render_markdown(report.build_report(load_results(path)), str(tmp_path / "q"), "q")
    assert ("consumes 2,000-2,400 windows/s" in text and "Its own rate, measured once per benchmark command, moved "
            "by 20.0% and 1 run(s) came out above AU 100%" in text and "are noise, not the data path." in text)
    mixed = report.render_markdown(report.build_report(load_results(results) + load_results(path)),
                                   str(tmp_path / "m"), "m")
    assert "## Penn Treebank into an LSTM language model" in mixed and "## The answer" in mixed


def test_runs_on_several_gpus_get_their_own_section_and_never_mix_with_one_gpus(tmp_path):
    """The rows of `bench train --gpus 2` and `--gpus 1` measured on the 2-GPU machine (results/): each rank's
    rate and AU stand in a section of their own; the answer's demand and AU are one GPU's."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h200x2.jsonl")
    rows = load_results(path)
    earlier = [r for r in rows if r.get("call", "").startswith("2026-11-24")]  # before rows said what limits
    text = report.render_markdown(report.build_report(earlier), str(tmp_path / "r"), "r")
    answer, ranks = text.split("## The answer")[1].split("\n## ")[0], text.split("## Several GPUs")[1]
    assert "it consumes 4,595 img/s when it never waits" in answer and "3,635" not in answer
    assert ("resnet50 train on 2 x NVIDIA H200: each rank consumes 4,224 img/s when it never waits. Best: lmdb "
            "with hw decoding, slowest rank at AU 86.1%, 7,289 img/s in all; below 90%: not fed.") in ranks
    assert "| train | 2 | lmdb | local | cold | hw | 3,635 / 3,653 | 86.1% / 86.5% | 86.1% | 7,289 | 2.74 | - |" in ranks
    # The answer's first lines: how many real GPUs each disk fed, from the runs with 1 and 2 ranks.
    # Before the workers' samples were counted (session 14) and before they decoded boxes alone (session 15; session
    # 19 measured that default again).
    rows = [r for r in rows if not any(s in r.get("call", "") for s in ("session 14", "session 15", "session 16", "session 19"))]
    fed = report.render_markdown(report.build_report(rows), str(tmp_path / "f"), "f").split("## The answer")[1]
    # (The one-GPU inference runs of that call read 10-47% of their records from the disk, the rest from the page
    # cache: not cold measurements, so not counted.)
    # Two runs of one configuration count at their median (the lower for two), beside which the other format's
    # one run of 2 ranks was better.
    # The answer names the counts of the format it comes from (lmdb's one run with 2 ranks did better than
    # recordio's median, and missed too).
    assert fed.lstrip().startswith("**GPUs fed, measured with real GPUs on one node:** local feeds **1** NVIDIA "
                                   "H200 training resnet50 (from recordio), measured with 1, 2 GPUs; local feeds **0** "
                                   "NVIDIA H200s running inference of resnet50, measured with 2 GPUs.")
    assert ("| resnet50 | train | NVIDIA H200 | local | recordio | 1 | 1: 96.7% (cpu; loop's rate), 2: 83.8% (hybrid; "
            "median of 2 runs: 83.8%, 88.3%; loop's rate) |") in fed
    assert "\"loop's rate\": a run written before `bench train` counted what the loader's workers made" in fed
    # The rows measured since say, per configuration below 90%, what limited it.
    ranks = report.render_markdown(report.build_report(rows), str(tmp_path / "s"), "s").split("## Several GPUs")[1]
    # (Read from the row's measured resources by this build: the loop waited 1% of its time, its steps ran long.)
    assert ("| train | 2 | recordio | local | cold | hybrid | 3,851 / 3,865 | 88.3% / 88.6% | 88.3% | 7,715 | 6.58 | the "
            "batches came in time (the loop waited for them 1% of its time, and each step took 66.5 ms against the "
            "model's 58.7 ms alone): the loader's work beside the model slowed its steps (each of the 2 ranks waits "
            "in the gradients' all-reduce for whichever rank came late; --trace DIR records where), not the feeding; "
            "no resource at 90% of its ceiling (disk: 0.56 of 1.64 GB/s; CPU: 44% of 32 cores busy; JPEG engines: "
            "2,063 of 13,000 img/s), so a faster disk would not help |") in ranks


def test_images_stored_another_way_are_never_reported_as_captured(tmp_path):
    """A row from a dataset stored as a 224 centre crop (its `store`, no `resize`) gets its own line in the AU
    matrix and every list, and is neither recommended nor counted as images kept as captured."""
    from gpufeed.bench.results import ResultWriter

    path = str(tmp_path / "r.jsonl")
    w = ResultWriter(path)
    _train(w, "memory", "synthetic", "infer", None, 15_900, 15_900)
    _train(w, "nvme", "recordio", "infer", "cpu", 5_800, 15_900)
    w.write({**load_results(path)[-1], "params": {**load_results(path)[-1]["params"],
                                                   "store": "--size 224x224 --center-crop"},
             "median": 14_400, "metrics": {"au": {"unit": "fraction", "median": 0.92, "spread": 0, "values": [0.92]}}})
    rows = load_results(path)
    text = report.render_markdown(report.Report("t", "s", [report.Section("a", report.answer(rows)),
                                                           report.Section("b", report.every_configuration(rows))]),
                                  "/nonexistent", "x")
    assert "| recordio | as captured | 36.5% (cpu) |" in text
    assert "| recordio | --size 224x224 --center-crop | **92.0% (cpu)** |" in text
    assert "recordio on nvme (cpu decode, stored as --size 224x224 --center-crop), 16 workers: AU 92.0%" in text
    assert "As captured, 16 workers already kept it" not in text


def test_loader_variants_and_graph_models_are_told_apart():
    """Rows of one decode path that differ by the loader's read-ahead, a fixed hybrid CPU share, its pacing (or the
    child-process loader measured once) are labelled apart, and a model run as a CUDA graph is its own demand, never merged with the eager one's."""
    def row(fmt, **p):
        return {"bench": "train", "format": fmt, "tier": "memory" if fmt == "synthetic" else "local", "median": 1.0,
                "params": {"task": "infer", "accelerator": "NVIDIA H200", **p}}

    rows = [row("synthetic"), row("synthetic", cuda_graph=True), row("recordio", decode="hw"),
            row("recordio", decode="hw", read_ahead=True), row("recordio", decode="hw", feed="process"),
            row("recordio", decode="hybrid", cpu_share_fixed=0.7), row("recordio", decode="hybrid", run_ahead=0),
            row("recordio", decode="hybrid", run_ahead=1), row("recordio", decode="hybrid", run_ahead=None)]
    assert [report.loader_label(r) for r in rows[2:]] == ["hw", "hw, read-ahead", "hw, child process",
                                                          "hybrid, CPU share 0.70", "hybrid, paced to its GPU",
                                                          "hybrid, paced (1 step(s) ahead)", "hybrid"]
    assert sorted(d.accelerator for d in report.demands(rows)) == ["NVIDIA H200", "NVIDIA H200 (model as a CUDA graph)"]
    assert len(report.train_table(rows).rows) == 9


def _feed_rows(path: str) -> str:
    """`bench feed` rows for the H200 of the ``results`` fixture: train at two record sizes, infer at one."""
    w = ResultWriter(path)
    for task, tier, record, fed, capped in (("train", "local", 118_000, 3, False), ("train", "ultra", 118_000, 0, False),
                                            ("train", "essd-pl1", 17_900, 4, False), ("train", "local", 17_900, 10, True),
                                            ("infer", "local", 118_000, 0, False)):
        emulated = tier != "local"
        w.write({"bench": "feed", "tier": tier, "mode": "emulated" if emulated else "measured",
                 "profile": tier if emulated else None, "format": "tfrecord",
                 "tier_limits": {"size_gib": 2000.0, "mb_per_s": 350.0, "iops": 50000} if emulated else {},
                 "record_bytes": record, "gpus_fed": fed, "capped_at_max": capped, "first_failing": fed + 1,
                 "params": {"task": task, "accelerator": "h200", "max_gpus": 10},
                 **summarize("gpus_fed", "accelerators", [fed])})
    return path


def test_each_task_says_how_many_gpus_each_disk_feeds_under_its_au_matrix(results, tmp_path):
    """The first screen's GPUs-fed figure per tier: from `bench feed` rows of the same task and accelerator,
    per record size, most-fed disk first, a search stopped at its cap written as a floor."""
    rows = load_results([results, _feed_rows(str(tmp_path / "feed.jsonl"))])
    blocks = report.answer(rows)
    tables = [b for b in blocks if isinstance(b, report.Table) and b.title.startswith("GPUs fed per disk")]
    train, infer = tables
    assert "NVIDIA H200 train" in train.title and "NVIDIA H200 infer" in infer.title
    # A small table, not a sentence of numbers: per record size, most-fed disk first; a capped search a floor.
    assert train.rows == [["118.0 KB", "tfrecord", "local", "measured mount", "**3**"],
                          ["118.0 KB", "tfrecord", "ultra*", "2,000 GiB", "**0**"],
                          ["17.9 KB", "tfrecord", "local", "measured mount", "**>= 10**"],
                          ["17.9 KB", "tfrecord", "essd-pl1*", "2,000 GiB", "**4**"]], train.rows
    # right under its task's AU matrix, before the cores and the long tables
    i = blocks.index(train)
    assert isinstance(blocks[i - 1], report.Table) and blocks[i - 1].title.startswith("AU of ResNet-50 train")
    assert not [b for b in report.answer([r for r in rows if r["bench"] != "feed"])
                if isinstance(b, report.Table) and b.title.startswith("GPUs fed per disk")]


def test_a_run_marked_cold_that_read_from_the_page_cache_is_not_counted_as_cold(tmp_path):
    """results/gpu-ranks-h100x4.jsonl holds multi-rank runs of a first session marked cold whose disk read
    0.2-7% of the bytes of the records they consumed (batches read before the timed steps): the real-GPU answer
    leaves them out, says so, and their rows say they are not cold measurements."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h100x4.jsonl")
    earlier = [r for r in load_results(path) if not any(f"session {n}" in r.get("call", "") for n in (4, 9, 10))]
    text = report.render_markdown(report.build_report(earlier), str(tmp_path / "r"), "r")
    answer, ranks = text.split("## The answer")[1].split("\n## ")[0], text.split("## Several GPUs")[1]
    # Two runs of one configuration count at the lower of the two (the median of an even count, never the best).
    assert ("| resnet50 | train | NVIDIA H100 80GB HBM3 | local | recordio | 1 | 1: 98.0% (cpu; median of 2 runs: 98.0%, "
            "99.6%; loop's rate), 2: 82.5% (hybrid; median of 2 runs: 82.5%, 86.7%; loop's rate), 3: 87.0% (hybrid; "
            "loop's rate), 4: 74.2% (hybrid; median of 2 runs: 74.2%, 85.5%; loop's rate) | the batches came in "
            "time") in answer
    assert "Left out: 4 runs marked cold whose disk read under 50% of the bytes of the records consumed" in answer
    assert ("| train | 4 | recordio | local | cold | hybrid | 3,082 / 3,083 / 3,084 / 3,090 | 84.1% / 84.2% / 84.3% / 84.4% | "
            "84.1% | 12,338 | 2.37 | not a cold measurement: the disk read 0% of the bytes of the records the run "
            "consumed, the rest came from the page cache |") in ranks


def test_the_gpus_fed_answer_counts_cold_runs_only_and_says_how_images_were_stored(tmp_path):
    """Session 4 of results/gpu-ranks-h100x4.jsonl: 4 ranks fed at 92.3% cold (hybrid, read-ahead) but 3 at 87.0%
    (the disk at its ceiling), so the disk feeds 2; runs with the data in the page cache by request (--no-cold)
    left out of the count and said so, and inference from images stored as 224 centre crops counted apart from
    photos as captured."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h100x4.jsonl")
    before = [r for r in load_results(path)  # the sessions this is about
              if not any(f"session {n}," in r.get("call", "") for n in (9, 10))]
    text = report.render_markdown(report.build_report(before), str(tmp_path / "r"), "r")
    answer, ranks = text.split("## The answer")[1].split("\n## ")[0], text.split("## Several GPUs")[1]
    assert ("| resnet50 | train | NVIDIA H100 80GB HBM3 | local | recordio | 2 | 1: 98.0% (cpu; median of 2 runs: 98.0%, "
            "99.6%; loop's rate), 2: 94.1% (hybrid, read-ahead, CPU share 0.75; loop's rate), 3: 87.0% (hybrid; loop's "
            "rate), 4: 92.3% (hybrid, read-ahead, CPU share 0.75; loop's rate) | disk: 1.51 of 1.16 GB/s (more than the "
            "ceiling measured at qd60: the loader kept more reads in flight, so the disk may read faster still); yet the "
            "batches came in time ") in answer
    assert ("| resnet50 | infer | NVIDIA H100 80GB HBM3 | local | recordio (--size 224x224 --center-crop) | 1 | "
            "1: 91.3% (cpu; loop's rate), 4: 82.6% (cpu; loop's rate) | disk: 1.29 of 1.21 GB/s (more than the ceiling measured at qd60: the "
            "loader kept more reads in flight, so the disk may read faster still); yet the batches came in time (the "
            "loop waited for them 2% of its time") in answer
    assert "Left out: 6 runs with the data in the page cache by request (`--no-cold`)" in answer
    assert ("| train | 4 | recordio | local | cold | hybrid, read-ahead, CPU share 0.75 | 3,350 / 3,350 / 3,343 / "
            "3,360 |") in ranks
    assert "| train | 4 | recordio | local | warm (--no-cold) | hybrid, CPU share 0.70 |" in ranks


def test_gpus_fed_counts_only_up_to_the_first_count_that_missed(tmp_path):
    """Four H200s (results/gpu-ranks-h200x4.jsonl): recordio fed 1, 2 and 4 ranks at 90% or more but 3 at 88.0%:
    the disk is said to feed 2 GPUs from recordio, and what limited the 3 ranks is named; lmdb, measured with 4
    ranks only, keeps its own line."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h200x4.jsonl")
    earlier = [r for r in load_results(path)  # the sessions this is about
               if not any(s in str(r.get("call")) for s in ("session 11", "session 12", "session 13", "session 14",
                                                             "session 16", "session 17", "session 18"))]
    text = report.render_markdown(report.build_report(earlier), str(tmp_path / "r"), "r")
    fed = text.split("## The answer")[1]
    line = next(row for row in fed.splitlines() if row.startswith("| resnet50 | train | NVIDIA H200 | local | recordio |"))
    # 4 ranks: the configuration whose runs' median was best (three runs of the default), not the best single run
    # (0.944 with --loop-cores 1, whose other run gave 0.913).
    assert line.startswith("| resnet50 | train | NVIDIA H200 | local | recordio | 2 | 1: 99.0% (cpu; loop's rate), 2: 92.2% "
                           "(hybrid, read-ahead, CPU share 0.75; loop's rate), 3: 88.0% (hybrid, read-ahead, CPU share "
                           "0.75; loop's rate), 4: 92.3% (hybrid, read-ahead, CPU share 0.75; median of 3 runs: 91.0%, "
                           "92.3%, 92.8%; loop's rate) | the batches came in time")
    assert "essd-pl1* feeds **0** NVIDIA H200s training resnet50, measured with 1, 2, 3 GPUs" in fed
    # lmdb's 92.8%, measured with 4 GPUs only, does not make the disk's answer 4 where 3 missed from recordio.
    assert ("local feeds **2** NVIDIA H200s training resnet50 (from recordio), measured with 1, 2, 3, 4 GPUs; local "
            "feeds **0** NVIDIA H200s running inference of resnet50, measured with 1 GPU (stored --resize 160: 0, "
            "measured with 4 GPUs).") in fed
    assert ("| resnet50 | train | NVIDIA H200 | local | lmdb | 4 | 4: 92.8% (hybrid, read-ahead, CPU share 0.75; loop's "
            "rate) | - |") in fed


def test_gpus_fed_takes_each_configuration_at_its_runs_median_and_a_cuda_graph_apart(tmp_path):
    """Session 11 on four H200s (results/gpu-ranks-h200x4.jsonl): one setting of 4 inference ranks ran three times
    (slowest rank 0.548, 0.728, 0.922): the answer takes each configuration's median run, names every run, and
    never counts the best single run as the disk's answer; the model run as one CUDA graph (another demand) is
    answered on a line of its own, never beside the eager model's runs."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h200x4.jsonl")
    rows = [r for r in load_results(path) if "session 11," in str(r.get("call"))]
    fed = report.render_markdown(report.build_report(rows), str(tmp_path / "r"), "r").split("## The answer")[1]
    lines = {row.split(" | ")[2] + " " + row.split(" | ")[1]: row for row in fed.splitlines()
             if row.startswith("| resnet50 | ") and "--quality 75" in row}
    # The plain setting's median (0.728) lost to the niced workers with a core kept per rank (0.749, 0.825).
    assert ("| 0 | 1: 88.3% (hybrid, CPU share 1.00; loop's rate), 4: 74.9% (cpu, read-ahead, workers at nice 10, 1 "
            "core(s) kept per rank; median of 2 runs: 74.9%, 82.5%; loop's rate) |") in lines["NVIDIA H200 infer"]
    assert "92.2%" not in fed.split("Left out")[0]
    graph = lines["NVIDIA H200 (model as a CUDA graph) infer"]
    assert ("| 1 | 1: 98.1% (cpu; loop's rate), 4: 58.0% (hybrid, read-ahead, CPU share 0.60, paced to its GPU; loop's "
            "rate) |") in graph
    assert ("local feeds **0** NVIDIA H200s running inference of resnet50, measured with 1, 4 GPUs; local feeds **1** "
            "NVIDIA H200 (model as a CUDA graph) running inference of resnet50") in fed
    # Training, paced by default (three runs) beside no limit (three runs): the paced runs' median.
    assert ("| 0 | 4: 83.0% (hybrid, read-ahead, CPU share 0.75, paced to its GPU; median of 3 runs: 61.6%, 83.0%, "
            "88.3%; loop's rate) |") in fed


def test_gpus_fed_four_ranks_inference_from_stored_small_records(tmp_path):
    """Session 12 on four H200s (results/gpu-ranks-h200x4.jsonl): inference from records stored small fed every
    rank (--resize 160 --quality 75: 2 runs; the 224 centre crop at quality 75: 5 runs, 0.923 to 0.998): the
    answer says the disk feeds 4 and names the recipe; training at ~0.90 feeds none: the disk read past the ceiling
    measured at a record per worker, yet the loop waited 1% and the steps took the rest, and the row says all of it."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h200x4.jsonl")
    rows = [r for r in load_results(path) if "session 12," in str(r.get("call"))]
    fed = report.render_markdown(report.build_report(rows), str(tmp_path / "r"), "r").split("## The answer")[1]
    assert ("local feeds **4** NVIDIA H200s running inference of resnet50 (from recordio (--resize 160 --quality 75)), "
            "measured with 1, 4 GPUs") in fed
    assert "| 4 | 4: 99.7% (cpu, read-ahead; median of 5 runs: 92.3% to 99.8%; loop's rate) |" in fed
    assert ("| resnet50 | train | NVIDIA H200 | local | tfrecord | 0 | 4: 88.8% (hybrid, read-ahead, CPU share 0.75, paced "
            "to its GPU; loop's rate) | disk: 1.62 of 1.43 GB/s (more "
            "than the ceiling measured at qd60: the loader kept more reads in flight, so the disk may read faster "
            "still); yet the batches came in time (the loop waited for them 1% of its time, and each step took 63.5 "
            "ms") in fed


def test_gpus_fed_names_each_counts_configuration(tmp_path):
    """Four H200s (results/gpu-ranks-h200x4.jsonl, sessions up to 14): each count names the loader settings of the
    configuration that gave it, and whether its figure is what the workers made (session 14 on) or the loop's
    rate. Session 13's 2 and 3 ranks from the CPU workers alone (0.972-1.001, the loop's rate) give way to session
    14's counted runs: 2 ranks 0.967, 3 ranks 0.721 at best, so the disk feeds 2 from recordio, and the 3 ranks'
    limit says the workers fell behind, never that the batches came in time."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h200x4.jsonl")
    rows = [r for r in load_results(path) if not any(s in str(r.get("call")) for s in ("session 16", "session 17", "session 18"))]
    fed = report.render_markdown(report.build_report(rows), str(tmp_path / "r"), "r")
    fed = fed.split("## The answer")[1]
    line = next(row for row in fed.splitlines() if row.startswith("| resnet50 | train | NVIDIA H200 | local | recordio |"))
    assert line.startswith("| resnet50 | train | NVIDIA H200 | local | recordio | 2 | 1: 99.0% (cpu; loop's rate), 2: 96.7% "
                           "(cpu, read-ahead), 3: 72.1% (hybrid, read-ahead, CPU share 0.75), 4: 92.3% (hybrid, "
                           "read-ahead, CPU share 0.75; median of 3 runs: 91.0%, 92.3%, 92.8%; loop's rate) | the workers "
                           "made 3,291 img/s over the timed steps and the loop took 3,396, the rest from batches made "
                           "before them; no resource at 90% of its ceiling")
    assert "local feeds **2** NVIDIA H200s training resnet50 (from recordio)" in fed


def test_four_h200s_counted_three_ranks_from_the_cpu_workers_decoding_boxes_alone(tmp_path):
    """Four H200s (results/gpu-ranks-h200x4.jsonl, sessions up to 16): session 16's counted runs replace the loop's
    rates for 3 and 4 ranks. Three ranks from the CPU workers decoding boxes alone fed 0.897 (hybrid 0.777, the
    engines 0.645 on the same host), the disk reading 1.55 of its 1.72 GB/s, which the row names; four ranks'
    best counted run is 0.634 (12 workers a rank, asked; the default 15 gave 0.611), so the disk still feeds 2 from
    recordio."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h200x4.jsonl")
    rows = [r for r in load_results(path) if not any(s in str(r.get("call")) for s in ("session 17", "session 18"))]
    fed = report.render_markdown(report.build_report(rows), str(tmp_path / "r"), "r")
    fed = fed.split("## The answer")[1]
    assert ("| resnet50 | train | NVIDIA H200 | local | recordio | 2 | 1: 99.0% (cpu; loop's rate), 2: 96.7% (cpu, "
            "read-ahead), 3: 89.7% (cpu, read-ahead, region decode), 4: 63.4% (cpu, read-ahead, region decode, 12 "
            "workers) | disk: 1.55 of 1.72 GB/s |") in fed
    # Each count's configuration names workers other than the default (15 a rank for 4 ranks on 64 cores).
    assert "| train | 3 | recordio | local | cold | cpu, read-ahead, region decode, 12 workers | 3,860 / " in fed
    assert "| train | 3 | recordio | local | cold | cpu, read-ahead, region decode | " in fed  # the default 20
    assert "local feeds **2** NVIDIA H200s training resnet50 (from recordio)" in fed
    assert "| tfrecord | 0 | 3: 81.5% (cpu, read-ahead, region decode), 4: 88.9% (hybrid" in fed


def test_four_h200s_three_ranks_fed_by_default_and_four_short_of_the_disk(tmp_path):
    """Four H200s (results/gpu-ranks-h200x4.jsonl, sessions up to 17): session 17's counted run of 3 ranks by default
    (the CPU path, 20 workers, boxes alone) fed 0.937 a rank, so the disk feeds 3 from recordio; lmdb's one
    uncounted 4-rank run (0.928, the loop's rate) does not make it 4, since lmdb missed with 3 (0.850). The 4 ranks'
    best counted run (28 workers a rank, asked) says the disk at 1.87 of its 1.94 GB/s, and that at that ceiling
    no loader could feed the 4 ranks at 90%."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h200x4.jsonl")
    rows = [r for r in load_results(path) if "session 18" not in str(r.get("call"))]
    fed = report.render_markdown(report.build_report(rows), str(tmp_path / "r"), "r")
    fed = fed.split("## The answer")[1]
    assert "local feeds **3** NVIDIA H200s training resnet50 (from recordio), measured with 1, 2, 3, 4 GPUs;" in fed
    assert ("| recordio | 3 | 1: 99.0% (cpu; loop's rate), 2: 96.7% (cpu, read-ahead), 3: 93.7% (cpu, read-ahead, "
            "region decode), 4: 75.5% (cpu, read-ahead, region decode, 28 workers) | disk: 1.87 of 1.94 GB/s (the "
            "workers made 3,443 img/s over the timed steps and the loop took 4,555, the rest from batches made before "
            "them); even read at its ceiling (1.94 GB/s) the disk feeds each of 4 ranks at most 89.8% AU: 4 x 4,560 "
            "img/s of 118 KB records need 2.15 GB/s; records of 106 KB or less would need no more than its ceiling "
            "(`gpufeed convert ... --resize 256` stores each photo's shorter side at 256) |") in fed
    assert "| lmdb | 0 | 3: 85.0% (cpu, read-ahead, region decode), 4: 92.8% (hybrid" in fed


def test_a_tier_feeds_what_one_format_fed_at_every_count_up_to_it():
    """The tier's answer comes from one format's counts, filled where it was not measured by the format of the same
    stored records that did best there: a format measured with 4 GPUs only does not feed 4 where 3 missed, nor one
    that missed with 3. Records stored at another size are judged apart: their counts fill none of the others'."""
    from gpufeed.bench.report_analysis import _tier_fed

    (most, counts), = _tier_fed({"recordio": {1: 0.99, 2: 0.967, 3: 0.937, 4: 0.755}, "lmdb": {3: 0.85, 4: 0.928}})
    assert most == 3 and counts == {1: (0.99, "recordio"), 2: (0.967, "recordio"), 3: (0.937, "recordio"),
                                    4: (0.755, "recordio")}
    assert _tier_fed({"recordio": {1: 0.99, 2: 0.92, 3: 0.88, 4: 0.923}, "lmdb": {4: 0.928}})[0][0] == 2
    assert _tier_fed({"recordio": {1: 0.99, 2: 0.8}, "lmdb": {2: 0.95}}) == [(2, {1: (0.99, "recordio"),
                                                                                  2: (0.95, "lmdb")})]
    assert _tier_fed({"tfrecord": {2: 0.5}})[0][0] == 0
    # Two formats of records stored at 256 measured with 4 only, both fed: that stored size feeds 4, named by the
    # format that fed better there; the captured records' answer stays their own (3).
    rows = {"recordio": {1: 0.99, 2: 0.967, 3: 0.937, 4: 0.755}, "lmdb (--resize 256)": {4: 0.979},
            "recordio (--resize 256)": {4: 0.999}}
    recipes = {"recordio": "", "lmdb (--resize 256)": "--resize 256", "recordio (--resize 256)": "--resize 256"}
    assert _tier_fed(rows, recipes) == [(4, {4: (0.999, "recordio (--resize 256)")}),
                                        (3, {1: (0.99, "recordio"), 2: (0.967, "recordio"), 3: (0.937, "recordio"),
                                             4: (0.755, "recordio")})]
    # Inference ranks fed from small records with 1 and 4 GPUs: 2 ranks that missed from the captured photos do not
    # hold them back.
    rows = {"recordio": {1: 0.414, 2: 0.357}, "recordio (--resize 160)": {1: 0.999, 4: 0.998}}
    assert [most for most, _ in _tier_fed(rows, {"recordio (--resize 160)": "--resize 160"})] == [4, 0]


def test_four_h200s_fed_from_records_stored_at_256(tmp_path):
    """Four H200s (results/gpu-ranks-h200x4.jsonl, every session): session 18's 4 ranks by default (the CPU workers,
    15 a rank, boxes alone) from records stored at 256 (52 KB) fed every rank 0.98-1.00 from each format, where the
    captured 118 KB records fed 0.698 on the same host with the disk 100% busy. The disk then feeds 4 from records
    stored at 256 and 3 from the captured ones, each said, and the captured rows say what size would fit the disk."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h200x4.jsonl")
    fed = report.render_markdown(report.build_report(load_results(path)), str(tmp_path / "r"), "r")
    fed = fed.split("## The answer")[1]
    assert ("local feeds **4** NVIDIA H200s training resnet50 (from recordio (--resize 256)), measured with 4 GPUs "
            "(as captured: 3 from recordio, measured with 1, 2, 3, 4 GPUs);") in fed
    # Inference: 4 ranks fed from records stored at 160 px, q75 (session 12), whatever 2 ranks from the captured
    # photos missed by.
    assert ("local feeds **4** NVIDIA H200s running inference of resnet50 (from recordio (--resize 160 --quality 75)), "
            "measured with 1, 4 GPUs (as captured: 0, measured with 1, 2 GPUs;") in fed
    for fmt, au in (("recordio", "99.9"), ("lmdb", "97.9"), ("tfrecord", "99.8")):
        assert f"| local | {fmt} (--resize 256) | 4 | 4: {au}% (cpu, read-ahead, region decode) | - |" in fed
    assert ("the loader itself limits this run: its reads kept the disk busy 100% of the time below the ceiling "
            "measured at qd256: they came fewer at once or smaller than that measurement's") in fed


def test_two_h200s_fed_from_the_cpu_workers_decoding_boxes_alone(tmp_path):
    """Two H200s on 32 cores (results/gpu-ranks-h200x2.jsonl, every session): since session 15 the default sends
    both ranks' training to the CPU workers, which decode each crop's box alone; the answer for recordio is then 2
    GPUs, each count's figure naming that setting, and two runs of one configuration count at the lower. Session 19
    measured the default again, further from the start (40 + 120 steps against 10 + 38), its row the best
    configuration; with it lmdb and tfrecord fed both ranks too (their one-GPU rows are older ones, from hw)."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-ranks-h200x2.jsonl")
    rows = load_results(path)
    fed = report.render_markdown(report.build_report(
        [r for r in rows if "session 19" not in r.get("call", "")]), str(tmp_path / "r"), "r").split("## The answer")[1]
    assert ("| resnet50 | train | NVIDIA H200 | local | recordio | 2 | 1: 100.1% (cpu, region decode), 2: 98.3% (cpu, "
            "read-ahead, region decode; median of 2 runs: 98.3%, 100.1%) | - |") in fed
    assert "local feeds **2** NVIDIA H200s training resnet50" in fed
    fed = report.render_markdown(report.build_report(rows), str(tmp_path / "s"), "s").split("## The answer")[1]
    assert ("| resnet50 | train | NVIDIA H200 | local | recordio | 2 | 1: 100.1% (cpu, region decode), 2: 99.9% (cpu, "
            "read-ahead, region decode) | - |") in fed
    for fmt, au in (("lmdb", "100.0"), ("tfrecord", "100.1")):
        assert f"2: {au}% (cpu, read-ahead, region decode) | - |" in fed.split(f"| local | {fmt} |")[1].split("\n")[0]
    assert "local feeds **2** NVIDIA H200s training resnet50 (from recordio)" in fed


def test_a_missing_results_file_is_named_with_a_command_that_writes_it(tmp_path, capsys):
    """The path in the advice is quoted, so the command pastes into a shell as it is."""
    missing = str(tmp_path / "my results.jsonl")
    assert main(["report", missing, "-o", str(tmp_path / "r.md")]) == 2
    assert (f"{missing}: results file not found; write one with `gpufeed bench ... --results '{missing}'`"
            in capsys.readouterr().err)
