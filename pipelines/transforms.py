"""The transforms conversion applies to each input, and the statistics it gathers on the way.

:func:`make_sample` is the whole per-item pipeline: read the item, decode it once (DCT-domain downscaled
when the file is much larger than needed), crop/resize, encode, and describe the result. It is a pure
function of ``(item, options, index)``, with options in a frozen, picklable :class:`ImageOptions`, so
Ray tasks call it directly. Geometry follows MXNet's ``im2rec.py`` (shorter side, floor, INTER_LINEAR,
centre square crop before resizing) or Caffe's ``convert_imageset`` (exact ``HxW``).

Example::

    opts = ImageOptions(resize=256, encode="jpeg", quality=95)
    sample = make_sample(item, opts, index=0)   # Sample(kind="encoded", payload=b"\\xff\\xd8...")

:class:`ChannelStats` holds exact integer sums, so per-worker partials merge into the split's exact
per-channel mean and std; :func:`write_stats` writes them for Caffe and MXNet.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from gpufeed.errors import ConfigError, InputError
from gpufeed.formats.base import Sample
from gpufeed.pipelines.base import Item, read_item
from gpufeed.pipelines.image_options import ENCODINGS, ImageOptions
from gpufeed.pipelines.imageio import ImageInfo, decode, decode_image, decode_region, probe, reduction_for

# Fast JPEG validation for pass-through: entropy-decodes every scan (so corruption is found) but runs
# the inverse DCT at 1/8 size.
_VALIDATE_REDUCTION = 8


def output_geometry(height: int, width: int, options: ImageOptions):
    """``((y, x, h, w), (out_h, out_w))``: the crop box in the upright input and the stored size."""
    y = x = 0
    ch, cw = height, width
    if options.center_crop:
        if ch > cw:
            y = (ch - cw) // 2
            ch = cw
        else:
            x = (cw - ch) // 2
            cw = ch
    oh, ow = ch, cw
    if options.resize:
        s = options.resize
        if ch > cw:
            oh, ow = ch * s // cw, s
        else:
            oh, ow = s, cw * s // ch
    elif options.size:
        oh, ow = options.size
    m = options.max_size
    if m and max(oh, ow) > m:
        if oh >= ow:
            oh, ow = m, max(1, ow * m // oh)
        else:
            oh, ow = max(1, oh * m // ow), m
    return (y, x, ch, cw), (oh, ow)


def crop_resize(img: np.ndarray, full_hw, box, out_hw) -> np.ndarray:
    """Cut ``box`` (given in ``full_hw`` coordinates; ``img`` may be DCT-reduced) and resize to ``out_hw``."""
    import cv2

    y, x, ch, cw = box
    fh, fw = full_hw
    ih, iw = img.shape[:2]
    if (ih, iw) != (fh, fw):
        # Reduced decode: map the box by the actual ratio (libjpeg rounds reduced sizes up).
        y, ch = round(y * ih / fh), max(1, round(ch * ih / fh))
        x, cw = round(x * iw / fw), max(1, round(cw * iw / fw))
    if (y, x, ch, cw) != (0, 0, ih, iw):
        img = img[y:y + ch, x:x + cw]
    if img.shape[:2] != out_hw:
        img = cv2.resize(img, (out_hw[1], out_hw[0]), interpolation=cv2.INTER_LINEAR)
    return img


def make_sample(item: Item, options: ImageOptions, index: int, stats: "ChannelStats | None" = None,
                data=None) -> Sample:
    """Turn one source item into the :class:`Sample` a writer stores.

    Image files are decoded once, transformed and encoded per ``options``; inline HWC uint8 RGB arrays
    (CIFAR) take the same transforms; inline 1-D integer arrays (PTB) become ``kind="tokens"``. When
    ``stats`` is given it is updated with the stored pixels before encoding (no second decode); with
    ``encode="pass"`` nothing is decoded in full, so ``stats`` is left alone: use
    :meth:`ChannelStats.update_from_sample` on the result. ``data`` is the item's bytes when the caller
    has already read them (a worker reading ahead), else they are read here.
    Raises :class:`~gpufeed.errors.BadImageError`, :class:`~gpufeed.errors.DecompressionBombError` or
    :class:`~gpufeed.errors.InputError`, each naming ``item.origin``.
    """
    if options.encode is None:
        raise ConfigError("ImageOptions(encode=None) leaves the encoding to a conversion; choose one of "
                          f"{', '.join(ENCODINGS)} to apply them to an image")
    if data is None:
        data = read_item(item)
    origin = item.origin
    meta = dict(item.meta)
    meta["source"] = origin
    if isinstance(data, np.ndarray):
        if data.ndim == 1:
            return Sample(item.key, item.label, _tokens(data, origin), "tokens", index, meta)
        if options.encode == "pass":
            raise InputError(origin, "inline pixels have no original file bytes to pass through",
                             "store them with encode='png' (lossless) or 'raw'")
        img, is_bgr, src_format = _pixels(data, options, origin), False, "RAW"
    else:
        info = probe(data, origin, options.max_pixels)
        src_format = info.format
        if options.encode == "pass":
            change = pass_through_change(info)
            if change is None:
                if options.validate:
                    decode(data, info, origin, gray=True, reduce=_VALIDATE_REDUCTION)
                meta.update(height=info.height, width=info.width, channels=3, format=info.format)
                return Sample(item.key, item.label, bytes(data), "encoded", index, meta)
            # Kept as they are, these would decode to 1 or 4 channels (or not as JPEG) in the readers'
            # default calls, and a batch would fail to stack: stored as an RGB JPEG instead, and listed.
            options = dataclasses.replace(options, encode="jpeg")
            meta["converted"] = f"{change}: stored as an RGB JPEG (quality {options.quality})"
        box, out_hw = output_geometry(info.height, info.width, options)
        check_stored_size(out_hw, options, origin)
        reduce = reduction_for(info, (box[2] / out_hw[0], box[3] / out_hw[1]))
        img = decode(data, info, origin, gray=options.gray, reduce=reduce)
        img = crop_resize(img, (info.height, info.width), box, out_hw)
        is_bgr = True
    if stats is not None:
        stats.update(img, bgr=is_bgr)
    payload, kind, fmt = _encode(img, is_bgr, options, origin)
    meta.update(height=img.shape[0], width=img.shape[1], channels=1 if img.ndim == 2 else img.shape[2],
                format=fmt)
    if fmt == "RAW" and src_format != "RAW":
        meta["source_format"] = src_format
    return Sample(item.key, item.label, payload, kind, index, meta)


def pass_through_change(info: ImageInfo) -> str | None:
    """Why pass-through cannot keep an image's bytes, or ``None`` for an RGB (YCbCr) JPEG, which every
    reader decodes to 3 channels by default. (A header claiming another number of components is a damaged
    file: validation refuses it, and ``--no-validate`` keeps it as it is, as asked.)"""
    if info.format != "JPEG":
        return f"a {info.format} file, not a JPEG"
    return {1: "a grayscale JPEG", 4: "a CMYK JPEG"}.get(info.channels)


def _tokens(data: np.ndarray, origin: str) -> np.ndarray:
    if data.dtype == np.int32:
        return data
    if not np.issubdtype(data.dtype, np.integer):
        raise InputError(origin, f"a 1-D {data.dtype} array is not token ids", "token ids must be integers")
    if data.size and (data.min() < 0 or data.max() > np.iinfo(np.int32).max):
        raise InputError(origin, "token ids outside 0..2**31-1", "the vocabulary is too large for int32 ids")
    return data.astype(np.int32)


def _pixels(data: np.ndarray, options: ImageOptions, origin: str) -> np.ndarray:
    """An inline HWC uint8 RGB (or HW gray) array, transformed like a decoded file (kept in RGB order)."""
    import cv2

    if data.dtype != np.uint8 or data.ndim not in (2, 3) or (data.ndim == 3 and data.shape[2] not in (1, 3)):
        raise InputError(origin, f"inline pixels of shape {data.shape} and dtype {data.dtype}",
                         "inline images must be HxWx3 (RGB) or HxW uint8 arrays")
    img = data[..., 0] if data.ndim == 3 and data.shape[2] == 1 else data
    if options.gray and img.ndim == 3:
        img = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)
    elif not options.gray and img.ndim == 2:
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
    if options.geometry_changes:
        box, out_hw = output_geometry(img.shape[0], img.shape[1], options)
        check_stored_size(out_hw, options, origin)
        img = crop_resize(img, img.shape[:2], box, out_hw)
    return img


def check_stored_size(out_hw, options: ImageOptions, origin: str) -> None:
    """Refuse, before anything is allocated, an image the options would store larger than a decoded one may be
    (``max_pixels``) or with a side no JPEG holds: a 20000x1 PNG resized to 256 on its shorter side would be
    5,120,000 pixels wide."""
    from gpufeed.errors import DecompressionBombError
    from gpufeed.pipelines import MAX_SIDE

    h, w = out_hw
    fix = "cap the longer side with --max-size, or leave the image out with --on-error skip"
    if h * w > options.max_pixels:
        raise DecompressionBombError(origin, f"would be stored as {w}x{h} = {h * w} pixels, over the limit of "
                                     f"{options.max_pixels} (--max-pixels)", fix)
    if max(h, w) > MAX_SIDE:
        raise InputError(origin, f"would be stored as {w}x{h}, a side over {MAX_SIDE} pixels, the most a JPEG "
                         "holds", fix)


def _encode(img: np.ndarray, is_bgr: bool, options: ImageOptions, origin: str):
    """``(payload, kind, format)`` for the stored sample."""
    import cv2

    colour = img.ndim == 3
    if options.encode == "raw":
        if colour and is_bgr:
            img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        img = np.ascontiguousarray(img if colour else img[..., None])
        if options.store_dtype != "uint8":
            img = normalise(img, options.mean, options.std, options.store_dtype)
        return img, "raw", "RAW"
    if colour and not is_bgr:
        img = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
    if options.encode == "jpeg":
        ok, buf = cv2.imencode(".jpg", img, (cv2.IMWRITE_JPEG_QUALITY, options.quality))
        fmt = "JPEG"
    else:
        ok, buf = cv2.imencode(".png", img)
        fmt = "PNG"
    if not ok:
        raise InputError(origin, f"OpenCV could not encode a {img.shape} image as {fmt}",
                         "report this input: it decoded but cannot be re-encoded")
    return buf.tobytes(), "encoded", fmt


def normalise(rgb: np.ndarray, mean, std, dtype: str = "float32") -> np.ndarray:
    """``(pixel - mean) / std`` per channel, in pixel units (0-255), as ``dtype``."""
    out = rgb.astype(np.float32)
    if mean is not None:
        out -= np.asarray(mean, np.float32)
    if std is not None:
        out *= 1.0 / np.asarray(std, np.float32)
    return out.astype(dtype, copy=False)


_VALUES = np.arange(256, dtype=np.int64)
_SQUARES = _VALUES * _VALUES
_EXACT_FLOAT32 = 1 << 24


class ChannelStats:
    """Exact per-channel pixel statistics of a split, mergeable across workers.

    Sums of pixel values and of their squares are Python integers, so partial results from any number of
    workers merge without rounding and the mean/std are those of the whole split, computed once. A
    per-pixel sum (for Caffe's mean image) is kept while every image has the same shape.
    """

    def __init__(self):
        self.images = 0
        self.pixels = 0  # per channel
        self.channels: int | None = None
        self._sum: list[int] | None = None
        self._sumsq: list[int] | None = None
        self._pixel_sum: np.ndarray | None = None  # HWC int64, RGB
        self.same_shape = True

    def update(self, pixels: np.ndarray, bgr: bool = False) -> None:
        """Add one uint8 image (HxWxC RGB, or BGR when ``bgr``; or HxW gray)."""
        if pixels.dtype != np.uint8:
            raise ConfigError(f"channel statistics take uint8 pixels, not {pixels.dtype}; gather them before "
                              "normalising (make_sample(..., stats=...))")
        img = pixels if pixels.ndim == 3 else pixels[..., None]
        c = img.shape[2]
        order = range(c - 1, -1, -1) if bgr and c == 3 else range(c)
        if self.channels is None:
            self.channels = c
            self._sum, self._sumsq = [0] * c, [0] * c
        elif c != self.channels:
            raise ConfigError(f"an image with {c} channels among images with {self.channels}; convert all "
                              "to colour or all to gray (ImageOptions.gray)")
        # A 256-bin histogram per channel gives exact sums and sums of squares far cheaper than squaring
        # every pixel. cv2.calcHist counts in float32, exact below 2**24, so tall images go in row bands.
        import cv2

        height, width = pixels.shape[:2]
        band = max(1, _EXACT_FLOAT32 // width)
        for ch, src in enumerate(order):
            counts = np.zeros(256, np.int64)
            for top in range(0, height, band):
                part = pixels[top:top + band]
                counts += cv2.calcHist([part], [src], None, [256], (0, 256)).ravel().astype(np.int64)
            self._sum[ch] += int(counts @ _VALUES)
            self._sumsq[ch] += int(counts @ _SQUARES)
        self.pixels += height * width
        if bgr and c == 3:
            img = img[..., ::-1]
        if self.same_shape:
            if self._pixel_sum is None and self.images == 0:
                self._pixel_sum = img.astype(np.int64)
            elif self._pixel_sum is not None and self._pixel_sum.shape == img.shape:
                self._pixel_sum += img
            else:
                self._pixel_sum, self.same_shape = None, False
        self.images += 1

    def update_from_sample(self, sample: Sample) -> None:
        """Add a stored sample: raw uint8 pixels as they are, encoded images as a reader decodes them."""
        if sample.kind == "raw":
            self.update(np.asarray(sample.payload))
        elif sample.kind == "encoded":
            gray = sample.meta.get("channels") == 1
            rgb = decode_image(sample.payload, str(sample.meta.get("source", sample.key)), max_pixels=2**62)
            self.update(rgb[..., 0] if gray else rgb)
        else:
            raise ConfigError(f"sample {sample.key!r} holds {sample.kind}; channel statistics are for images")

    def state(self) -> tuple[dict, np.ndarray | None]:
        """What rebuilds these statistics elsewhere (:meth:`from_state`): the JSON-safe fields, with exact
        integer sums, and the per-pixel sum (``None`` once shapes differ)."""
        return {k: v for k, v in vars(self).items() if k != "_pixel_sum"}, self._pixel_sum

    @classmethod
    def from_state(cls, fields: dict, pixel_sum: np.ndarray | None) -> "ChannelStats":
        stats = cls()
        vars(stats).update(fields)
        stats._pixel_sum = pixel_sum
        return stats

    def merge(self, other: "ChannelStats") -> "ChannelStats":
        """Add ``other``'s partial sums into this one (order does not matter); returns ``self``."""
        if other.images == 0:
            return self
        if self.images == 0:
            self.__dict__.update({k: (v.copy() if isinstance(v, (list, np.ndarray)) else v)
                                  for k, v in other.__dict__.items()})
            return self
        if other.channels != self.channels:
            raise ConfigError(f"cannot merge statistics of {other.channels}-channel images into "
                              f"{self.channels}-channel ones")
        self._sum = [a + b for a, b in zip(self._sum, other._sum)]
        self._sumsq = [a + b for a, b in zip(self._sumsq, other._sumsq)]
        self.pixels += other.pixels
        self.images += other.images
        if (self.same_shape and other.same_shape and self._pixel_sum is not None
                and other._pixel_sum is not None and self._pixel_sum.shape == other._pixel_sum.shape):
            self._pixel_sum += other._pixel_sum  # this object owns its array (copied on first merge)
        else:
            self._pixel_sum, self.same_shape = None, False
        return self

    def _require(self):
        if not self.pixels:
            raise ConfigError("no images were added to these statistics")

    @property
    def mean(self) -> tuple[float, ...]:
        """Per-channel mean in pixel units (0-255), RGB order."""
        self._require()
        return tuple(s / self.pixels for s in self._sum)

    @property
    def std(self) -> tuple[float, ...]:
        """Per-channel population standard deviation, pixel units, RGB order."""
        self._require()
        n = self.pixels
        # n*sumsq - sum^2 is an exact integer, so no catastrophic cancellation.
        return tuple(math.sqrt(n * q - s * s) / n for s, q in zip(self._sum, self._sumsq))

    def mean_image(self) -> np.ndarray:
        """The per-pixel mean image, CHW float32 RGB (what Caffe's compute_image_mean gives, in RGB)."""
        self._require()
        if self._pixel_sum is None:
            raise ConfigError("the images differ in size, so there is no mean image; use the per-channel "
                              "mean (Caffe transform_param mean_value) or convert with an exact --size")
        return np.ascontiguousarray((self._pixel_sum / self.images).astype(np.float32).transpose(2, 0, 1))


MEAN_STD_JSON = "mean_std.json"
MEAN_BINARYPROTO = "mean.binaryproto"


def write_stats(stats: ChannelStats, dst_dir_url: str) -> dict:
    """Write ``mean_std.json`` (MXNet ImageRecordIter's ``mean_r``... ``std_b``) and, when every image
    had the same size, ``mean.binaryproto`` (Caffe mean image, BGR planes as Caffe's data are BGR).
    Returns the statistics as a dict for the manifest.
    """
    from gpufeed.formats.atomic import write_file
    from gpufeed.io import is_local, local_path

    base = dst_dir_url.rstrip("/")
    if is_local(base):
        import os

        os.makedirs(local_path(base), exist_ok=True)
    mean, std = stats.mean, stats.std
    names = "rgb" if len(mean) == 3 else "r"
    doc = {f"mean_{c}": m for c, m in zip(names, mean)}
    doc.update({f"std_{c}": s for c, s in zip(names, std)})
    doc.update(mean=list(mean), std=list(std), channels="RGB" if len(mean) == 3 else "gray",
               units="pixel values 0-255", images=stats.images, pixels_per_channel=stats.pixels)
    write_file(f"{base}/{MEAN_STD_JSON}", (json.dumps(doc, indent=2) + "\n").encode(), "stats")
    result = dict(doc, mean_std_json=MEAN_STD_JSON, mean_binaryproto=None)
    if stats.same_shape:
        from gpufeed.formats.caffe_datum import write_mean_binaryproto

        chw = stats.mean_image()
        write_mean_binaryproto(f"{base}/{MEAN_BINARYPROTO}", chw, order="RGB")
        result.update(mean_binaryproto=MEAN_BINARYPROTO, mean_image_shape=list(chw.shape),
                      mean_binaryproto_channels="BGR")
    else:
        result["mean_binaryproto_skipped"] = ("images differ in size; Caffe needs a mean image of the data "
                                              "size, use mean_value from mean_std.json instead")
    return result


# torchvision.transforms.RandomResizedCrop defaults.
_RRC_SCALE = (0.08, 1.0)
_RRC_RATIO = (3 / 4, 4 / 3)
_RRC_TRIES = 10


def random_resized_crop_params(height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a crop drawn as torchvision's ``RandomResizedCrop.get_params`` draws it."""
    area = height * width
    log_lo, log_hi = math.log(_RRC_RATIO[0]), math.log(_RRC_RATIO[1])
    for _ in range(_RRC_TRIES):
        target = area * rng.uniform(*_RRC_SCALE)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    # Fallback: the centre crop with the aspect clamped into the allowed range.
    ratio = width / height
    if ratio < _RRC_RATIO[0]:
        w, h = width, int(round(width / _RRC_RATIO[0]))
    elif ratio > _RRC_RATIO[1]:
        h, w = height, int(round(height * _RRC_RATIO[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop_choice(rng: np.random.Generator):
    """For :func:`decode_crop`: ``RandomResizedCrop``'s box, then ``RandomHorizontalFlip``'s coin, drawn from
    ``rng`` in :func:`random_resized_crop_flip`'s order (the same crops from the same generator)."""

    def choose(height: int, width: int):
        box = random_resized_crop_params(height, width, rng)
        return box, bool(rng.random() < 0.5)

    return choose


def decode_crop(data: bytes, origin: str, size: int, choose, reduce: bool = True,
                out: np.ndarray | None = None, region: bool = False) -> np.ndarray:
    """Decode an image file straight into the ``size`` x ``size`` upright RGB crop that
    ``choose(height, width) -> ((top, left, h, w), flip)`` picks in full-image coordinates.

    A JPEG whose box holds at least twice the output's pixels per side decodes in the DCT domain at the largest
    scale-down that keeps >= 1 decoded pixel per output pixel (:func:`reduction_for`; ``reduce=False``: always
    in full), the box mapped onto the smaller image, so large photos cost a fraction of a full decode; the
    colour order is swapped on the small output, not the decoded image. Otherwise, with ``region``, a JPEG's box
    is decoded alone where nvImageCodec is installed (:func:`~gpufeed.pipelines.imageio.decode_region`: the same
    pixels, ~15% less work for a random-resized crop of a 500x375 photo). ``out``: a ``size`` x ``size`` x 3 uint8
    array the crop is written into (a batch's slot) and returned. Raises what :func:`decode_image` raises.
    """
    import cv2

    info = probe(data, origin)
    full = (info.height, info.width)
    box, flip = choose(*full)
    factor = reduction_for(info, (box[2] / size, box[3] / size)) if reduce else 1
    rgb = decode_region(data, info, box) if region and factor == 1 else None
    if rgb is not None:  # the box alone, already RGB
        img = crop_resize(rgb, rgb.shape[:2], (0, 0, *rgb.shape[:2]), (size, size))
        img = cv2.flip(img, 1) if flip else img
        return written_into(out, img) if out is not None else np.ascontiguousarray(img)
    img = crop_resize(decode(data, info, origin, reduce=factor), full, box, (size, size))
    if out is None or not out.flags.c_contiguous:  # OpenCV writes only into a contiguous dst
        rgb = cv2.cvtColor(cv2.flip(img, 1) if flip else img, cv2.COLOR_BGR2RGB)
        return rgb if out is None else written_into(out, rgb)
    written_into(out, cv2.cvtColor(img, cv2.COLOR_BGR2RGB, dst=out))
    if flip:  # a horizontal flip in place: the colour swap and the flip commute
        written_into(out, cv2.flip(out, 1, dst=out))
    return out


def written_into(out: np.ndarray, result: np.ndarray) -> np.ndarray:
    """``out`` holding ``result``: OpenCV writes into a ``dst`` of the right shape and type, and otherwise
    returns a new array, which is then copied in."""
    if result.__array_interface__["data"][0] != out.__array_interface__["data"][0]:
        out[...] = result
    return out


def random_resized_crop_flip(img: np.ndarray, size=224, rng: np.random.Generator | None = None) -> np.ndarray:
    """torchvision's ``RandomResizedCrop(size)`` + ``RandomHorizontalFlip()`` in numpy/cv2.

    Area in (0.08, 1) of the image, aspect in (3/4, 4/3) sampled log-uniformly, 10 tries, then the
    centre crop clamped to the ratio range; bilinear resize to ``size`` (int or ``(h, w)``); flip with p=0.5.
    """
    import cv2

    rng = rng if rng is not None else np.random.default_rng()
    out_h, out_w = (size, size) if isinstance(size, int) else size
    i, j, h, w = random_resized_crop_params(img.shape[0], img.shape[1], rng)
    out = cv2.resize(img[i:i + h, j:j + w], (out_w, out_h), interpolation=cv2.INTER_LINEAR)
    if rng.random() < 0.5:
        out = cv2.flip(out, 1)
    return out
