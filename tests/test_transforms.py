"""make_sample's geometry and encodings, DCT downscaling, channel statistics and the read-bench augmentation."""

from __future__ import annotations

import io
import json
import math
import pickle

import cv2
import numpy as np
import pytest
from PIL import Image

from gpufeed.errors import ConfigError, InputError
from gpufeed.formats.base import Sample
from gpufeed.pipelines.base import FileRef, InlineRef, Item
from gpufeed.pipelines.imageio import decode_image, probe, reduction_for
from gpufeed.pipelines.transforms import (ChannelStats, ImageOptions, decode_crop, make_sample, output_geometry,
                                          random_resized_crop_choice, random_resized_crop_flip,
                                          random_resized_crop_params, write_stats)


def photo(h, w, seed=0):
    """Smooth, photo-like BGR content with a few edges, as cv2 works in BGR."""
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8), (w, h), interpolation=cv2.INTER_CUBIC)
    cv2.rectangle(img, (w // 5, h // 4), (w // 2, h // 2), (20, 200, 60), 3)
    return img


def jpeg_file(tmp_path, name, bgr, quality=92) -> Item:
    ok, buf = cv2.imencode(".jpg", bgr, (cv2.IMWRITE_JPEG_QUALITY, quality))
    (tmp_path / name).write_bytes(buf.tobytes())
    return Item(f"cls/{name}", 7, FileRef(str(tmp_path / name)), {"synset": "n0000"})


def im2rec(path, resize=0, center_crop=False):
    """What MXNet's tools/im2rec.py does to an image before pack_img (BGR)."""
    img = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if center_crop:
        if img.shape[0] > img.shape[1]:
            margin = (img.shape[0] - img.shape[1]) // 2
            img = img[margin:margin + img.shape[1], :]
        else:
            margin = (img.shape[1] - img.shape[0]) // 2
            img = img[:, margin:margin + img.shape[0]]
    if resize:
        if img.shape[0] > img.shape[1]:
            newsize = (resize, img.shape[0] * resize // img.shape[1])
        else:
            newsize = (img.shape[1] * resize // img.shape[0], resize)
        img = cv2.resize(img, newsize)
    return img


@pytest.mark.parametrize("hw,crop", [((375, 500), False), ((500, 333), False), ((300, 300), False),
                                     ((375, 500), True), ((480, 270), True), ((120, 90), False)])
def test_resize_matches_im2rec_pixel_for_pixel(tmp_path, hw, crop):
    item = jpeg_file(tmp_path, "a.jpg", photo(*hw))
    out = make_sample(item, ImageOptions(resize=256, center_crop=crop, encode="raw"), 3)
    expect = im2rec(item.ref.url, 256, crop)[..., ::-1]  # raw samples are RGB
    np.testing.assert_array_equal(out.payload, expect)
    assert (out.meta["height"], out.meta["width"]) == expect.shape[:2]
    assert out.key == "cls/a.jpg" and out.label == 7 and out.index == 3 and out.meta["synset"] == "n0000"


def test_geometry_rules():
    assert output_geometry(375, 500, ImageOptions(resize=256))[1] == (256, 341)  # 500*256//375 = 341.33
    assert output_geometry(500, 375, ImageOptions(resize=256))[1] == (341, 256)
    assert output_geometry(375, 500, ImageOptions(size=(227, 300)))[1] == (227, 300)
    assert output_geometry(375, 500, ImageOptions(center_crop=True, size=(64, 64))) == ((0, 62, 375, 375), (64, 64))
    assert output_geometry(3000, 1000, ImageOptions(max_size=500))[1] == (500, 166)
    assert output_geometry(300, 4000, ImageOptions(resize=256, max_size=1000))[1] == (75, 1000)
    assert output_geometry(40, 50, ImageOptions(max_size=500))[1] == (40, 50)  # only caps, never grows


def test_exact_size_like_caffe(tmp_path):
    item = jpeg_file(tmp_path, "b.jpg", photo(375, 500))
    out = make_sample(item, ImageOptions(size=(227, 250), encode="raw"), 0)
    expect = cv2.resize(cv2.imread(item.ref.url), (250, 227), interpolation=cv2.INTER_LINEAR)[..., ::-1]
    np.testing.assert_array_equal(out.payload, expect)


def psnr(a, b):
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


@pytest.mark.parametrize("hw,factor", [((1200, 1600), 4), ((800, 1200), 2), ((2400, 3200), 8), ((375, 500), 1)])
def test_dct_downscale_is_chosen_and_visually_equivalent(tmp_path, hw, factor):
    item = jpeg_file(tmp_path, "big.jpg", photo(*hw), quality=95)
    data = open(item.ref.url, "rb").read()
    info = probe(data, "big.jpg")
    opts = ImageOptions(resize=256, encode="raw")
    box, out_hw = output_geometry(info.height, info.width, opts)
    assert reduction_for(info, (box[2] / out_hw[0], box[3] / out_hw[1])) == factor
    fast = make_sample(item, opts, 0).payload
    full = im2rec(item.ref.url, 256)[..., ::-1]
    assert fast.shape == full.shape
    assert psnr(fast, full) > 30


def test_dct_downscale_with_centre_crop_stays_aligned(tmp_path):
    item = jpeg_file(tmp_path, "wide.jpg", photo(1200, 2000), quality=95)
    fast = make_sample(item, ImageOptions(resize=224, center_crop=True, encode="raw"), 0).payload
    full = im2rec(item.ref.url, 224, center_crop=True)[..., ::-1]
    assert fast.shape == full.shape == (224, 224, 3)
    assert psnr(fast, full) > 30


def test_jpeg_output_is_colour_correct(tmp_path):
    bgr = np.zeros((64, 64, 3), np.uint8)
    bgr[..., 2] = 230  # red in BGR
    item = jpeg_file(tmp_path, "red.jpg", bgr)
    out = make_sample(item, ImageOptions(resize=32, quality=90), 0)
    assert out.kind == "encoded" and out.meta["format"] == "JPEG" and out.payload[:3] == b"\xff\xd8\xff"
    rgb = np.asarray(Image.open(io.BytesIO(out.payload)).convert("RGB"))  # an independent decoder
    assert rgb.shape == (32, 32, 3)
    assert abs(int(rgb[16, 16, 0]) - 230) < 4 and rgb[16, 16, 1:].max() < 6


def test_quality_changes_size(tmp_path):
    item = jpeg_file(tmp_path, "q.jpg", photo(375, 500), quality=98)
    small = make_sample(item, ImageOptions(resize=256, quality=50), 0).payload
    large = make_sample(item, ImageOptions(resize=256, quality=95), 0).payload
    assert len(small) < len(large)


def test_png_and_gray_outputs(tmp_path):
    item = jpeg_file(tmp_path, "p.jpg", photo(100, 150))
    png = make_sample(item, ImageOptions(encode="png"), 0)
    raw = make_sample(item, ImageOptions(encode="raw"), 0)
    assert png.meta["format"] == "PNG"
    np.testing.assert_array_equal(decode_image(png.payload, "png"), raw.payload)  # lossless
    gray = make_sample(item, ImageOptions(encode="png", gray=True), 0)
    assert gray.meta["channels"] == 1
    assert cv2.imdecode(np.frombuffer(gray.payload, np.uint8), cv2.IMREAD_UNCHANGED).ndim == 2


def test_pass_through_keeps_bytes_and_still_validates(tmp_path):
    item = jpeg_file(tmp_path, "keep.jpg", photo(300, 400))
    data = open(item.ref.url, "rb").read()
    out = make_sample(item, ImageOptions(encode="pass"), 0)
    assert out.payload == data and out.meta["format"] == "JPEG"
    assert (out.meta["height"], out.meta["width"], out.meta["channels"]) == (300, 400, 3)
    bad = bytearray(data)
    sof = bad.index(b"\xff\xc0")
    bad[sof + 9] = 0
    (tmp_path / "keep.jpg").write_bytes(bytes(bad))
    with pytest.raises(InputError):
        make_sample(item, ImageOptions(encode="pass"), 0)
    assert make_sample(item, ImageOptions(encode="pass", validate=False), 0).payload == bytes(bad)


@pytest.mark.parametrize("kwargs", [dict(resize=256, size=(3, 3)), dict(encode="pass", resize=256),
                                    dict(encode="jpeg", store_dtype="float16"), dict(encode="webp"),
                                    dict(quality=0), dict(resize=0), dict(mean=(1, 2)), dict(std=(0,)),
                                    dict(size=(10,))])
def test_bad_options_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        ImageOptions(**kwargs)


def test_options_cross_processes_unchanged():
    opts = ImageOptions(size=[224, 224], encode="raw", store_dtype="float16", mean=[1, 2, 3], std=(4, 5, 6))
    assert opts.size == (224, 224) and opts.mean == (1.0, 2.0, 3.0)
    assert pickle.loads(pickle.dumps(opts)) == opts and hash(opts) == hash(pickle.loads(pickle.dumps(opts)))


def test_normalised_float_storage(tmp_path):
    item = jpeg_file(tmp_path, "n.jpg", photo(60, 80))
    raw = make_sample(item, ImageOptions(encode="raw"), 0).payload
    mean, std = (123.7, 116.3, 103.5), (58.4, 57.1, 57.4)
    for dtype in ("float16", "float32"):
        out = make_sample(item, ImageOptions(encode="raw", store_dtype=dtype, mean=mean, std=std), 0).payload
        assert out.dtype == dtype and out.shape == raw.shape
        expect = (raw.astype(np.float64) - mean) / std
        np.testing.assert_allclose(out.astype(np.float64), expect, atol=2e-3 if dtype == "float16" else 1e-5)


def test_cifar_pixels_take_the_same_transforms():
    rgb = photo(32, 32)[..., ::-1].copy()
    item = Item("train/00001", 3, InlineRef(rgb), {"coarse_label": 11})
    raw = make_sample(item, ImageOptions(encode="raw"), 1)
    np.testing.assert_array_equal(raw.payload, rgb)
    png = make_sample(item, ImageOptions(encode="png"), 1)
    np.testing.assert_array_equal(decode_image(png.payload, "png"), rgb)
    assert png.meta["coarse_label"] == 11 and png.meta["format"] == "PNG"
    up = make_sample(item, ImageOptions(resize=64, encode="jpeg"), 1)
    assert (up.meta["height"], up.meta["width"]) == (64, 64)
    with pytest.raises(InputError, match="pass"):
        make_sample(item, ImageOptions(encode="pass"), 1)
    with pytest.raises(InputError, match="HxWx3"):
        make_sample(Item("x", 0, InlineRef(np.zeros((4, 4, 3), np.float32))), ImageOptions(), 0)


def test_tokens_become_token_samples():
    ids = np.array([5, 9, 0, 2], np.int64)
    out = make_sample(Item("ptb/train/0", 0, InlineRef(ids)), ImageOptions(), 4)
    assert out.kind == "tokens" and out.payload.dtype == np.int32 and out.payload.tolist() == [5, 9, 0, 2]
    with pytest.raises(InputError):
        make_sample(Item("t", 0, InlineRef(np.array([1.5]))), ImageOptions(), 0)


def test_channel_stats_are_exact_and_merge_across_workers():
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (int(rng.integers(5, 40)), int(rng.integers(5, 40)), 3), dtype=np.uint8)
              for _ in range(12)]
    whole = ChannelStats()
    parts = [ChannelStats() for _ in range(3)]
    for i, img in enumerate(images):
        whole.update(img)
        parts[i % 3].update(np.ascontiguousarray(img[..., ::-1]), bgr=True)
    merged = ChannelStats()
    for part in parts:
        merged.merge(pickle.loads(pickle.dumps(part)))  # partials cross Ray as pickles
    allpix = np.concatenate([im.reshape(-1, 3) for im in images]).astype(np.float64)
    for stats in (whole, merged):
        np.testing.assert_allclose(stats.mean, allpix.mean(0), rtol=1e-12)
        np.testing.assert_allclose(stats.std, allpix.std(0), rtol=1e-12)
        assert stats.images == 12 and stats.pixels == len(allpix)
    with pytest.raises(ConfigError, match="differ in size"):
        merged.mean_image()


def test_mean_image_and_sample_updates(tmp_path):
    rng = np.random.default_rng(5)
    stats, from_samples = ChannelStats(), ChannelStats()
    imgs = [rng.integers(0, 256, (6, 7, 3), dtype=np.uint8) for _ in range(4)]
    for i, img in enumerate(imgs):
        item = Item(f"k{i}", 0, InlineRef(img))
        sample = make_sample(item, ImageOptions(encode="png"), i, stats=stats)
        from_samples.update_from_sample(sample)
    np.testing.assert_allclose(stats.mean_image(), np.mean(imgs, axis=0).transpose(2, 0, 1), rtol=1e-6)
    assert stats.mean == from_samples.mean and stats.std == from_samples.std  # PNG is lossless
    with pytest.raises(ConfigError):
        stats.update_from_sample(Sample("t", 0, np.arange(3, dtype=np.int32), "tokens"))


def test_write_stats_for_mxnet_and_caffe(tmp_path):
    caffe_datum = pytest.importorskip("gpufeed.formats.caffe_datum")
    stats = ChannelStats()
    img = np.zeros((4, 5, 3), np.uint8)
    img[..., 0], img[..., 1], img[..., 2] = 10, 20, 30
    stats.update(img)
    img2 = img.copy()
    img2[..., 0] = 30
    stats.update(img2)
    info = write_stats(stats, str(tmp_path / "out"))
    doc = json.loads((tmp_path / "out" / "mean_std.json").read_text())
    assert (doc["mean_r"], doc["mean_g"], doc["mean_b"]) == (20.0, 20.0, 30.0)
    assert (doc["std_r"], doc["std_g"], doc["std_b"]) == (10.0, 0.0, 0.0)
    assert info["mean_binaryproto"] == "mean.binaryproto" and info["images"] == 2
    blob = caffe_datum.read_mean_binaryproto(str(tmp_path / "out" / "mean.binaryproto"))
    assert blob.reshape(3, 4, 5)[:, 0, 0].tolist() == [30.0, 20.0, 20.0]  # BGR planes, as Caffe's data
    stats.update(np.zeros((2, 2, 3), np.uint8))
    info = write_stats(stats, str(tmp_path / "vary"))
    assert info["mean_binaryproto"] is None and not (tmp_path / "vary" / "mean.binaryproto").exists()


def test_random_resized_crop_follows_torchvision_rules():
    rng = np.random.default_rng(0)
    for _ in range(500):
        i, j, h, w = random_resized_crop_params(375, 500, rng)
        assert 0 <= i <= 375 - h and 0 <= j <= 500 - w
        assert 0.08 * 0.95 <= h * w / (375 * 500) <= 1.0
        assert 3 / 4 * 0.95 <= w / h <= 4 / 3 * 1.05
    # An extreme panorama: every try fails, so the centre crop clamped to ratio 4/3 is used.
    assert random_resized_crop_params(10, 1000, rng) == (0, 493, 10, 13)
    img = photo(375, 500)
    flips = 0
    for seed in range(40):
        out = random_resized_crop_flip(img, 224, np.random.default_rng(seed))
        replay = np.random.default_rng(seed)
        i, j, h, w = random_resized_crop_params(375, 500, replay)
        expect = cv2.resize(img[i:i + h, j:j + w], (224, 224), interpolation=cv2.INTER_LINEAR)
        flipped = replay.random() < 0.5
        flips += flipped
        np.testing.assert_array_equal(out, expect[:, ::-1] if flipped else expect)
    assert 10 <= flips <= 30
    assert random_resized_crop_flip(img, (100, 120), rng).shape == (100, 120, 3)


def test_decode_crop_is_the_crop_of_the_full_decode_and_reduces_large_photos():
    """decode_crop draws the crop as random_resized_crop_flip does; a small photo decodes in full (the same
    pixels), a large one at a DCT scale-down (close to the full decode's crop, not equal)."""
    small = cv2.imencode(".jpg", photo(375, 500), [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
    large = cv2.imencode(".jpg", photo(1200, 1600, seed=1), [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
    for seed in range(6):
        full = random_resized_crop_flip(decode_image(small, "s"), 224, np.random.default_rng(seed))
        got = decode_crop(small, "s", 224, random_resized_crop_choice(np.random.default_rng(seed)))
        np.testing.assert_array_equal(got, full)
    whole = lambda h, w: ((0, 0, h, w), True)  # noqa: E731  a 1200 px box for 224: decoded at 1/4
    exact = decode_crop(large, "l", 224, whole, reduce=False)
    np.testing.assert_array_equal(exact, cv2.resize(decode_image(large, "l"), (224, 224))[:, ::-1])
    reduced = decode_crop(large, "l", 224, whole)
    assert reduced.shape == (224, 224, 3) and not np.array_equal(reduced, exact)
    assert np.abs(reduced.astype(int) - exact.astype(int)).mean() < 4
    assert reduction_for(probe(large, "l"), (1200 / 224, 1600 / 224)) == 4


def test_speed_bench_runs_in_a_tiny_configuration(tmp_path):
    from gpufeed.bench.results import load_results
    from gpufeed.bench.experiments.transform_speed import run

    result = run(n=3, repeats=1, out_path=str(tmp_path / "rows.jsonl"))
    assert set(result["loops"]) == {"limit", "cv2", "make_sample", "pillow"}
    assert all(r["img_per_s"] > 0 for r in result["loops"].values())
    rows = load_results(str(tmp_path / "rows.jsonl"))
    assert [r["params"]["loop"] for r in rows] == ["limit", "cv2", "make_sample", "pillow"]


def test_pass_through_leaves_stats_to_update_from_sample(tmp_path):
    item = jpeg_file(tmp_path, "s.jpg", photo(30, 40))
    stats = ChannelStats()
    sample = make_sample(item, ImageOptions(encode="pass"), 0, stats=stats)
    assert stats.images == 0
    stats.update_from_sample(sample)
    assert stats.images == 1 and stats.pixels == 30 * 40


def test_stats_stay_exact_beyond_float32_counts():
    # 4097 x 4096 = 16,781,312 pixels of one value: more than float32 counts exactly (2**24).
    img = np.full((4097, 4096), 3, np.uint8)
    img[0, 0] = 250
    stats = ChannelStats()
    stats.update(img)
    n = img.size
    assert stats.pixels == n and stats.mean[0] == (3 * (n - 1) + 250) / n
    assert stats.std[0] == pytest.approx(np.std(img.astype(np.float64)), rel=1e-12)


def test_write_stats_to_an_fsspec_url_and_gray():
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("gpufeed.formats.lmdb")
    stats = ChannelStats()
    stats.update(np.full((3, 3), 9, np.uint8))
    info = write_stats(stats, "memory://b2-stats/out")
    with fsspec.open("memory://b2-stats/out/mean_std.json", "rb") as f:
        doc = json.loads(f.read())
    assert doc["mean_r"] == 9.0 and doc["std_r"] == 0.0 and doc["channels"] == "gray" and "mean_g" not in doc
    assert info["mean_binaryproto"] == "mean.binaryproto"
    assert fsspec.filesystem("memory").exists("/b2-stats/out/mean.binaryproto")


@pytest.mark.parametrize("kwargs, python, flag", [
    (dict(max_size=0), "max_size must be a positive number", "--max-size must be a positive number"),
    (dict(resize=256, size=(3, 3)), "resize (shorter side) and size", "--resize (shorter side) and --size"),
    (dict(encode="pass", center_crop=True), "encode='pass' stores the original bytes, so it cannot be combined with "
     "center_crop", "--encode pass stores the original bytes, so it cannot be combined with --center-crop"),
    (dict(encode="jpeg", store_dtype="float16", mean=(1,), std=(2,)), "use encode='raw'", "use --encode raw"),
    (dict(quality=101), "quality must be within 1..100", "--quality must be within 1..100"),
    (dict(size=(0, 3)), "e.g. (227, 227), not (0, 3)", "e.g. 227x227, not 0x3"),
    (dict(encode="raw", store_dtype="float32", mean=(1, 2), std=(1,)), "mean has 2 values",
     "--mean has 2 values")])
def test_one_set_of_image_rules_speaks_python_to_the_api_and_flags_to_the_command_line(tmp_path, kwargs, python,
                                                                                        flag):
    """ImageOptions checks its rules once; built from `convert`'s flags (as ConvertOptions then holds it), its
    messages name the flags."""
    with pytest.raises(ConfigError) as api:
        ImageOptions(**{"encode": "jpeg", **kwargs})
    assert python in str(api.value)
    with pytest.raises(ConfigError) as cli:
        ImageOptions(**{"encode": None, **kwargs}, spelling="cli")
    assert flag in str(cli.value)


def test_every_image_option_is_a_flag_of_convert(tmp_path):
    """The image options are declared once (ImageFields); `convert`'s flags for them are built from the fields
    and parsed back into ConvertOptions by name, so a new field is a new flag."""
    import argparse
    import dataclasses

    from gpufeed.convert.command import add_arguments, options_from_args
    from gpufeed.pipelines.image_options import ImageFields

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = {a.dest for a in p._actions}
    assert set(ImageFields.names()) <= flags
    src = tmp_path / "src"
    src.mkdir()
    args = p.parse_args(["imagenet", str(src), "--to", "lmdb", "--out", str(tmp_path / "o"), "--size", "20x30",
                         "--max-size", "25", "--center-crop", "--encode", "raw", "--quality", "80",
                         "--store-dtype", "float32", "--mean", "1,2,3", "--std", "4,5,6", "--max-pixels", "1000",
                         "--no-validate"])
    o = options_from_args(args).image
    got = {f: getattr(o, f) for f in ImageFields.names()}
    assert got == {"resize": None, "size": (20, 30), "max_size": 25, "center_crop": True, "gray": False,
                   "encode": "raw", "quality": 80, "store_dtype": "float32", "mean": (1.0, 2.0, 3.0),
                   "std": (4.0, 5.0, 6.0), "max_pixels": 1000, "validate": False}
    gray = p.parse_args(["imagenet", str(src), "--to", "lmdb", "--out", str(tmp_path / "o"), "--gray", "--resize", "8"])
    assert options_from_args(gray).image.gray and options_from_args(gray).image.resize == 8
    defaults = options_from_args(p.parse_args(["imagenet", str(src), "--to", "lmdb", "--out", str(tmp_path / "o")])).image
    assert {f.name: getattr(defaults, f.name) for f in dataclasses.fields(ImageFields)} == {
        f.name: f.default for f in dataclasses.fields(ImageFields)}
