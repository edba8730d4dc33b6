"""Per-image CPU cost of a conversion worker against the limit loop, per format, in one process.

The node-scale runs (bench/experiments/convert_node.py) see each format's worker-seconds but not where they go. This
converts one shard of ``--n`` ImageNet-like JPEGs (bench.transform_speed.make_corpus, warm page cache) with
``gpufeed.convert.worker.run_shard`` for each format alone and all three, alternating with the limit loop
(decode with DCT downscale, resize 256, JPEG q95, nothing written), and prints the CPU milliseconds per image
of each (best of ``--repeats``), the hash and CRC rates of this CPU, and a profile of the worker's own
Python-side work for the formats named by ``--profile``. One JSON line per measurement.

    python3 scripts/worker_cost.py --n 600 --repeats 3 --profile recordio,all
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import tempfile
import time

ALL = "lmdb,recordio,tfrecord"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default="recordio,tfrecord,lmdb,all")
    ap.add_argument("--profile", default="recordio,all")
    args = ap.parse_args()

    import cv2

    cv2.setNumThreads(1)
    from gpufeed.bench.experiments.transform_speed import limit_one, make_corpus
    from gpufeed.convert import worker
    from gpufeed.convert.options import ConvertOptions
    from gpufeed.pipelines.image_options import ImageOptions
    from gpufeed.convert.plan import ShardPlan
    from gpufeed.pipelines import open_source

    work = tempfile.mkdtemp(prefix="gpufeed-worker-cost-")
    src = os.path.join(work, "src", "n0001")
    os.makedirs(src)
    for i, (data, _, _) in enumerate(make_corpus(args.n, seed=7)):
        with open(os.path.join(src, f"{i:05d}.JPEG"), "wb") as f:
            f.write(data)
    paths = sorted(os.path.join(src, p) for p in os.listdir(src))
    source = open_source("folder", os.path.dirname(src))
    split = source.splits()[0]
    items = source.items(split)

    def limit():
        for p in paths:
            with open(p, "rb") as f:
                limit_one(f.read())

    def shard(formats: str):
        out = tempfile.mkdtemp(dir=work)
        opts = ConvertOptions(dataset="folder", src=os.path.dirname(src), out=out, formats=tuple(formats.split(",")),
                              image=ImageOptions(resize=256, encode=None))
        fmts = opts.output_formats()
        spool = os.path.join(out, "spool")
        os.makedirs(spool)
        for f in fmts:
            os.makedirs(os.path.join(out, f.name))
        job = worker.ShardJob(ShardPlan(split, 0, 1, 0, len(items)), out, tuple(fmts), opts.image_options(), "fail",
                              False, spool, encodes=tuple(opts.encode_for(f.name) for f in fmts), identify="stat")
        return lambda: worker.run_shard(job, items)

    def cpu_ms(fn) -> float:
        c = time.process_time()
        fn()
        return (time.process_time() - c) / args.n * 1e3

    names = args.formats.split(",")
    best = {name: float("inf") for name in ["limit", *names]}
    for _ in range(args.repeats):
        best["limit"] = min(best["limit"], cpu_ms(limit))
        for name in names:
            best[name] = min(best[name], cpu_ms(shard(ALL if name == "all" else name)))
    for name, ms in best.items():
        print(json.dumps({"run": name, "cpu_ms_per_image": round(ms, 3),
                          "limit_over_this": round(best["limit"] / ms, 3)}), flush=True)

    blob = os.urandom(1 << 20)
    import crc32c

    for what, fn in (("sha256", lambda: hashlib.sha256(blob).digest()), ("crc32c", lambda: crc32c.crc32c(blob))):
        t = time.perf_counter()
        for _ in range(200):
            fn()
        print(json.dumps({"run": what, "mb_per_second": round(200 * len(blob) / (time.perf_counter() - t) / 1e6)}))

    for name in filter(None, args.profile.split(",")):
        run = shard(ALL if name == "all" else name)
        prof = cProfile.Profile()
        prof.runcall(run)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(int(os.environ.get("PROFILE_ROWS", 14)))
        print(f"--- profile: {name} ({args.n} images)\n" + text.getvalue().split("\n\n", 1)[-1].strip(), flush=True)


if __name__ == "__main__":
    main()
