"""``manifest.json``: what a finished conversion wrote, written last so that its presence means complete.

It records gpufeed's version, the options, every output file (path relative to the destination, role, size,
record count, SHA-256), class lists, normalisation statistics, skipped inputs with reasons, and timings.
``gpufeed verify`` checks the outputs against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time

import numpy as np

from gpufeed import __version__, io
from gpufeed.convert import sinks
from gpufeed.convert.destination import check_entries, owned_split
from gpufeed.errors import ConfigError, NotAFileError, OutputError, make_readable
from gpufeed.formats.atomic import write_file
from gpufeed.formats.naming import is_temp_name, temp_target

MANIFEST = "manifest.json"
#: Bumped when the manifest's layout changes; ``gpufeed verify`` refuses versions it does not know.
MANIFEST_VERSION = 1


def path(out: str) -> str:
    return sinks.join(out, MANIFEST)


#: The largest ``manifest.json`` read: ImageNet's is a few MB (a file list, the skipped inputs, the timeline).
MAX_MANIFEST_BYTES = 256 << 20


class NotAManifest(ValueError):
    """What is at ``DST/manifest.json`` is not a file gpufeed could have written: a symlink, a FIFO or a device
    (never opened, so never followed, waited on or read without end), or a file over :data:`MAX_MANIFEST_BYTES`."""


def load(out: str) -> dict | None:
    """The manifest's JSON, ``None`` where there is none; :class:`NotAManifest` or another ``ValueError`` for
    what gpufeed did not write."""
    url = path(out)
    if not io.is_local(url):
        try:
            with io.open_file(url, "rb") as f:
                return json.loads(f.read(MAX_MANIFEST_BYTES + 1))
        except FileNotFoundError:
            return None
    try:
        fd = io.open_fd(io.local_path(url), follow=False)
    except FileNotFoundError:
        return None
    except NotAFileError as e:
        raise NotAManifest(f"{e.kind}, which gpufeed never writes") from None
    except IsADirectoryError:
        raise NotAManifest(f"{io.FOLDER}, which gpufeed never writes") from None
    except OSError as e:  # there, but not to be read by this user (or an I/O error)
        raise OutputError(f"{url}: cannot be read ({e.strerror or e}); {make_readable()}, then run the command "
                          "again") from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if st.st_size > MAX_MANIFEST_BYTES:
            raise NotAManifest(f"{st.st_size} bytes, more than a gpufeed manifest ({MAX_MANIFEST_BYTES})")
        return json.loads(f.read(MAX_MANIFEST_BYTES + 1))


def finished(out: str) -> tuple[str, dict | None]:
    """What ``out`` holds: ``("none", None)``; ``("foreign", None)`` for a ``manifest.json`` that gpufeed
    did not write (never overwritten); ``("complete", doc)`` for a finished conversion whose files are all
    there at their recorded sizes; ``("damaged", doc)`` for one that has lost or changed a file. A manifest
    that names anything but gpufeed's own files inside ``out`` is refused
    (:class:`~gpufeed.errors.UnsafeManifestError`): it is input, not trusted."""
    try:
        doc = load(out)
    except OutputError:  # there, but cannot be read: what it proves is unknown, so nothing can go on
        raise
    except OSError:
        return "none", None
    except ValueError:
        return "foreign", None
    if not isinstance(doc, dict) or "gpufeed_version" not in doc or "output_options" not in doc:
        return ("foreign", None) if doc is not None else ("none", None)
    for f in check_entries(out, doc.get("files"), path(out)):
        if sinks.file_size(sinks.join(out, f["path"])) != f["bytes"]:
            return "damaged", doc
    return "complete", doc


def remove(out: str) -> None:
    """Drop the manifest before anything in ``out`` changes: a partial destination must never look complete."""
    sinks.remove(path(out))


def remove_temporaries(out: str, formats) -> tuple[int, int]:
    """Delete the temporary files of these formats' outputs that a killed run left next to them, and of the
    manifest, class lists and statistics beside the formats' folders (a run killed as it wrote one) (never a final
    name; called while this conversion's journal holds the destination). Returns the files removed and their
    bytes."""
    from gpufeed.convert.destination import kind_at, owned_split, top_level_files

    found = []
    try:
        names = io.listdir(out)
    except (FileNotFoundError, NotADirectoryError):
        names = []
    own = {MANIFEST, *top_level_files()}
    for name in names:
        base = name.rstrip("/").rsplit("/", 1)[-1]
        # Only a file: gpufeed writes these whole, never as folders or links.
        if temp_target(base) in own and kind_at(name) == io.FILE:
            found.append(name)
    for fmt in formats:
        try:
            names = io.listdir(sinks.join(out, fmt))
        except FileNotFoundError:
            continue
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if is_temp_name(base) and owned_split(f"{fmt}/{base}") is not None:
                found.append(name)
    files = size = 0
    for name in found:
        folder = io.is_local(name) and os.path.isdir(io.local_path(name))  # an LMDB environment being written
        files += sum(len(f) for _, _, f in os.walk(io.local_path(name))) if folder else 1
        size += io.tree_bytes(name)
        # Gone meanwhile is fine: a task of the stopped run, still finishing, renamed or dropped it.
        io.remove_entry(name)
    return files, size


def save_stats(stats, file: str) -> None:
    """Persist one shard's partial :class:`~gpufeed.pipelines.transforms.ChannelStats` (exact integer
    sums as decimal strings, the per-pixel sum as an array) so a resumed run can merge it."""
    os.makedirs(os.path.dirname(file), exist_ok=True)
    scalars, pixel_sum = stats.state()
    arrays = {"pixel_sum": pixel_sum} if pixel_sum is not None else {}
    tmp = file + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, scalars=np.frombuffer(json.dumps(scalars).encode(), np.uint8), **arrays)
    os.replace(tmp, file)


def _load_stats(file: str):
    from gpufeed.pipelines.transforms import ChannelStats

    with np.load(file, allow_pickle=False) as z:
        return ChannelStats.from_state(json.loads(z["scalars"].tobytes()),
                                       z["pixel_sum"] if "pixel_sum" in z.files else None)


def merge_stats(state_dir: str, split: str):
    """All of a split's shard statistics merged (exact, so the order does not change the result)."""
    from gpufeed.pipelines.transforms import ChannelStats

    total = ChannelStats()
    d = os.path.join(state_dir, "stats")
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.startswith(f"{split}-") and name.endswith(".npz"):
            total.merge(_load_stats(os.path.join(d, name)))
    return total


def _small_file(url: str, role: str) -> dict:
    with io.open_file(url, "rb") as f:
        data = f.read()
    return {"path": url, "role": role, "records": data.count(b"\n"), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def _relative(out: str, p: str) -> str:
    if io.is_local(out):
        return os.path.relpath(io.local_path(p), io.local_path(out)).replace(os.sep, "/")
    return p[len(out.rstrip("/")) + 1:] if p.startswith(out.rstrip("/") + "/") else p


def split_sources(doc: dict) -> dict:
    """``{split: the source it was converted from}`` of a finished conversion (manifests before they said so:
    every split from the run's one source)."""
    found = doc.get("split_sources")
    if isinstance(found, dict):
        return found
    src = (doc.get("output_options") or {}).get("src")
    return {s: src for s in doc.get("splits") or {}}


def joined_manifest(events: list[dict]) -> dict | None:
    """The finished conversion a run adds its splits to, as its journal keeps it."""
    return next((e["manifest"] for e in events if e.get("event") == "joined" and isinstance(e.get("manifest"), dict)),
                None)


def _merged_classes(earlier: list[str], now: list[str]) -> list[str] | None:
    """One class list for both: the same, or (a list file's numbered classes, 0..max label) one the other's
    start; None where they differ."""
    short, long = sorted((list(earlier), list(now)), key=len)
    return long if long[:len(short)] == short else None


def check_classes(joined: dict, classes, out: str) -> None:
    """A split joins a destination only with the same class list (or, numbered, one that extends it)."""
    earlier = (joined.get("classes") or {}).get("names") or []
    if _merged_classes(earlier, classes.names) is None:
        raise ConfigError(f"{out} holds the finished {', '.join(sorted(joined.get('splits') or {}))} split(s) with "
                          f"{len(earlier)} classes, and this source has another class list ({len(classes.names)} "
                          "classes): write it to its own --out")


def write(options, summary, classes, stats, joined: dict | None = None) -> dict:
    """Write class lists, statistics and finally ``manifest.json`` into the destination. ``joined``: the
    finished conversion this run added its splits to, whose files, splits and skipped inputs the manifest
    lists too."""
    from gpufeed.pipelines.base import ClassInfo
    from gpufeed.pipelines.sources import write_class_list

    out = summary.out
    if joined is not None:
        names = _merged_classes((joined.get("classes") or {}).get("names") or [], classes.names)
        if names is not None and list(names) != list(classes.names):  # a list file's numbered classes, extended
            classes = ClassInfo(names=names)
    extra = [_small_file(u, "classes") for u in write_class_list(classes, out)]
    stats_doc = None
    if stats is not None and stats.images:
        from gpufeed.pipelines.transforms import write_stats

        stats_doc = write_stats(stats, out)
        for name in ("mean_std_json", "mean_binaryproto"):
            if stats_doc.get(name):
                extra.append(_small_file(sinks.join(out, stats_doc[name]), "stats"))
    formats = options.output_formats()
    key = options.output_key()
    files = []
    for f in [*summary.files, *extra]:
        entry = {"path": _relative(out, f["path"]), "role": f["role"], "records": f["records"],
                 "bytes": f["bytes"], "sha256": f["sha256"]}
        # Which format wrote it: readers (verify, the benchmarks) dispatch on this, not on the file's name.
        owner = owned_split(entry["path"], formats)
        if owner is not None:
            entry["format"] = owner[0]
        if f.get("parts"):
            entry["parts"] = [list(p) for p in f["parts"]]
        files.append(entry)
    samples, skipped, converted = summary.samples, list(summary.skipped), list(summary.converted)
    sources = {s: key.get("src") for s in summary.samples}
    if joined is not None:
        mine = {f["path"] for f in files}
        files += [f for f in joined.get("files") or [] if f["path"] not in mine and f.get("role") != "classes"]
        samples = {**joined.get("splits", {}), **summary.samples}
        skipped = [tuple(x) for x in joined.get("skipped") or []] + skipped
        converted = [tuple(x) for x in joined.get("converted") or []] + converted
        sources = {**split_sources(joined), **sources}
    files.sort(key=lambda f: f["path"])
    doc = {
        "manifest_version": MANIFEST_VERSION,
        "gpufeed_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "output_options": key,
        "options": options.to_json(),
        "formats": list(options.formats),
        "splits": samples,
        "split_sources": sources,
        "files": files,
        "classes": {"count": len(classes.names), "names": list(classes.names)},
        "normalization": stats_doc,
        "skipped": [list(s) for s in skipped],
        "converted": [list(c) for c in converted],
        "bytes_written": summary.bytes_written + (joined or {}).get("bytes_written", 0),
        "timings": {"seconds": round(summary.seconds, 3),
                    "images_per_second": round(summary.images_per_second, 1),
                    "first_shard_started": summary.first_shard_started,
                    "timeline": summary.timeline},
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
    }
    save(out, doc)
    return doc


def save(out: str, doc: dict) -> None:
    """Write ``out``'s manifest whole under its temporary name, then put it in place."""
    write_file(path(out), (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(), "manifest")
