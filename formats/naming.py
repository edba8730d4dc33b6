"""Output names, built and parsed in one place.

Shards follow TensorFlow's ``%s-%.5d-of-%.5d`` (``train-00000-of-01024``); RecordIO shards add ``.rec``/``.idx``
/``.lst``; a single RecordIO output is ``train.rec``. Temporary names are hidden dot-files next to the target
so that a directory listing never shows a half-written file under a final name.
"""

from __future__ import annotations

import os
import re
import uuid

_SHARD = re.compile(r"^(?P<split>.+)-(?P<index>\d{5,})-of-(?P<count>\d{5,})(?P<ext>\.[A-Za-z0-9.]+)?$")


def shard_name(split: str, index: int, count: int, ext: str = "") -> str:
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} outside 0..{count - 1}")
    return f"{split}-{index:05d}-of-{count:05d}{ext}"


def parse_shard_name(name: str) -> tuple[str, int, int, str] | None:
    """``(split, index, count, ext)`` for a shard file name, or ``None`` if it is not one."""
    m = _SHARD.match(os.path.basename(name))
    if not m:
        return None
    return m["split"], int(m["index"]), int(m["count"]), m["ext"] or ""


def temp_name(final_path: str) -> str:
    """A unique temporary path in the same directory as ``final_path`` (so the rename is atomic)."""
    head, tail = os.path.split(final_path)
    return os.path.join(head, f".{tail}.tmp-{uuid.uuid4().hex[:8]}")


_TEMP = re.compile(r"^\.(?P<final>.+)\.tmp-[0-9a-f]{8}$")


def temp_target(name: str) -> str | None:
    """The final name a temporary name (:func:`temp_name`) stands for, or ``None`` if it is not one."""
    m = _TEMP.match(os.path.basename(name))
    return m["final"] if m else None


def is_temp_name(name: str) -> bool:
    return temp_target(name) is not None
