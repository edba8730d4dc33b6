"""A dataset made up on the spot: ``gpufeed convert synthetic KIND:N[:SEED]`` and the benchmarks' datasets.

Each item is named by ``(kind, seed, index)`` (:class:`~gpufeed.pipelines.base.SynthRef`) and made by the
worker that converts it, so listing a million items costs nothing and the bytes depend only on that triple:

* ``imagenet``: JPEGs (q90) of photo-like content (:func:`gpufeed.pipelines.synth.synth_jpeg`) at ImageNet's
  typical geometry (500x375 either way round, 1 in each 50 at 1600x1200, placed as drawn: :func:`is_large`);
  ~117 KB on average as captured, like ImageNet's ~110 KB and MLPerf Storage's ResNet-50 records (114,660
  bytes); 1,000 classes;
* ``cifar``: 32x32 RGB pixels (3,072 bytes), 10 classes;
* ``ptb``: Penn Treebank language-model windows, 36 token ids (``seq_len`` 35 + 1) of a 10,000-word vocabulary
  with Zipf's word frequencies, label 0, as ``gpufeed convert ptb`` writes them.

One split, ``train``; keys sort in index order.
"""

from __future__ import annotations

import re

import numpy as np

from gpufeed.draw import mixed
from gpufeed.errors import ConfigError
from gpufeed.pipelines.base import ClassInfo, Item, SynthRef

KINDS = ("imagenet", "cifar", "ptb")
CLASSES = {"imagenet": 1000, "cifar": 10, "ptb": 1}
#: Penn Treebank's vocabulary (Mikolov's preprocessing) and the language models' unrolled length.
PTB_VOCAB = 10_000
PTB_SEQ_LEN = 35
#: A tail of multi-megapixel photos as ImageNet has; at q90 a 500x375 synthetic photo is ~100 KB and a
#: 1600x1200 one ~980 KB, so 1 in 50 large gives ImageNet's mean record size.
LARGE_EVERY = 50
LARGE_HW = (1200, 1600)
COMMON_HW = (375, 500)
CIFAR_HW = (32, 32)
_EXT = {"imagenet": ".JPEG", "cifar": ".png", "ptb": ""}


def is_large(i: int) -> bool:
    """Whether synthetic ImageNet photo ``i`` is one of the large ones: one in each run of :data:`LARGE_EVERY`
    indices, at a place drawn for that run. At a fixed place (every 50th, always an odd index), a loader dealing
    records ``r, r + w, ...`` to an even number of ranks gave every large photo to its odd ranks: with 4 ranks,
    ranks 1 and 3 decoded 29% more a sample than ranks 0 and 2, and every rank trained at their pace (gpufeed's
    loader now deals each round with a drawn turn: :class:`gpufeed.formats.torch.RankShare`)."""
    return i % LARGE_EVERY == mixed(i // LARGE_EVERY) % LARGE_EVERY


def geometry(i: int) -> tuple[int, int]:
    """``(height, width)`` of synthetic ImageNet photo ``i``: :data:`COMMON_HW` or, where :func:`is_large`,
    :data:`LARGE_HW`, landscape or portrait as drawn for ``i``."""
    h, w = LARGE_HW if is_large(i) else COMMON_HW
    return (h, w) if mixed(i) & 1 == 0 else (w, h)


def make_data(ref: SynthRef):
    """The input ``ref`` names: JPEG bytes, HWC uint8 pixels or int32 token ids."""
    rng = np.random.default_rng([ref.seed, ref.index])
    if ref.kind == "cifar":
        return rng.integers(0, 256, size=(*CIFAR_HW, 3), dtype=np.uint8)
    if ref.kind == "ptb":
        return ((rng.zipf(1.2, PTB_SEQ_LEN + 1) - 1) % PTB_VOCAB).astype(np.int32)
    from gpufeed.pipelines.synth import synth_jpeg

    return synth_jpeg(rng, *geometry(ref.index), quality=90)


def parse_spec(spec: str) -> tuple[str, int, int]:
    """``"imagenet:40000"`` -> ``("imagenet", 40000, 0)``; ``"cifar:2000:7"`` -> ``("cifar", 2000, 7)``."""
    m = re.fullmatch(r"\s*([a-z]+):(\d+)(?::(\d+))?\s*", spec)
    if not m or m[1] not in KINDS or int(m[2]) < 1:
        raise ConfigError(f"synthetic SRC {spec!r} is not KIND:N[:SEED] with KIND one of {', '.join(KINDS)} and N "
                          "at least 1; write it like imagenet:2000 (or imagenet:2000:7 for another seed)")
    return m[1], int(m[2]), int(m[3] or 0)


class SyntheticSource:
    """The :class:`~gpufeed.pipelines.base.Source` of ``spec`` (:func:`parse_spec`)."""

    name = "synthetic"

    def __init__(self, spec: str, on_error: str = "fail"):
        self.kind, self.n, self.seed = parse_spec(spec)
        self.modality = "text" if self.kind == "ptb" else "image"

    def splits(self) -> list[str]:
        return ["train"]

    def expect(self, splits: list[str]) -> None:
        """Nothing to begin: the items are made, not listed."""

    def items(self, split: str) -> list[Item]:
        classes, ext, kind, seed = CLASSES[self.kind], _EXT[self.kind], self.kind, self.seed
        return [Item(f"train/{i:09d}{ext}", i % classes, SynthRef(kind, seed, i), {"source": f"synthetic {kind} {i}"})
                for i in range(self.n)]

    def classes(self) -> ClassInfo:
        if self.kind == "ptb":
            from gpufeed.pipelines.sources import Vocabulary

            return Vocabulary(names=[f"w{i}" for i in range(PTB_VOCAB)])
        return ClassInfo(names=[f"class{c:04d}" for c in range(CLASSES[self.kind])])

    def skipped(self) -> list:
        return []
