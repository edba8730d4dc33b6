"""How conversion turns an input image into the stored one (:class:`ImageOptions`), and the rules every
such option set obeys (:func:`check_image_options`), stated once: :class:`ImageOptions` checks them in
Python's words, :class:`gpufeed.convert.options.ConvertOptions` in the command line's. Light on purpose (no
numpy, no codecs): the command line checks its options before it imports anything heavy.
"""

from __future__ import annotations

import dataclasses
import math
import re

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


def parse_size(text: str, what: str = "--size") -> tuple[int, int]:
    """``"227x227"`` -> ``(227, 227)`` (height x width)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m:
        raise ConfigError(f"{what} {text!r} is not HxW; write it like 227x227")
    return int(m[1]), int(m[2])


def parse_floats(text: str, what: str) -> tuple[float, ...]:
    """``"123.7,116.3,103.5"`` -> ``(123.7, 116.3, 103.5)``."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{what} {text!r} names nothing; give a comma-separated list")
    try:
        return tuple(float(t) for t in items)
    except ValueError:
        raise ConfigError(f"{what} {text!r} is not a comma-separated list of numbers, e.g. 123.7,116.3,103.5") from None


def parse_flag(how: str, text: str, what: str):
    """A flag's text as its field's value: ``"size"`` (HxW) or ``"floats"`` (R,G,B)."""
    return parse_size(text, what) if how == "size" else parse_floats(text, what)


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


def _field(default, **cli):
    """A field with how the command line takes it (``cli`` in its metadata: argparse's keywords, plus ``group``
    for flags that exclude each other, ``parse`` for text turned into the value by :func:`parse_flag`, and
    ``boolean`` for a ``--x/--no-x`` pair)."""
    return dataclasses.field(default=default, metadata={"cli": cli})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageFields:
    """The image options, declared once with their command-line flags; :class:`ImageOptions` holds and checks
    them, and the conversion's options (:class:`gpufeed.convert.options.ConvertOptions`) hold an
    ImageOptions, so a new image option is added here and nowhere else.

    ``resize``: shorter side in pixels, longer = longer * resize // shorter (im2rec; upscales too).
    ``size``: exact ``(height, width)``, aspect not kept (Caffe). ``max_size``: cap on the longer side,
    applied last. ``center_crop``: cut the centre square before resizing (im2rec ``--center-crop``).
    ``gray``: one channel. ``encode``: ``"jpeg"`` (``quality``), ``"png"``, ``"raw"`` pixels (HWC RGB), or
    ``"pass"`` to store the original bytes untouched (``validate`` still decodes them, to keep broken
    files out). ``store_dtype`` float16/float32 stores ``(pixel - mean) / std`` (pixel units 0-255, RGB
    order, as MXNet's ``mean_r``/``std_r``) and needs ``encode="raw"``. ``max_pixels``: larger images are
    refused as decompression bombs before decoding.
    """

    resize: int | None = _field(None, type=int, metavar="N", group="geometry", help=(
        "resize the shorter side to N pixels, keeping the aspect (im2rec --resize; default: no resize%(default).0s)"))
    size: tuple[int, int] | None = _field(None, metavar="HxW", group="geometry", parse="size", help=(
        "resize to exactly HxW, aspect not kept (Caffe resize_height/resize_width)"))
    max_size: int | None = _field(None, type=int, metavar="N", help=(
        "then cap the longer side at N pixels (combines with --resize/--size)"))
    center_crop: bool = _field(False, action="store_true", help="cut the centre square before resizing (im2rec)")
    gray: bool = _field(False, action="store_true", help="store one gray channel")
    encode: str | None = _field(None, choices=ENCODINGS, help=(
        "how images are stored: jpeg, png, raw pixels, or pass (the original bytes, checked to decode). Default: "
        "pass when nothing changes the pixels, jpeg when they are resized or cropped, raw for CIFAR%(default).0s"))
    quality: int = _field(DEFAULT_QUALITY, type=int, help="JPEG quality (im2rec's default)")
    store_dtype: str = _field("uint8", choices=STORE_DTYPES, help=(
        "uint8 stores pixels as they are; float16/float32 store (pixel - mean) / std as raw HWC RGB tensors "
        "(implies --encode raw; needs --mean/--std or --normalize)"))
    mean: tuple[float, ...] | None = _field(None, metavar="R,G,B", parse="floats", help=(
        "per-channel mean for --store-dtype float*, in pixel units 0-255, RGB order (e.g. 123.675,116.28,103.53); "
        "default: computed by --normalize%(default).0s"))
    std: tuple[float, ...] | None = _field(None, metavar="R,G,B", parse="floats", help=(
        "per-channel std for --store-dtype float*, pixel units 0-255, RGB (e.g. 58.395,57.12,57.375); default: "
        "computed by --normalize%(default).0s"))
    max_pixels: int = _field(DEFAULT_MAX_PIXELS, type=int, metavar="N", help=(
        "refuse images with more pixels than this, undecoded: a guard against decompression bombs, at Pillow's "
        "default limit"))
    validate: bool = _field(True, boolean=True, help=(
        "with --encode pass, decode each image (at 1/8 scale) so broken files are caught; --no-validate copies "
        "the bytes unchecked, as fast as the disk"))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(ImageFields))

    def fields(self) -> dict:
        """The options by name (:meth:`names`), as given."""
        return {name: getattr(self, name) for name in self.names()}

    @classmethod
    def add_arguments(cls, parser) -> None:
        """The command-line flags of the image options (``--resize`` ... ``--validate``), one per field, from
        the fields' own metadata."""
        import argparse

        groups = {}
        for f in dataclasses.fields(ImageFields):
            cli = dict(f.metadata["cli"])
            group, boolean = cli.pop("group", None), cli.pop("boolean", False)
            cli.pop("parse", None)
            if boolean:
                cli["action"] = argparse.BooleanOptionalAction
            if group is not None and group not in groups:
                groups[group] = parser.add_mutually_exclusive_group()
            target = groups[group] if group is not None else parser
            target.add_argument(f"--{f.name.replace('_', '-')}", default=f.default, **cli)

    @classmethod
    def from_args(cls, args) -> ImageOptions:
        """The image options of parsed command-line ``args`` (as :meth:`add_arguments` defined them), text
        parsed where the field says so, checked with the rules' messages naming the flags; ``encode`` is None
        where ``--encode`` was not given (a conversion chooses it)."""
        out = {}
        for f in dataclasses.fields(ImageFields):
            value = getattr(args, f.name)
            how = f.metadata["cli"].get("parse")
            if how is not None and value is not None:
                value = parse_flag(how, value, f"--{f.name.replace('_', '-')}")
            out[f.name] = value
        return ImageOptions(**out, spelling="cli")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageOptions(ImageFields):
    """How conversion turns an input image into the stored one (the fields: :class:`ImageFields`), checked
    once, here. ``encode`` defaults to ``"jpeg"``; ``None`` leaves it to a conversion, which chooses it from
    the other options and the dataset (:attr:`gpufeed.convert.options.ConvertOptions.effective_encode`):
    :func:`~gpufeed.pipelines.transforms.make_sample` applies only options whose encoding is chosen.
    ``spelling``: how the rules' messages name an option, as Python's keyword (``max_size=0``) or the command
    line's flag (``--max-size 0``)."""

    encode: str | None = "jpeg"
    spelling: str = dataclasses.field(default="python", compare=False, repr=False)

    def __post_init__(self):
        check_image_options(self, flags=self.spelling == "cli")
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
