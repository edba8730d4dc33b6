"""Every known kind of bad or unusual image file, as real bytes, has the outcome docs/transforms.md states."""

from __future__ import annotations

import io
import pickle
import struct

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from gpufeed.errors import BadImageError, DecompressionBombError
from gpufeed.pipelines.base import FileRef, InlineRef, Item
from gpufeed.pipelines.imageio import DEFAULT_MAX_PIXELS, decode_image, probe
from gpufeed.pipelines.transforms import ImageOptions, make_sample


def smooth_rgb(h=80, w=120, seed=0):
    """Photo-like content (smooth gradients) so JPEG round trips stay close to the original."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_LINEAR)


def pil_bytes(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def jpeg(rgb, quality=95) -> bytes:
    return pil_bytes(Image.fromarray(rgb), "JPEG", quality=quality)


def item_for(tmp_path, name, data) -> Item:
    path = tmp_path / name
    path.write_bytes(data)
    return Item(name, 0, FileRef(str(path)))


def test_cmyk_jpeg_becomes_rgb(tmp_path):
    rgb = smooth_rgb()
    rgb[:20, :30] = (255, 0, 0)
    data = pil_bytes(Image.fromarray(rgb).convert("CMYK"), "JPEG", quality=95)
    assert b"Adobe" in data[:200]  # the Adobe APP14 marker, as in ImageNet's Photoshop-made CMYK files
    out = decode_image(data, "cmyk.JPEG")
    assert out.shape == rgb.shape
    assert np.abs(out.astype(int) - rgb).mean() < 3
    assert np.abs(out[5, 5].astype(int) - (255, 0, 0)).max() <= 6
    sample = make_sample(item_for(tmp_path, "n01739381_1309.JPEG", data), ImageOptions(encode="raw"), 0)
    assert sample.meta["channels"] == 3 and sample.payload.shape == (80, 120, 3)


def test_grayscale_jpeg_becomes_rgb_or_stays_gray(tmp_path):
    gray = smooth_rgb()[..., 0]
    data = pil_bytes(Image.fromarray(gray), "JPEG", quality=95)
    out = decode_image(data, "g.jpg")
    assert out.shape == (80, 120, 3)
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()
    item = item_for(tmp_path, "g.jpg", data)
    kept = make_sample(item, ImageOptions(encode="raw", gray=True), 0)
    assert kept.payload.shape == (80, 120, 1) and kept.meta["channels"] == 1
    assert probe(data, "g.jpg").channels == 1


def test_png_named_jpeg_is_detected_by_its_bytes(tmp_path):
    rgb = smooth_rgb()
    data = pil_bytes(Image.fromarray(rgb), "PNG")
    sample = make_sample(item_for(tmp_path, "n02105855_2933.JPEG", data), ImageOptions(encode="raw"), 0)
    assert sample.meta["source_format"] == "PNG"
    np.testing.assert_array_equal(sample.payload, rgb)
    # Pass-through cannot keep it (a JPEG decoder would refuse it): stored as an RGB JPEG, and said so.
    passed = make_sample(item_for(tmp_path, "x.JPEG", data), ImageOptions(encode="pass"), 0)
    assert passed.meta["format"] == "JPEG" and passed.payload.startswith(b"\xff\xd8")
    assert passed.meta["converted"] == "a PNG file, not a JPEG: stored as an RGB JPEG (quality 95)"
    back = cv2.cvtColor(cv2.imdecode(np.frombuffer(passed.payload, np.uint8), cv2.IMREAD_UNCHANGED), cv2.COLOR_BGR2RGB)
    assert np.abs(back.astype(int) - rgb).mean() < 2


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95, -2])
def test_truncated_jpeg_is_refused(tmp_path, keep):
    data = jpeg(smooth_rgb(240, 320))
    cut = data[:keep] if keep < 0 else data[:int(len(data) * keep)]
    with pytest.raises(BadImageError, match="truncated JPEG") as err:
        make_sample(item_for(tmp_path, "cut.jpg", cut), ImageOptions(resize=64), 0)
    assert "cut.jpg" in str(err.value) and "--on-error skip" in str(err.value)


def test_truncation_is_found_from_the_bytes_not_the_decoder():
    # OpenCV 4.x's libjpeg pads a truncated scan with grey and only warns (5.x returns None): the
    # header check must refuse the file before any decoder sees it.
    data = jpeg(smooth_rgb(240, 320))
    with pytest.raises(BadImageError, match="end-of-image marker is missing"):
        probe(data[:int(len(data) * 0.6)], "cut.jpg")
    data_with_trailer = data + b"\x00" * 64  # padding after EOI, common from some cameras, is fine
    assert decode_image(data_with_trailer, "ok.jpg").shape == (240, 320, 3)


def test_truncated_png_is_refused():
    data = pil_bytes(Image.fromarray(smooth_rgb()), "PNG")
    with pytest.raises(BadImageError, match="truncated PNG"):
        decode_image(data[: len(data) - 20], "cut.png")


@pytest.mark.parametrize("data", [b"<html>404 Not Found</html>", bytes(range(256)) * 4,
                                  b"\xff\xd8\xff\xe0\x00\x10JFIF\x00garbage", b"\x89PNG\r\n\x1a\nIHDRxx"])
def test_corrupt_bytes_are_refused(data):
    with pytest.raises(BadImageError):
        decode_image(data, "bad.jpg")


def test_stray_bytes_between_segments_are_tolerated_like_libjpeg():
    data = jpeg(smooth_rgb(40, 60))
    dqt = data.index(b"\xff\xdb")
    padded = data[:dqt] + b"\x00\x00junk" + data[dqt:]
    np.testing.assert_array_equal(decode_image(padded, "pad.jpg"), decode_image(data, "ok.jpg"))


def test_frame_header_libjpeg_rejects_is_refused():
    data = bytearray(jpeg(smooth_rgb(240, 320)))
    sof = data.index(b"\xff\xc0")
    data[sof + 9] = 0  # zero components in the frame: the header parses, libjpeg refuses it
    with pytest.raises(BadImageError, match="libjpeg could not decode"):
        decode_image(bytes(data), "bad.jpg")


def test_zero_byte_file_is_refused(tmp_path):
    with pytest.raises(BadImageError, match="empty") as err:
        make_sample(item_for(tmp_path, "empty.JPEG", b""), ImageOptions(), 0)
    assert "empty.JPEG" in str(err.value)


def test_16_bit_png_is_scaled_to_8_bit():
    rgb = smooth_rgb()
    deep = rgb.astype(np.uint16) * 257  # 8-bit values stretched exactly onto 0..65535
    ok, buf = cv2.imencode(".png", deep[..., ::-1])
    assert ok
    out = decode_image(buf.tobytes(), "deep.png")
    np.testing.assert_array_equal(out, rgb)
    gray16 = Image.fromarray(rgb[..., 1].astype(np.uint16) * 257)
    out = decode_image(pil_bytes(gray16, "PNG"), "g16.png")
    np.testing.assert_array_equal(out[..., 0], rgb[..., 1])


def test_palette_png_expands_to_its_colours():
    rgb = smooth_rgb()
    pal = Image.fromarray(rgb).convert("P", palette=Image.ADAPTIVE, colors=16)
    out = decode_image(pil_bytes(pal, "PNG"), "pal.png")
    np.testing.assert_array_equal(out, np.asarray(pal.convert("RGB")))


def test_alpha_is_composited_on_white():
    rgba = np.zeros((10, 10, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:, :5, 3] = 255  # left half opaque red-ish, right half fully transparent
    rgba[0, 9, 3] = 128
    out = decode_image(pil_bytes(Image.fromarray(rgba, "RGBA"), "PNG"), "a.png")
    assert tuple(out[0, 0]) == (200, 0, 0)
    assert tuple(out[5, 9]) == (255, 255, 255)
    assert tuple(out[0, 9]) == (227, 127, 127)  # round((200*128 + 255*127)/255), round(255*127/255)
    la = Image.fromarray(np.dstack([np.full((4, 4), 50, np.uint8), np.zeros((4, 4), np.uint8)]), "LA")
    assert (decode_image(pil_bytes(la, "PNG"), "la.png") == 255).all()
    pal = Image.fromarray(rgba, "RGBA").convert("P", palette=Image.ADAPTIVE)
    out = decode_image(pil_bytes(pal, "PNG", transparency=pal.getpixel((9, 5))), "pt.png")
    assert tuple(out[5, 9]) == (255, 255, 255)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_like_pillow(tmp_path, orientation):
    rgb = smooth_rgb(60, 100)
    rgb[:10, :10] = (255, 255, 255)  # a marker corner that moves with the orientation
    im = Image.fromarray(rgb)
    exif = im.getexif()
    exif[0x0112] = orientation
    data = pil_bytes(im, "JPEG", quality=95, exif=exif.tobytes())
    expect = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    out = decode_image(data, "r.jpg")
    assert out.shape == expect.shape
    assert np.abs(out.astype(int) - expect).mean() < 1.5
    sample = make_sample(item_for(tmp_path, "r.jpg", data), ImageOptions(encode="pass"), 0)
    assert (sample.meta["height"], sample.meta["width"]) == expect.shape[:2]


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_png_exif_orientation_is_applied(orientation):
    rgb = smooth_rgb(30, 50)
    rgb[:5, :5] = (255, 255, 255)
    im = Image.fromarray(rgb)
    exif = im.getexif()
    exif[0x0112] = orientation
    data = pil_bytes(im, "PNG", exif=exif.tobytes())
    expect = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    np.testing.assert_array_equal(decode_image(data, "r.png"), expect)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_one_pixel_image_decodes_and_upscales(tmp_path, fmt):
    data = pil_bytes(Image.new("RGB", (1, 1), (10, 200, 30)), fmt)
    assert decode_image(data, "1x1").shape == (1, 1, 3)
    sample = make_sample(item_for(tmp_path, "one", data), ImageOptions(resize=32, encode="raw"), 0)
    assert sample.payload.shape == (32, 32, 3)
    assert np.abs(sample.payload.astype(int) - (10, 200, 30)).max() <= 3


@pytest.fixture(scope="module")
def huge_png():
    """A real 10000x10000 gray PNG (100 M pixels; ~100 KB on disk because it is uniform)."""
    return pil_bytes(Image.new("L", (10000, 10000), 77), "PNG", compress_level=1)


def test_10000_square_is_a_bomb_by_default(tmp_path, huge_png):
    assert 10000 * 10000 > DEFAULT_MAX_PIXELS
    with pytest.raises(DecompressionBombError, match="10000x10000") as err:
        make_sample(item_for(tmp_path, "big.png", huge_png), ImageOptions(resize=256), 0)
    assert "max-pixels" in str(err.value)


def test_10000_square_decodes_when_allowed(tmp_path, huge_png):
    opts = ImageOptions(resize=256, encode="raw", max_pixels=10000 * 10000)
    sample = make_sample(item_for(tmp_path, "big.png", huge_png), opts, 0)
    assert sample.payload.shape == (256, 256, 3) and (sample.payload == 77).all()


def test_bomb_header_is_refused_before_any_pixel_is_allocated():
    data = bytearray(jpeg(smooth_rgb(8, 8)))
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, 60000, 60000)  # claims 3.6 G pixels: 10 GiB if decoded
    with pytest.raises(DecompressionBombError, match="60000x60000"):
        decode_image(bytes(data), "bomb.jpg")


@pytest.mark.parametrize("fmt", ["BMP", "GIF", "WEBP", "TIFF"])
def test_other_formats_decode_through_pillow(fmt):
    rgb = smooth_rgb()
    data = pil_bytes(Image.fromarray(rgb), fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    out = decode_image(data, f"x.{fmt.lower()}")
    assert out.shape == rgb.shape
    if fmt != "GIF":  # GIF quantises to 256 colours
        np.testing.assert_array_equal(out, rgb)


def test_errors_pickle_with_their_message():
    with pytest.raises(BadImageError) as err:
        decode_image(b"", "some/file.JPEG")
    again = pickle.loads(pickle.dumps(err.value))
    assert type(again) is BadImageError and str(again) == str(err.value)


def test_progressive_jpeg_downscales_and_truncation_is_found():
    rgb = smooth_rgb(400, 600)
    data = pil_bytes(Image.fromarray(rgb), "JPEG", quality=90, progressive=True)
    sample = make_sample(Item("p", 0, InlineRef(data)), ImageOptions(resize=100, encode="raw"), 0)
    assert sample.payload.shape == (100, 150, 3)  # decoded at 1/4 in the DCT domain, then resized
    assert np.abs(sample.payload.astype(int) - cv2.resize(rgb, (150, 100), interpolation=cv2.INTER_AREA)).mean() < 3
    with pytest.raises(BadImageError, match="truncated"):
        decode_image(data[: len(data) * 2 // 3], "p.jpg")  # cut between scans: earlier scans are complete


def test_cmyk_jpeg_to_gray():
    rgb = smooth_rgb(40, 60)
    data = pil_bytes(Image.fromarray(rgb).convert("CMYK"), "JPEG", quality=95)
    sample = make_sample(Item("c", 0, InlineRef(data)), ImageOptions(encode="raw", gray=True), 0)
    expect = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    assert sample.payload.shape == (40, 60, 1)
    assert np.abs(sample.payload[..., 0].astype(int) - expect).mean() < 3


@pytest.fixture(scope="module")
def seeds():
    rgb = smooth_rgb(24, 32)
    im = Image.fromarray(rgb)
    exif = im.getexif()
    exif[0x0112] = 6
    return [jpeg(rgb, 80), pil_bytes(im, "JPEG", exif=exif.tobytes(), progressive=True),
            pil_bytes(im, "PNG"), pil_bytes(im.convert("P"), "PNG", transparency=0), pil_bytes(im, "GIF")]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_bytes_end_in_an_image_or_a_bad_image_error(seeds, data):
    """Flipped, cut and inserted bytes in real files: decoding returns pixels or raises BadImageError."""
    buf = bytearray(data.draw(st.sampled_from(seeds)))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[at] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del buf[at:at + data.draw(st.integers(1, 64))]
        else:
            buf[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    try:
        out = decode_image(bytes(buf), "fuzz.jpg", max_pixels=1 << 22)
    except BadImageError:
        return
    assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3


def test_a_png_colour_profile_libpng_dislikes_prints_nothing_and_decodes(capfd):
    """libpng prints `libpng warning: iCCP: ...` on the process's stderr, naming no file, for a profile it
    dislikes; the profile is not used in decoding, so it is left out of what libpng sees (the stored bytes keep
    it)."""
    import zlib

    from gpufeed.pipelines.imageio import decode, without_icc_profile

    pixels = np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    png = cv2.imencode(".png", pixels)[1].tobytes()

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    profiled = png[:33] + chunk(b"iCCP", b"ICC Profile\0\0" + zlib.compress(b"not a profile" * 3)) + png[33:]
    assert without_icc_profile(profiled) == png and without_icc_profile(png) is png
    img = decode(profiled, probe(profiled, "photo.png"), "photo.png")
    assert np.array_equal(img, pixels)
    assert "libpng" not in capfd.readouterr().err
