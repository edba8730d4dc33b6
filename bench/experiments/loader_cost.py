"""``python -m gpufeed.bench.experiments.loader_cost DST``: what the loader's CPU path costs per image beyond its
decode, side by side in one run: the CPU time per image of :class:`~gpufeed.pipelines.batches_cpu.CpuDecode`
alone over the dataset's records held in memory (what ``bench train``'s CPU decode ceiling measures), and of the
whole loader (``decode="cpu"`` on the CPU device: its workers reading the records, decoding, cropping and making
each batch, and its own process taking the batches) over the same dataset, the two alternated ``--rounds`` times.

The difference is the loader's own work per image (reading, the batch's assembly, handing it over), which the
cores spend beside the decoding: on 4 H200s feeding inference, 71-86% of 64 vCPUs were busy for 0.9-1.6 vCPU-ms
an image where the decode alone measured 0.55 (results/gpu-ranks-h200x4.txt, session 11). One JSON line per
round: ``decode_ms`` and ``loader_ms`` (CPU ms per image; ``workers_ms`` and ``main_ms`` its two parts), their
``ratio``, and the loader's images per second.

``--blocks``: instead, where the batches are made, alternated: each in a new block of shared memory (``fresh``),
or in a block of the worker's pool used again once the loop's process has copied the batch out (``pooled``,
:class:`~gpufeed.pipelines.batches_cpu.BatchPool`), the loop copying every batch out as the DataLoader's
pin-memory step does for a GPU (here into ordinary memory: this machine has none). One JSON line per round and
way: ``workers_ms`` and ``main_ms``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time


def _decode_alone(samples: list, train: bool, size: int, images: int) -> float:
    """CPU seconds per image of CpuDecode over ``samples`` in turn (each time another index: another crop)."""
    from gpufeed.pipelines.batches_cpu import CpuDecode

    decode = CpuDecode(train, size)
    decode(samples[0])  # imports and first-call costs before the clock
    t0 = time.process_time()
    for n in range(images):
        decode(dataclasses.replace(samples[n % len(samples)], index=n))
    return (time.process_time() - t0) / images


def _per_image(batches, images: int, take=lambda batch: batch) -> dict:
    """CPU seconds per image of the processes under this one (the DataLoader's workers) and of this one, and
    images per second, over ``images`` images of ``batches`` (an iterable of ``(x, y)`` batches, taken anew at
    each epoch's end) after one batch, which starts the workers; ``take(batch)`` is the loop's own work on each."""
    from gpufeed.bench.results import cpu_seconds

    it = iter(batches)
    take(next(it))
    seen = 0
    w0, m0, t0 = cpu_seconds(own=False), time.process_time(), time.perf_counter()
    while seen < images:
        try:
            x, _ = take(next(it))
        except StopIteration:  # the next epoch's batches: the workers flow on into it
            it = iter(batches)
            continue
        seen += len(x)
    wall = time.perf_counter() - t0
    workers_s, main_s = cpu_seconds(own=False) - w0, time.process_time() - m0
    return {"workers_ms": workers_s / seen * 1e3, "main_ms": main_s / seen * 1e3, "img_per_s": seen / wall,
            "images": seen}


def _through_loader(paths: list[str], fmt: str, train: bool, size: int, batch: int, workers: int,
                    images: int) -> dict:
    """:func:`_per_image` of the loader's CPU path."""
    from gpufeed.pipelines.loader import Loader

    loader = Loader(paths, format=fmt, batch_size=batch, decode="cpu", augment="train" if train else "eval",
                    size=size, workers=workers, device="cpu")
    try:
        return _per_image(loader, images)
    finally:
        loader.close()


def _in_blocks(paths: list[str], fmt: str, train: bool, size: int, batch: int, workers: int, images: int,
               pooled: bool) -> dict:
    """:func:`_per_image` of DataLoader workers making CPU-path batches (the loader's CpuBatch) in new blocks or
    pooled ones, this process copying each out as the pin step does (a pooled batch's copy frees its block)."""
    import torch

    from gpufeed.formats.torch import MapDataset
    from gpufeed.pipelines.batches_cpu import BatchPool, CpuBatch, CpuDecode, PooledBatch, as_made

    data = MapDataset(fmt, paths, batch_transform=CpuBatch(CpuDecode(train, size), BatchPool() if pooled else None))
    data.close()
    made = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, num_workers=workers,
                                       collate_fn=as_made, persistent_workers=True, prefetch_factor=2)

    def copied(b):
        return b.copied(torch.clone) if isinstance(b, PooledBatch) else tuple(t.clone() for t in b)

    got = _per_image(made, images, copied)
    del made
    return got


def run_blocks(dst: str, augment: str = "eval", size: int = 224, batch: int = 256, workers: int = 1,
               images: int = 2048, rounds: int = 3, emit=print) -> list[dict]:
    """``--blocks``: per round, the batches made in new blocks, then in pooled ones."""
    from gpufeed.bench.dataset import load_dataset_info

    fmt, built = next(iter(load_dataset_info(dst)["formats"].items()))
    rows = []
    for i in range(rounds):
        for way in ("fresh", "pooled"):
            got = _in_blocks(built["paths"], fmt, augment == "train", size, batch, workers, images, way == "pooled")
            row = {"bench": "loader-cost-blocks", "round": i, "way": way, "format": fmt, "augment": augment,
                   "size": size, "batch": batch, "workers": workers, "images": got["images"],
                   "workers_ms": round(got["workers_ms"], 4), "main_ms": round(got["main_ms"], 4)}
            rows.append(row)
            emit(json.dumps(row))
    return rows


def run(dst: str, augment: str = "eval", size: int = 224, batch: int = 256, workers: int = 1,
        images: int = 2048, rounds: int = 3, emit=print) -> list[dict]:
    from gpufeed.bench.cpuceiling import _read_samples
    from gpufeed.bench.dataset import load_dataset_info

    fmt, built = next(iter(load_dataset_info(dst)["formats"].items()))
    paths = built["paths"]
    samples = _read_samples(fmt, paths[0], 64)
    train = augment == "train"
    rows = []
    for i in range(rounds):
        alone = _decode_alone(samples, train, size, images) * 1e3
        through = _through_loader(paths, fmt, train, size, batch, workers, images)
        loader_ms = through["workers_ms"] + through["main_ms"]
        row = {"bench": "loader-cost", "round": i, "format": fmt, "augment": augment, "size": size, "batch": batch,
               "workers": workers, "images": through["images"], "decode_ms": round(alone, 4),
               "loader_ms": round(loader_ms, 4), "workers_ms": round(through["workers_ms"], 4),
               "main_ms": round(through["main_ms"], 4), "ratio": round(loader_ms / alone, 3),
               "img_per_s": round(through["img_per_s"], 1)}
        rows.append(row)
        emit(json.dumps(row))
    return rows


def main(argv=None) -> int:
    from gpufeed.bench.experiments import dataset_parser

    p = dataset_parser("gpufeed.bench.experiments.loader_cost", __doc__)
    p.add_argument("--augment", choices=("eval", "train"), default="eval")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--images", type=int, default=2048, help="images timed per round and side")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", action="store_true",
                   help="batches made in new shared-memory blocks against pooled ones, copied out as pinning does")
    args = p.parse_args(argv)
    (run_blocks if args.blocks else run)(args.dst, args.augment, args.size, args.batch, args.workers, args.images,
                                         args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
