"""Per-core conversion speed: how close :func:`make_sample` gets to the best a tight loop can do.

Four loops (three with ``--no-pillow``) run over one in-memory corpus on one core (``cv2.setNumThreads(1)``),
each doing decode -> resize shorter side to 256 -> JPEG q95, no I/O, no framework:

* ``limit``: the per-core limit of PERFORMANCE.md: sizes known in advance, libjpeg DCT-domain downscale
  when the image is >= 2x the target, cv2 resize (SIMD), libjpeg-turbo encode;
* ``cv2``: plain OpenCV, full decode + resize + encode (what im2rec does);
* ``make_sample``: gpufeed's whole per-item path (header probe, bomb and truncation checks, EXIF, DCT
  downscale, encode, metadata) on ``InlineRef`` items;
* ``pillow``: Pillow with ``draft()`` (its DCT downscale) + bilinear resize + encode. Run this module
  under a Pillow-SIMD install to measure that (see docs/transforms.md).

Loops are interleaved within each repeat so machine drift hits all of them alike; rates use the
process's CPU time (robust when other jobs share the machine), wall-clock rates are recorded too.

    python -m gpufeed.bench.experiments.transform_speed --n 300 --repeats 5 --out results/transform_speed.jsonl
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np

from gpufeed.bench import MEMORY_TIER
from gpufeed.bench.results import ResultWriter, machine_info, stat, summarize
from gpufeed.pipelines.base import InlineRef, Item
from gpufeed.pipelines.transforms import ImageOptions, make_sample

TARGET = 256
QUALITY = 95
# ImageNet-like mix (PERFORMANCE.md): mostly 500x375 (a quarter portrait), 10% 1600x1200.
LARGE_SHARE = 0.10
SOURCE_QUALITY = 90
#: Size mixes of synthesised corpora, as ``(share, (height, width))``; 500x375 drawn a quarter of the time
#: portrait (375 wide). ``"default"``: the mix the figures in results/ were measured on (~193 KB a photo, its
#: 10% of 1600x1200 dominating the bytes); ``"imagenet"``: ILSVRC2012 train's mix (~110 KB mean, 500x375 and
#: 500x333 typical, a few percent large), for whole-ImageNet runs whose corpus and outputs must fit one disk.
MIXES = {
    "default": ((LARGE_SHARE, (1200, 1600)), (1 - LARGE_SHARE, (375, 500))),
    "imagenet": ((0.62, (375, 500)), (0.35, (333, 500)), (0.02, (768, 1024)), (0.01, (1200, 1600))),
}


def make_corpus(n: int, seed: int = 0, mix: str = "default") -> list[tuple[bytes, int, int]]:
    """``n`` photo-like JPEG files (:func:`gpufeed.pipelines.synth.synth_jpeg`) in memory as
    ``(bytes, height, width)``, their sizes drawn from ``MIXES[mix]``."""
    from gpufeed.pipelines.synth import synth_jpeg

    rng = np.random.default_rng(seed)
    shares = MIXES[mix]
    corpus = []
    for _ in range(n):
        r, acc = rng.random(), 0.0
        for share, (h, w) in shares:
            acc += share
            if r < acc:
                break
        if (h, w) == (375, 500) and rng.random() >= 0.75:
            h, w = w, h
        corpus.append((synth_jpeg(rng, h, w, quality=SOURCE_QUALITY), h, w))
    return corpus


def _reduced() -> dict:
    import cv2

    return {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
            8: cv2.IMREAD_REDUCED_COLOR_8}


def _shorter_side(h: int, w: int, size: int) -> tuple[int, int]:
    return (h * size // w, size) if h > w else (size, w * size // h)


def limit_one(data: bytes, h: int | None = None, w: int | None = None) -> int:
    """The per-core limit's work on one JPEG (its size read from the header when not given): decode with
    DCT-domain downscale where the image is >= 2x the target, resize the shorter side, encode q95."""
    limit_encode(data, h, w)
    return 1


def limit_encode(data: bytes, h: int | None = None, w: int | None = None) -> np.ndarray:
    """:func:`limit_one`'s work, returning the JPEG it encoded (a uint8 array: a buffer to write)."""
    import cv2

    if h is None:
        from gpufeed.pipelines.imageio import probe

        info = probe(data, "limit")
        h, w = info.height, info.width
    short = min(h, w)
    f = next((f for f in (8, 4, 2) if short >= f * TARGET), 1)
    img = cv2.imdecode(np.frombuffer(data, np.uint8), _reduced()[f])
    oh, ow = _shorter_side(h, w, TARGET)
    img = cv2.resize(img, (ow, oh), interpolation=cv2.INTER_LINEAR)
    return cv2.imencode(".jpg", img, (cv2.IMWRITE_JPEG_QUALITY, QUALITY))[1]


def loop_limit(corpus) -> int:
    for data, h, w in corpus:
        limit_one(data, h, w)
    return len(corpus)


def loop_cv2(corpus) -> int:
    import cv2

    enc = (cv2.IMWRITE_JPEG_QUALITY, QUALITY)
    for data, _, _ in corpus:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        oh, ow = _shorter_side(img.shape[0], img.shape[1], TARGET)
        img = cv2.resize(img, (ow, oh), interpolation=cv2.INTER_LINEAR)
        cv2.imencode(".jpg", img, enc)
    return len(corpus)


def loop_pillow(corpus) -> int:
    from PIL import Image

    for data, h, w in corpus:
        oh, ow = _shorter_side(h, w, TARGET)
        with Image.open(io.BytesIO(data)) as im:
            im.draft("RGB", (ow, oh))  # picks the largest DCT scale still >= the requested size
            im = im.convert("RGB").resize((ow, oh), Image.BILINEAR)
            im.save(io.BytesIO(), "JPEG", quality=QUALITY)
    return len(corpus)


def make_loop_make_sample(corpus):
    items = [Item(f"img/{i:06d}.JPEG", i % 1000, InlineRef(data)) for i, (data, _, _) in enumerate(corpus)]
    options = ImageOptions(resize=TARGET, encode="jpeg", quality=QUALITY)

    def loop_make_sample(_corpus) -> int:
        for i, item in enumerate(items):
            make_sample(item, options, i)
        return len(items)

    return loop_make_sample


def measure(corpus, loops: dict, repeats: int) -> dict[str, dict[str, list[float]]]:
    """``{loop: {"cpu": [img/s...], "wall": [img/s...]}}`` over ``repeats`` interleaved rounds (+ a warm-up)."""
    out = {name: {"cpu": [], "wall": []} for name in loops}
    for round_ in range(repeats + 1):
        for name, fn in loops.items():
            c0, w0 = time.process_time(), time.perf_counter()
            n = fn(corpus)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            if round_:
                out[name]["cpu"].append(n / cpu)
                out[name]["wall"].append(n / wall)
    return out


def run(n: int = 300, repeats: int = 5, seed: int = 0, pillow: bool = True, out_path: str | None = None) -> dict:
    import cv2
    import PIL

    cv2.setNumThreads(1)
    corpus = make_corpus(n, seed)
    loops = {"limit": loop_limit, "cv2": loop_cv2, "make_sample": make_loop_make_sample(corpus)}
    if pillow:
        loops["pillow"] = loop_pillow
    rates = measure(corpus, loops, repeats)
    limit = stat(rates["limit"]["cpu"])["median"]
    corpus_bytes = sum(len(d) for d, _, _ in corpus)
    # The imported PIL, not package metadata: Pillow-SIMD installs the same ``PIL`` package.
    libs = {"opencv": cv2.__version__, "PIL": PIL.__version__, "numpy": np.__version__}
    result = {"n": n, "mean_file_bytes": corpus_bytes / n, "loops": {}, "versions": libs}
    writer = ResultWriter(out_path) if out_path else None
    for name, r in rates.items():
        cpu, wall = stat(r["cpu"]), stat(r["wall"])
        result["loops"][name] = {"img_per_s": cpu["median"], "spread": cpu["spread"],
                                 "wall_img_per_s": wall["median"], "ratio_to_limit": cpu["median"] / limit}
        if writer:
            writer.write({"bench": "convert", "tier": MEMORY_TIER, "mode": "measured", "profile": "none",
                          "format": "jpeg", "n_samples": n, "sample_bytes": corpus_bytes / n,
                          "versions": {"PIL": libs["PIL"]},
                          "params": {"loop": name, "resize": TARGET, "quality": QUALITY, "threads": 1,
                                     "corpus": "imagenet-like synthetic, 10% 1600x1200"},
                          **summarize("img_per_s_cpu", "img/s", r["cpu"]),
                          "metrics": {"img_per_s_wall": {"unit": "img/s", **wall},
                                      "ratio_to_limit": {"unit": "ratio", **stat([v / limit for v in r["cpu"]])}}})
    result["cpu"] = machine_info()["cpu"]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="images in the in-memory corpus")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-pillow", action="store_true", help="skip the Pillow loop")
    parser.add_argument("--out", help="append result rows (JSON lines, gpufeed.bench.results schema)")
    args = parser.parse_args(argv)
    result = run(args.n, args.repeats, args.seed, not args.no_pillow, args.out)
    print(f"{result['n']} images, mean {result['mean_file_bytes'] / 1024:.0f} KiB, one core, CPU-time rates "
          f"({result['cpu']}; {result['versions']})")
    print(f"{'loop':<12} {'img/s':>8} {'spread':>7} {'wall img/s':>11} {'vs limit':>9}")
    for name, r in result["loops"].items():
        print(f"{name:<12} {r['img_per_s']:8.1f} {r['spread']:7.1%} {r['wall_img_per_s']:11.1f} "
              f"{r['ratio_to_limit']:9.3f}")


if __name__ == "__main__":
    main()
