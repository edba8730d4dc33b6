"""The CPU workers' region decode (nvImageCodec's libjpeg-turbo backend decoding only a crop's box): the pixels of
decoding the whole image with OpenCV and cutting the box out, bit for bit, for every kind of JPEG it takes; every
other image decoded whole as before; and the loader's setting. Real JPEG bytes throughout (OpenCV's and Pillow's
encoders); nvImageCodec runs on the CPU here (no GPU needed)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import cv2
import numpy as np
import pytest
from PIL import Image

from gpufeed.errors import BadImageError, ConfigError
from gpufeed.formats.base import Sample
from gpufeed.pipelines.base import SynthRef
from gpufeed.pipelines.imageio import decode_region, nvimgcodec_module, probe, region_decodable
from gpufeed.pipelines.synth import photo_like
from gpufeed.pipelines.transforms import random_resized_crop_params

nv = nvimgcodec_module()
needs_nvimgcodec = pytest.mark.skipif(nv is None, reason="nvImageCodec is not installed (pip install '.[test]')")


def photo(h=375, w=500, seed=0) -> np.ndarray:
    return photo_like(np.random.default_rng(seed), h, w)


def cv2_jpeg(bgr, **params) -> bytes:
    flags = [cv2.IMWRITE_JPEG_QUALITY, params.pop("quality", 90)]
    for name, value in params.items():
        flags += [getattr(cv2, f"IMWRITE_JPEG_{name.upper()}"), value]
    ok, buf = cv2.imencode(".jpg", bgr, flags)
    assert ok
    return buf.tobytes()


def whole_then_cut(data: bytes, box) -> np.ndarray:
    top, left, h, w = box
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)[top:top + h, left:left + w]


JPEGS = {
    "baseline 4:2:0": lambda: cv2_jpeg(photo()),
    "4:2:2": lambda: cv2_jpeg(photo(seed=1), sampling_factor=cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422),
    "4:4:4": lambda: cv2_jpeg(photo(seed=2), sampling_factor=cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444),
    "progressive": lambda: cv2_jpeg(photo(seed=3), progressive=1),
    "restart markers": lambda: cv2_jpeg(photo(seed=4), rst_interval=4),
    "gray": lambda: cv2_jpeg(cv2.cvtColor(photo(seed=5), cv2.COLOR_BGR2GRAY)),
    "odd size": lambda: cv2_jpeg(photo(333, 499, seed=6)),
    "portrait, Pillow's encoder": lambda: _pil_jpeg(photo(500, 375, seed=7)),
}


def _pil_jpeg(bgr) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)).save(buf, "JPEG", quality=85)
    return buf.getvalue()


@needs_nvimgcodec
@pytest.mark.parametrize("kind", sorted(JPEGS))
def test_a_box_decoded_alone_is_the_whole_decode_cut(kind):
    data = JPEGS[kind]()
    info = probe(data, kind)
    assert region_decodable(info)
    rng = np.random.default_rng(0)
    boxes = [random_resized_crop_params(info.height, info.width, rng) for _ in range(12)]
    boxes += [(0, 0, info.height, info.width), (0, 0, 1, 1), (info.height - 7, info.width - 9, 7, 9)]
    for box in boxes:
        got = decode_region(data, info, box)
        assert got is not None and got.shape == (box[2], box[3], 3), (kind, box)
        assert np.array_equal(got, whole_then_cut(data, box)), (kind, box)


@needs_nvimgcodec
def test_cpu_decode_gives_the_same_crops_with_and_without_region_decode():
    """The workers' whole path (train's random-resized crop and flip, evaluation's centre crop, large photos that
    take the DCT scale-down instead) gives identical batches either way."""
    from gpufeed.pipelines.batches_cpu import CpuDecode
    from gpufeed.pipelines.sources_synthetic import is_large, make_data

    indices = list(range(12)) + [i for i in range(12, 200) if is_large(i)][:2]  # two 1600x1200 photos
    samples = [Sample(key=f"train/{i}.JPEG", label=0, payload=make_data(SynthRef("imagenet", 0, i)), index=i)
               for i in indices]
    for train in (True, False):
        region, whole = CpuDecode(train, 224, seed=3, region=True), CpuDecode(train, 224, seed=3, region=False)
        slot = np.empty((224, 224, 3), np.uint8)
        for s in samples:
            want = whole.pixels(s)
            assert np.array_equal(region.pixels(s), want), (train, s.index)
            assert np.array_equal(region.pixels(s, out=slot), want), (train, s.index)


@needs_nvimgcodec
@pytest.mark.parametrize("orientation", [3, 6])
def test_a_rotated_jpeg_is_decoded_whole_and_turned(orientation):
    """A box is drawn upright; an EXIF-rotated JPEG's stored pixels are not, so it is decoded whole (as before)."""
    from gpufeed.pipelines.batches_cpu import CpuDecode

    im = Image.fromarray(cv2.cvtColor(photo(120, 200), cv2.COLOR_BGR2RGB))
    exif = im.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, exif=exif.tobytes())
    data = buf.getvalue()
    info = probe(data, "r.jpg")
    assert not region_decodable(info) and decode_region(data, info, (0, 0, 10, 10)) is None
    sample = Sample(key="r.jpg", label=0, payload=data, index=1)
    for train in (True, False):
        assert np.array_equal(CpuDecode(train, 64, region=True).pixels(sample),
                              CpuDecode(train, 64, region=False).pixels(sample))


@needs_nvimgcodec
def test_cmyk_and_png_are_decoded_whole():
    from gpufeed.pipelines.batches_cpu import CpuDecode

    rgb = cv2.cvtColor(photo(64, 96), cv2.COLOR_BGR2RGB)
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(buf, "JPEG", quality=90)
    cmyk = buf.getvalue()
    assert probe(cmyk, "c.jpg").channels == 4 and not region_decodable(probe(cmyk, "c.jpg"))
    png = cv2.imencode(".png", photo(64, 96))[1].tobytes()
    assert not region_decodable(probe(png, "p.png"))
    for i, data in enumerate((cmyk, png)):
        sample = Sample(key=f"x{i}", label=0, payload=data, index=i)
        assert np.array_equal(CpuDecode(True, 48, region=True).pixels(sample),
                              CpuDecode(True, 48, region=False).pixels(sample))


@needs_nvimgcodec
def test_a_damaged_jpeg_fares_as_it_did_before():
    """A stream cut short is refused by name either way; one cut short but ended with an end-of-image marker is
    decoded by libjpeg-turbo either way, the missing rows filled alike."""
    from gpufeed.pipelines.batches_cpu import CpuDecode

    data = cv2_jpeg(photo())
    cut = Sample(key="train/n01/cut.JPEG", label=0, payload=data[:len(data) // 2], index=0)
    errors = []
    for region in (True, False):
        with pytest.raises(BadImageError) as e:
            CpuDecode(True, 224, region=region).pixels(cut)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "train/n01/cut.JPEG" in errors[0]
    ended = Sample(key="ended.JPEG", label=0, payload=data[:len(data) // 2] + b"\xff\xd9", index=0)
    for train in (True, False):
        assert np.array_equal(CpuDecode(train, 224, region=True).pixels(ended),
                              CpuDecode(train, 224, region=False).pixels(ended))


@needs_nvimgcodec
def test_threads_and_forked_children_decode_regions_each_with_their_own_decoder():
    """CPU decoders as threads of one process (bench.experiments.step_beside_load runs them so) and children forked
    from a process that has decoded: each gets the pixels it would alone. (Two threads sharing one nvImageCodec
    decoder aborted the process.)"""
    import concurrent.futures
    import multiprocessing

    data = [JPEGS[k]() for k in ("baseline 4:2:0", "4:2:2", "progressive", "gray")]
    infos = [probe(d, "t") for d in data]
    rng = np.random.default_rng(1)
    jobs = [(i % len(data), random_resized_crop_params(infos[i % len(data)].height, infos[i % len(data)].width, rng))
            for i in range(64)]
    want = [whole_then_cut(data[k], box) for k, box in jobs]

    args = [(data[k], box) for k, box in jobs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert all(np.array_equal(g, w) for g, w in zip(pool.map(_region_of, args), want))
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert all(np.array_equal(g, w) for g, w in zip(pool.map(_region_of, args[:8]), want[:8]))


def _region_of(args):
    data, box = args
    return decode_region(data, probe(data, "t"), box)


def _without_nvimgcodec(code: str) -> subprocess.CompletedProcess:
    """``code`` run in a fresh interpreter where ``from nvidia import nvimgcodec`` fails, as where it is not
    installed."""
    prelude = "import sys; sys.modules['nvidia.nvimgcodec'] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_without_nvimgcodec_images_are_decoded_whole_and_asking_for_region_decode_says_what_to_install():
    done = _without_nvimgcodec(
        "from gpufeed.pipelines.loader import region_decode_on\n"
        "from gpufeed.pipelines.imageio import region_decoder\n"
        "from gpufeed.errors import ConfigError\n"
        "assert region_decoder() is None and region_decode_on(None) is False and region_decode_on(False) is False\n"
        "try:\n"
        "    region_decode_on(True, '--region-decode on')\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
        # Asked for through the loader's options, refused as the caller spelt it: bench train's flag, the keyword.
        "from gpufeed.pipelines.loader import LoaderOptions\n"
        "for spelling in ('cli', 'python'):\n"
        "    try:\n"
        "        LoaderOptions(region_decode=True, spelling=spelling)\n"
        "    except ConfigError as e:\n"
        "        print(str(e).split(' decodes')[0])\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("--region-decode on decodes only each crop's box") and "gpufeed[gpu]" in done.stdout
    assert done.stdout.splitlines()[-2:] == ["--region-decode on", "region_decode=True"]


@needs_nvimgcodec
def test_nvimgcodec_imports_without_its_notices():
    """On import nvImageCodec writes a few lines to stderr for each codec library it lacks (here at least JPEG 2000
    and TIFF, which the gpu extra does not install); a DataLoader worker importing it says nothing."""
    code = ("import sys, threading\n"
            "from gpufeed.pipelines.imageio import region_decoder\n"
            "threads = [threading.Thread(target=region_decoder) for _ in range(8)]\n"  # importing at once
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "assert region_decoder() is not None\n"
            "print('done'); print('still here', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Nothing of nvImageCodec's, and both streams lead where they did before the import.
    assert done.stdout == "done\n" and done.stderr == "still here\n"


@needs_nvimgcodec
def test_the_loader_decodes_regions_where_it_can_and_rows_say_so(tmp_path):
    pytest.importorskip("torch")
    import gpufeed
    from gpufeed.bench.dataset import build_dataset, load_dataset_info

    build_dataset(str(tmp_path / "ds"), n=16, formats=("recordio",), workers=2)
    paths = load_dataset_info(str(tmp_path / "ds"))["formats"]["recordio"]["paths"]
    on = gpufeed.loader(paths, batch_size=8, decode="cpu", workers=0, device="cpu")
    off = gpufeed.loader(paths, batch_size=8, decode="cpu", workers=0, device="cpu", region_decode=False)
    assert on.region_decode is True and off.region_decode is False
    (x_on, y_on), (x_off, y_off) = next(iter(on)), next(iter(off))
    assert torch_equal(x_on, x_off) and torch_equal(y_on, y_off)
    with pytest.raises(ConfigError, match="region_decode"):
        gpufeed.loader(paths, batch_size=8, decode="cpu", workers=0, device="cpu", region_decode="yes")


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))
