"""Benchmarks (conversion, read, training), storage-tier emulation and comparison reports.

Nothing here imports Ray: the GPU machine runs these benchmarks without it.
"""

#: MLPerf Storage's pass mark for ResNet-50: accelerator utilisation (compute time / wall time) of at least this.
AU_TARGET = 0.90
#: Format name of the rows measured on synthetic tensors (no storage, no decoding).
SYNTHETIC = "synthetic"
#: Tier name of rows whose data sits in memory: no storage tier, so never a baseline of ratios.
MEMORY_TIER = "memory"
