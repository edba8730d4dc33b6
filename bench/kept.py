"""Figures measured once per machine and kept in the user cache (``$XDG_CACHE_HOME/gpufeed`` or
``~/.cache/gpufeed``): the disk's cold random-read ceilings (:mod:`gpufeed.bench.hostdisk`) and the cores' decode
ceilings (:mod:`gpufeed.bench.cpuceiling`), each file a JSON object of figures by key."""

from __future__ import annotations

import json
import os


def kept_path(name: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpufeed", name)


def kept(name: str, key: str) -> dict | None:
    """The figures kept under ``key`` in the file ``name``, or None (never measured, or the file unreadable)."""
    try:
        with open(kept_path(name)) as f:
            return json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def keep(name: str, key: str, figures: dict) -> None:
    """Keep ``figures`` under ``key`` in the file ``name``, beside what it holds (written whole, then renamed),
    under an exclusive lock: two benchmarks keeping figures at once would otherwise each drop the other's."""
    import fcntl

    path = kept_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                held = json.load(f)
        except (OSError, ValueError):
            held = {}
        if not isinstance(held, dict):
            held = {}
        held[key] = figures
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(held, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
