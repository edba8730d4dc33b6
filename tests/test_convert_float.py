"""Normalised float storage (--store-dtype float16/float32) and exact statistics, end to end on a real local Ray."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from convert_fixtures import conversion, options, synth_source, tree_bytes
from gpufeed.convert.engine import convert
from gpufeed.convert.progress import Progress
from gpufeed.convert.verify import verify
from gpufeed.errors import ConfigError, CorruptRecordError


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    from gpufeed.pipelines.synth import synth_cifar10

    root = tmp_path_factory.mktemp("cifar")
    synth_cifar10(str(root / "c"), per_class=3, test_per_class=1, forms=("python",))
    return str(root / "c")


def _cifar_options(src, out, **kw):
    base = dict(dataset="cifar10", src=src, formats=("lmdb", "recordio", "tfrecord"), out=str(out), workers=2,
                shard_size=8, progress=False, store_dtype="float16", normalize=True)
    base.update(kw)
    return conversion(**base)


def _exact_stats(src, split):
    from gpufeed.pipelines import open_source
    from gpufeed.pipelines.base import read_item
    from gpufeed.pipelines.transforms import ChannelStats

    stats = ChannelStats()
    for item in open_source("cifar10", src).items(split):
        stats.update(np.asarray(read_item(item)))
    return stats


def test_store_dtype_options_are_checked():
    base = dict(dataset="imagenet", src="s", formats=("lmdb",), out="o")
    with pytest.raises(ConfigError, match="encode='raw'"):
        conversion(**base, store_dtype="float16", normalize=True, encode="jpeg")
    with pytest.raises(ConfigError, match="--mean R,G,B"):
        conversion(**base, store_dtype="float32")
    with pytest.raises(ConfigError, match="--store-dtype float16 or float32"):
        conversion(**base, mean=(1, 2, 3), std=(1, 1, 1))
    with pytest.raises(ConfigError, match="needs its partner"):
        conversion(**base, store_dtype="float32", mean=(1, 2, 3))
    o = conversion(**base, store_dtype="float32", mean=(1, 2, 3), std=(4, 5, 6))
    assert o.effective_encode == "raw" and not o.statistics_prepass
    assert conversion(**base, store_dtype="float16", normalize=True).statistics_prepass


def test_float16_normalised_with_a_statistics_prepass_in_every_format(cifar, tmp_path, ray_local):
    from gpufeed.formats import get_format
    from gpufeed.pipelines.transforms import normalise

    ref = tmp_path / "ref"
    summary = convert(_cifar_options(cifar, ref))
    assert summary.prepass_shards == 4  # 30 train images in shards of about 8
    doc = json.loads((ref / "mean_std.json").read_text())
    exact = _exact_stats(cifar, "train")
    assert doc["mean"] == pytest.approx(exact.mean, abs=1e-9) and doc["std"] == pytest.approx(exact.std, abs=1e-9)
    assert doc["images"] == 30
    report = verify(str(ref))
    assert report.records[("test", "lmdb")] == 10

    # Every format gives back float16 HWC tensors equal to (pixel - mean) / std of the source pixels.
    from gpufeed.pipelines import open_source
    from gpufeed.pipelines.base import read_item

    source = {it.key: np.asarray(read_item(it)) for it in open_source("cifar10", cifar).items("test")}
    readers = {
        "lmdb": get_format("lmdb").reader(str(ref / "lmdb" / "test_lmdb")),
        "recordio": get_format("recordio").reader(str(ref / "recordio" / "test.rec")),
        "tfrecord": get_format("tfrecord").reader(str(ref / "tfrecord" / "test-00000-of-00001")),
    }
    for name, reader in readers.items():
        samples = list(reader)
        reader.close()
        assert len(samples) == 10, name
        for s in samples:
            assert s.kind == "raw" and s.payload.dtype == np.float16 and s.payload.shape == (32, 32, 3), name
            want = normalise(source[s.key], exact.mean, exact.std, "float16")
            np.testing.assert_array_equal(np.asarray(s.payload), want, err_msg=name)

    # Interrupted after the pre-pass: the resumed run takes the journalled statistics, same bytes.
    class StopAfterFirstShard(Progress):
        def update(self, samples, nbytes):
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert(_cifar_options(cifar, out, workers=1), StopAfterFirstShard(enabled=False))
    again = convert(_cifar_options(cifar, out, workers=1))
    assert again.prepass_shards == 0
    assert tree_bytes(out) == tree_bytes(ref)


def test_verify_rejects_non_finite_pixels(cifar, tmp_path, ray_local):
    """A std so small that pixels overflow float16 is refused when given; a file holding infinite pixels anyway
    (written by another tool, with a manifest made to agree) is not accepted by verify as a good output."""
    import hashlib

    from gpufeed.errors import ConfigError
    from gpufeed.formats import get_format

    with pytest.raises(ConfigError, match="mean 0,0,0 with std 0.001,0.001,0.001 stores pixel values up to "
                                          "2.55e\\+05, beyond float16's 65504"):
        _cifar_options(cifar, tmp_path / "o", formats=("tfrecord",), normalize=False, mean=(0, 0, 0),
                       std=(1e-3, 1e-3, 1e-3), splits=("test",))
    out = tmp_path / "o"
    convert(_cifar_options(cifar, out, formats=("tfrecord",), normalize=False, mean=(0, 0, 0),
                           std=(1, 1, 1), splits=("test",)))
    shard = out / "tfrecord" / "test-00000-of-00001"
    fmt = get_format("tfrecord")
    samples = list(fmt.reader(str(shard)))
    samples[0].payload = np.full_like(samples[0].payload, np.inf)
    with fmt.writer(str(shard)) as w:
        for s in samples:
            w.write(s)
    doc = json.loads((out / "manifest.json").read_text())
    for f in doc["files"]:
        if f["path"].startswith("tfrecord/"):
            data = (out / f["path"]).read_bytes()
            f.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (out / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptRecordError, match="NaN or infinity"):
        verify(str(out))
    assert next(iter(fmt.reader(str(shard)))).payload.dtype == np.float16


def test_pass_through_statistics_count_each_image_once(tmp_path, ray_local):
    from gpufeed.formats import get_format
    from gpufeed.pipelines.transforms import ChannelStats, decode_image

    src = synth_source(tmp_path / "src")
    out = tmp_path / "o"
    summary = convert(options(src, out, formats=("tfrecord",), resize=None, encode="pass", normalize=True,
                              splits=("train",)))
    doc = json.loads((out / "mean_std.json").read_text())
    # The statistics are those of exactly the images written (the gray and CMYK JPEGs among them stored as
    # RGB JPEGs), each decoded to RGB as a reader decodes it; the broken files are skipped and not counted.
    assert doc["images"] == summary.samples["train"]["written"] > 0 and summary.skipped and summary.converted
    stats = ChannelStats()
    for shard in sorted((out / "tfrecord").glob("train-*-of-*")):
        if not shard.suffix:
            for sample in get_format("tfrecord").reader(str(shard)):
                stats.update(decode_image(bytes(sample.payload), sample.key))
    assert doc["images"] == stats.images and doc["mean"] == pytest.approx(stats.mean, abs=1e-9)
    verify(str(out))
    assert os.path.exists(out / "manifest.json")
