"""WebDataset output, as its consumers read it: the ``webdataset`` package (``WebDataset(...).decode()``), the
``wds2idx`` index DALI reads beside each shard, and gpufeed's own reader, loader and verify. The format's byte
contract (round trips, damage, truncation, raw pixels, tokens) is in the conformance suite."""

from __future__ import annotations

import glob
import json
import os
import tarfile

import pytest

import gpufeed
from convert_fixtures import options, tree_bytes
from gpufeed.convert.engine import convert
from gpufeed.convert.verify import verify
from gpufeed.errors import ConfigError
from gpufeed.formats import format_of, get_format

wds = pytest.importorskip("webdataset")


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory, ray_local):
    out = tmp_path_factory.mktemp("wds") / "o"
    convert(options(src, out, formats=("webdataset", "tfrecord"), workers=2))
    return out


def test_the_webdataset_package_reads_every_sample_with_its_label(converted):
    """`webdataset.WebDataset(urls).decode("pil")`: the same images and labels as the TFRecord beside them."""
    for split in ("train", "val"):
        want = {}
        for shard in sorted(glob.glob(str(converted / "tfrecord" / f"{split}-*-of-*[0-9]"))):
            for s in get_format("tfrecord").reader(shard):
                want[s.key] = (int(s.label), bytes(s.payload))
        urls = sorted(glob.glob(str(converted / "webdataset" / f"{split}-*.tar")))
        assert urls and all(os.path.basename(u)[len(split) + 1:-4].isdigit() for u in urls)
        got = {}
        for sample in wds.WebDataset(urls, shardshuffle=False).decode("pil"):
            assert len(sample["__key__"]) == 9 and sample["__key__"].isdigit()
            got[sample["json"]["key"]] = (sample["cls"], sample["jpg"])
        assert set(got) == set(want)
        for key, (label, image) in got.items():
            assert label == want[key][0] and image.mode == "RGB" and image.size[0] > 0
        # Undecoded, the image member is the stored JPEG itself.
        raw = {json.loads(s["json"])["key"]: s["jpg"] for s in wds.WebDataset(urls, shardshuffle=False)}
        assert raw == {k: v[1] for k, v in want.items()}


def test_each_shard_is_a_plain_tar_with_dali_s_index_beside_it(converted):
    """Fixed member metadata, members of a sample adjacent (payload, .cls, .json), and a `v1.2` wds2idx index
    whose offsets point at each member's data."""
    for shard in sorted(glob.glob(str(converted / "webdataset" / "*.tar"))):
        with tarfile.open(shard) as tar:
            members = tar.getmembers()
            assert all(m.mode == 0o644 and m.mtime == 0 and m.uid == m.gid == 0 and not m.uname for m in members)
            assert [m.name.split(".", 1)[1] for m in members[:3]] == ["jpg", "cls", "json"]
        lines = open(shard + ".idx").read().splitlines()
        assert lines[0] == f"v1.2 {len(lines) - 1}" and len(lines) - 1 == len(members) // 3
        data = open(shard, "rb").read()
        for line in lines[1:]:
            parts = line.split()
            for ext, offset, size, name in zip(parts[0::4], parts[1::4], parts[2::4], parts[3::4]):
                assert name.endswith("." + ext)
                header = tarfile.TarInfo.frombuf(data[int(offset) - 512:int(offset)], "utf-8", "strict")
                assert header.name == name and header.size == int(size)


def test_gpufeed_reads_verifies_and_loads_its_shards(converted):
    report = verify(str(converted))
    assert report.records[("train", "webdataset")] == report.records[("train", "tfrecord")]
    shards = sorted(glob.glob(str(converted / "webdataset" / "train-*.tar")))
    assert format_of(shards) == "webdataset"
    with pytest.raises(ConfigError, match=r"\.idx is the index or list of a data file"):
        format_of(sorted(glob.glob(str(converted / "webdataset" / "train-*"))))
    batch = next(iter(gpufeed.loader(shards, batch_size=4, workers=0, decode="cpu", size=32)))
    assert tuple(batch[0].shape) == (4, 32, 32, 3)


def test_a_conversion_to_webdataset_gives_the_same_bytes_again(src, converted, tmp_path, ray_local):
    """Deterministic tar bytes: another run (one worker) writes every shard and index identically."""
    again = tmp_path / "again"
    convert(options(src, again, formats=("webdataset", "tfrecord"), workers=1))
    assert tree_bytes(again) == tree_bytes(converted)
