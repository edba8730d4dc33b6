"""The storage-tier report's model: :class:`Section` of paragraphs, bullet lists, :class:`Table` and
:class:`Plot` (a :data:`Block` is any of them), and how its numbers are written. :mod:`.report_render` writes
it as HTML or Markdown."""

from __future__ import annotations

import dataclasses
import math
from typing import Union



MB = 1e6


GiB = 1 << 30


def fmt_num(value: float | None, digits: int = 3) -> str:
    """A readable number: thousands separators, ``digits`` significant digits for small values."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if value == 0:
        return "0"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(value)))))
    return f"{value:,.{decimals}f}"


def fmt_pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


@dataclasses.dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclasses.dataclass
class Plot:
    title: str
    png: bytes
    caption: str = ""


Block = Union[str, Table, Plot, list]


@dataclasses.dataclass
class Section:
    """A heading and its blocks in order: paragraphs (str), bullet lists (list of str), tables, plots."""

    title: str
    blocks: list[Block] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Report:
    title: str
    subtitle: str
    sections: list[Section]
