"""On-disk formats: MXNet RecordIO, Caffe LMDB and TFRecord, behind one contract (:mod:`.base`)."""

from __future__ import annotations

import importlib

from gpufeed.errors import ConfigError

#: format name -> "module:Class" of its :class:`~gpufeed.formats.base.Format`; imported on first use.
_REGISTRY = {
    "recordio": "gpufeed.formats.recordio:RecordIOFormat",
    "lmdb": "gpufeed.formats.lmdb:LMDBFormat",
    "tfrecord": "gpufeed.formats.tfrecord:TFRecordFormat",
}

FORMATS = tuple(_REGISTRY)


def get_format(name: str, **options):
    """The :class:`~gpufeed.formats.base.Format` instance called ``name``, configured with ``options``
    (TFRecord's ``label_offset``, RecordIO's ``single``)."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**options)
