"""How conversion turns an input image into the stored one (:class:`ImageOptions`), and the rules every
such option set obeys (:func:`check_image_options`), stated once: :class:`ImageOptions` checks them in
Python's words, :class:`gpufeed.convert.options.ConvertOptions` in the command line's. Light on purpose (no
numpy, no codecs): the command line checks its options before it imports anything heavy.
"""

from __future__ import annotations

import dataclasses
import math

from gpufeed.errors import ConfigError
from gpufeed.pipelines import DEFAULT_MAX_PIXELS, MAX_SIDE

ENCODINGS = ("jpeg", "png", "raw", "pass")
#: JPEG quality im2rec uses by default (``--quality 95``); a different value is allowed, not assumed.
DEFAULT_QUALITY = 95
STORE_DTYPES = ("uint8", "float16", "float32")
#: The options that change an image's geometry (``encode="pass"`` keeps the original bytes, so none of them).
GEOMETRY = ("resize", "size", "max_size", "center_crop")
#: The largest magnitude each stored float dtype holds (numpy's finfo, stated here to keep numpy out).
FLOAT_MAX = {"float16": 65504.0, "float32": 3.4028234663852886e38}


def check_image_options(o, flags: bool = False) -> None:
    """Raise a :class:`ConfigError` for the first rule ``o`` breaks: any object with ImageOptions' fields
    (``o.encode`` may be ``None``, an encoding chosen later from the others). ``flags``: name the options
    as the command line spells them (``--max-size 0``), not as Python does (``max_size=0``)."""

    def name(field: str) -> str:
        return f"--{field.replace('_', '-')}" if flags else field

    def given(field: str, value) -> str:
        return f"{name(field)} {value}" if flags else f"{field}={value!r}"

    if o.encode is not None and o.encode not in ENCODINGS:
        raise ConfigError(f"{given('encode', o.encode)} is not valid; choose one of {', '.join(ENCODINGS)}")
    if o.store_dtype not in STORE_DTYPES:
        raise ConfigError(f"{given('store_dtype', o.store_dtype)} is not valid; choose one of "
                          f"{', '.join(STORE_DTYPES)}")
    if o.resize is not None and o.size is not None:
        raise ConfigError(f"{name('resize')} (shorter side) and {name('size')} (exact HxW) exclude each other; "
                          "give one")
    for field in ("resize", "max_size"):
        value = getattr(o, field)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name(field)} must be a positive number of pixels, not {value!r}")
    if o.size is not None and (len(o.size) != 2 or any(not isinstance(v, int) or v < 1 for v in o.size)):
        example, shown = ("227x227", "x".join(map(str, o.size))) if flags else ("(227, 227)", repr(o.size))
        raise ConfigError(f"{name('size')} must be height x width in positive pixels, e.g. {example}, not {shown}")
    if o.max_pixels < 1:
        raise ConfigError(f"{name('max_pixels')} must be a positive number of pixels, not {o.max_pixels}")
    # Stored sizes are bounded like decoded ones: no option may ask every image for an absurd allocation.
    sides = {"resize": [o.resize], "max_size": [o.max_size], "size": list(o.size or ())}
    for field, values in sides.items():
        if any(v is not None and v > MAX_SIDE for v in values):
            shown = "x".join(map(str, values)) if field == "size" else values[0]
            raise ConfigError(f"{given(field, shown)} is over {MAX_SIDE} pixels, the longest side an image can be "
                              "stored with (JPEG's limit)")
    if o.size:
        smallest, asked = o.size[0] * o.size[1], given("size", "x".join(map(str, o.size)) if flags else o.size)
    else:
        smallest, asked = (o.resize ** 2, given("resize", o.resize)) if o.resize else (0, "")
    if smallest > o.max_pixels:
        raise ConfigError(f"{asked} makes images of at least {smallest} pixels, over the {o.max_pixels} that "
                          f"{name('max_pixels')} allows; choose a smaller size (or raise {name('max_pixels')})")
    if not 1 <= o.quality <= 100:
        raise ConfigError(f"{name('quality')} must be within 1..100 (im2rec uses 95), not {o.quality}")
    if o.store_dtype != "uint8" and o.encode not in (None, "raw"):
        raise ConfigError(f"{given('store_dtype', o.store_dtype)} stores normalised pixel tensors, which cannot be "
                          f"{given('encode', o.encode)}; use {given('encode', 'raw')}"
                          f"{' (or leave --encode out)' if flags else ''}")
    changes = [name(f) for f in GEOMETRY if getattr(o, f)] + [name("gray")] * bool(o.gray)
    if o.encode == "pass" and changes:
        raise ConfigError(f"{given('encode', 'pass')} stores the original bytes, so it cannot be combined with "
                          f"{', '.join(changes)}; drop them or choose {given('encode', 'jpeg')}")
    channels = 1 if o.gray else 3
    for field in ("mean", "std"):
        value = getattr(o, field)
        if value is not None and len(value) not in (1, channels):
            raise ConfigError(f"{name(field)} has {len(value)} values; give {channels} (one per channel) or 1")
    for field in ("mean", "std"):
        value = getattr(o, field)
        if value is not None and not all(-math.inf < v < math.inf for v in value):
            raise ConfigError(f"{name(field)} must be finite numbers, not {','.join(map(str, value))}")
    if o.std is not None and min(o.std) <= 0:
        raise ConfigError(f"{name('std')} must be positive, not {','.join(map(str, o.std))}")
    check_normalised_range(o.mean, o.std, o.store_dtype, name("mean"), name("std"), name("store_dtype"))


def check_normalised_range(mean, std, store_dtype: str, mean_name="mean", std_name="std",
                           dtype_name="store_dtype") -> None:
    """Every pixel 0..255 stored as ``(pixel - mean) / std`` must fit ``store_dtype``: a value beyond it would
    be stored as infinity, which no reader can use."""
    if store_dtype not in FLOAT_MAX or mean is None or std is None:
        return
    means = list(mean) * (len(std) if len(mean) == 1 else 1)
    stds = list(std) * (len(mean) if len(std) == 1 else 1)
    largest = max(max(abs(m), abs(255 - m)) / s for m, s in zip(means, stds))
    if not largest <= FLOAT_MAX[store_dtype]:
        raise ConfigError(f"{mean_name} {','.join(f'{m:g}' for m in mean)} with {std_name} "
                          f"{','.join(f'{s:g}' for s in std)} stores pixel values up to {largest:.3g}, beyond "
                          f"{store_dtype}'s {FLOAT_MAX[store_dtype]:g}; use a larger {std_name}"
                          f"{' or ' + dtype_name + ' float32' if store_dtype == 'float16' else ''}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageFields:
    """The image options, declared once: :class:`ImageOptions` (what a worker applies) and the conversion's
    options (:class:`gpufeed.convert.options.ConvertOptions`, where ``encode=None`` means chosen from the
    others) both have exactly these, so a new image option is added here and on the command line.

    ``resize``: shorter side in pixels, longer = longer * resize // shorter (im2rec; upscales too).
    ``size``: exact ``(height, width)``, aspect not kept (Caffe). ``max_size``: cap on the longer side,
    applied last. ``center_crop``: cut the centre square before resizing (im2rec ``--center-crop``).
    ``gray``: one channel. ``encode``: ``"jpeg"`` (``quality``), ``"png"``, ``"raw"`` pixels (HWC RGB), or
    ``"pass"`` to store the original bytes untouched (``validate`` still decodes them, to keep broken
    files out). ``store_dtype`` float16/float32 stores ``(pixel - mean) / std`` (pixel units 0-255, RGB
    order, as MXNet's ``mean_r``/``std_r``) and needs ``encode="raw"``. ``max_pixels``: larger images are
    refused as decompression bombs before decoding.
    """

    resize: int | None = None
    size: tuple[int, int] | None = None
    max_size: int | None = None
    center_crop: bool = False
    gray: bool = False
    encode: str | None = None
    quality: int = DEFAULT_QUALITY
    store_dtype: str = "uint8"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    validate: bool = True

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(ImageFields))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageOptions(ImageFields):
    """How conversion turns an input image into the stored one (the fields: :class:`ImageFields`); ``encode``
    is always given here (default ``"jpeg"``)."""

    encode: str = "jpeg"

    def __post_init__(self):
        if self.encode is None:
            raise ConfigError(f"encode=None is not valid; choose one of {', '.join(ENCODINGS)}")
        check_image_options(self)
        # Equal options compare and hash equal whatever sequences they were given as (and cross processes so).
        if self.size is not None:
            object.__setattr__(self, "size", tuple(self.size))
        for field in ("mean", "std"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, tuple(float(v) for v in value))

    @property
    def geometry_changes(self) -> bool:
        return any(getattr(self, f) for f in GEOMETRY)
