"""gpufeed: prepare deep-learning datasets for training and measure how fast storage can feed a GPU.

Subpackages: ``gpufeed.formats`` (Caffe LMDB, MXNet RecordIO, TFRecord), ``gpufeed.pipelines`` (dataset
sources, transforms, synthetic data), ``gpufeed.convert`` (CLI, Ray orchestration, resume, verify) and
``gpufeed.bench`` (benchmarks, storage-tier emulation, reports).
"""

__version__ = "0.1.0"
