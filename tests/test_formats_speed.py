"""The format read-speed benchmark runs end to end in a tiny configuration, so it cannot rot."""

from __future__ import annotations

import json

from gpufeed.bench.experiments import formats_speed


def test_tiny_run_writes_every_row(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert formats_speed.main(["--records", "5", "--small-records", "7", "--size", "4000", "--small-size", "300",
                               "--repeats", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    readers = {(r["record_bytes"], r["reader"]) for r in doc["rows"]}
    for size in (4000, 300):
        for name in ("recordio", "tfrecord", "lmdb", "tfrecord-package"):
            assert (size, name) in readers
    package = [r for r in doc["rows"] if r["reader"] == "tfrecord-package"]
    assert all(r["detects_corruption"] is False for r in package)
    assert all(r["detects_corruption"] for r in doc["rows"] if r["reader"] in ("recordio", "tfrecord", "lmdb"))
    assert "ratio" in capsys.readouterr().out
