"""Does ``gpufeed convert`` reach the per-core limit, and does it scale? Ratios measured side by side.

On one ImageNet-like corpus (:func:`gpufeed.bench.experiments.transform_speed.make_corpus`: photo-like JPEGs, 90%
~500x375, 10% 1600x1200) written as an image folder, each repeat runs, interleaved so machine drift hits
all alike:

* ``limit``: the per-core limit loop (:func:`gpufeed.bench.experiments.transform_speed.loop_limit`, decode with DCT
  downscale -> resize shorter side 256 -> JPEG q95, no I/O) in this process, one core;
* ``convert w1`` / ``convert w2``: the real conversion (resize 256, q95, TFRecord) with 1 and 2 Ray workers,
  wall clock of :func:`gpufeed.convert.engine.convert` from listing to manifest, on one local Ray runtime
  started once (its start-up is not counted); for one worker also images per CPU-second of every process
  involved (driver, raylet, GCS, workers), against the limit loop's images per CPU-second: on a shared
  machine, CPU time stays comparable when wall time does not;
* ``pass-through`` vs ``copy``: ``--encode pass`` with 2 workers (with and without ``--no-validate``, the
  1/8-scale decode that keeps broken files out) against a plain copy of the same files, fsync'd;
* then ``1 node x 2 CPUs`` vs ``2 nodes x 1 CPU`` (``ray.cluster_utils.Cluster``, head without CPUs).

Targets (PERFORMANCE.md, issue 4): convert w1 >= 90% of limit; w2 >= 90% of 2 x w1; two nodes = one node;
pass-through bound by the disk (near the copy).

    python bench/experiments/convert_scaling.py --n 400 --repeats 3 [--out results/convert_scaling.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from gpufeed.bench.results import cpu_seconds
from gpufeed.bench.experiments.transform_speed import loop_limit, make_corpus
from gpufeed.convert.engine import convert
from gpufeed.convert.options import ConvertOptions
from gpufeed.pipelines.image_options import ImageOptions

CLASSES = 10
#: Shards per conversion: enough for two workers to share the work evenly, few enough that each shard's
#: fixed costs (opening writers, fsync, rename, journal) stay small, as with the default 1250 on ImageNet.
SHARDS = 8


def write_corpus(corpus, root: str) -> int:
    """The corpus as ``root/<class>/<n>.JPEG`` (the folder dataset); returns the bytes written."""
    total = 0
    for i, (data, _, _) in enumerate(corpus):
        d = os.path.join(root, f"class{i % CLASSES:02d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:06d}.JPEG"), "wb") as f:
            f.write(data)
        total += len(data)
    return total


def convert_rate(src: str, work: str, workers: int, **kw) -> tuple[float, float, float, float]:
    """``(images/s wall, images per CPU-second of all processes, MB/s written, images per CPU-second inside
    the shard tasks)`` of one conversion into a fresh directory."""
    out = tempfile.mkdtemp(dir=work)
    image = ImageOptions(encode=None, **{k: kw.pop(k) for k in ImageOptions.names() if k in kw})
    options = ConvertOptions(dataset="folder", src=src, formats=kw.pop("formats", ("tfrecord",)), out=out,
                             workers=workers, shards=SHARDS, progress=False, resume=False, image=image, **kw)
    c0, t0 = cpu_seconds(), time.perf_counter()
    summary = convert(options)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    shutil.rmtree(out)
    return (summary.written / wall, summary.written / cpu, summary.bytes_written / wall / 1e6,
            summary.written / summary.worker_cpu_seconds)


def copy_rate(src: str, work: str, nbytes: int) -> float:
    out = os.path.join(tempfile.mkdtemp(dir=work), "copy")
    t0 = time.perf_counter()
    shutil.copytree(src, out)
    for dirpath, _, names in os.walk(out):
        for n in names:
            with open(os.path.join(dirpath, n), "rb+") as f:
                os.fsync(f.fileno())
    wall = time.perf_counter() - t0
    shutil.rmtree(os.path.dirname(out))
    return nbytes / wall / 1e6


def median(values):
    return statistics.median(values), (max(values) - min(values)) / statistics.median(values)


def run(n: int, repeats: int, work: str) -> dict:
    import cv2
    import ray

    cv2.setNumThreads(1)
    corpus = make_corpus(n)
    src = os.path.join(work, "src")
    nbytes = write_corpus(corpus, src)
    rates = {k: [] for k in ("limit", "convert w1", "convert w2", "limit per CPU-s", "convert w1 per CPU-s",
                             "convert w1 per task CPU-s",
                             "pass-through MB/s", "pass-through unchecked MB/s", "copy MB/s")}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        convert_rate(src, work, 2)  # warm-up: worker processes, imports, page cache
        for _ in range(repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            loop_limit(corpus)
            rates["limit"].append(n / (time.perf_counter() - t0))
            rates["limit per CPU-s"].append(n / (time.process_time() - c0))
            wall, per_cpu, _, per_task_cpu = convert_rate(src, work, 1, resize=256)
            rates["convert w1"].append(wall)
            rates["convert w1 per CPU-s"].append(per_cpu)
            rates["convert w1 per task CPU-s"].append(per_task_cpu)
            rates["convert w2"].append(convert_rate(src, work, 2, resize=256)[0])
            rates["pass-through MB/s"].append(convert_rate(src, work, 2, encode="pass")[2])
            rates["pass-through unchecked MB/s"].append(convert_rate(src, work, 2, encode="pass", validate=False)[2])
            rates["copy MB/s"].append(copy_rate(src, work, nbytes))
    finally:
        ray.shutdown()
    for name, layout in (("1 node x 2 CPUs", [2]), ("2 nodes x 1 CPU", [1, 1])):
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 0})
        try:
            for cpus in layout:
                cluster.add_node(num_cpus=cpus)
            cluster.wait_for_nodes()
            convert_rate(src, work, 2, resize=256)
            rates[name] = [convert_rate(src, work, 2, resize=256)[0] for _ in range(repeats)]
        finally:
            ray.shutdown()
            cluster.shutdown()
    med = {k: median(v) for k, v in rates.items()}
    m = {k: v[0] for k, v in med.items()}
    ratios = {
        "convert w1 / limit, wall (target >= 0.90)": m["convert w1"] / m["limit"],
        "convert w1 / limit, per CPU-second, all processes": m["convert w1 per CPU-s"] / m["limit per CPU-s"],
        "convert w1 / limit, per CPU-second in the worker (target >= 0.90)":
            m["convert w1 per task CPU-s"] / m["limit per CPU-s"],
        "convert w2 / (2 x w1) (target >= 0.90)": m["convert w2"] / (2 * m["convert w1"]),
        "2 nodes / 1 node (target ~1.0)": m["2 nodes x 1 CPU"] / m["1 node x 2 CPUs"],
        "pass-through / copy (each image checked to decode)": m["pass-through MB/s"] / m["copy MB/s"],
        "pass-through --no-validate / copy (disk-bound: ~1.0)": m["pass-through unchecked MB/s"] / m["copy MB/s"],
    }
    return {"n": n, "repeats": repeats, "corpus_bytes": nbytes, "load_average": os.getloadavg(),
            "rates": {k: {"median": v[0], "spread": v[1]} for k, v in med.items()}, "ratios": ratios}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=400, help="images in the corpus")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpufeed-scaling-") as work:
        result = run(args.n, args.repeats, work)
    for name, r in result["rates"].items():
        unit = "" if "MB/s" in name else " img/s"
        print(f"{name:<22} {r['median']:8.1f}{unit}  (spread {r['spread']:.0%})")
    for name, v in result["ratios"].items():
        print(f"{name:<52} {v:.3f}")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in result['load_average'])} on {os.cpu_count()} cores")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
