"""An input's identity: what decides its bytes and label besides its key (:func:`item_identity`).

The plan digests it per shard, and a resumed run compares the digests, so an input replaced between a kill
and a resume is noticed, never mixed into the output (:meth:`gpufeed.convert.state.Journal.check_plan`).
"""

from __future__ import annotations

import os

from gpufeed import io
from gpufeed.errors import INPUT_ERRORS
from gpufeed.pipelines.base import (FileRef, InlineRef, ItemBatch, ListedItems, MemberRun, SynthRef, TarMemberRef,
                                    read_item)


def item_identity(item, cache: dict, strict: bool = False) -> bytes:
    """What decides an input's bytes and label besides its key: the label; for a local file its size,
    modification time and inode (a replaced file has another); for a remote file (fsspec) its size, ETag
    and modification time as its directory's listing gives them (one request per directory); for a tar
    member its place in the archive and the archive's identity; for data in memory a checksum of it. With
    ``strict`` (``--strict``), a checksum of every input's bytes as well, read once more (local files by the
    worker converting their shard, others by the driver while planning). ``cache`` keeps stats and listings
    across the items of a split."""
    import crc32c

    ref = item.ref
    parts = [repr(item.label)]
    if "list_index" in item.meta:  # an im2rec list's own index, the record's id
        parts.append(f"list index {item.meta['list_index']}")
    if isinstance(ref, (FileRef, TarMemberRef)):
        key = ref.url
        if key not in cache or isinstance(ref, FileRef):
            cache[key] = _file_identity(ref.url, cache)
        parts.append(cache[key])
        if isinstance(ref, TarMemberRef):
            parts.append(f"{ref.offset}:{ref.size}")
        if strict:
            try:
                data = read_item(item)
                parts.append(f"crc32c {crc32c.crc32c(data)}:{len(data)}")
            except INPUT_ERRORS:
                parts.append("unreadable")  # converting it will say why
    elif isinstance(ref, InlineRef):
        import numpy as np

        data = ref.data.tobytes() if isinstance(ref.data, np.ndarray) else bytes(ref.data)
        parts.append(f"{crc32c.crc32c(data)}:{len(data)}")
    elif isinstance(ref, SynthRef):
        parts.append(f"synthetic {ref.kind} {ref.seed} {ref.index}")
    return "\t".join(parts).encode("utf-8", "surrogateescape")


def _file_identity(url: str, cache: dict) -> str:
    if io.is_local(url):
        try:
            st = os.stat(io.local_path(url))
            cache[("size", url)] = st.st_size  # for --shard-bytes (input_bytes): one stat per file
            # The change time too: an edit in place that kept the size, the inode and (os.utime) the
            # modification time still moves it.
            return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
        except OSError:
            return "unreadable"
    fs, path = io.url_to_fs(url)
    parent = path.rsplit("/", 1)[0]
    listing = cache.get(("listing", parent))
    if listing is None:
        listing = cache[("listing", parent)] = _listing(url)
    info = listing.get(path.rstrip("/"), {})
    fields = ("size", "ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "updated", "created")
    return ":".join(f"{k}={info[k]}" for k in fields if k in info) or "unlisted"


def _listing(url: str) -> dict:
    """The listing (name: details) of the remote folder holding ``url``; empty where it cannot be listed."""
    fs, path = io.url_to_fs(url)
    try:
        return {e["name"].rstrip("/"): e for e in fs.ls(path.rsplit("/", 1)[0], detail=True)}
    except OSError:
        return {}


def _remote_listings(items, cache: dict) -> None:
    """Every remote folder's listing the identities of ``items`` need, asked for in threads of this process
    (:func:`gpufeed.pipelines.pooled.threads`) instead of one after another: each is a request that waits on the
    network (ImageNet's train tree: 1,000 folders)."""
    from gpufeed.pipelines.pooled import in_order, pieces, threads

    first: dict[str, str] = {}  # a file's URL per remote folder URL, in order
    runs = items.runs() if isinstance(items, ListedItems) else [(None, items)]
    for folder, names in runs:
        if folder is None:  # (each URL once: a tar's members name it each; data in memory has none)
            found = dict.fromkeys(getattr(it.ref, "url", None) for it in names)
            found.pop(None, None)
        elif isinstance(folder, MemberRun):
            found = [folder.url]
        elif io.is_local(folder[1]):
            continue
        else:
            found = [folder[1] + name for name in {n.rpartition("/")[0]: n for n in names}.values()]
        for url in found:
            if not io.is_local(url):
                first.setdefault(url.rsplit("/", 1)[0], url)
    wanted = {}
    for url in first.values():
        parent = io.url_to_fs(url)[1].rsplit("/", 1)[0]
        if ("listing", parent) not in cache:
            wanted.setdefault(parent, url)
    for parent, (listing, _) in zip(wanted, in_order(threads(), pieces, list(wanted.values()), 4, _listing)):
        cache[("listing", parent)] = listing if listing is not None else {}


def identities(items: list, strict: bool = False, cache: dict | None = None) -> list[bytes]:
    """:func:`item_identity` of each item. A :class:`ListedItems`' tar members (ImageNet's train tar: 1.28
    million) get the same bytes without an Item made for each. Remote folders are listed side by side first."""
    cache = {} if cache is None else cache
    _remote_listings(items, cache)
    if strict or not isinstance(items, ListedItems):
        return [item_identity(it, cache, strict) for it in items]
    out: list[bytes] = []
    for folder, names in items.runs():
        if isinstance(folder, MemberRun) and "list_index" not in folder.meta:
            if folder.url not in cache:
                cache[folder.url] = _file_identity(folder.url, cache)
            head = f"{folder.label!r}\t{cache[folder.url]}\t"
            out += [f"{head}{offset}:{size}".encode("utf-8", "surrogateescape") for _, offset, size in names]
        else:
            made = names if folder is None else ItemBatch([(folder, name) for name in names])
            out += [item_identity(it, cache) for it in made]
    return out


def input_bytes(items: list, cache: dict) -> int:
    """The inputs' total size as listed (``--shard-bytes``): a tar member's header, a local file's stat and a
    remote file's entry in its directory's listing as :func:`item_identity` cached them (nothing is asked of
    the storage again); data in memory by its length. Inputs whose size is unknown count as the mean of the
    others."""
    sizes = []
    for it in items:
        ref = it.ref
        if isinstance(ref, TarMemberRef):
            sizes.append(ref.size)
        elif isinstance(ref, InlineRef):
            sizes.append(getattr(ref.data, "nbytes", None) or len(ref.data))
        elif isinstance(ref, SynthRef):
            sizes.append(None)
        elif io.is_local(ref.url):
            sizes.append(cache.get(("size", ref.url)))
        else:
            path = io.url_to_fs(ref.url)[1].rstrip("/")
            listing = cache.get(("listing", path.rsplit("/", 1)[0]), {})
            sizes.append(listing.get(path, {}).get("size"))
    known = [n for n in sizes if n is not None]
    mean = sum(known) / len(known) if known else 0
    return int(sum(known) + mean * (len(sizes) - len(known)))
