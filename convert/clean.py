"""``gpufeed clean DST``: give up a conversion that did not finish, removing what it left behind.

A conversion stopped (Ctrl-C, SIGTERM, an error) or killed keeps what it did for its rerun, which resumes from it:
its journal and the split outputs it was assembling (``DST/.gpufeed``, or for a remote destination a folder under
``~/.cache/gpufeed``), the shards it converted (TFRecord and WebDataset shards in DST; spools in memory or under
``DST/.gpufeed``) and temporary files. Where the run is given up instead, this removes exactly those: the files the
conversion's journal proves it wrote (each checked against the size and SHA-256 it recorded, all before any is
removed) and whatever lies at the names its plan reserved for it. A finished conversion's files stay: those its
manifest lists, and those of the conversion a stopped run was adding splits to (kept in its journal; its
manifest, removed while the run was under way, is written back). Nothing else in DST is touched.
"""

from __future__ import annotations

import dataclasses
import os

from gpufeed import io
from gpufeed.errors import ConfigError

#: A file at a name the conversion wrote that its journal does not prove it wrote.
UNPROVEN_FIX = ("move them away (or delete what you know to be damaged) and run gpufeed clean again, or leave the "
                "destination as it is")


def add_arguments(p) -> None:
    p.add_argument("out", metavar="DST", help="the destination (--out) of a `gpufeed convert` that was stopped or "
                                              "killed, and will not be rerun")


def run(args) -> int:
    from gpufeed.convert.progress import Progress

    print(clean(args.out, Progress(enabled=True)).text())
    return 0


@dataclasses.dataclass
class Cleaned:
    """What :func:`clean` removed."""

    out: str
    files: int  # files removed from DST
    file_bytes: int
    state: str  # the conversion's state folder, removed
    state_bytes: int
    memory: str | None = None  # its memory spool folder, where it held any
    memory_bytes: int = 0
    spool_bytes: int = 0  # a remote destination's spools (``DST/.gpufeed/spool``)
    restored: int | None = None  # files of the conversion it was adding to, whose manifest was written back

    def text(self) -> str:
        from gpufeed.convert.progress import size_text
        from gpufeed.convert.sinks import SPOOL_DIR
        from gpufeed.convert.state import STATE_DIR

        said = [f"{self.files} file{'' if self.files == 1 else 's'} ({size_text(self.file_bytes)}) it wrote there",
                f"its state in {self.state} ({size_text(self.state_bytes)})"]
        if self.spool_bytes:
            said.append(f"its spools in {io.join(self.out, STATE_DIR, SPOOL_DIR)} ({size_text(self.spool_bytes)})")
        if self.memory_bytes:
            said.append(f"{size_text(self.memory_bytes)} of its converted shards in memory ({self.memory})")
        text = f"{self.out}: removed the unfinished conversion: {', '.join(said)}."
        if self.restored is not None:
            text += (f" The finished conversion it was adding splits to is as it was ({self.restored} files; "
                     "manifest.json written back).")
        return text + " Nothing else there was changed."


def clean(out: str, progress=None) -> Cleaned:
    """Remove the conversion into ``out`` that was stopped or killed (see the module's text), while holding the
    destination's lock: never while a run writes it."""
    from gpufeed.convert import destination, sinks
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.state import (JOURNAL, STATE_DIR, DestinationLock, Journal, destination_spelling,
                                       remove_state, state_dir_for)
    from gpufeed.formats import get_format

    out = destination_spelling(out)
    if io.is_local(out) and not os.path.isdir(out):
        what = "not found" if not os.path.lexists(out) else "not a folder"
        raise ConfigError(f"{out}: {what}; give the destination (--out) of the conversion to remove")
    state_dir = state_dir_for(out)
    memory = sinks.memory_spool_dir(out) if io.is_local(out) else None
    lock = DestinationLock.acquire(state_dir, out)  # refused while a run holds the destination
    try:
        destination.check_state_dir(out)  # nothing in it leads outside DST
        events = Journal.peek(state_dir)
        start = next((e for e in events if e.get("event") == "start"), None)
        memory_bytes = io.tree_bytes(memory) if memory is not None and sinks.private_folder(memory) else 0
        spool = io.join(out, STATE_DIR, sinks.SPOOL_DIR)
        if start is None and not memory_bytes and not os.path.isdir(state_dir):
            raise ConfigError(f"{out}: holds no conversion that was stopped or killed (no journal in {state_dir}); "
                              "nothing to remove")
        journal = os.path.join(state_dir, JOURNAL)
        kind, doc = manifest_mod.finished(out)
        kept = {f["path"] for f in doc["files"]} if doc is not None else set()
        joined = manifest_mod.joined_manifest(events) if kind == "none" else None
        if joined is not None:
            entries = destination.check_entries(out, joined.get("files"), journal)
            kept |= {f["path"] for f in entries}
            changed = [f"{f['path']} ({problem})" for f in entries if f.get("role") == "classes"
                       and (problem := destination.file_problem(io.join(out, f["path"]), f)) is not None]
            if changed:
                raise ConfigError(f"{out}: the stopped run was adding splits to a finished conversion, and "
                                  f"{', '.join(changed)} no longer holds what that conversion wrote (the run "
                                  "rewrote it for its splits, or it was changed since), so it cannot be put back as "
                                  "it was; nothing was removed: finish the run instead (rerun the same command)")
        evidence = destination.Evidence(out)
        evidence.add_journal(events, journal)
        formats = [f for f in ((start or {}).get("options") or {}).get("formats") or () if isinstance(f, str)]
        for name in formats:
            get_format(name)  # a journal is input: a name that is no format's stops here
        # Each format's folder inside DST, as a run checks it: one that is a link to a folder elsewhere would have
        # the names the plan reserved removed there.
        destination.check_output_folders(out, formats)
        planned = sorted({e["split"] for e in events if e.get("event") == "plan" and isinstance(e.get("split"), str)})
        rels = sorted((set(evidence.digests) | set(destination.in_the_way(out, formats, planned, False))) - kept)
        cleared = destination.clear(out, rels, evidence, progress, fix=UNPROVEN_FIX)
        temporaries, size = manifest_mod.remove_temporaries(out, formats)
        removed, file_bytes = len(cleared) + temporaries, sum(cleared.values()) + size
        for name in formats:
            io.remove_empty_dir(io.join(out, name))
        state_bytes = io.tree_bytes(state_dir)
        remove_state(state_dir)
        spool_bytes = 0
        if not io.is_local(out):
            spool_bytes = io.tree_bytes(spool)
            io.remove_tree(spool)
            io.remove_empty_dir(io.join(out, STATE_DIR))
        if memory is not None:
            sinks.remove_memory_spools(out)
        if joined is not None:
            manifest_mod.save(out, joined)
    finally:
        lock.release()
    return Cleaned(out, removed, file_bytes, state_dir, state_bytes, memory if memory_bytes else None,
                   memory_bytes, spool_bytes, len(kept) if joined is not None else None)
