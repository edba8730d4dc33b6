"""How long indexing ImageNet's train tar in place takes, cold and warm: a tar of per-class tars of JPEGs spaced as
ImageNet's are (~110 KB apart, so each header is a read of its own on a cold disk), indexed as ``convert imagenet``
lists it (in one process, or in a pool of processes as a conversion's), page cache dropped before each cold run
(root: the GPU machine). The tar and its class list are left in the folder for a conversion to read. With
``--layout tree``, the same for ImageNet's train tree: its class folders walked here or in the pool.

    python3 scripts/tar_index.py /tmp/tarprobe --classes 1000 --per-class 60 --processes 0,16 --results OUT/x.jsonl
"""

from __future__ import annotations

import argparse
import os
import tarfile
import time


def _member(name: str, data: bytes) -> bytes:
    """A tar member: its GNU header, ``data``, padded to the block."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    member = info.tobuf(tarfile.GNU_FORMAT) + data
    return member + bytes(-len(member) % tarfile.BLOCKSIZE)


def build(folder: str, classes: int, per_class: int, member_bytes: int) -> str:
    """The train tar (and a class list) in ``folder``, made once; its path."""
    path = os.path.join(folder, "ILSVRC2012_img_train.tar")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    pool = jpegs(member_bytes)
    block = tarfile.BLOCKSIZE
    inner_bytes = sum(block + -(-len(pool[i % len(pool)]) // block) * block for i in range(per_class)) + 2 * block
    with open(path + ".part", "wb") as f:
        for c in range(classes):
            wnid = f"n{c:08d}"
            info = tarfile.TarInfo(f"{wnid}.tar")
            info.size = inner_bytes + (-inner_bytes % (20 * block))  # tar pads an archive to its record size
            f.write(info.tobuf(tarfile.GNU_FORMAT))
            written = 0
            for i in range(per_class):
                data = _member(f"{wnid}_{i}.JPEG", pool[i % len(pool)])
                f.write(data)
                written += len(data)
            f.write(bytes(info.size - written))
        f.write(bytes(2 * block))
    os.rename(path + ".part", path)
    with open(os.path.join(folder, "LOC_synset_mapping.txt"), "w") as f:
        f.writelines(f"n{c:08d} class {c}\n" for c in range(classes))
    return path


def build_val(folder: str, n: int, classes: int, member_bytes: int) -> str:
    """ImageNet's flat val tar of ``n`` JPEGs (``ILSVRC2012_val_<n>.JPEG``, ~``member_bytes`` apart) and its
    ``val_labels.txt`` in ``folder``, made once; its path."""
    path = os.path.join(folder, "ILSVRC2012_img_val.tar")
    if os.path.exists(path):
        return path
    pool = jpegs(member_bytes)
    with open(path + ".part", "wb") as f:
        for i in range(1, n + 1):
            f.write(_member(f"ILSVRC2012_val_{i:08d}.JPEG", pool[i % len(pool)]))
        f.write(bytes(2 * tarfile.BLOCKSIZE))
    os.rename(path + ".part", path)
    with open(os.path.join(folder, "val_labels.txt"), "w") as f:
        f.writelines(f"ILSVRC2012_val_{i:08d}.JPEG n{i % classes:08d}\n" for i in range(1, n + 1))
    return path


def index(path: str, processes: int, nested: bool = True) -> list:
    """A tar's index as ``convert imagenet`` lists it: the train tar's inner tars (``nested``), or a flat tar's
    spans (the val tar), in ``processes`` processes of a fork server's pool (a conversion's local processes), or
    here (0)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from gpufeed.pipelines.archive import index_tar
    from gpufeed.pipelines.pooled import Lent

    inner = (lambda e: e.name.endswith(".tar")) if nested else None
    if not processes:
        return index_tar(path, nested=inner)
    with ProcessPoolExecutor(processes, mp_context=get_context("forkserver")) as pool:
        return index_tar(path, nested=inner, pool=Lent(pool))


def build_tree(folder: str, classes: int, per_class: int, member_bytes: int) -> str:
    """ImageNet's train tree (``train/<wnid>/<wnid>_<n>.JPEG``) and a class list in ``folder``, made once; the
    folder. The listing reads folders, not files: small JPEGs serve."""
    train = os.path.join(folder, "train")
    if os.path.isdir(train):
        return folder
    pool = jpegs(member_bytes)
    for c in range(classes):
        wnid = f"n{c:08d}"
        os.makedirs(os.path.join(train + ".part", wnid))
        for i in range(per_class):
            with open(os.path.join(train + ".part", wnid, f"{wnid}_{i}.JPEG"), "wb") as f:
                f.write(pool[i % len(pool)])
    os.rename(train + ".part", train)
    with open(os.path.join(folder, "LOC_synset_mapping.txt"), "w") as f:
        f.writelines(f"n{c:08d} class {c}\n" for c in range(classes))
    return folder


def list_tree(folder: str, processes: int) -> int:
    """How many inputs ``convert imagenet`` lists in the tree, its class folders walked in ``processes``
    processes of a fork server's pool, or here (0)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from gpufeed.pipelines import open_source
    from gpufeed.pipelines.pooled import Lent

    source = open_source("imagenet", folder)
    if not processes:
        return len(source.items("train"))
    with ProcessPoolExecutor(processes, mp_context=get_context("forkserver")) as pool:
        source.pool = Lent(pool)
        return len(source.items("train"))


def jpegs(member_bytes: int, n: int = 16) -> list[bytes]:
    """``n`` distinct JPEGs of about ``member_bytes`` each (noise, which no disk compresses away)."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    side = 64
    while True:
        data = cv2.imencode(".jpg", rng.integers(0, 256, (side, side * 4 // 3, 3), dtype=np.uint8))[1].tobytes()
        if len(data) >= member_bytes:
            break
        side += 16
    return [cv2.imencode(".jpg", rng.integers(0, 256, (side, side * 4 // 3, 3), dtype=np.uint8))[1].tobytes()
            for _ in range(n)]


def main() -> None:
    from listing_probe import drop_caches, emit  # (scripts/, this script's folder)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=60)
    p.add_argument("--member-bytes", type=int, default=110_000)
    p.add_argument("--processes", default="0,16", help="0: in this process; N: in a pool of N (comma-separated)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--results")
    p.add_argument("--layout", choices=("tar", "tree"), default="tar")
    p.add_argument("--val", type=int, default=0, help="also a flat val tar of this many JPEGs (tar layout)")
    a = p.parse_args()
    t = time.perf_counter()
    if a.layout == "tar":
        path = build(a.folder, a.classes, a.per_class, a.member_bytes)
        print(f"tar: {os.path.getsize(path) / 1e9:.2f} GB, {a.classes} x {a.per_class} members "
              f"({time.perf_counter() - t:.1f} s to make)", flush=True)
        if a.val:
            t = time.perf_counter()
            val = build_val(a.folder, a.val, a.classes, a.member_bytes)
            print(f"val tar: {os.path.getsize(val) / 1e9:.2f} GB, {a.val} members ({time.perf_counter() - t:.1f} s "
                  "to make)", flush=True)
    else:
        build_tree(a.folder, a.classes, a.per_class, a.member_bytes)
        print(f"tree: {a.classes} x {a.per_class} files ({time.perf_counter() - t:.1f} s to make)", flush=True)
    for _ in range(a.repeats):
        for processes in [int(x) for x in a.processes.split(",")] if a.layout == "tar" and a.val else ():
            for cache in ("cold", "warm"):  # the val tar's index alone: one chain here, its spans in a pool
                if cache == "cold":
                    drop_caches()
                t = time.perf_counter()
                members = len(index(val, processes, nested=False))
                s = time.perf_counter() - t
                emit({"bench": "val-index", "cache": cache, "processes": processes, "members": members,
                      "seconds": round(s, 3), "members_per_s": round(members / s), "cores": os.cpu_count()}, a.results)
        for processes in [int(x) for x in a.processes.split(",")]:
            for cache in ("cold", "warm"):
                if cache == "cold":
                    drop_caches()
                t = time.perf_counter()
                if a.layout == "tar":
                    members = sum(len(inner or ()) for _, inner in index(path, processes))
                else:
                    members = list_tree(a.folder, processes)
                s = time.perf_counter() - t
                row = {"bench": f"{a.layout}-index" if a.layout == "tar" else "tree-list", "cache": cache,
                       "processes": processes, "members": members, "seconds": round(s, 3),
                       "members_per_s": round(members / s), "cores": os.cpu_count()}
                emit(row, a.results)


if __name__ == "__main__":
    main()
