"""How long `convert imagenet` of a remote source lists and identifies its inputs when each request to the store
takes LATENCY seconds: an fsspec filesystem in memory (``slowmem://``) that waits that long on each folder listing,
file details, open and read, as an object store's round trip does. An ImageNet-shaped tree (class folders) or
tars (a train tar of per-class tars, a flat val tar), listed as a conversion lists them (``items`` per split, then
the plan's input identities), with whichever gpufeed is imported (PYTHONPATH picks another build).

    python3 scripts/remote_listing.py --layout tree --classes 300 --latency 0.02 --results OUT/remote.jsonl
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tarfile
import time

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

LATENCY = [0.02]


class _SlowFile:
    """A file of :class:`SlowMemory`: each read waits, as a ranged GET does."""

    def __init__(self, f):
        self._f = f

    def read(self, n=-1):
        time.sleep(LATENCY[0])
        return self._f.read(n)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class SlowMemory(MemoryFileSystem):
    protocol = ("slowmem",)

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol("memory://" + path[len("slowmem://"):] if path.startswith("slowmem://")
                                       else path)

    def ls(self, path, detail=True, **kwargs):
        time.sleep(LATENCY[0])
        return super().ls(path, detail=detail, **kwargs)

    def info(self, path, **kwargs):
        time.sleep(LATENCY[0])
        return super().info(path, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        time.sleep(LATENCY[0])
        return _SlowFile(io.BytesIO(super()._open(path, mode, **kwargs).getvalue()))  # a position of its own


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def build(fs, root: str, layout: str, classes: int, per_class: int, val: int) -> None:
    jpeg = b"\xff\xd8\xff\xe0" + bytes(2000) + b"\xff\xd9"
    wnids = [f"n{c:08d}" for c in range(classes)]
    fs.pipe(f"{root}/LOC_synset_mapping.txt", "".join(f"{w} class\n" for w in wnids).encode())
    if layout == "tree":
        for w in wnids:
            for i in range(per_class):
                fs.pipe(f"{root}/train/{w}/{w}_{i}.JPEG", jpeg)
        return
    fs.pipe(f"{root}/ILSVRC2012_img_train.tar",
            _tar([(f"{w}.tar", _tar([(f"{w}_{i}.JPEG", jpeg) for i in range(per_class)])) for w in wnids]))
    fs.pipe(f"{root}/ILSVRC2012_img_val.tar", _tar([(f"ILSVRC2012_val_{i:08d}.JPEG", jpeg) for i in range(1, val + 1)]))
    fs.pipe(f"{root}/val_labels.txt", "".join(f"ILSVRC2012_val_{i:08d}.JPEG {wnids[i % classes]}\n"
                                              for i in range(1, val + 1)).encode())


def main() -> None:
    import gpufeed
    from gpufeed.convert.identity import identities
    from gpufeed.pipelines import open_source

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=("tree", "tar"), default="tree")
    p.add_argument("--classes", type=int, default=300)
    p.add_argument("--per-class", type=int, default=3)
    p.add_argument("--val", type=int, default=0, help="val tar members (tar layout)")
    p.add_argument("--latency", type=float, default=0.02, help="seconds each request waits")
    p.add_argument("--results")
    p.add_argument("--label", default="", help="a name for the build, kept in the row")
    a = p.parse_args()
    fsspec.register_implementation("slowmem", SlowMemory, clobber=True)
    fs = MemoryFileSystem()
    root = f"/remote-{a.layout}"
    build(fs, root, a.layout, a.classes, a.per_class, a.val)
    LATENCY[0] = a.latency
    t0 = time.perf_counter()
    source = open_source("imagenet", f"slowmem://{root}")
    splits, listed, identified = source.splits(), {}, 0.0
    if hasattr(source, "expect"):  # (as a conversion begins its listing; a build before it has none)
        source.expect(splits)
    for split in splits:
        items = source.items(split)
        listed[split] = len(items)
    t1 = time.perf_counter()
    for split in splits:
        t = time.perf_counter()
        identities(source.items(split), cache={})
        identified += time.perf_counter() - t
    row = {"bench": "remote-listing", "layout": a.layout, "latency_s": a.latency, "listed": listed,
           "list_s": round(t1 - t0, 2), "identities_s": round(identified, 2), "build": a.label,
           "gpufeed": os.path.dirname(gpufeed.__file__), "cores": os.cpu_count()}
    print(json.dumps(row), flush=True)
    if a.results:
        with open(a.results, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
