"""``python -m gpufeed.bench.experiments.decode_rates DST``: JPEG decode rates side by side, in one run, on one GPU machine.

The same records (the first ``--images`` of a benchmark dataset's RecordIO, as stored) decoded by:

* one CPU core (OpenCV, full decode, as :func:`gpufeed.pipelines.transforms.decode_image`),
* nvJPEG on the SMs (``torchvision.io.decode_jpeg(device="cuda")``, batches of ``--batch``),
* the JPEG engines through nvImageCodec (``HW_GPU_ONLY``, the ``hw`` path of :mod:`gpufeed.pipelines.loader`),
* the ``hw`` path's whole evaluation step (decode, centre crop, resize to 224), decoding each image whole and
  decoding only its centre box (region-of-interest decoding, which the loader leaves off: the engines
  refused it on the H200, and the CUDA decoder that took over was 2.2x slower than the engines on whole images),

each timed to the end of its work on the GPU (stream synchronised), after one warm-up batch. It also checks
that the engines' pixels match the CPU's (mean absolute difference, 0-255 scale) so a fast path that
decodes wrongly cannot pass. Prints one JSON line per decoder and appends them to ``--results``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _records(dst: str, n: int) -> list[bytes]:
    from gpufeed.bench.dataset import load_dataset_info
    from gpufeed.formats import get_format

    fmt, built = next(iter(load_dataset_info(dst)["formats"].items()))  # any format: the records are the same
    reader = get_format(fmt).reader(built["paths"][0])
    return [bytes(reader[i].payload) for i in range(min(n, len(reader)))]


class _Record:
    """What :class:`gpufeed.pipelines.batches_cpu.EncodedBytes` reads of a sample."""

    def __init__(self, payload: bytes, index: int):
        self.payload, self.index, self.labels, self.key = payload, index, (0,), f"record {index}"


def _timed(fn, batches, sync) -> float:
    fn(batches[0])
    sync()
    t0 = time.perf_counter()
    for b in batches:
        fn(b)
    sync()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    import torch

    from gpufeed.bench.results import append_rows
    from gpufeed.pipelines.batches_cpu import CROP_COLUMNS, EncodedBytes, collate_encoded
    from gpufeed.pipelines.batches_gpu import HwJpegDecoder, NvJpegDecoder
    from gpufeed.pipelines.transforms import decode_image

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dst", help="benchmark dataset (gpufeed bench dataset DST)")
    p.add_argument("--images", type=int, default=2048, help="records decoded by each GPU path")
    p.add_argument("--cpu-images", type=int, default=200, help="records decoded by the one CPU core")
    p.add_argument("--batch", type=int, default=256, help="images per GPU decode call")
    p.add_argument("--results", default=None, help="JSON-lines file to append the rows to")
    args = p.parse_args(argv)

    datas = _records(args.dst, args.images)
    mean_kib = sum(map(len, datas)) / len(datas) / 1024
    device = torch.device("cuda")
    batches = [collate_encoded([(d, 0, 0, (0,) * CROP_COLUMNS) for d in datas[k:k + args.batch]])[:2]
               for k in range(0, len(datas), args.batch)]
    rows = []

    def row(decoder: str, images: int, seconds: float, **extra):
        r = {"bench": "decode", "decoder": decoder, "images": images, "seconds": round(seconds, 4),
             "images_per_s": round(images / seconds, 1), "mean_kib": round(mean_kib, 1),
             "gpu": torch.cuda.get_device_name(device), **extra}
        rows.append(r)
        print(json.dumps(r), flush=True)

    cpu = datas[:args.cpu_images]
    t0 = time.perf_counter()
    for i, d in enumerate(cpu):
        decode_image(d, f"record {i}")
    row("cpu-1-core", len(cpu), time.perf_counter() - t0)

    sync = torch.cuda.synchronize
    nv = NvJpegDecoder(device, train=False)
    row("nvjpeg-sm", len(datas), _timed(lambda b: nv.images(*b), batches, sync), batch=args.batch)
    hw = HwJpegDecoder(device, train=False)
    seconds = _timed(lambda b: hw.images(*b), batches, sync)
    # The engines' pixels against the CPU's, on the first images (JPEG decoders may differ by rounding).
    got = hw.images(*collate_encoded([(d, 0, 0, (0,) * CROP_COLUMNS) for d in cpu[:32]])[:2])
    diffs = [float(np.abs(g.permute(1, 2, 0).cpu().numpy().astype(int) - decode_image(d, "x").astype(int)).mean())
             for g, d in zip(got, cpu[:32])]
    row("hw-engines", len(datas), seconds, batch=args.batch, fallbacks=hw.fallbacks,
        max_mean_abs_diff_vs_cpu=round(max(diffs), 3))
    # The evaluation step, whole images against centre boxes only, each with its crop drawn from the header.
    encoded = [EncodedBytes(train=False)(_Record(d, i)) for i, d in enumerate(datas)]
    steps = [collate_encoded(encoded[k:k + args.batch]) for k in range(0, len(encoded), args.batch)]
    outs = {}
    for roi in (False, True):
        path = HwJpegDecoder(device, train=False)
        path.roi = roi
        seconds = _timed(lambda b: path.decoded(b[0], b[1], b[3], b[4]), steps, sync)
        outs[roi] = path.decoded(*(steps[0][i] for i in (0, 1, 3, 4)))
        row("hw-eval-path-roi" if roi else "hw-eval-path", len(datas), seconds, batch=args.batch,
            fallbacks=path.fallbacks)
    rows[-1]["mean_abs_diff_vs_whole"] = round(float((outs[True].int() - outs[False].int()).abs().float().mean()), 3)
    append_rows(args.results, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
