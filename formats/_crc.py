"""CRC-32C (Castagnoli), the checksum of RecordIO's IRHeader id2, TFRecord's framing, our LMDB records and pages
and WebDataset sample digests: the ``crc32c`` package's C function, imported on first use.

Importing that package reads every installed distribution's metadata for its ``__version__`` (30-170 ms), which
a conversion's driver paid before listing although it computes no CRC: its workers do, in processes that have
the package imported already. Callers write ``_crc.crc32c(data, value)``: the first call puts the C function in
this module's namespace, so every later one goes straight to it; a loop binds :func:`function` once.
"""

from __future__ import annotations


def function():
    """The C function itself, imported now."""
    global crc32c
    from crc32c import crc32c as c_function

    crc32c = c_function
    return c_function


def crc32c(data, value: int = 0) -> int:
    return function()(data, value)
