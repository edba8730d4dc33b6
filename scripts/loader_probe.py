"""Where gpufeed.loader's GPU paths spend their time, without the model (warm page cache).

For one dataset and format, prints a JSON line per stage, each a ceiling the full loop cannot beat:
  bytes        the DataLoader workers alone: records read and packed into batches (no decode);
  hw-N         gpufeed.loader(decode="hw") with N decoder threads: batches decoded and cropped on the GPU;
  hw-N-si      the same with the interpreter's thread switch interval at 1 ms instead of 5 ms;
  hw-2-maincrops  hw-2 with every crop drawn in this process instead of in the DataLoader workers;
  cpu-*        the CPU path's workers decoding and cropping into pinned batches (no copy to the GPU):
               cpu-full-cvpool decodes every JPEG in full with OpenCV's default thread pool in each worker (the
               loader before DCT-reduced decoding and one OpenCV thread per worker), cpu-full with one thread per
               worker, cpu the loader's own path (DCT-reduced where the crop allows, one thread per worker).

    python3 scripts/loader_probe.py DATASET --format tfrecord --augment eval --batches 40 --results OUT.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time


def timed(it, batches: int, sync) -> float:
    next(it)  # workers started, decoders made
    sync()
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    sync()
    return time.perf_counter() - t0


def _without_crops(batch):
    """The workers' batch without the crops they drew (hw-2-maincrops)."""
    from gpufeed.pipelines.batches_cpu import collate_encoded

    return collate_encoded(batch)[:4]


def main(argv=None) -> int:
    import torch

    from gpufeed.bench.dataset import load_dataset_info
    from gpufeed.bench.results import append_rows
    from gpufeed.formats.torch import MapDataset
    from gpufeed.pipelines.loader import Loader
    from gpufeed.pipelines.batches_cpu import EncodedBytes, collate_encoded

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dst")
    p.add_argument("--format", default="tfrecord")
    p.add_argument("--augment", default="eval", choices=("train", "eval"))
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--threads", default="1,2,3")
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    info = load_dataset_info(args.dst)
    paths = info["formats"][args.format]["paths"]
    sync = torch.cuda.synchronize
    rows = []

    def row(stage: str, seconds: float, **extra):
        n = args.batches * args.batch_size
        r = {"bench": "loader-probe", "stage": stage, "format": args.format, "augment": args.augment,
             "store": info.get("store"), "record_bytes": round(info["formats"][args.format]["record_bytes"]),
             "images": n, "seconds": round(seconds, 3), "images_per_s": round(n / seconds, 1), **extra}
        rows.append(r)
        print(json.dumps(r), flush=True)

    # The GPU crop against the CPU path's on real records (the unit test needs torchvision, CI lacks it).
    import numpy as np

    from gpufeed.formats import get_format
    from gpufeed.pipelines.batches_cpu import CpuDecode
    from gpufeed.pipelines.batches_gpu import GpuCrop
    from gpufeed.pipelines.transforms import decode_image

    reader = get_format(args.format).reader(paths[0])
    samples = [reader[i] for i in range(16)]
    for train in (True, False):
        images = [torch.from_numpy(decode_image(s.payload, s.key)).cuda().permute(2, 0, 1) for s in samples]
        got = GpuCrop(torch.device("cuda"), train, 224, seed=3).crop(images, [s.index for s in samples]).cpu()
        crops = collate_encoded([EncodedBytes(train, 3)(s) for s in samples])[4]
        drawn = GpuCrop(torch.device("cuda"), train, 224, seed=3).crop(images, [s.index for s in samples], crops)
        assert torch.equal(drawn.cpu(), got), "crops drawn in the workers differ from the main process's"
        want = np.stack([CpuDecode(train, 224, seed=3).pixels(s) for s in samples])
        diff = np.abs(got.numpy().astype(int) - want.astype(int)).mean(axis=(1, 2, 3))
        r = {"bench": "loader-probe", "stage": "crop-check", "train": train, "max_mean_abs_diff": round(float(diff.max()), 2)}
        rows.append(r)
        print(json.dumps(r), flush=True)

    ds = MapDataset(args.format, paths, transform=EncodedBytes())
    ds.close()
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                     collate_fn=collate_encoded, drop_last=True, persistent_workers=True,
                                     multiprocessing_context="forkserver")
    row("bytes", timed(iter(dl), args.batches, lambda: None))
    del dl

    from gpufeed.pipelines.loader import one_thread_per_worker, opencv_threads

    train = args.augment == "train"
    for stage, transform, init in (("cpu-full-cvpool", CpuDecode(train, 224, reduce=False), None),
                                   ("cpu-full", CpuDecode(train, 224, reduce=False), one_thread_per_worker),
                                   ("cpu", CpuDecode(train, 224), one_thread_per_worker)):
        ds = MapDataset(args.format, paths, transform=transform)
        ds.close()
        dl = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                         drop_last=True, persistent_workers=True, pin_memory=True,
                                         worker_init_fn=init, multiprocessing_context="fork")
        with opencv_threads(1) if init else contextlib.nullcontext():
            it = iter(dl)
        row(stage, timed(it, args.batches, lambda: None), workers=args.workers)
        del dl

    for threads in [int(t) for t in args.threads.split(",") if t]:
        for si, main_crops in ((None, False), (0.001, False), (None, True)):
            if (si is not None or main_crops) and threads != 2:
                continue
            old = sys.getswitchinterval()
            if si is not None:
                sys.setswitchinterval(si)
            ld = Loader(paths, format=args.format, batch_size=args.batch_size, decode="hw", augment=args.augment,
                        workers=args.workers, decode_threads=threads)
            if main_crops:
                ld._collate = _without_crops  # the decoders draw every crop in this process, as before
            seconds = timed(iter(ld), args.batches, sync)
            fallbacks = sum(d.fallbacks for d in ld._gpu_decoders())
            ld.close()
            sys.setswitchinterval(old)
            row(f"hw-{threads}" + ("-si" if si else "") + ("-maincrops" if main_crops else ""), seconds,
                fallbacks=fallbacks)
    append_rows(args.results, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
