"""Benchmarks (conversion, read, training), storage-tier emulation and comparison reports.

Nothing here imports Ray: the GPU machine runs these benchmarks without it.
"""
