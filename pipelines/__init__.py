"""Dataset sources (ImageNet, CIFAR-10/100, Penn Treebank, image folders), transforms and synthetic data."""

from __future__ import annotations

DATASETS = ("imagenet", "cifar10", "cifar100", "ptb", "folder", "synthetic")
#: What an unusable input does to a run: end it (naming the input), or skip it and list it in the summary.
ON_ERROR = ("fail", "skip")
#: Images with more pixels are refused undecoded. Pillow's own default (``PIL.Image.MAX_IMAGE_PIXELS``):
#: about a 9459x9459 image, 256 MiB of RGB.
DEFAULT_MAX_PIXELS = 89_478_485
#: The longest side an image may be stored with: JPEG's limit as libjpeg enforces it (65,500), applied to every
#: encoding, so that a stored size is checked before anything is allocated or encoded.
MAX_SIDE = 65_500


def open_source(dataset: str, src: str, **options):
    """The :class:`~gpufeed.pipelines.base.Source` for ``dataset`` rooted at ``src`` (path or fsspec URL)."""
    from gpufeed.pipelines.sources import open_source as _open

    return _open(dataset, src, **options)
