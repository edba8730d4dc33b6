"""Figures kept per machine (bench/kept.py): every process's figures stay when several keep theirs at once."""

from __future__ import annotations

import subprocess
import sys

_KEEP = """
import sys
from gpufeed.bench.kept import keep
for i in range(40):
    keep("figures.json", f"{sys.argv[1]}-{i}", {"value": i})
"""


def test_processes_keeping_figures_at_once_lose_none(tmp_path, monkeypatch):
    from gpufeed.bench.kept import kept

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", _KEEP, name]) for name in ("a", "b", "c")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    missing = [f"{n}-{i}" for n in "abc" for i in range(40) if kept("figures.json", f"{n}-{i}") != {"value": i}]
    assert missing == []
    # A file that is not an object of figures is started afresh, not a crash.
    (tmp_path / "gpufeed" / "figures.json").write_text("[1, 2]")
    from gpufeed.bench.kept import keep

    keep("figures.json", "d", {"value": 1})
    assert kept("figures.json", "d") == {"value": 1}
