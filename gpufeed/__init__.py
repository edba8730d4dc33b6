"""gpufeed: prepare deep-learning datasets for training and measure how fast storage can feed a GPU.

Subpackages: ``gpufeed.formats`` (Caffe LMDB, MXNet RecordIO, TFRecord, WebDataset), ``gpufeed.pipelines`` (dataset
sources, transforms, synthetic data), ``gpufeed.convert`` (CLI, Ray orchestration, resume, verify) and
``gpufeed.bench`` (benchmarks, storage-tier emulation, reports).
"""

__version__ = "0.1.0"


def loader(paths, format=None, batch_size=256, decode="auto", augment="train", **options):
    """Training or inference batches on the GPU from gpufeed's files, decoded on the CPU, with nvJPEG, on the
    GPU's JPEG engines or both; by default where :func:`gpufeed.pipelines.loader.choose_decode` picks from the
    node (:mod:`gpufeed.pipelines.loader`)."""
    from gpufeed.pipelines.loader import loader as _loader

    return _loader(paths, format=format, batch_size=batch_size, decode=decode, augment=augment, **options)
