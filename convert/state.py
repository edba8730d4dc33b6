"""The journal that makes a conversion resumable after a kill at any moment.

An append-only file of JSON lines, each written with one ``write`` and fsync'd before the run goes on:
a line is either entirely there or is the torn last line of a killed run, which :meth:`Journal.load`
drops. Events: ``start`` (the options that determine the output, and each split's plan digest),
``shard`` (a worker finished a shard: its files with sizes and checksums, counts, skipped inputs, partial
statistics) and ``commit`` (an ordered sink took a shard in: the byte lengths of the single ``.rec``,
``.idx`` and ``.lst``, or the LMDB record count). Output bytes never depend on the journal, only on what
is redone, which is why a resumed run is byte-identical to an uninterrupted one.

The journal and the ordered sinks' partial files live in a local state directory: ``DST/.gpufeed`` for a
local destination, a per-destination directory under the user cache for a remote one (appends,
truncation and fsync need a local file). A lock file beside it (:class:`DestinationLock`) keeps two runs
off one destination.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import threading

from gpufeed import io
from gpufeed.errors import (ConfigError, DestinationError, GpufeedError, NotAFileError, OutputError, rerun_command,
                            write_fix)
from gpufeed.io import is_local, local_path

JOURNAL = "journal.jsonl"
#: Bumped when the journal's meaning changes, so an old journal is never misread. 3: a split's plan is
#: journalled only once the names it writes were found free, or proven gpufeed's and cleared
#: (:mod:`.destination`), so those names are this run's.
#: 4: a split's plan may be tapered (its plan event carries ``tapered_from``, :func:`gpufeed.convert.plan.shard_bounds`),
#: which a gpufeed that reads version 3 would take for equal shards.
JOURNAL_VERSION = 4
#: The versions this gpufeed resumes: a version 3 journal holds equal shards only, and its splits stay equal.
RESUMABLE_JOURNAL_VERSIONS = (3, 4)
#: The first version whose plans may be tapered.
TAPERED_JOURNAL_VERSION = 4
#: A local destination's state directory, ``DST/.gpufeed`` (a remote one keeps only spool files there).
STATE_DIR = ".gpufeed"


def destination_spelling(out: str) -> str:
    """DST as a run spells it: a local path absolute (the workers do not run in this directory), a URL without a
    trailing slash (a remote destination's state folder is named after this spelling)."""
    return os.path.abspath(local_path(out)) if is_local(out) else out.rstrip("/")


def _remote_states() -> str:
    """Where remote destinations' states are kept: the user cache's gpufeed folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpufeed")


def state_dir_for(out: str) -> str:
    if is_local(out):
        return os.path.join(local_path(out), STATE_DIR)
    return os.path.join(_remote_states(), "convert-" + hashlib.sha256(out.encode()).hexdigest()[:16])


def recorded_options(old: dict, new: dict) -> dict:
    """The output options a journal or manifest recorded, less those the current ones no longer count
    (an option since found not to change the output bytes, e.g. ``on_error``, or the destination), with
    its paths in their canonical spelling (a record from before they were kept so names them as typed; a
    relative one is taken from this directory, as the command that wrote it most likely was)."""
    from gpufeed.convert.options import canonical_places

    return canonical_places({k: v for k, v in old.items() if k in new})


def options_diff(old: dict, new: dict, before: str = "journal") -> str:
    """``shards: journal 3, now 2; ...``: the output options that differ between a recorded run and now."""
    old = recorded_options(old, new)
    keys = sorted(set(old) | set(new))
    return "; ".join(f"{k}: {before} {_shown(old.get(k))}, now {_shown(new.get(k))}" for k in keys
                     if old.get(k) != new.get(k))


def _shown(value) -> str:
    """An option's value as a user gives it: a list comma-separated, an option left out as such."""
    if value is None:
        return "not given"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return repr(value)


def remove_state(state_dir: str) -> None:
    """Delete a conversion's state directory, its journal last: a removal cut short leaves a journal beside
    what is left, never a folder that no journal explains (:func:`gpufeed.convert.destination.check_state_dir`)."""
    journal = os.path.join(state_dir, JOURNAL)
    try:
        names = os.listdir(state_dir)
    except FileNotFoundError:
        return
    for name in names:
        path = os.path.join(state_dir, name)
        if name == JOURNAL:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    try:
        os.remove(journal)
    except FileNotFoundError:
        pass
    try:
        os.rmdir(state_dir)
    except OSError:
        pass


class DestinationLock:
    """One conversion at a time per destination: an exclusive ``flock`` on ``<state dir>.lock``, beside
    the state directory, taken before a run deletes or writes anything (a ``--no-resume`` run deletes the
    state directory, so a lock inside it would not hold). The file is removed when the run ends, while
    still locked; a run that locked a file since removed tries again on the new one, so two runs never
    hold locks on two different files of one destination."""

    def __init__(self, f, path: str):
        self._f, self.path = f, path

    @classmethod
    def acquire(cls, state_dir: str, out: str) -> "DestinationLock":
        path = state_dir.rstrip(os.sep) + ".lock"
        while True:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                # Never through a link: opening one would create or lock whatever it names, outside DST.
                f = _own_file(path, os.O_RDWR | os.O_CREAT, "a+b", "where gpufeed keeps the destination's lock")
            except DestinationError:
                raise
            except OSError as e:
                raise OutputError(f"{path}: cannot create the destination's lock file ({e.strerror}); check "
                                  f"that {out} is writable, or choose another destination") from e
            if not _lock_within(f, LOCK_PATIENCE_S):
                f.close()
                raise ConfigError(f"{out}: another gpufeed convert is writing this destination; wait for it "
                                  "to finish or choose another destination") from None
            try:
                if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                    return cls(f, path)
            except FileNotFoundError:
                pass
            f.close()  # the run that held it removed the file as we opened it: lock the new one

    def release(self) -> None:
        if self._f is not None:
            try:
                os.remove(self.path)
            except OSError:
                pass
            self._f.close()  # closing the descriptor drops the flock
            self._f = None


#: How long a run waits for a destination's lock before it says another run holds it: a run holds it from start to
#: end, where :func:`stopped_states` holds one for the moment it takes to look.
LOCK_PATIENCE_S = 0.5


def _lock_within(f, seconds: float) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def stopped_states(keep: str) -> list[tuple[str, str | None, int]]:
    """The state folders of remote destinations under the user cache (:func:`state_dir_for`) whose runs were
    stopped or killed and not rerun (no live run holds them), but ``keep``'s: ``(folder, the destination its
    journal names, or None for a journal from before it named one, bytes)``. A remote run's state is out of its
    user's sight, and holds the split outputs it assembles, as large as they will be."""
    base = _remote_states()
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    found = []
    for name in names:
        folder = os.path.join(base, name)
        if not name.startswith("convert-") or folder == state_dir_for(keep) or not os.path.isdir(folder) \
                or os.path.islink(folder) or _held(folder + ".lock"):
            continue
        try:
            start = next((e for e in Journal.peek(folder) if e.get("event") == "start"), {})
        except (OSError, GpufeedError):
            continue  # not a folder gpufeed keeps as it does: left alone, unnamed
        out = start.get("out") if isinstance(start.get("out"), str) else None
        found.append((folder, out, io.tree_bytes(folder)))
    return found


def _held(lock: str) -> bool:
    """Whether a live run holds the lock file ``lock`` (looked at without waiting, and let go at once)."""
    try:
        fd = io.open_fd(lock, os.O_RDONLY, follow=False)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not a lock file as gpufeed makes them: taken as held, so the folder is left alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # the lock, where taken, goes with it


def _own_file(path: str, flags: int, mode: str, where: str = "inside gpufeed's conversion state"):
    """``path``, a file gpufeed keeps (``where``: the lock beside the state folder, or a file in it), opened as a
    file object: never through a symlink, and only a file of one link; anything else is a
    :class:`DestinationError` naming it. (:func:`gpufeed.convert.destination.check_state_dir` refuses anything
    else in the state folder before a run reads it; this holds for what is put there meanwhile.)"""
    try:
        fd = io.open_fd(path, flags, follow=False)
    except (NotAFileError, IsADirectoryError) as e:
        kind = e.kind if isinstance(e, NotAFileError) else io.FOLDER
        raise DestinationError(f"{path}: {kind}, {where}; move it away, or choose another destination") from None
    links = os.fstat(fd).st_nlink
    if links > 1:
        os.close(fd)
        raise DestinationError(f"{path}: {linked(links)}, {where}; move it away, or choose another destination")
    return open(fd, mode)


def linked(links: int) -> str:
    """A file of ``links`` hard links, as messages name it."""
    return f"a file with {links} links (hard-linked elsewhere)"


class Journal:
    """One destination's journal. Use :meth:`open` (loads or starts the journal) while holding the
    destination's :class:`DestinationLock`."""

    def __init__(self, state_dir: str):
        self.dir = state_dir
        self.path = os.path.join(state_dir, JOURNAL)
        self.events: list[dict] = []
        self.version = JOURNAL_VERSION  # the version of the gpufeed that started it (open() reads it)
        self._append_lock = threading.Lock()
        self._f = None

    @classmethod
    def open(cls, state_dir: str, out: str, key: dict, resume: bool) -> "Journal":
        j = cls(state_dir)
        try:
            os.makedirs(state_dir, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{state_dir}: cannot create the conversion state directory ({e.strerror}); "
                              "check that the destination is writable") from e
        if resume:
            j.events = j._load()
        else:
            j._reset()
        cls.check_options(j.events, out, key)
        start = next((e for e in j.events if e["event"] == "start"), None)
        j._f = _own_file(j.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "ab")
        if start is None:
            j.events = []
            # ``out``: named where a remote destination's state is found again (:func:`stopped_states`).
            j.append({"event": "start", "version": JOURNAL_VERSION, "options": key, "out": out})
        else:
            j.version = start["version"]
        return j

    @staticmethod
    def check_options(events: list[dict], out: str, key: dict) -> None:
        """Refuse to go on from a journal that another gpufeed, or other output options, started."""
        start = next((e for e in events if e.get("event") == "start"), None)
        if start is None:
            return
        old = recorded_options(start.get("options") or {}, key)
        if start.get("version") not in RESUMABLE_JOURNAL_VERSIONS or old != key:
            diff = options_diff(old, key) if start.get("version") in RESUMABLE_JOURNAL_VERSIONS else (
                f"journal version {start.get('version')}, now {JOURNAL_VERSION}")
            raise ConfigError(f"{out} holds a partial conversion made with other options "
                              f"({diff}): rerun with the journal's options to resume it, "
                              f"or start over with these: {rerun_command(('--no-resume',), ('--resume',))}")

    @classmethod
    def peek(cls, state_dir: str) -> list[dict]:
        """The events of the journal in ``state_dir`` (none if there is none), read without changing it."""
        return cls(state_dir)._load(truncate=False)

    def _load(self, truncate: bool = True) -> list[dict]:
        try:
            with _own_file(self.path, os.O_RDONLY, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        events, good = [], 0
        for line in data.split(b"\n"):
            try:
                events.append(json.loads(line))
            except ValueError:
                break  # the torn last line of a killed run; everything after it is unwritten
            good += len(line) + 1
        events = [e for e in events if isinstance(e, dict)]
        if good < len(data) and truncate:
            with _own_file(self.path, os.O_RDWR, "r+b") as f:
                f.truncate(good)
        return events

    def _reset(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def append(self, event: dict, durable: bool = True) -> None:
        """Write one event (the driver's loop and its committer threads all append)."""
        self.append_many([event], durable)

    def append_many(self, events: list[dict], durable: bool = True) -> None:
        """Write several events with one flush to the disk (a commit batch's events). ``durable=False`` leaves
        the flush to the next durable append (every line before it reaches the disk with it): for an event
        whose loss in a crash of the machine costs only work redone, where the run's own kill loses nothing
        either way (the kernel holds what was written). The flush is made outside the lock, so a thread that
        appends does not wait for another's flush to the disk."""
        data = b"".join(json.dumps(e, sort_keys=True, separators=(",", ":")).encode() + b"\n" for e in events)
        try:
            with self._append_lock:
                self._f.write(data)
                self._f.flush()
                self.events.extend(events)
            if durable:
                os.fsync(self._f.fileno())
        except OSError as e:
            raise OutputError(f"{self.path}: cannot record progress ({e.strerror}); {write_fix(self.path, e)}, "
                              "then rerun the same command to resume") from e

    def planned_shards(self, split: str, digest: str) -> tuple[int, int | None] | None:
        """How ``split`` was cut when this conversion started, where its inputs' keys are the same now
        (``digest``): its shard count and the count of equal shards it was tapered from (None where its shards
        are equal, as in every journal from before the taper); None for a split not planned yet, or planned from
        other inputs."""
        for e in self.events:
            if e["event"] == "plan" and e["split"] == split and e["digest"] == digest:
                return e["shards"], e.get("tapered_from")
        return None

    def check_plan(self, split: str, plan, items: list, strict: bool = False, digest_of=None) -> None:
        """Record a split's plan, or refuse to resume if the source changed since it was journalled: other
        inputs, or, in a shard already converted, the same names with other contents or labels (named in
        the message). A shard not converted yet is simply converted from its inputs as they are now.
        ``digest_of(shard_plan)``: the shard's digest now, where ``plan`` holds none (its workers digest)."""
        shards = len(plan.shards)
        identity = "content" if strict else "stat"
        for e in self.events:
            if e["event"] == "plan" and e["split"] == split:
                if (e["digest"], e["shards"], e.get("tapered_from")) != (plan.digest, shards, plan.tapered_from):
                    raise ConfigError(f"the {split} split of the source changed since this conversion started "
                                      "(inputs added, removed or renamed); add --no-resume to start over")
                if e.get("identity", "stat") != identity:
                    was = "with" if e.get("identity") == "content" else "without"
                    raise ConfigError(f"this conversion started {was} --strict; rerun it the same way to resume, "
                                      "or add --no-resume to start over")
                planned = e.get("shard_digests") or []
                changed = []
                # A shard converted again (its spool lost before its commit was journalled) has several events:
                # the last counts, as in shards_done().
                done_now = {ev["shard"]: ev for ev in self.events if ev["event"] == "shard" and ev["split"] == split}
                for i, done in sorted(done_now.items()):
                    was = done.get("digest") or (planned[i] if i < len(planned) else None)
                    if was is None:
                        continue
                    sp = plan.shards[i]
                    now = plan.shard_digests[i] if plan.shard_digests else digest_of(sp)
                    if now != was:
                        changed.append(sp)
                if changed:
                    named = "; ".join(f"{sp.id}: inputs {items[plan.order[sp.start]].origin} .. "
                                      f"{items[plan.order[sp.stop - 1]].origin}" for sp in changed[:5])
                    more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
                    raise ConfigError(f"inputs of the {split} split changed since this conversion started (a file "
                                      f"replaced, or a label changed) in {len(changed)} converted shard(s): "
                                      f"{named}{more}; add --no-resume to convert from the current inputs")
                return
        event = {"event": "plan", "split": split, "digest": plan.digest, "shards": shards,
                 "identity": identity, "shard_digests": list(plan.shard_digests)}
        if plan.tapered_from is not None:
            event["tapered_from"] = plan.tapered_from
        self.append(event)

    def shards_done(self) -> dict[tuple[str, int], dict]:
        return {(e["split"], e["shard"]): e for e in self.events if e["event"] == "shard"}

    def commit_events(self, sink: str, split: str) -> list[dict]:
        """Every commit of ``sink`` for ``split``, in order."""
        return [e for e in self.events if e["event"] == "commit" and e["sink"] == sink and e["split"] == split]

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
