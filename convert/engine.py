"""A conversion, driven: list and plan, run the shards in parallel, feed the ordered sinks, finish.

The driver plans (:mod:`.plan`) and hands each shard to what runs it (:mod:`.scheduler`: local processes,
Ray's workers); a shard (:mod:`.worker`) reads its inputs, encodes them once for every format and writes
its own files or spool files. The driver keeps at most ``2 x workers`` shards between submission and
commit, journals every completed shard and commit (:mod:`.state`), and commits the spools into each split's
ordered sinks (:mod:`.sinks`) on a thread per sink (:class:`_Committer`), while the workers go on. With
``--store-dtype float*`` and no given mean/std, a statistics pre-pass over the train split (:func:`_prepass`)
runs first.

Determinism: the plan fixes which items form each shard and each sample's index; a shard's bytes depend only
on its items and the options, so the number of workers, nodes, retries or resumes changes nothing. A skipped
input keeps its planned index unused (see docs/convert.md).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import os
import shlex
import threading
import time
from collections.abc import Sequence

from gpufeed import io
from gpufeed.convert import faults, sinks
from gpufeed.convert.identity import identities, input_bytes
from gpufeed.convert.options import ConvertOptions
from gpufeed.convert.plan import ShardPlan, SplitPlan, plan_split, shard_digest, split_order
from gpufeed.convert.scheduler import RayStart, Tasks, cap_workers, ray_initialized
from gpufeed.convert.worker import ShardJob, file_entry, run_shard, stats_shard
from gpufeed.errors import ConfigError, GpufeedError, OutputError
from gpufeed.formats.base import PER_SPLIT
from gpufeed.machine import run_queue_seconds, usable_cores
from gpufeed.pipelines.base import Item, all_local_files, keys_of, take_items

#: Shards between submission and commit, per worker (in flight, or done and waiting for an ordered sink).
#: At most ``workers`` run at once, also on a shared cluster, so ``--workers`` means what it says; the
#: driver submits the next shard as soon as ``ray.wait`` reports one done, so workers do not idle. The shards in
#: flight count (64 running and 8 queued at 64 workers), so 2 a worker left under one done shard a worker of room
#: behind a slow one: a shard taking twice the median (most runs have one) held free workers back 0.3-1.6 s a run,
#: where 3 a worker held none in 3 runs of 4 (32 workers, warm: results/convert-node-h200x2.txt, session 26); at 64
#: workers it halved the idle worker-seconds mid-run, four pairs 0.989-1.051 (results/convert-node-h200x4.txt). In
#: session 13, with the commit then the pace, 4 a worker had fed slower than 2 (0.716 and 0.764 of the plain loop
#: against 0.830 and 0.810; results/convert-node-h200x4.txt).
WINDOW_PER_WORKER = 3
#: The window where memory spools have room for this many shards a worker and not for WINDOW_PER_WORKER: spools
#: in memory matter more than the wider window (on the disk they are written back for nothing).
MIN_WINDOW_PER_WORKER = 2
#: At most this many shards a split sink commits together (one disk flush for them: see SplitSink.commit_many).
COMMIT_BATCH = 16


@dataclasses.dataclass
class Summary:
    """What a run did: per split and format, the samples written; skipped inputs; bytes and time."""

    out: str
    samples: dict  # split -> {"planned", "written", "skipped", "formats": {format: records}}
    skipped: list  # [(origin, reason)]
    bytes_written: int
    seconds: float
    files: list = dataclasses.field(default_factory=list)
    complete: bool = True
    note: str = ""
    worker_seconds: float = 0.0  # summed wall time of the shards converted, inside the workers
    worker_cpu_seconds: float = 0.0  # and their CPU time
    prepass_shards: int = 0  # shards whose statistics this run computed in the pre-pass (not resumed)
    first_shard_started: float | None = None  # when a worker began this run's first shard (epoch seconds)
    timeline: dict = dataclasses.field(default_factory=dict)  # seconds from the start to each step
    unit: str = "images"  # what a sample is: images, or token records (Penn Treebank)
    dry_run: bool = False  # nothing was written: ``planned`` is what a run would write
    converted: list = dataclasses.field(default_factory=list)  # [(origin, why)]: re-encoded in pass-through
    normalization: dict | None = None  # the statistics files written (manifest.json's "normalization")

    @property
    def written(self) -> int:
        return sum(s["written"] for s in self.samples.values())

    @property
    def images_per_second(self) -> float:
        return self.written / self.seconds if self.seconds else 0.0


class _Split:
    """Driver-side state of one split: plan, items, ordered sinks and how far they have committed."""

    def __init__(self, plan: SplitPlan, items: Sequence[Item]):
        self.plan = plan
        self.items = items
        self.sinks = {}  # a per-split format's name -> its sink
        self.next = {}  # sink -> next shard to commit
        self.taken = {}  # sink -> next shard not yet handed to it (ahead of ``next`` while a batch commits)
        self.results = {}  # shard -> journalled shard event
        self.finished = {}  # sink -> files, once the split's ordered output is final

    def shard_items(self, sp: ShardPlan) -> Sequence[Item]:
        return take_items(self.items, self.plan.order[sp.start:sp.stop])


class _Clock:
    """When the run reached each step (seconds since it began), and the driver's own busy time: the
    summary's ``timeline``, so a slow run shows where its time went."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.epoch = time.time()
        # The driver's CPU time: its main thread's (made on the thread that runs convert()), and every thread's.
        self.cpu0 = (time.thread_time(), time.process_time())
        self.marks = {}
        # commit: the appending threads' time adding shards to the split outputs (SplitSink.append_many);
        # commit_cpu: their own CPU time in it, the kernel's copies included;
        # commit_run_queue: the part they were runnable but waiting for a core (the workers had them all); the
        # rest of it waited for the disk or the kernel's locks; commit_writeback: the part spent starting the
        # appended bytes' writes to the disk (SplitSink.writeback_s).
        # On the syncing threads, beside them: commit_sync, waiting for what was appended to reach the disk
        # (SplitSink.sync_s: a .rec's writes in flight, then the fsync); commit_journal, journalling the commits
        # (a write and an fsync of the journal).
        # On the main thread: shard_journal, journalling each converted shard (and saving its statistics).
        self.busy = {"commit": 0.0, "commit_cpu": 0.0, "commit_run_queue": 0.0, "commit_sync": 0.0,
                     "commit_writeback": 0.0, "commit_journal": 0.0, "shard_journal": 0.0, "finish": 0.0}
        self._lock = threading.Lock()

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, round(time.perf_counter() - self.t0, 3))

    @contextlib.contextmanager
    def timed(self, what: str):
        # Only what is kept is read: a commit batch's /proc read, not every timed step's.
        cpu = time.thread_time() if f"{what}_cpu" in self.busy else None
        queued = run_queue_seconds() if f"{what}_run_queue" in self.busy else None
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(what, time.perf_counter() - start)
            if cpu is not None:
                self.add(f"{what}_cpu", time.thread_time() - cpu)
            if queued is not None:
                self.add(f"{what}_run_queue", (run_queue_seconds() or queued) - queued)

    def add(self, what: str, seconds: float) -> None:
        with self._lock:  # the sinks' commit threads add to it side by side
            self.busy[what] += seconds

    def timeline(self, first_started: float | None) -> dict:
        out = dict(self.marks)
        if first_started is not None:
            out["first_shard_started"] = round(first_started - self.epoch, 3)
        out.update({f"driver_{k}_s": round(v, 3) for k, v in self.busy.items()})
        # Read on the thread that made the clock: the main thread's CPU apart from the commit threads' and the
        # pool's (the rest of driver_cpu_s).
        out["driver_main_cpu_s"] = round(time.thread_time() - self.cpu0[0], 3)
        out["driver_cpu_s"] = round(time.process_time() - self.cpu0[1], 3)
        out["total"] = round(time.perf_counter() - self.t0, 3)
        return out


def convert(options: ConvertOptions, progress=None) -> Summary:
    """Run one conversion. ``progress`` is a :class:`gpufeed.convert.progress.Progress` or ``None``."""
    t0 = _Clock()
    if not options.address and not ray_initialized():
        options = cap_workers(options, usable_cores(), "this machine has", progress)
    ray_start = None if options.dry_run else RayStart(options)
    host_frozen = gc.get_freeze_count()  # a program that froze objects of its own keeps them frozen
    try:
        return _convert(options, progress, t0, ray_start)
    finally:
        if not host_frozen:
            gc.unfreeze()
        if ray_start is not None:
            ray_start.shutdown()


def _convert(options: ConvertOptions, progress, t0: _Clock, ray_start) -> Summary:
    from gpufeed.convert import destination
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.state import (TAPERED_JOURNAL_VERSION, DestinationLock, Journal, destination_spelling,
                                       state_dir_for)
    from gpufeed.pipelines import open_source
    from gpufeed.pipelines.pooled import Lent

    out = destination_spelling(options.out)
    root = options.source_root
    root = os.path.abspath(io.local_path(root)) if options.src_is_place and io.is_local(root) else root
    if progress is not None:
        progress.phase(f"listing {options.src}")
    source = open_source(options.dataset, root, on_error=options.on_error, **options.source_options())
    local = ray_start.local if ray_start is not None else None
    if local is not None:  # its processes start while the driver lists: they take part once they are up
        source.pool = Lent(local.pool, lambda: local.started_at() is not None)
    if progress is not None:
        source.tell = progress.listing
    available = source.splits()
    splits = list(options.splits or available)
    for s in splits:
        if s not in available:
            raise ConfigError(f"--split {s!r} is not in {options.src}; it holds {', '.join(available) or 'no splits'}")
    plans, items_by_split, listed, known_by_split = {}, {}, {}, {}
    source.expect(splits)
    for s in splits:
        items = source.items(s)
        if options.list_file is not None:
            _check_inputs_outside(items, out, options.src)
        listed[s] = len(items)
        if options.limit is not None and options.limit < len(items):
            keep = split_order(len(items), s, options.seed, options.effective_shuffle)[:options.limit]
            items = [items[i] for i in sorted(keep)]
        cache = {}
        # Local files are digested by the workers that read them (a stat each, cold, is seconds per 100,000
        # inputs here); remote files, tar members and data in memory are cheaper to identify from here.
        in_workers = options.shard_bytes is None and all_local_files(items)
        known = None if in_workers else identities(items, options.strict, cache)
        shards = options.shards
        if options.shard_bytes is not None:
            shards = max(1, round(input_bytes(items, cache) / options.shard_bytes))
        plans[s] = plan_split(s, keys_of(items), options.seed, options.effective_shuffle,
                              shards, options.shard_size, identities=known,
                              per_shard=options.default_shard_samples, taper=options.tapers)
        items_by_split[s], known_by_split[s] = items, known
    # The listing's objects (a million names and keys for ImageNet; items where listed one by one) live until
    # the run ends and make no garbage: the collector leaves them out of its passes from here (each pass over
    # them held the GIL, which the driver's loop and commit threads need, for ~0.1 s per 300,000 items).
    # convert() hands them back when it returns.
    # Not where the program running convert() froze objects of its own: there is no unfreezing ours alone.
    if not gc.get_freeze_count():
        gc.freeze()
    t0.mark("listed")
    if ray_start is not None and not options.pool_converts:
        ray_start.begin()  # (where the local processes convert, Ray starts only once a shard needs it)
    if progress is not None:
        limited = "" if options.limit is None else (
            f"; converting {', '.join(f'{s} {len(v)}' for s, v in items_by_split.items())} of them (--limit)")
        planned = sum(len(p.shards) for p in plans.values())
        progress.phase(f"listed {sum(listed.values())} inputs "
                       f"({', '.join(f'{s} {n}' for s, n in listed.items())}){limited}; planned "
                       f"{planned} shard{'' if planned == 1 else 's'}")
    if options.dry_run:
        return _dry_run(options, out, plans)

    try:
        sinks.makedirs(out)
    except OSError as e:
        if not io.is_local(out):
            raise OutputError(f"{out}: cannot be written ({type(e).__name__}: {e}); check the URL, its "
                              "credentials and the network") from e
        raise OutputError(f"{out}: cannot be created ({e.strerror or e}); choose another destination, or make the "
                          "folder it goes in a writable folder") from e
    except GpufeedError:
        raise
    except Exception as e:  # fsspec backends raise their own errors for bad URLs, credentials, networks
        raise OutputError(f"{out}: cannot be written ({type(e).__name__}: {e}); check the path or URL, its "
                          "credentials and the network") from e
    state_dir = state_dir_for(out)
    lock = DestinationLock.acquire(state_dir, out)
    journal = None
    try:
        destination.check_state_dir(out)  # before the journal is read: nothing in it leads outside DST
        kind, doc = manifest_mod.finished(out)
        done = _finished_output(options, out, kind, doc)
        joined = done.manifest if isinstance(done, _Join) else None
        if done is not None and joined is None:
            return done
        if kind == "none":
            # A join killed before its manifest, rerun (with or without --resume): its journal keeps the
            # finished conversion it adds to.
            earlier = manifest_mod.joined_manifest(Journal.peek(state_dir))
            if earlier is not None and isinstance(_finished_output(options, out, "complete", earlier), _Join):
                joined = earlier
        if joined is not None:
            manifest_mod.check_classes(joined, source.classes(), out)
        _clear_destination(options, out, state_dir, list(plans), doc, progress, replacing=joined is None)
        journal = Journal.open(state_dir, out, options.output_key(), options.resume)
        if joined is not None and not manifest_mod.joined_manifest(journal.events):
            # Kept in the journal, as the manifest is removed until this run finishes: a run killed meanwhile
            # still proves the earlier splits' files, and its rerun writes them into the manifest.
            journal.append({"event": "joined", "manifest": joined})
        for s, plan in list(plans.items()):
            items = items_by_split[s]
            # Resumed with the same options: the split keeps the shards it was planned in, even where this
            # gpufeed's default count or taper differs from the one that started it; a split a journal an older
            # gpufeed started has not planned yet is cut into equal shards, the only ones that gpufeed reads.
            planned = want = journal.planned_shards(s, plan.digest)
            if planned is None and plan.tapered_from is not None and journal.version < TAPERED_JOURNAL_VERSION:
                want = (plan.tapered_from, None)
            if want is not None and want != (len(plan.shards), plan.tapered_from):
                count, tapered_from = want
                plan = plans[s] = plan_split(s, keys_of(items), options.seed, options.effective_shuffle,
                                             tapered_from or count, identities=known_by_split[s],
                                             taper=tapered_from is not None, taper_min=0)
                if progress is not None and planned is not None:
                    progress.phase(f"resuming {s} in the {count} shards it was planned in")
            journal.check_plan(s, plan, items, options.strict, lambda sp, plan=plan, items=items: shard_digest(
                identities(take_items(items, plan.order[sp.start:sp.stop]), options.strict)))
        return _run(options, out, source, plans, items_by_split, journal, state_dir, progress, t0, ray_start)
    finally:
        if journal is not None:
            journal.close()
        sinks.release_memory_spools(out)  # where the run stopped before it could remove them (the lock only)
        lock.release()


def _check_inputs_outside(items, out: str, src: str) -> None:
    """No input a list file names may lie inside the destination (a folder source's own check keeps --out out
    of the folder): the next run would read what this one wrote, or this one overwrite an input. Paths are
    compared as spelled and with the destination's links followed (no call per input)."""
    if not io.is_local(out):
        return
    inside = tuple({os.path.realpath(out).rstrip(os.sep) + os.sep, os.path.abspath(out).rstrip(os.sep) + os.sep})
    for it in items:
        url = getattr(it.ref, "url", None)
        if url is not None and io.is_local(url) and os.path.abspath(io.local_path(url)).startswith(inside):
            raise ConfigError(f"{it.origin}, an input {src} lists, is inside the destination {out}; choose a "
                              "destination that holds none of the inputs")


def _named_splits(options: ConvertOptions) -> list[str] | None:
    """The splits a run converts where known before listing: ``--split``, or a list file's one."""
    if options.splits:
        return list(options.splits)
    if options.list_file:
        from gpufeed.pipelines.sources_imagenet import split_of_list

        return [split_of_list(options.list_file)]
    return None


@dataclasses.dataclass
class _Join:
    """A run that adds its splits to a destination's finished conversion (``manifest``): same options, other
    splits. Its files stay; the manifest written at the end lists both."""

    manifest: dict


def _finished_output(options: ConvertOptions, out: str, kind: str, doc: dict | None) -> "Summary | _Join | None":
    """A destination that already holds a finished conversion: the same one (nothing to do), the same
    conversion of other splits (:class:`_Join`: this run adds its splits), another one (refused, unless
    ``--overwrite`` removes its files), or a ``manifest.json`` gpufeed did not write (refused: never
    overwritten). ``None`` when the run goes ahead."""
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.state import options_diff, recorded_options

    if kind == "foreign":
        raise ConfigError(f"{manifest_mod.path(out)} was not written by gpufeed, which would overwrite it; "
                          "choose another destination")
    if kind == "none":
        return None
    key = options.output_key()
    recorded = recorded_options(doc["output_options"], key)
    if recorded == key and kind == "complete" and options.resume:
        return Summary(out, doc["splits"], [tuple(s) for s in doc["skipped"]], doc["bytes_written"], 0.0,
                       unit=_unit(options), converted=[tuple(c) for c in doc.get("converted", ())],
                       note="already complete; nothing to do (add --no-resume to convert again)")
    differing = {k for k in set(recorded) | set(key) if recorded.get(k) != key.get(k)}
    held = sorted(doc.get("splits") or {})
    mine = _named_splits(options)
    if (recorded != key and not options.overwrite and differing <= {"splits", "src"} and held and mine
            and kind == "complete"):
        sources = manifest_mod.split_sources(doc)
        if set(mine) <= set(held) and options.resume and all(sources.get(s) == key.get("src") for s in mine):
            return Summary(out, {s: doc["splits"][s] for s in mine}, [], 0, 0.0, unit=_unit(options),
                           note=f"{', '.join(mine)} already complete in {out}; nothing to do (add --no-resume to "
                                "convert again)")
        if not set(mine) & set(held):
            # Another split of the same conversion (im2rec's val.lst after train.lst, --split val after
            # --split train): it joins the destination, whose files stay as they are.
            if doc.get("normalization") or options.normalize or options.statistics_prepass:
                raise ConfigError(f"{out} holds the finished {', '.join(held)} split(s), with statistics of their "
                                  f"own; a split computing statistics cannot join it: write this one to a "
                                  f"destination of its own (e.g. {out.rstrip('/')}-{'-'.join(mine)}), or convert "
                                  "every split in one run")
            return _Join(doc)
    if recorded != key and not options.overwrite:
        diff = options_diff(recorded, key, "finished run")
        raise ConfigError(f"{out} holds a finished conversion made with other options ({diff}); add --overwrite "
                          "to replace it (its files are removed first), or choose another destination")
    return None


def _clear_destination(options, out: str, state_dir: str, splits: list, doc: dict | None, progress,
                       replacing: bool = True) -> None:
    """Before anything is written: a finished conversion being replaced (``doc``: converted again with
    ``--no-resume`` or ``--overwrite``, or after losing files) has its files removed, and so has whatever an
    earlier run wrote at the names the splits that start afresh now will write; only files the destination's
    manifest or journal prove gpufeed wrote, checked all before any is removed (:mod:`.destination`). Then the
    manifest goes, and without ``--resume`` the earlier run's journal."""
    from gpufeed.convert import destination
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.state import Journal, remove_state

    destination.check_output_folders(out, options.formats)  # the state folder was checked once the lock was held
    events = Journal.peek(state_dir)
    if options.resume:
        Journal.check_options(events, out, options.output_key())
    kept = events if options.resume else []
    planned = {e.get("split") for e in kept if e.get("event") == "plan"}
    evidence = destination.Evidence(out)
    evidence.add_journal(events, os.path.join(state_dir, "journal.jsonl"))
    rels = []
    for earlier in ([manifest_mod.joined_manifest(events)] if manifest_mod.joined_manifest(events) else []):
        evidence.add_manifest(earlier, os.path.join(state_dir, "journal.jsonl"))
    if doc is not None:
        evidence.add_manifest(doc, manifest_mod.path(out))
        if replacing:
            rels = [f["path"] for f in doc["files"]]
    # A join keeps the class lists in place (its end rewrites them whole): a join given up leaves them as they were.
    rels += destination.in_the_way(out, options.formats, [s for s in splits if s not in planned],
                                   not planned and replacing)
    destination.clear(out, rels, evidence, progress)
    try:
        manifest_mod.remove(out)
    except OSError as e:
        raise OutputError(f"{manifest_mod.path(out)}: cannot be removed ({e.strerror or e}); the destination "
                          "must be writable: fix its permissions or mount, or choose another destination") from e
    if not options.resume:
        remove_state(state_dir)
        sinks.remove_memory_spools(out)


def _dry_run(options, out, plans) -> Summary:
    samples = {s: {"planned": len(p), "written": 0, "skipped": 0, "shards": len(p.shards),
                   "formats": {f: 0 for f in options.formats}} for s, p in plans.items()}
    return Summary(out, samples, [], 0, 0.0, complete=False, unit=_unit(options), dry_run=True,
                   note=f"dry run: would write {', '.join(options.formats)} to {out}; nothing was written")


def _unit(options) -> str:
    return "records" if options.text else "images"


def _stats_split(options, plans) -> str | None:
    if not options.normalize:
        return None
    return "train" if "train" in plans else next(iter(plans))


def _prepass(ray_once, options, out, st: _Split, journal, state_dir, image_options):
    """The exact statistics of ``st``'s split before anything is written, for normalised float storage:
    one Ray task per shard sums the stored pixels; each partial is saved and journalled, so a resumed
    run computes only the missing ones. Returns ``(merged ChannelStats, shards computed)``."""
    from gpufeed.convert.manifest import merge_stats, save_stats

    split = st.plan.split
    prefix = f"prepass-{split}"
    stats_dir = os.path.join(state_dir, "stats")
    done = {e["shard"] for e in journal.events if e["event"] == "prestats" and e["split"] == split}
    todo = [sp for sp in st.plan.shards
            if sp.shard not in done or not os.path.exists(os.path.join(stats_dir, f"{prefix}-{sp.shard:05d}.npz"))]
    if todo:
        tasks = Tasks(lambda block: ray_once(), stats_shard, options, st.shard_items)
        formats = tuple(options.output_formats())
        tasks.pending.extend(ShardJob(sp, out, formats, image_options, options.on_error, True,
                                      faults=faults.from_env()) for sp in todo)
        try:
            while tasks:
                _, result = tasks.next()
                save_stats(result["stats"], os.path.join(stats_dir, f"{prefix}-{result['shard']:05d}.npz"))
                journal.append({"event": "prestats", "split": split, "shard": result["shard"]})
        except BaseException:
            tasks.cancel()
            raise
    stats = merge_stats(state_dir, prefix)
    if not stats.images:
        raise ConfigError(f"the {split} split has no usable image, so --normalize has no statistics to "
                          "normalise with; give --mean and --std")
    return stats, len(todo)


def _run(options, out, source, plans, items_by_split, journal, state_dir, progress, t0, ray_start) -> Summary:
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.state import STATE_DIR

    formats = options.output_formats()
    ordered = [f.name for f in formats if f.layout == PER_SPLIT]
    assemblers = {f.name: f.assembler() for f in formats if f.layout == PER_SPLIT}
    prepass_split = _stats_split(options, plans) if options.statistics_prepass else None
    stats_split = None if prepass_split else _stats_split(options, plans)
    image_options = options.image_options()
    # A destination the workers cannot write (memory://, or --driver-writes): shards come back to the
    # driver as bytes, and spool files stay in the local state directory.
    driver_writes = options.driver_writes or out.startswith("memory://")
    spool_dir = (os.path.join(state_dir, sinks.SPOOL_DIR) if driver_writes
                 else sinks.join(out, STATE_DIR, sinks.SPOOL_DIR))
    window, memory = WINDOW_PER_WORKER, None
    _report_stopped_states(out, progress)
    if ordered and io.is_local(out) and options.address is None:
        _sweep_memory_spools(out, progress)
        # Every worker is on this machine: spools in memory, never written back to the disk.
        per_shard = max((sp.stop - sp.start for p in plans.values() for sp in p.shards), default=0)
        # Raw pixels (float stores, --encode raw) are many times an encoded image: sized for them too.
        raw = any(options.encode_for(f) == "raw" for f in ordered)
        memory, window = memory_spools_and_window(out, options.workers, per_shard, len(ordered),
                                                  sinks.RAW_SPOOL_SAMPLE_BYTES if raw else sinks.SPOOL_SAMPLE_BYTES)
        spool_dir = memory or spool_dir
    t0.marks["commit_window_per_worker"] = window
    float_dtype = options.image.store_dtype if options.image.store_dtype != "uint8" else None
    for fmt in options.formats:
        sinks.makedirs(sinks.join(out, fmt))
    if ordered:
        sinks.makedirs(spool_dir)
    manifest_mod.remove_temporaries(out, options.formats)

    splits = {s: _Split(p, items_by_split[s]) for s, p in plans.items()}
    shard_events = journal.shards_done()
    finals = {(e["sink"], e["split"]): e["files"] for e in journal.events if e["event"] == "final"}
    todo = []
    for s, st in splits.items():
        for sp in st.plan.shards:
            ev = shard_events.get((s, sp.shard))
            if ev is not None:
                st.results[sp.shard] = ev
        for sink in ordered:
            if (sink, s) in finals:
                st.finished[sink] = finals[(sink, s)]
                continue
            commits = journal.commit_events(sink, s)
            st.sinks[sink] = assemblers[sink](state_dir, out, s, float_dtype).open(commits)
            st.next[sink] = st.taken[sink] = commits[-1]["shard"] + 1 if commits else 0
        for sp in st.plan.shards:
            if not _shard_usable(st, sp, spool_dir):
                st.results.pop(sp.shard, None)
                todo.append(sp)

    ray = None

    def ray_ready(block: bool):
        if not block and not ray_start.ready():
            ray_start.begin()  # asked for, so needed: a runtime the local pool deferred starts now
            return None
        return ray_once()

    def ray_once():
        nonlocal ray, options
        if ray is None:
            ray, _ = ray_start.get(progress)
            t0.mark("ray_ready")
            cpus = int(ray.cluster_resources().get("CPU", 0))
            if cpus:
                options = cap_workers(options, cpus, "the Ray cluster has" if options.address else
                                       "this Ray runtime has", progress)
        return ray

    total = sum(sp.stop - sp.start for sp in todo)
    tasks = committer = None
    prepass_stats, prepass_shards = None, 0
    try:
        if prepass_split:
            ray_once()  # the worker count is settled before the pre-pass submits anything
            prepass_stats, prepass_shards = _prepass(ray_once, options, out, splits[prepass_split], journal,
                                                     state_dir, image_options)
            try:
                image_options = dataclasses.replace(image_options, mean=prepass_stats.mean, std=prepass_stats.std)
            except ConfigError as e:
                raise ConfigError(f"the {prepass_split} split's statistics cannot normalise its pixels ({e}); give "
                                  "--mean and --std") from None
        if progress is not None:
            progress.start(total, sum(len(p) for p in plans.values()) - total,
                           unit="img" if source.modality == "image" else "seq")
        committer = _Committer(ordered, journal, spool_dir, progress, t0)
        for st in splits.values():
            committer.ready(st)
        if todo:
            local = (ray_start.local if options.pool_converts or (ray is None and not ray_start.ready())
                     else None)
            tasks = Tasks(ray_ready, run_shard, options, lambda sp: splits[sp.split].shard_items(sp),
                           lambda inflight: inflight + _awaiting(splits) < window * options.workers,
                           local=local)
            if progress is not None:
                progress.converting()
            injected = faults.from_env()
            encodes = tuple(options.encode_for(f.name) for f in formats)
            identify = "content" if options.strict else "stat"
            tasks.pending.extend(
                ShardJob(sp, out, tuple(formats), image_options, options.on_error, sp.split == stats_split,
                         spool_dir, driver_writes, faults=injected, encodes=encodes,
                         identify="" if plans[sp.split].shard_digests else identify) for sp in todo)
            tasks.submit()
            t0.mark("ready_to_convert")  # destination, journal and sinks set up; shards handed to what runs them
            while tasks:
                committer.check()
                job, result = tasks.next()
                sp = job.plan
                st = splits[sp.split]
                # The freed worker gets its next shard before the driver journals and commits this one.
                st.results[sp.shard] = result
                tasks.submit()
                if driver_writes:
                    sinks.land(result.pop("blobs"), result["files"], out, spool_dir)
                with t0.timed("shard_journal"):
                    event = _journal_shard(journal, state_dir, spool_dir, result)
                st.results[sp.shard] = event
                if progress is not None:
                    progress.update(result["written"] + len(result["skipped"]), result["bytes"])
                committer.ready(st)
            t0.marks["held_by_commit_window_s"] = round(tasks.held_s, 3)
            if local is not None:
                local.close()
                t0.marks["shards_converted_locally"] = local.shards
                if (started := local.started_at()) is not None:  # every local process up, against the listing
                    t0.marks["local_processes_started"] = round(started - t0.epoch, 3)
                if not options.pool_converts:
                    t0.marks["shards_converted_before_ray"] = local.shards
        t0.mark("shards_done")
        committer.close()
    except BaseException:
        if tasks is not None:
            tasks.cancel()
        if committer is not None:
            try:
                committer.close()
            except BaseException:
                pass  # the error being raised already says what went wrong first
        for st in splits.values():
            for sink in st.sinks.values():
                sink.close()
        _drop_leftovers(out, options.formats, state_dir, memory, progress)
        raise
    finally:
        if progress is not None:
            progress.close()
        if ray_start.ready():
            ray_start.stop()  # down while the outputs are finished; convert() waits for it
        # else: every shard ran before Ray came up; convert() shuts it down once the outputs are finished,
        # rather than wait for it here.

    try:
        for st in splits.values():
            _commit_ready(st, journal, spool_dir, progress, t0)
            missing = [sink for sink in ordered if sink not in st.finished]
            if missing:
                raise OutputError(f"{out}: the {st.plan.split} split's {', '.join(missing)} output did not "
                                  "complete; rerun the same command to resume")
        summary = _finish(options, out, source, splits, journal, state_dir, spool_dir, stats_split, t0,
                          prepass_stats)
    except BaseException:
        _drop_leftovers(out, options.formats, state_dir, memory, progress)
        raise
    summary.prepass_shards = prepass_shards
    return summary


def _drop_leftovers(out: str, formats, state_dir: str, memory: str | None = None, progress=None) -> None:
    """A stopped run (an error, Ctrl-C) leaves no temporary file of a shard it cut short beside the outputs (a
    task still running on Ray may yet write one; the rerun removes it). Its memory spools (``memory``) stay: they
    hold shards converted and journalled, which its rerun takes instead of converting them again (up to the
    in-flight window: 5.4 GB, half of a 100,000-image run at 32 workers, results/killed-spools-h200x2.txt); the lock
    released, the next run of another destination frees them (:func:`_sweep_memory_spools`). So does its state
    (``state_dir``: the journal, the split outputs assembled so far, spools on disk). With ``progress``, it says
    what each holds, how to free the memory without a rerun, and how to give the run up (``gpufeed clean``)."""
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.progress import size_text

    try:
        manifest_mod.remove_temporaries(out, formats)
    except Exception:
        pass  # the error being raised already says what went wrong first; the rerun removes them
    if progress is None:
        return
    if memory is not None and (size := io.tree_bytes(memory)):
        progress.warn(f"{size_text(size)} of converted shards stay in memory in {memory} for the rerun, which "
                      "takes them instead of converting them again; to free that memory without a rerun: "
                      f"rm -r {shlex.quote(memory)}")
    if os.path.isdir(state_dir):
        progress.warn(f"{size_text(io.tree_bytes(state_dir))} of the conversion's state (its journal and the split "
                      f"outputs assembled so far) stays in {state_dir} for the rerun, which resumes from it; to give "
                      f"the run up instead: gpufeed clean {shlex.quote(out)}")


def _report_stopped_states(out: str, progress, shown: int = 5) -> None:
    """Say what the remote destinations' runs that were stopped or killed keep under the user cache (their
    journals and split outputs, out of sight and never freed by a sweep: only they prove what the runs wrote to
    those destinations), and how to finish or give up each."""
    from gpufeed.convert.progress import size_text
    from gpufeed.convert.state import stopped_states

    found = stopped_states(keep=out) if progress is not None else []
    if not found:
        return
    named = [f"{dst} ({size_text(size)})" if dst else f"{folder} ({size_text(size)}; its destination not recorded)"
             for folder, dst, size in found[:shown]]
    more = f" and {len(found) - shown} more" if len(found) > shown else ""
    many = len(found) > 1
    total = size_text(sum(size for _, _, size in found))
    command = shlex.quote(found[0][1]) if not many and found[0][1] else "DST"
    progress.warn(f"{len(found)} conversion{'s' * many} to {'' if many else 'a '}remote destination{'s' * many}, "
                  f"stopped or killed, keep{'' if many else 's'} {total} of state in {os.path.dirname(found[0][0])}: "
                  f"{', '.join(named)}{more}; rerun {'each' if many else 'its'} command to finish it, or give it up: "
                  f"gpufeed clean {command}")


def _sweep_memory_spools(out: str, progress) -> None:
    """Free the memory that unfinished runs (stopped, or killed outright) left in spools: other destinations'
    (this one's are kept to resume from), where no live run holds them; saying so."""
    removed, size = sinks.sweep_memory_spools(keep=out)
    if removed and progress is not None:
        progress.phase(f"removed {removed} spool folder{'s' * (removed != 1)} that unfinished gpufeed runs left in "
                       f"{sinks.MEMORY_ROOT} ({size / 1e6:.1f} MB of memory)")


def memory_spools_and_window(out: str, workers: int, per_shard: int, sinks_count: int,
                             sample_bytes: int) -> tuple[str | None, int]:
    """The memory spool folder for ``out`` and the commit window (shards a worker) it has room for: the
    window bounds the shards whose spools exist at once. :data:`WINDOW_PER_WORKER` where memory holds that
    many, else :data:`MIN_WINDOW_PER_WORKER` where it holds those; ``(None, WINDOW_PER_WORKER)`` where it holds
    neither (the spools then go to the destination's state folder, where the window costs no memory)."""
    for window in (WINDOW_PER_WORKER, MIN_WINDOW_PER_WORKER):
        path = sinks.memory_spools(out, window * max(1, workers) * per_shard * sinks_count, sample_bytes)
        if path is not None:
            return path, window
    return None, WINDOW_PER_WORKER


def _awaiting(splits) -> int:
    """Completed shards still waiting for a split sink to take them (they hold spool files); those in a batch
    being committed are taken already, so a batch does not hold back the next shards' submission."""
    n = 0
    for st in splits.values():
        taken = tuple(st.taken.values())  # one step under the GIL: the committer thread changes it
        if taken:
            low = min(taken)
            n += sum(1 for i in tuple(st.results) if i >= low)
    return n


class _Committer:
    """Commits finished shards into the split sinks (and finishes each split's output) on two threads per
    sink, so the driver's loop goes on handing shards to workers while an LMDB transaction or a ``.rec`` append
    runs, and the sinks of one run (LMDB beside a ``.rec``) commit side by side. One thread appends the shards
    next in line (:meth:`SplitSink.append_many`) and drops their spools; the other makes what was appended
    durable with one sync for every batch appended meanwhile and journals those commits, so that a ``.rec``'s
    copies go on while the disk flushes the fragments before them. Commits stay in shard order per split and
    sink; the first failure stops both threads and is raised in the driver's loop (:meth:`check`)."""

    def __init__(self, sink_names, journal, spool_dir: str, progress, clock):
        import queue

        self._journal, self._spool_dir, self._progress, self._clock = journal, spool_dir, progress, clock
        self.error = None
        self._queues = {name: queue.SimpleQueue() for name in sink_names}
        self._threads = []
        for name, q in self._queues.items():
            synced = queue.SimpleQueue()
            self._threads += [threading.Thread(target=self._append_loop, args=(name, q, synced), daemon=True,
                                               name=f"gpufeed-commit-{name}"),
                              threading.Thread(target=self._sync_loop, args=(name, synced), daemon=True,
                                               name=f"gpufeed-sync-{name}")]
        for t in self._threads:
            t.start()

    def ready(self, st: _Split) -> None:
        """``st`` has a newly journalled shard: commit what is next in line."""
        for q in self._queues.values():
            q.put(st)

    def _append_loop(self, name: str, q, synced) -> None:
        try:
            while (st := q.get()) is not None:
                while self.error is None and (appended := _append_ready(st, name, self._spool_dir, self._clock)):
                    synced.put((st, appended))
                if self.error is None:
                    synced.put((st, None))  # a split with nothing left to append may be finished
        except BaseException as e:  # raised in the driver's loop
            self._failed(e)
        finally:
            synced.put(None)

    def _sync_loop(self, name: str, synced) -> None:
        import queue

        done = False
        while not done:
            items = [synced.get()]
            while True:  # every batch appended meanwhile, made durable together
                try:
                    items.append(synced.get_nowait())
                except queue.Empty:
                    break
            done = None in items
            if self.error is not None:
                continue
            try:
                by_split = {}
                for item in items:
                    if item is not None:
                        by_split.setdefault(id(item[0]), (item[0], []))[1].append(item[1])
                for st, appended in by_split.values():
                    if batches := [a for a in appended if a is not None]:
                        _sync_appended(st, name, batches, self._journal, self._clock)
                    _finish_if_complete(st, name, self._journal, self._progress, self._clock)
            except BaseException as e:  # raised in the driver's loop
                self._failed(e)

    def _failed(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Wait for every queued commit; raise the first failure."""
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
        self.check()


def _shard_usable(st: _Split, sp: ShardPlan, spool_dir: str) -> bool:
    """A journalled shard whose outputs are all still there (else it is redone)."""
    ev = st.results.get(sp.shard)
    if ev is None:
        return False
    for f in ev["files"]:
        if _is_spool(f, spool_dir):
            continue
        if sinks.file_size(f["path"]) != f["bytes"]:
            return False
    for sink, nxt in st.next.items():
        if sp.shard >= nxt and sinks.file_size(sinks.spool_path(spool_dir, sp.split, sink, sp.shard)) is None:
            return False
    return True


def _is_spool(f: dict, spool_dir: str) -> bool:
    """A file for an ordered sink (not an output of its own)."""
    return f["role"] == "spool" or f["path"].startswith(spool_dir.rstrip("/") + "/")


def _per_sample_costs(events: list) -> dict:
    """The shards' wall, CPU, core-wait, read, write and output-closing milliseconds per sample, and their
    converting threads' sleeps and page faults per sample, for those the local processes ran and those Ray's
    workers ran apart (``local_`` / ``ray_`` keys; a resumed run's earlier shards say neither)."""
    out = {}
    for where in ("local", "ray"):
        group = [ev for ev in events if "seconds" in ev and (ev.get("ran") == "local") == (where == "local")]
        samples = sum(ev["written"] + len(ev["skipped"]) for ev in group)
        if not samples:
            continue
        out[f"{where}_shards"] = len(group)
        for key, name in (("seconds", "wall"), ("cpu_seconds", "cpu"), ("run_queue_seconds", "run_queue"),
                          ("read_seconds", "read"), ("write_seconds", "write"), ("close_seconds", "close")):
            if all(key in ev for ev in group):
                out[f"{where}_{name}_ms_per_sample"] = round(sum(ev[key] for ev in group) / samples * 1e3, 3)
        for key in ("sleeps", "page_faults"):
            if all(key in ev for ev in group):
                out[f"{where}_{key}_per_sample"] = round(sum(ev[key] for ev in group) / samples, 2)
    return out


def idle_worker_seconds(events: list, workers: int) -> dict:
    """Worker-seconds with no shard running, from this run's shard events (``started``, ``seconds``), between the
    first shard's start and the last one's end, in three parts: ``ramp`` (until every worker first had a shard),
    ``middle``, and ``last_wave`` (after the last shard started: workers left with nothing to take while the last
    shards finish). Empty without timed shards."""
    spans = sorted((ev["started"], ev["started"] + ev["seconds"]) for ev in events if "started" in ev and "seconds" in ev)
    if not spans:
        return {}
    deltas = collections.Counter()
    for s0, s1 in spans:
        deltas[s0] += 1
        deltas[s1] -= 1
    edges = sorted(deltas)
    last_start = spans[-1][0]
    full = None  # when every worker first had a shard
    idle = {"ramp": 0.0, "middle": 0.0, "last_wave": 0.0}
    running = 0
    for a, b in zip(edges, edges[1:]):
        running += deltas[a]  # the shards running from a to b
        if full is None and running >= workers:
            full = a
        part = "ramp" if full is None else "last_wave" if a >= last_start else "middle"
        idle[part] += max(0, workers - running) * (b - a)
    return {f"idle_worker_s_{k}": round(v, 3) for k, v in idle.items()}


def shard_seconds_spread(events: list) -> dict:
    """How long this run's shards took in their workers: median, 90th percentile and longest (seconds). Shards
    of one size that take unequal times end the last wave ragged (``idle_worker_s_last_wave``), and one that
    takes far longer than the rest holds the commit window's shards behind it; this says by how much, and of
    the longest: its number, when it started (seconds after the first shard), and its CPU and core-wait seconds
    (work of its own where its CPU is near its time, a worker kept from a core where it is far below). Empty
    without timed shards."""
    timed = sorted((ev for ev in events if "started" in ev and "seconds" in ev), key=lambda ev: ev["seconds"])
    if not timed:
        return {}

    def at(q: float) -> float:
        return round(timed[min(len(timed) - 1, int(q * len(timed)))]["seconds"], 3)

    longest = timed[-1]
    out = {"shard_s_p50": at(0.5), "shard_s_p90": at(0.9), "shard_s_max": round(longest["seconds"], 3)}
    if "shard" in longest:
        out["shard_s_max_shard"] = longest["shard"]
    out["shard_s_max_started"] = round(longest["started"] - min(ev["started"] for ev in timed), 3)
    for key, name in (("cpu_seconds", "cpu"), ("run_queue_seconds", "run_queue")):
        if key in longest:
            out[f"shard_s_max_{name}"] = round(longest[key], 3)
    return out


def _journal_shard(journal, state_dir: str, spool_dir: str, result) -> dict:
    """Journal a converted shard. Where all it wrote is spools for the split sinks (a single ``.rec``, an LMDB),
    its line goes to the disk with the next commit's flush instead of one of its own: a crash of the machine
    that loses the line loses the spools too (they are in memory, or not synced), and the shard is converted
    again either way. A shard that wrote files of its own (TFRecord shards) or statistics is journalled durably,
    as it names files outside the spools that this run made."""
    stats = result.pop("stats")
    if stats is not None:
        from gpufeed.convert.manifest import save_stats

        save_stats(stats, os.path.join(state_dir, "stats", f"{result['split']}-{result['shard']:05d}.npz"))
    event = dict(result, event="shard", skipped=[list(x) for x in result["skipped"]],
                 converted=[list(x) for x in result["converted"]])
    journal.append(event, durable=shard_line_durable(event, spool_dir, stats is not None))
    return event


def shard_line_durable(event: dict, spool_dir: str, has_stats: bool) -> bool:
    """Whether a converted shard's journal line needs an fsync of its own: where it names a file outside the
    spools (a TFRecord or WebDataset shard: a file in DST this run made) or statistics saved beside it."""
    return has_stats or not all(_is_spool(f, spool_dir) for f in event["files"])


def _commit_ready(st: _Split, journal, spool_dir: str, progress=None, clock: _Clock | None = None) -> None:
    """Give the ordered sinks every shard that is next in line and complete, durably and
    journalled; finish a split when done. (The driver's :class:`_Committer` does the same on two threads a sink.)"""
    for sink_name in list(st.sinks):
        while appended := _append_ready(st, sink_name, spool_dir, clock):
            _sync_appended(st, sink_name, [appended], journal, clock)
        _finish_if_complete(st, sink_name, journal, progress, clock)


def _append_ready(st: _Split, sink_name: str, spool_dir: str, clock: _Clock | None):
    """Append to ``sink_name``'s output the journalled shards next in line (a result still being landed or
    journalled has no "event" yet), at most :data:`COMMIT_BATCH`, not yet durable: ``(first shard, batch, what
    the journal will record of each)``, or None where none is ready."""
    shards = st.plan.shards
    first = st.taken.get(sink_name)  # gone once the split is finished (by the syncing thread)
    batch, i = [], first
    while i is not None and i < len(shards) and len(batch) < COMMIT_BATCH and st.results.get(i, {}).get("event"):
        batch.append((sinks.spool_path(spool_dir, st.plan.split, sink_name, i), st.results[i]["files"]))
        i += 1
    if not batch:
        return None
    st.taken[sink_name] = i
    sink = st.sinks[sink_name]
    kicked = sink.writeback_s
    with clock.timed("commit") if clock else contextlib.nullcontext():
        committed = sink.append_many(batch)
    if clock:
        clock.add("commit_writeback", sink.writeback_s - kicked)
    # The spools go now, not once journalled: a shard journalled as converted whose spool is gone and whose
    # commit is not journalled is converted again on resume, as any shard whose spool was lost.
    for spool, _ in batch:
        for path in sink.spool_files(spool):
            sinks.remove(path)
    return first, batch, committed


def _sync_appended(st: _Split, sink_name: str, appended: list, journal, clock: _Clock | None) -> None:
    """Make the ``appended`` batches (:func:`_append_ready`'s, in order) durable with one sync and journal their
    commits."""
    sink = st.sinks[sink_name]
    synced = sink.sync_s
    sink.sync()
    if clock:
        clock.add("commit_sync", sink.sync_s - synced)
    with clock.timed("commit_journal") if clock else contextlib.nullcontext():
        journal.append_many([{"event": "commit", "sink": sink_name, "split": st.plan.split, "shard": first + k,
                              **fields} for first, _, committed in appended for k, fields in enumerate(committed)])
    first, batch, _ = appended[-1]
    st.next[sink_name] = first + len(batch)


def _finish_if_complete(st: _Split, sink_name: str, journal, progress, clock: _Clock | None) -> None:
    if sink_name not in st.next or st.next[sink_name] != len(st.plan.shards):
        return
    if progress is not None:
        progress.phase(f"finishing the {st.plan.split} {sink_name} output")
    with clock.timed("finish") if clock else contextlib.nullcontext():
        files = [file_entry(f) for f in st.sinks[sink_name].finish()]
    journal.append({"event": "final", "sink": sink_name, "split": st.plan.split, "files": files})
    st.finished[sink_name] = files
    st.sinks.pop(sink_name)
    st.taken.pop(sink_name, None)
    st.next.pop(sink_name)


def _records_per_format(formats, st: _Split) -> dict:
    """Records each format holds for a split, counted: per shard by its worker (split sinks add no record
    that a shard did not write; their finished file's own count is checked against that)."""
    counts = {f: 0 for f in formats}
    for ev in st.results.values():
        for f, n in ev["records"].items():
            counts[f] += n
    for sink, files in st.finished.items():
        data = sum(f["records"] for f in files if f["role"] == "data")
        if data != counts[sink]:
            raise OutputError(f"the {st.plan.split} {sink} output holds {data} records but its shards wrote "
                              f"{counts[sink]}; this is a bug, please report it (rerun with --no-resume)")
    return counts


def _stored_bytes(formats, st: _Split) -> dict:
    """``{"stored_bytes": {format: bytes}}``: the samples a split's records store (images, pixels, ids, without
    their framing), summed from its shards' workers; nothing where a shard was converted by a gpufeed that did
    not count them (resumed from its journal)."""
    events = list(st.results.values())
    if not all("stored_bytes" in ev for ev in events):
        return {}
    return {"stored_bytes": {f: sum(ev["stored_bytes"].get(f, 0) for ev in events) for f in formats}}


def _finish(options, out, source, splits, journal, state_dir, spool_dir, stats_split, t0,
            prepass_stats=None) -> Summary:
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.state import STATE_DIR, remove_state

    samples, skipped, converted, files, nbytes = {}, [], [], [], 0
    for s, st in splits.items():
        written = sum(ev["written"] for ev in st.results.values())
        sk = [tuple(x) for i in sorted(st.results) for x in st.results[i]["skipped"]]
        skipped.extend(sk)
        converted.extend(tuple(x) for i in sorted(st.results) for x in st.results[i].get("converted", ()))
        samples[s] = {"planned": len(st.plan), "written": written, "skipped": len(sk), "shards": len(st.plan.shards),
                      "formats": _records_per_format(options.formats, st), **_stored_bytes(options.formats, st)}
        for i in sorted(st.results):
            files.extend(f for f in st.results[i]["files"] if not _is_spool(f, spool_dir))
        for sink_files in st.finished.values():
            files.extend(sink_files)
    listing = [(x.origin, x.reason) for x in source.skipped()]
    nbytes = sum(f["bytes"] for f in files)
    stats = manifest_mod.merge_stats(state_dir, stats_split) if stats_split else prepass_stats
    # A worker killed mid-task (then retried) leaves its temporary files behind.
    manifest_mod.remove_temporaries(out, options.formats)
    seconds = time.perf_counter() - t0.t0
    events = [ev for st in splits.values() for ev in st.results.values()]
    summary = Summary(out, samples, listing + skipped, nbytes, seconds, files,
                      worker_seconds=sum(ev.get("seconds", 0.0) for ev in events),
                      worker_cpu_seconds=sum(ev.get("cpu_seconds", 0.0) for ev in events),
                      first_shard_started=min((ev["started"] for ev in events if "started" in ev), default=None),
                      unit=_unit(options), converted=converted)
    t0.mark("sinks_done")
    summary.timeline = t0.timeline(summary.first_shard_started)
    summary.timeline["worker_seconds"] = round(summary.worker_seconds, 3)  # shards' own time, all workers
    summary.timeline["worker_cpu_seconds"] = round(summary.worker_cpu_seconds, 3)  # their CPU, read threads too
    queued = [ev["run_queue_seconds"] for ev in events if "run_queue_seconds" in ev]
    if queued:  # the converting threads' waits for a core, where the OS reports them
        summary.timeline["worker_run_queue_seconds"] = round(sum(queued), 3)
    summary.timeline.update(_per_sample_costs(events))
    timed = [ev for ev in events if ev.get("started", 0) >= t0.epoch]
    summary.timeline.update(idle_worker_seconds(timed, options.workers))
    summary.timeline.update(shard_seconds_spread(timed))
    summary.normalization = manifest_mod.write(options, summary, source.classes(), stats,
                                               joined=manifest_mod.joined_manifest(journal.events))["normalization"]
    remove_state(state_dir)
    sinks.remove_memory_spools(out)
    if not io.is_local(out):
        sinks.remove_tree(sinks.join(out, STATE_DIR, sinks.SPOOL_DIR))
        io.remove_empty_dir(sinks.join(out, STATE_DIR))
    return summary
