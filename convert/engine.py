"""Ray orchestration of a conversion: plan, run shards in parallel, feed the ordered sinks, finish.

One Ray task per shard (:func:`run_shard`): it reads each item, makes the sample once (one decode), encodes
it for every requested format, and writes TFRecord / sharded RecordIO files itself, or spool files for the
driver's ordered sinks (:mod:`.sinks`). The driver keeps at most ``2 x workers`` shards between submission
and commit, reacts to completions with ``ray.wait``, journals every completed shard and commit
(:mod:`.state`), and receives only small result dicts: payloads never pass through it except as spool files.

Determinism: the plan (:mod:`.plan`) fixes which items form each shard and each sample's index; a shard's
bytes depend only on its items and the options, so the number of workers, nodes, retries or resumes changes
nothing. A skipped input keeps its planned index unused (see docs/convert.md).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections import deque

from gpufeed import io
from gpufeed.convert import sinks
from gpufeed.convert.options import ConvertOptions
from gpufeed.convert.plan import ShardPlan, SplitPlan, plan_split
from gpufeed.errors import ConfigError, GpufeedError, InputError, OutputError, RecordTooLargeError, SourceNotFound

#: Retries of a shard whose worker process or node died (not of errors the task raises itself).
TASK_RETRIES = 3
#: Shards between submission and commit, per worker (in flight, or done and waiting for an ordered sink).
#: At most ``workers`` run at once, also on a shared cluster, so ``--workers`` means what it says; the
#: driver submits the next shard as soon as ``ray.wait`` reports one done, so workers do not idle.
WINDOW_PER_WORKER = 2
#: Errors that mean "this input is unusable" and fall under ``--on-error``; anything else stops the run.
_INPUT_ERRORS = (InputError, SourceNotFound, RecordTooLargeError)


@dataclasses.dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs for one shard, besides its items."""

    plan: ShardPlan
    out: str
    formats: tuple[str, ...]
    sharded_recordio: bool
    image_options: object  # gpufeed.pipelines.transforms.ImageOptions
    on_error: str
    stats: bool


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

    @property
    def written(self) -> int:
        return sum(s["written"] for s in self.samples.values())

    @property
    def images_per_second(self) -> float:
        return self.written / self.seconds if self.seconds else 0.0


# -- worker side ---------------------------------------------------------------------------------------------

def _worker_setup() -> None:
    import cv2

    # One Ray worker per core: OpenCV's own thread pool would only make workers fight over cores.
    cv2.setNumThreads(1)


def run_shard(job: ShardJob, items: list) -> dict:
    """Convert one shard (runs in a Ray worker). Returns a small dict; raises gpufeed errors on failure."""
    _worker_setup()
    from gpufeed.formats import get_format
    from gpufeed.pipelines.transforms import ChannelStats, make_sample

    t0, c0 = time.perf_counter(), time.process_time()
    sp = job.plan
    opts = job.image_options
    outputs = []
    try:
        for name in job.formats:
            fmt = get_format(name)
            if name == "tfrecord":
                writer = fmt.writer(sinks.tfrecord_path(job.out, sp.split, sp.shard, sp.count))
            elif name == "recordio" and job.sharded_recordio:
                writer = fmt.writer(sinks.recordio_shard_path(job.out, sp.split, sp.shard, sp.count))
            elif name == "recordio":
                writer = fmt.writer(sinks.spool_path(job.out, sp.split, "recordio", sp.shard))
            else:
                writer = sinks.SpoolWriter(sinks.spool_path(job.out, sp.split, "lmdb", sp.shard))
            outputs.append((fmt, writer))
    except BaseException:
        for _, w in outputs:
            w.abort()
        raise
    stats = ChannelStats() if job.stats else None
    skipped, written, out_bytes = [], 0, 0
    try:
        for index, item in zip(range(sp.start, sp.stop), items):
            try:
                sample = make_sample(item, opts, index, stats=stats)
                if stats is not None and opts.encode == "pass":
                    stats.update_from_sample(sample)
                records = [fmt.encode(sample) for fmt, _ in outputs]
            except _INPUT_ERRORS as e:
                if job.on_error == "fail":
                    raise
                skipped.append((item.origin, getattr(e, "reason", None) or str(e)))
                continue
            for (_, writer), record in zip(outputs, records):
                writer.write_encoded(record)
                out_bytes += len(record.value)
            written += 1
        files = []
        for _, writer in outputs:
            closed = writer.close()
            files.extend(closed if isinstance(closed, list) else [closed])
    except BaseException:
        for _, w in outputs:
            w.abort()
        raise
    return {"split": sp.split, "shard": sp.shard, "written": written, "skipped": skipped,
            "files": [dataclasses.asdict(f) for f in files], "bytes": out_bytes,
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "stats": stats}


# -- driver side -----------------------------------------------------------------------------------------

def _open_ray(options: ConvertOptions):
    """Connect to Ray: reuse a runtime already initialised in this process, else start or join one.
    Returns ``(ray, started_here)``."""
    import logging

    import ray

    if ray.is_initialized():
        return ray, False
    env = {"env_vars": {"PYTHONHASHSEED": "0"}}
    # Ray workers are started by the raylet, not by this process: an emulated storage tier reaches them
    # only through runtime_env.
    if os.environ.get(io.ENV_VAR):
        env["env_vars"][io.ENV_VAR] = os.environ[io.ENV_VAR]
    try:
        if options.address:
            ray.init(address=options.address, logging_level=logging.ERROR, log_to_driver=False,
                     runtime_env=env)
        else:
            # address="local": a new runtime even when `ray start` left a cluster address behind in /tmp/ray
            # or RAY_ADDRESS, which ray.init would otherwise join (and refuse num_cpus for).
            ray.init(address="local", num_cpus=options.workers, include_dashboard=False,
                     logging_level=logging.ERROR, log_to_driver=False, object_store_memory=512 << 20,
                     runtime_env=env)
    except ConnectionError as e:
        raise ConfigError(f"cannot reach the Ray cluster at {options.address} ({e}); start it with "
                          "`ray start --head` or check --address") from e
    return ray, True


def _unwrap(err, sp: ShardPlan, items: list) -> BaseException:
    """Turn what Ray raised for a shard into one clear gpufeed error (never a Ray traceback)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        if isinstance(cause, GpufeedError):
            return cause
        if isinstance(cause, OSError):
            return OutputError(f"{getattr(cause, 'filename', None) or sp.id}: {cause.strerror or cause}; free "
                               "space or fix access to the destination, then rerun the same command to resume")
        first = items[0].origin if items else "?"
        return GpufeedError(f"shard {sp.id} (inputs {first} ...) failed with {type(cause).__name__}: {cause}; "
                            "if the destination is remote, check its URL, credentials and network, then rerun "
                            "the same command to resume")
    first = items[0].origin if items else "?"
    last = items[-1].origin if items else "?"
    return InputError(first, f"shard {sp.id} (inputs {first} .. {last}) crashed its Ray worker "
                             f"{TASK_RETRIES + 1} times ({type(err).__name__})",
                      "remove or repair the input that crashes the decoder (rerun with --workers 1 to find "
                      "it), then rerun the same command to resume")


class _Split:
    """Driver-side state of one split: plan, items, ordered sinks and how far they have committed."""

    def __init__(self, plan: SplitPlan, items: list):
        self.plan = plan
        self.items = items
        self.sinks = {}  # "lmdb"/"recordio" -> sink
        self.next = {}  # sink -> next shard to commit
        self.results = {}  # shard -> journalled shard event
        self.finished = {}  # sink -> files, once the split's ordered output is final

    def shard_items(self, sp: ShardPlan) -> list:
        return [self.items[i] for i in self.plan.order[sp.start:sp.stop]]


def convert(options: ConvertOptions, progress=None) -> Summary:
    """Run one conversion. ``progress`` is a :class:`gpufeed.convert.progress.Progress` or ``None``."""
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.state import Journal, state_dir_for
    from gpufeed.pipelines import open_source

    t0 = time.perf_counter()
    out = options.out.rstrip("/") if not io.is_local(options.out) else io.local_path(options.out)
    if out.startswith("memory://"):
        raise ConfigError(f"{out}: a memory:// filesystem lives inside one process, so Ray workers cannot "
                          "write to it; give a path or a URL every worker can reach (s3://, gs://, a shared mount)")
    source = open_source(options.dataset, options.src, on_error=options.on_error, **options.source_options())
    available = source.splits()
    splits = list(options.splits or available)
    for s in splits:
        if s not in available:
            raise ConfigError(f"--split {s!r} is not in {options.src}; it holds {', '.join(available) or 'no splits'}")
    plans, items_by_split = {}, {}
    for s in splits:
        items = source.items(s)
        plans[s] = plan_split(s, [it.key for it in items], options.seed, options.effective_shuffle,
                              options.shards, options.shard_size)
        items_by_split[s] = items
    if options.dry_run:
        return _dry_run(options, out, plans)

    try:
        sinks.makedirs(out)
    except Exception as e:  # fsspec backends raise their own errors for bad URLs, credentials, networks
        raise OutputError(f"{out}: cannot be written ({type(e).__name__}: {e}); check the path or URL, its "
                          "credentials and the network") from e
    if options.resume:
        done = manifest_mod.load_if_complete(out, options.output_key())
        if done is not None:
            return Summary(out, done["splits"], [tuple(s) for s in done["skipped"]], done["bytes_written"], 0.0,
                           note="already complete; nothing to do (add --no-resume to convert again)")
    manifest_mod.remove(out)
    state_dir = state_dir_for(out)
    if not options.resume:
        shutil.rmtree(state_dir, ignore_errors=True)
    journal = Journal.open(state_dir, out, options.output_key(), options.resume)
    try:
        for s, plan in plans.items():
            journal.check_plan(s, plan.digest, len(plan.shards))
        return _run(options, out, source, plans, items_by_split, journal, state_dir, progress, t0)
    finally:
        journal.close()


def _dry_run(options, out, plans) -> Summary:
    samples = {s: {"planned": len(p), "written": 0, "skipped": 0, "shards": len(p.shards),
                   "formats": {f: 0 for f in options.formats}} for s, p in plans.items()}
    return Summary(out, samples, [], 0, 0.0, complete=False,
                   note=f"dry run: would write {', '.join(options.formats)} to {out}")


def _stats_split(options, plans) -> str | None:
    if not options.normalize:
        return None
    return "train" if "train" in plans else next(iter(plans))


def _run(options, out, source, plans, items_by_split, journal, state_dir, progress, t0) -> Summary:
    from gpufeed.convert import manifest as manifest_mod

    ordered = [f for f in options.formats if f == "lmdb" or (f == "recordio" and options.shards is None)]
    stats_split = _stats_split(options, plans)
    image_options = options.image_options()
    for fmt in options.formats:
        sinks.makedirs(sinks.join(out, fmt))
    if ordered:
        sinks.makedirs(sinks.join(out, ".gpufeed", sinks.SPOOL_DIR))
    manifest_mod.remove_temporaries(out, options.formats)

    splits = {s: _Split(p, items_by_split[s]) for s, p in plans.items()}
    shard_events = journal.shards_done()
    if not shard_events:
        manifest_mod.remove_stale_outputs(out, options.formats, list(plans))
    finals = {(e["sink"], e["split"]): e["files"] for e in journal.events if e["event"] == "final"}
    rec_commits = journal.commits("recordio")
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
            if sink == "lmdb":
                st.sinks[sink] = sinks.LmdbSink(state_dir, out, s).open()
                st.next[sink] = _lmdb_position(st, st.sinks[sink].entries())
            else:
                last = rec_commits.get(s)
                records = last["records"] if last else 0
                st.sinks[sink] = sinks.RecordIOSink(state_dir, out, s).open(
                    last and last["lengths"], records, last and last["sidecar"])
                st.next[sink] = last["shard"] + 1 if last else 0
        for sp in st.plan.shards:
            if not _shard_usable(st, sp, out):
                st.results.pop(sp.shard, None)
                todo.append(sp)

    ray = None
    started = False
    window = WINDOW_PER_WORKER * options.workers
    total = sum(sp.stop - sp.start for sp in todo)
    if progress is not None:
        progress.start(total, sum(len(p) for p in plans.values()) - total)
    inflight = {}
    try:
        for st in splits.values():
            _commit_ready(st, journal, out)
        if todo:
            ray, started = _open_ray(options)
            task = ray.remote(run_shard).options(num_cpus=1, max_retries=TASK_RETRIES, retry_exceptions=False)
            pending = deque(todo)
            sharded_rec = options.shards is not None and "recordio" in options.formats

            def submit():
                while pending and len(inflight) < options.workers and (
                        not inflight or len(inflight) + _awaiting(splits) < window):
                    sp = pending.popleft()
                    job = ShardJob(sp, out, options.formats, sharded_rec, image_options, options.on_error,
                                   sp.split == stats_split)
                    inflight[task.remote(job, splits[sp.split].shard_items(sp))] = sp

            while pending or inflight:
                submit()
                ready, _ = ray.wait(list(inflight), num_returns=1)
                for ref in ready:
                    sp = inflight.pop(ref)
                    st = splits[sp.split]
                    try:
                        result = ray.get(ref)
                    except Exception as e:  # Ray wraps what the task raised, or reports a dead worker
                        raise _unwrap(e, sp, st.shard_items(sp)) from None
                    # The freed worker gets its next shard before the driver journals and commits this one.
                    st.results[sp.shard] = result
                    submit()
                    event = _journal_shard(journal, state_dir, result)
                    st.results[sp.shard] = event
                    if progress is not None:
                        progress.update(result["written"] + len(result["skipped"]), result["bytes"])
                    _commit_ready(st, journal, out)
    except BaseException:
        if ray is not None:
            for ref in inflight:
                ray.cancel(ref, force=True)
        for st in splits.values():
            for sink in st.sinks.values():
                sink.close()
        raise
    finally:
        if progress is not None:
            progress.close()
        if started:
            ray.shutdown()

    for st in splits.values():
        _commit_ready(st, journal, out)
        missing = [sink for sink in ordered if sink not in st.finished]
        if missing:
            raise OutputError(f"{out}: the {st.plan.split} split's {', '.join(missing)} output did not complete; "
                              "rerun the same command to resume")
    return _finish(options, out, source, splits, journal, state_dir, stats_split, t0)


def _awaiting(splits) -> int:
    """Completed shards still waiting for an ordered sink to take them (they hold spool files)."""
    n = 0
    for st in splits.values():
        if st.next:
            low = min(st.next.values())
            n += sum(1 for i in st.results if i >= low)
    return n


def _lmdb_position(st: _Split, entries: int) -> int:
    """The first shard not yet in the partial LMDB, from its record count and the journalled shard counts."""
    total, i = 0, 0
    shards = st.plan.shards
    while total < entries and i < len(shards) and i in st.results:
        total += st.results[i]["written"]
        i += 1
    if total != entries:
        raise OutputError(f"the partial {st.plan.split} LMDB holds {entries} records, which matches no shard "
                          "boundary in the journal; rerun with --no-resume to start over")
    # Shards with nothing written (every input skipped) add no records but are committed all the same.
    while i < len(shards) and i in st.results and st.results[i]["written"] == 0:
        i += 1
    return i


def _shard_usable(st: _Split, sp: ShardPlan, out: str) -> bool:
    """A journalled shard whose outputs are all still there (else it is redone)."""
    ev = st.results.get(sp.shard)
    if ev is None:
        return False
    for f in ev["files"]:
        if f["role"] == "spool" or "/.gpufeed/" in f["path"].replace(os.sep, "/"):
            continue
        if sinks.file_size(f["path"]) != f["bytes"]:
            return False
    for sink, nxt in st.next.items():
        if sp.shard >= nxt and sinks.file_size(sinks.spool_path(out, sp.split, sink, sp.shard)) is None:
            return False
    return True


def _journal_shard(journal, state_dir, result) -> dict:
    stats = result.pop("stats")
    if stats is not None:
        from gpufeed.convert.manifest import save_stats

        save_stats(stats, os.path.join(state_dir, "stats", f"{result['split']}-{result['shard']:05d}.npz"))
    event = dict(result, event="shard", skipped=[list(x) for x in result["skipped"]])
    journal.append(event)
    return event


def _commit_ready(st: _Split, journal, out: str) -> None:
    """Give the ordered sinks every shard that is next in line and complete; finish a split when done."""
    shards = st.plan.shards
    for sink_name, sink in list(st.sinks.items()):
        while st.next[sink_name] < len(shards) and st.next[sink_name] in st.results:
            i = st.next[sink_name]
            spool = sinks.spool_path(out, st.plan.split, sink_name, i)
            if sink_name == "lmdb":
                entries = sink.commit(spool)
                journal.append({"event": "commit", "sink": "lmdb", "split": st.plan.split, "shard": i,
                                "records": entries})
                sinks.remove(spool)
            else:
                lengths = sink.commit(spool)
                journal.append({"event": "commit", "sink": "recordio", "split": st.plan.split, "shard": i,
                                "lengths": lengths, "records": sink.records, "sidecar": sink.sidecar})
                base = spool[:-len(".rec")]
                for path in (spool, base + ".idx", base + ".lst", spool + ".json"):
                    sinks.remove(path)
            st.next[sink_name] = i + 1
        if st.next[sink_name] == len(shards):
            files = [dataclasses.asdict(f) for f in sink.finish()]
            journal.append({"event": "final", "sink": sink_name, "split": st.plan.split, "files": files})
            st.finished[sink_name] = files
            del st.sinks[sink_name]
            del st.next[sink_name]


def _finish(options, out, source, splits, journal, state_dir, stats_split, t0) -> Summary:
    from gpufeed.convert import manifest as manifest_mod

    samples, skipped, files, nbytes = {}, [], [], 0
    for s, st in splits.items():
        written = sum(ev["written"] for ev in st.results.values())
        sk = [tuple(x) for i in sorted(st.results) for x in st.results[i]["skipped"]]
        skipped.extend(sk)
        samples[s] = {"planned": len(st.plan), "written": written, "skipped": len(sk), "shards": len(st.plan.shards),
                      "formats": {f: written for f in options.formats}}
        for i in sorted(st.results):
            files.extend(f for f in st.results[i]["files"] if f["role"] != "spool"
                         and "/.gpufeed/" not in f["path"].replace(os.sep, "/"))
        for sink_files in st.finished.values():
            files.extend(sink_files)
    listing = [(x.origin, x.reason) for x in source.skipped()]
    nbytes = sum(f["bytes"] for f in files)
    stats = manifest_mod.merge_stats(state_dir, stats_split) if stats_split else None
    # A worker killed mid-task (then retried) leaves its temporary files behind.
    manifest_mod.remove_temporaries(out, options.formats)
    seconds = time.perf_counter() - t0
    events = [ev for st in splits.values() for ev in st.results.values()]
    summary = Summary(out, samples, listing + skipped, nbytes, seconds, files,
                      worker_seconds=sum(ev.get("seconds", 0.0) for ev in events),
                      worker_cpu_seconds=sum(ev.get("cpu_seconds", 0.0) for ev in events))
    manifest_mod.write(options, summary, source.classes(), stats)
    shutil.rmtree(state_dir, ignore_errors=True)
    sinks.remove_tree(sinks.join(out, ".gpufeed"))
    return summary
