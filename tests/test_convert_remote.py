"""A destination the workers cannot reach (memory://, --driver-writes): shards come back through Ray's
object store and the driver writes them; same bytes as a local run, and verify reads the URL."""

from __future__ import annotations

import uuid

import fsspec
import pytest

from convert_fixtures import options, tree_bytes
from gpufeed.convert.engine import convert
from gpufeed.convert.verify import verify
from gpufeed.errors import IncompleteOutputError


def _memory_tree(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    return {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(root) if not p.endswith("/manifest.json")}


def _opts(src, out, **kw):
    # Several shards per split, so the single .rec and the LMDB are assembled from several spools.
    return options(src, out, splits=("val",), shard_size=2, **kw)


def test_memory_destination_is_written_by_the_driver(src, tmp_path, ray_local, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the journal of a remote destination
    ref = tmp_path / "ref"
    convert(_opts(src, ref))
    url = f"memory://gpufeed-{uuid.uuid4().hex[:8]}/out"
    summary = convert(_opts(src, url))
    assert summary.samples["val"]["shards"] >= 3
    assert _memory_tree(url) == tree_bytes(ref)
    report = verify(url)
    assert report.records[("val", "lmdb")] == summary.samples["val"]["written"] > 0
    # verify reads every byte from the URL: a flipped byte there is found.
    fs, root = fsspec.core.url_to_fs(url)
    shard = f"{root}/tfrecord/val-00001-of-00003"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 1
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(IncompleteOutputError, match="val-00001-of-00003: SHA-256"):
        verify(url)
    fs.rm(root, recursive=True)

    # --driver-writes with a local destination: the same path, the same bytes.
    out = tmp_path / "driver"
    convert(_opts(src, out, driver_writes=True, workers=1))
    assert tree_bytes(out) == tree_bytes(ref)
