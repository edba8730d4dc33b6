"""What a conversion may delete or overwrite in its destination: only what it can prove it wrote.

A destination may hold a user's files beside gpufeed's, and a ``manifest.json`` or journal found in it is
input like any other: anyone who can write a shared dataset folder can edit them. So:

* every path a manifest or journal names must be a name gpufeed writes there (a format's output file, a class
  list, statistics) and resolve, symlinks followed, inside the destination; else the run (or ``gpufeed
  verify``) stops naming the entry (:func:`checked`);
* a file is removed or overwritten only when proven gpufeed's: listed by the destination's manifest or journal
  with the size and SHA-256 it has now, or at a name one of its journalled plans reserved. A plan is journalled
  only after this module found its names free (or proven and cleared) and before any of them is written, so a
  file there since can only be that run's own (a shard finished after its last journal entry, say);
* before a fresh run writes anything, everything at a name it writes (any shard count, an LMDB's folder, the
  class lists) is checked (:func:`clear`): proven files are removed, and anything else stops the run naming it.
  Nothing is removed before all of them are checked.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import posixpath

from gpufeed import io
from gpufeed.convert.state import STATE_DIR as STATE, linked
from gpufeed.errors import DestinationError, UnsafeManifestError, rerun_command

#: Shown at most this many of the files in the way (then a count).
_LISTED = 10


@functools.cache
def top_level_files() -> tuple[str, ...]:
    """The class lists and statistics a conversion writes beside the formats' folders."""
    from gpufeed.pipelines.sources import CLASS_FILES
    from gpufeed.pipelines.transforms import MEAN_BINARYPROTO, MEAN_STD_JSON

    return (*CLASS_FILES, MEAN_STD_JSON, MEAN_BINARYPROTO)


@functools.cache
def _formats() -> tuple:
    """Every format as a conversion configures it by default (each recognises its names however configured)."""
    from gpufeed.formats import FORMATS, get_format

    return tuple(get_format(name) for name in FORMATS)


def owned_split(rel: str, formats=None) -> tuple[str, str] | None:
    """``(format, split)`` of the output ``rel`` (relative to the destination) is a file of, ``(format, split)``
    of the output a temporary name stands for, or ``None`` when no format writes that name."""
    from gpufeed.formats.naming import temp_target

    head, _, name = rel.partition("/")
    final = temp_target(name) if "/" not in name else None
    for fmt in formats or _formats():
        if head != fmt.name:
            continue
        split = fmt.owned_split(f"{head}/{final}" if final else rel)
        if split is not None:
            return fmt.name, split
    return None


def ours(rel: str) -> bool:
    """Whether ``rel`` is a name gpufeed writes in a destination."""
    return rel in top_level_files() or owned_split(rel) is not None


def relative(out: str, path: str) -> str | None:
    """``path`` (as a journal records it: under ``out``) relative to ``out``; ``None`` when it is not under it."""
    base = out.rstrip("/") + "/"
    path = str(path)
    if io.is_local(out):
        base, path = io.local_path(base), io.local_path(path)
    return path[len(base):] if path.startswith(base) else None


def checked(out: str, rel, where: str) -> str:
    """The URL of ``rel``, a path a manifest or journal (``where``) records relative to ``out``, once it is
    proven a name gpufeed writes there that resolves (symlinks followed) inside ``out``; otherwise
    :class:`UnsafeManifestError` naming ``where`` and the entry. Nothing is opened."""
    def refuse(why):
        return UnsafeManifestError(f"{where}: lists {rel!r}, {why}; gpufeed reads, removes and overwrites only its "
                                   f"own files inside {out}, so it stops here: the file was edited or is not this "
                                   "destination's; move it away and rerun")

    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise refuse("which is not a file name")
    if rel.startswith("/") or posixpath.normpath(rel) != rel or rel.split("/", 1)[0] == "..":
        raise refuse("which is not a plain path inside the destination")
    if not ours(rel):
        raise refuse("which is no name gpufeed writes there")
    url = io.join(out, *rel.split("/"))
    if io.is_local(out):
        root = os.path.realpath(io.local_path(out))
        if os.path.commonpath([root, os.path.realpath(url)]) != root:
            raise refuse(f"which resolves to {os.path.realpath(url)}, outside the destination (a symlink)")
    return url


def check_entries(out: str, entries, where: str) -> list[dict]:
    """A manifest's ``files``: a list of ``{path, bytes, sha256, ...}`` whose paths pass :func:`checked`."""
    if not isinstance(entries, list):
        raise UnsafeManifestError(f"{where}: its file list is not a list; the file was edited or is not "
                                  "gpufeed's: move it away and rerun")
    for e in entries:
        if not (isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                and isinstance(e.get("records", 0), int) and isinstance(e.get("role", ""), str)):
            raise UnsafeManifestError(f"{where}: a file entry {str(e)[:80]!r} is not {{path, bytes, sha256, role, "
                                      "records}; the file was edited or is not gpufeed's: move it away and rerun")
        checked(out, e.get("path"), where)
    return entries


#: How :func:`file_problem` begins for a file that is there but cannot be read (no permission, an I/O error).
UNREADABLE = "cannot be read"


def file_problem(url: str, entry: dict) -> str | None:
    """What keeps the file at ``url`` from being the one ``entry`` records (``bytes``, ``sha256``, and for a file
    assembled from parts each part's digest), or ``None`` when it is that file. Special files (a FIFO, a device,
    a folder) are never opened; a file that cannot be read is :data:`UNREADABLE` with the reason."""
    try:
        return _file_problem(url, entry)
    except OSError as e:
        return f"{UNREADABLE} ({e.strerror or e})"


def _file_problem(url: str, entry: dict) -> str | None:
    from gpufeed.formats.base import parts_digest

    kind = kind_at(url)
    if kind is None:
        return "missing"
    if kind != io.FILE:
        return f"{kind}, not a file gpufeed wrote"
    parts = entry.get("parts") or ()
    size = io.file_size(url)
    if size == entry["bytes"]:  # else not read at all
        size, digests = _sha256(url, parts)
    if size != entry["bytes"]:
        return f"{size} bytes, {entry['bytes']} recorded: truncated or replaced"
    if parts:
        offset = 0
        for (n, want), got in zip(parts, digests):
            if got != want:
                return f"the SHA-256 of bytes {offset}..{offset + n} differs: modified or damaged"
            offset += n
        if parts_digest(parts) != entry["sha256"]:
            return "its recorded parts do not make its recorded SHA-256: the record was edited"
    elif digests[0] != entry["sha256"]:
        return "SHA-256 differs: modified or damaged"
    return None


def kind_at(url: str) -> str | None:
    """What is at ``url`` as :func:`gpufeed.io.kind_of` names it (``io.FILE``, ``io.FOLDER``, ``io.SYMLINK``,
    "a FIFO (named pipe)"...; a local path's not followed), or ``None`` when nothing is."""
    if io.is_local(url):
        try:
            return io.kind_of(os.lstat(io.local_path(url)).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return None
    fs, p = io.url_to_fs(url)
    try:
        info = fs.info(p)
    except FileNotFoundError:
        return None
    return io.FILE if info.get("type") == "file" else io.FOLDER


def _sha256(url: str, parts=()) -> tuple[int, list[str]]:
    """The file's size and SHA-256; for a file assembled from ``parts`` (``[bytes, sha256]`` each), the
    SHA-256 of each part's byte range instead."""
    import hashlib

    sizes = [p[0] for p in parts] or [None]
    digests, size = [], 0
    with io.open_file(url, "rb") as f:
        for want in sizes:
            h = hashlib.sha256()
            left = want
            while left is None or left > 0:
                chunk = f.read(8 << 20 if left is None else min(8 << 20, left))
                if not chunk:
                    break
                h.update(chunk)
                size += len(chunk)
                if left is not None:
                    left -= len(chunk)
            digests.append(h.hexdigest())
        size += len(f.read()) if parts else 0
    return size, digests


@dataclasses.dataclass
class Evidence:
    """What a destination's own records prove gpufeed wrote there: files with their size and SHA-256
    (``digests``, by relative path) and names a journalled plan reserved (``reserved``)."""

    out: str
    digests: dict = dataclasses.field(default_factory=dict)
    reserved: set = dataclasses.field(default_factory=set)

    def add_manifest(self, doc: dict, where: str) -> None:
        for e in check_entries(self.out, doc.get("files"), where):
            self.digests[e["path"]] = e

    def add_journal(self, events: list[dict], where: str) -> None:
        """A journal's finished shards and split outputs (digests), and the outputs its plans reserved."""
        from gpufeed.convert.options import configured_formats

        start = next((e for e in events if e.get("event") == "start"), None)
        key = start.get("options") if start else None
        formats = []
        if isinstance(key, dict) and isinstance(key.get("formats"), list):
            formats = configured_formats(key["formats"], key.get("shards"), key.get("label_offset") or 0)
        for e in events:
            if e.get("event") in ("shard", "final"):
                for f in e.get("files") or ():
                    rel = relative(self.out, f.get("path", ""))
                    if f.get("role") == "spool" or rel is None or rel.startswith(STATE + "/"):
                        continue  # a spool for a split's sink: in the state directory, removed with it
                    checked(self.out, rel, where)
                    self.digests[rel] = f
            elif e.get("event") == "plan" and isinstance(e.get("shards"), int) and isinstance(e.get("split"), str):
                for fmt in formats:
                    count = e["shards"] if fmt.layout != "split" else 1
                    for i in range(count):
                        path = fmt.output_path("", e["split"], i, count).lstrip("/")
                        self.reserved.add(path)
                        self.reserved.update(f.lstrip("/") for f in fmt.output_files(path))


def in_the_way(out: str, formats, splits, top_level: bool) -> list[str]:
    """What a fresh run of ``splits`` in ``formats`` (names) would overwrite, or leave to be read beside its own
    output: every entry at a name those formats write for those splits (any shard count, temporary names too),
    and with ``top_level`` the class lists and statistics; relative paths."""
    from gpufeed.formats import get_format

    found = []
    fmts = [get_format(name) for name in formats]
    for name in formats:
        try:
            entries = io.listdir(io.join(out, name))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            rel = f"{name}/{entry.rstrip('/').rsplit('/', 1)[-1]}"
            owner = owned_split(rel, fmts)
            if owner is not None and owner[1] in splits:
                found.append(rel)
    if top_level:
        found.extend(name for name in top_level_files() if kind_at(io.join(out, name)) is not None)
    return sorted(found)


#: What to do about files at gpufeed's names that it cannot prove it wrote, where a run would replace them.
UNPROVEN_FIX = "move them away (or delete what you know to be damaged), or choose another destination"


def clear(out: str, rels, evidence: Evidence, progress=None, fix: str = UNPROVEN_FIX) -> dict[str, int]:
    """Remove ``rels`` (relative paths in ``out``; an LMDB environment's folder with what it holds) when every
    file among them is proven gpufeed's by ``evidence``; else remove nothing and raise :class:`DestinationError`
    naming each file that is not, and ``fix``. Missing ones are fine. Returns the files removed (relative paths)
    and their bytes: a proven file's as checked, another's (a temporary, a reserved name) as found."""
    from concurrent.futures import ThreadPoolExecutor

    from gpufeed.convert.progress import size_text
    from gpufeed.machine import usable_cores

    files, folders = {}, []  # relative path -> what is there (a listed file inside a folder in the way: once)
    for rel in sorted(set(rels)):
        kind = kind_at(io.join(out, rel))
        if kind == io.FOLDER and _folder_output(rel):
            folders.append(rel)
            for child in io.listdir(io.join(out, rel)):
                inside = f"{rel}/{child.rstrip('/').rsplit('/', 1)[-1]}"
                files[inside] = kind_at(io.join(out, inside))
        elif kind is not None:
            files[rel] = kind
    hashed = [r for r in files if r in evidence.digests]
    if progress is not None and hashed:
        size = sum(evidence.digests[r]["bytes"] for r in hashed)
        progress.phase(f"checking the {len(hashed)} files ({size_text(size)}) an earlier conversion wrote here "
                       "before removing them")
    with ThreadPoolExecutor(max(1, min(usable_cores(), 16))) as pool:
        problems = dict(zip(hashed, pool.map(lambda r: file_problem(io.join(out, r), evidence.digests[r]), hashed)))
    refused = []
    for rel, kind in files.items():
        if rel in problems:
            if problems[rel] is not None:
                refused.append(f"{rel}: changed since gpufeed wrote it ({problems[rel]})")
            continue
        if kind == io.FILE and (rel in evidence.reserved or _temporary(rel) and (evidence.digests or evidence.reserved)):
            continue
        refused.append(f"{rel}: {kind}, which gpufeed never writes" if kind != io.FILE else
                       f"{rel}: not listed by this destination's manifest.json or conversion journal")
    if refused:
        shown = "\n".join(f"  {line}" for line in refused[:_LISTED])
        more = f"\n  and {len(refused) - _LISTED} more" if len(refused) > _LISTED else ""
        raise DestinationError(f"{out}: holds {len(refused)} file{'s' if len(refused) > 1 else ''} at names this "
                               f"conversion writes that gpufeed cannot prove it wrote, so it removes or overwrites "
                               f"nothing: {fix}:\n{shown}{more}")
    removed = {rel: evidence.digests[rel]["bytes"] if rel in problems else io.file_size(io.join(out, rel)) or 0
               for rel in files}
    for rel in files:
        io.remove(io.join(out, rel))
    for rel in folders:
        io.remove_empty_dir(io.join(out, rel))
    return removed


def _folder_output(rel: str) -> bool:
    """Whether ``rel`` names an output that is a folder of files (an LMDB environment), or its temporary name."""
    from gpufeed.formats import get_format
    from gpufeed.formats.naming import temp_target

    owner = owned_split(rel)
    if owner is None:
        return False
    head, _, name = rel.partition("/")
    target = f"{head}/{temp_target(name) or name}"
    return all(f.startswith(target + "/") for f in get_format(owner[0]).output_files(target))


def _temporary(rel: str) -> bool:
    """A temporary name of an output, or a file inside one (an LMDB environment being written)."""
    from gpufeed.formats.naming import temp_target

    return any(temp_target(part) for part in rel.split("/")[1:3])


def check_state_dir(out: str) -> None:
    """``DST/.gpufeed`` is gpufeed's conversion state (journal, spools) while a run is under way: one that is
    a symlink, a file, or a folder without a journal that holds something is a user's, never used or removed.
    Inside it gpufeed makes only folders and files of one link each; anything else there (a symlink, a FIFO, a
    device, a file hard-linked elsewhere) was put there by something else, and a resume that appended to or cut
    it would write outside the destination (a partial ``.lst`` linked to a user's file was cut and overwritten):
    the run stops naming it, before the journal is read."""
    url = io.join(out, STATE)
    kind = kind_at(url)
    if kind is None:
        return
    if kind != io.FOLDER:
        raise DestinationError(f"{url}: {kind}, where gpufeed keeps a conversion's state; move it away, or "
                               "choose another destination")
    if not io.is_local(url):
        return
    top = io.local_path(url)
    if os.listdir(top) and not os.path.exists(os.path.join(top, "journal.jsonl")):
        raise DestinationError(f"{url}: a folder that holds no gpufeed conversion journal, where gpufeed keeps a "
                               "conversion's state; move it away, or choose another destination")
    for folder, dirs, files in os.walk(top):  # links are not followed: each is reported below
        for name in dirs + files:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            what = io.kind_of(st.st_mode)
            if what == io.FILE and st.st_nlink > 1:
                what = linked(st.st_nlink)
            elif what in (io.FILE, io.FOLDER):
                continue
            fix = (f"move {url} away (its journal is not gpufeed's), then rerun"
                   if path == os.path.join(top, "journal.jsonl")
                   else f"move it away, then start over: {rerun_command(('--no-resume',), ('--resume',))}")
            raise DestinationError(f"{path}: {what}, inside gpufeed's conversion state, where gpufeed makes only "
                                   f"folders and files of its own: something else changed {url}; {fix}")


def check_output_folders(out: str, formats) -> None:
    """Each format's folder in ``DST`` is a folder (or nothing yet) that resolves inside ``DST``: one that is a
    symlink to a folder elsewhere would have the run write there, and every later run and ``gpufeed verify``
    refuse the manifest that lists those files (:func:`checked`), so the run stops first, writing nothing."""
    if not io.is_local(out):
        return
    root = os.path.realpath(io.local_path(out))
    for name in formats:
        url = io.join(out, name)
        path = io.local_path(url)
        if not os.path.lexists(path):
            continue
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise DestinationError(f"{url}: a symlink to {real}, outside the destination, where gpufeed writes its "
                                   f"{name} output; gpufeed writes, and later removes, only inside {out}: make it a "
                                   "folder (or move it away), or choose a destination on the disk it points to")
        if not os.path.isdir(path):  # a symlink to a folder inside DST is one
            kind = kind_at(url) if not os.path.islink(path) else f"{io.SYMLINK} to nothing"
            raise DestinationError(f"{url}: {kind}, where gpufeed writes its {name} output folder; move it away, "
                                   "or choose another destination")
