"""``python -m gpufeed.bench.experiments.epoch_edge DST``: what the loop waits for at each epoch's first batch,
side by side in one run: epochs taken one after another (the loader's DataLoader stream flows on across each
epoch's end, its workers already on the next epoch's batches), and epochs that start the stream afresh
(``set_epoch`` to another epoch than the next: the DataLoader's iterator is reset and its prefetch drains, as
every epoch did before the stream spanned them).

The loop sleeps ``--step-ms`` per batch in place of a model's step (longer than the workers take for a batch:
a fed loop, where the batches wait in the queue). One JSON line per way: ``first_batch_wait_ms`` of each epoch
after the first, and the median wait of every other batch. Small datasets (CIFAR, or any dataset over many
ranks) start an epoch every few dozen batches: a restart there costs the loop one batch's making each time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def run(dst: str, epochs: int = 4, batch: int = 32, workers: int = 2, step_ms: float = 90.0,
        emit=print) -> list[dict]:
    """One row per way (``flow``: epochs 0, 1, 2, ...; ``restart``: epochs 0, 2, 4, ...)."""
    from gpufeed.bench.dataset import load_dataset_info
    from gpufeed.pipelines.loader import Loader

    fmt, built = next(iter(load_dataset_info(dst)["formats"].items()))
    rows = []
    for way, stride in (("flow", 1), ("restart", 2)):
        loader = Loader(built["paths"], format=fmt, batch_size=batch, workers=workers, device="cpu")
        firsts, others = [], []
        try:
            for e in range(epochs):
                loader.set_epoch(e * stride)
                it, i = iter(loader), 0
                while True:
                    t0 = time.perf_counter()
                    try:
                        next(it)
                    except StopIteration:
                        break
                    (firsts if i == 0 else others).append((time.perf_counter() - t0) * 1e3)
                    i += 1
                    time.sleep(step_ms / 1e3)
        finally:
            loader.close()
        row = {"bench": "epoch-edge", "way": way, "format": fmt, "batch": batch, "workers": workers,
               "batches_per_epoch": len(loader), "step_ms": step_ms,
               "first_batch_wait_ms": [round(v, 1) for v in firsts[1:]],
               "other_wait_median_ms": round(statistics.median(others), 1) if others else None}
        rows.append(row)
        emit(json.dumps(row))
    return rows


def main(argv=None) -> int:
    from gpufeed.bench.experiments import dataset_parser

    p = dataset_parser("gpufeed.bench.experiments.epoch_edge", __doc__)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=90.0, help="the loop's sleep per batch, in place of a model")
    args = p.parse_args(argv)
    run(args.dst, args.epochs, args.batch, args.workers, args.step_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
