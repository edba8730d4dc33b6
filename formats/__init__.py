"""On-disk formats: MXNet RecordIO, Caffe LMDB, TFRecord and WebDataset, behind one contract (:mod:`.base`)."""

from __future__ import annotations

import importlib

from gpufeed.errors import ConfigError

#: format name -> "module:Class" of its :class:`~gpufeed.formats.base.Format`; imported on first use.
_REGISTRY = {
    "recordio": "gpufeed.formats.recordio:RecordIOFormat",
    "lmdb": "gpufeed.formats.lmdb:LMDBFormat",
    "tfrecord": "gpufeed.formats.tfrecord:TFRecordFormat",
    "webdataset": "gpufeed.formats.webdataset:WebDatasetFormat",
}

FORMATS = tuple(_REGISTRY)


def parse_formats(text: str, allowed=FORMATS, what: str = "--formats") -> tuple[str, ...]:
    """A comma-separated list of format names as a command line takes it (``"lmdb,recordio"``), each one of
    ``allowed`` (default: every format), in the order given; a :class:`~gpufeed.errors.ConfigError` naming
    the choices otherwise."""
    from gpufeed.errors import ConfigError

    names = tuple(t.strip() for t in str(text).split(",") if t.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ConfigError(f"{what} {text!r}: {'no format named' if not names else 'unknown ' + ', '.join(bad)}; "
                          f"choose from {', '.join(allowed)} (comma-separated)")
    return names


def format_modules() -> list[str]:
    """The modules that implement the formats (and the split outputs' assembly), for processes that import them
    ahead of their first shard."""
    return sorted({target.split(":")[0] for target in _REGISTRY.values()} | {"gpufeed.formats.assembly"})


def format_class(name: str):
    """The :class:`~gpufeed.formats.base.Format` subclass called ``name``."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def get_format(name: str, **options):
    """The :class:`~gpufeed.formats.base.Format` instance called ``name``, configured with ``options``
    (TFRecord's ``label_offset``, RecordIO's ``single``)."""
    return format_class(name)(**options)


def outputs_in(folder: str) -> dict[tuple[str, str], list[str]]:
    """The data files (an LMDB: its folder) of each format's split in ``folder``, where it is a conversion's
    destination (``DST``, which holds ``DST/recordio/train.rec`` ...) or one format's folder in it
    (``DST/recordio``): ``{(format, split): [paths, sorted]}``, in the formats' order, each format naming its
    own outputs (:meth:`~gpufeed.formats.base.Format.parse_output`); empty where it is neither."""
    import os

    def entries(path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return []

    folder = folder.rstrip("/") or "/"
    found: dict[tuple[str, str], list[str]] = {}
    for name in FORMATS:
        fmt = get_format(name)
        # As the destination (its format folders below it), or as the format's own folder.
        places = [(os.path.join(folder, name), name)]
        if os.path.basename(folder) == name:
            places.append((folder, name))
        for place, head in places:
            for entry in entries(place):
                split = fmt.parse_output(f"{head}/{entry}")
                if split is not None:
                    found.setdefault((name, split), []).append(os.path.join(place, entry))
    return found


def format_of(paths) -> str:
    """The one format of ``paths`` (data files, or output folders such as an LMDB), each claimed by a format
    (:meth:`~gpufeed.formats.base.Format.claims`; TFRecord takes any other plain file). What a glob over an
    output also matches is refused, naming it: a file beside a data file (an index, a list), a file inside an
    output, a folder no format claims; and so is a mix of formats."""
    import os

    formats = [get_format(name) for name in FORMATS]
    side = sorted({suffix for fmt in formats for suffix in fmt.side_files}, key=len, reverse=True)
    found = set()
    for path in (os.fspath(p) for p in paths):
        name = os.path.basename(path.rstrip("/"))
        suffix = next((s for s in side if name.endswith(s)), None)
        if suffix is not None:
            raise ConfigError(f"{path} is the index or list of a data file, not one; give the data files only "
                              f"(leave out the {suffix} files)")
        for fmt in formats:
            whole = fmt.part_of(path)
            if whole is not None:
                raise ConfigError(f"{path} is a file inside an {fmt.name.upper()}; give the {fmt.name.upper()}'s "
                                  f"folder, {whole}")
        fmt = next((f for f in formats if f.claims(path)), None)
        if fmt is None and os.path.isfile(path):
            fmt = next((f for f in formats if f.claims_other_files), None)
        if fmt is None:
            held = outputs_in(path)
            if held:
                (first, split), data = next(iter(held.items()))
                splits: dict[str, list[str]] = {}
                for f, s in held:
                    splits.setdefault(f, []).append(s)
                names = "; ".join(f"{f}: {', '.join(s)}" for f, s in splits.items())
                shown = " ".join(data[:2]) + (f" ... ({len(data)} files)" if len(data) > 2 else "")
                raise ConfigError(f"{path} is a folder of gpufeed outputs ({names}), not one: give one format's data "
                                  f"files of one split, e.g. the {first} {split} split's: {shown}")
            names = ", ".join(f.name for f in formats)
            raise ConfigError(f"{path} is a folder no format claims (without data.mdb, so not an LMDB); give "
                              f"output files or folders of {names}")
        found.add(fmt.name)
    if len(found) > 1:
        raise ConfigError(f"the paths mix formats ({', '.join(sorted(found))}); give one format's outputs")
    if not found:
        raise ConfigError("no paths given")
    return found.pop()
