"""Ray orchestration of a conversion: plan, run shards in parallel, feed the ordered sinks, finish.

One Ray task per shard (:func:`run_shard`): it reads each item, makes the sample once (one decode), encodes
it for every requested format, and writes TFRecord / sharded RecordIO files itself, or spool files for the
driver's ordered sinks (:mod:`.sinks`). The driver keeps at most ``2 x workers`` shards between submission
and commit, reacts to completions with ``ray.wait``, journals every completed shard and commit
(:mod:`.state`), and receives only small result dicts: payloads never pass through it except as spool files,
or, for a destination the workers cannot write (``memory://``, ``--driver-writes``), as the finished files'
bytes, which it writes to the destination at once.

A shard whose worker dies on every retry is bisected with probe tasks down to the one input that kills the
worker (:class:`_Tasks`). With ``--store-dtype float*`` and no given mean/std, a statistics pre-pass over
the train split (:func:`_prepass`) runs first.

Determinism: the plan (:mod:`.plan`) fixes which items form each shard and each sample's index; a shard's
bytes depend only on its items and the options, so the number of workers, nodes, retries or resumes changes
nothing. A skipped input keeps its planned index unused (see docs/convert.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import threading
import time
from collections import deque

from gpufeed import io
from gpufeed.convert import forkserver, sinks
from gpufeed.convert.options import ConvertOptions
from gpufeed.convert.plan import ShardPlan, SplitPlan, plan_split, shard_digest, split_order
from gpufeed.errors import ConfigError, GpufeedError, InputError, OutputError, RecordTooLargeError, SourceNotFound
from gpufeed.formats.base import PER_SHARD, PER_SPLIT
from gpufeed.machine import run_queue_seconds, usable_cores
from gpufeed.pipelines.base import FileRef, InlineRef, TarMemberRef, item_size, needs_read, read_item

#: Shards between submission and commit, per worker (in flight, or done and waiting for an ordered sink).
#: At most ``workers`` run at once, also on a shared cluster, so ``--workers`` means what it says; the
#: driver submits the next shard as soon as ``ray.wait`` reports one done, so workers do not idle.
WINDOW_PER_WORKER = 2
#: Errors that mean "this input is unusable" and fall under ``--on-error``; anything else stops the run.
_INPUT_ERRORS = (InputError, SourceNotFound, RecordTooLargeError)
#: Inputs read ahead of the one being converted, inside each worker: enough to keep a cold disk's latency
#: behind decoding (an ImageNet JPEG decodes in ~4 ms, a cold read takes ~1 ms), and at most this many bytes
#: of them held (one large image is always read). Local files are left to the kernel's read-ahead; other
#: inputs (remote, or under tier emulation, whose delays are paid in the reading thread) to this many threads.
READ_AHEAD = 8
READ_THREADS = 2
READ_AHEAD_BYTES = 64 << 20
#: At most this many shards a split sink commits together (one disk flush for them: see SplitSink.commit_many).
COMMIT_BATCH = 16
#: A read of one input that takes longer is an input error (``--on-error`` applies), never a hung job.
READ_TIMEOUT_S = float(os.environ.get("GPUFEED_READ_TIMEOUT_S", 120))


@dataclasses.dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs for one shard, besides its items."""

    plan: ShardPlan
    out: str
    formats: tuple  # gpufeed.formats.base.Format instances, configured (ConvertOptions.output_formats)
    image_options: object  # gpufeed.pipelines.transforms.ImageOptions
    on_error: str
    stats: bool
    spool_dir: str = ""  # where spool files for the split sinks go
    driver_writes: bool = False  # write into a worker-local directory and return the files' bytes
    exclude: tuple = ()  # planned indices of inputs found to crash the worker, skipped by --on-error skip
    encodes: tuple = ()  # per format, the encoding its samples get (empty: image_options.encode for all)
    faults: dict | None = None  # test-only fault injection (see _test_faults)
    #: "stat" / "content": digest the shard's inputs as they are read (:func:`shard_digest`), where the plan
    #: did not (local files: the driver would stat every input before the first shard could start)
    identify: str = ""


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

    @property
    def written(self) -> int:
        return sum(s["written"] for s in self.samples.values())

    @property
    def images_per_second(self) -> float:
        return self.written / self.seconds if self.seconds else 0.0


# -- worker side ---------------------------------------------------------------------------------------------

#: Test-only fault injection, read by the driver and handed to the workers in the job (Ray workers are
#: started by the raylet, so their environment is not the driver's): a JSON object with ``fsize`` (a file
#: size limit, RLIMIT_FSIZE, applied while a shard runs: the condition a full disk creates), ``crash_on``
#: (inputs whose origin ends with this string kill their worker, like a crashing decoder) and/or ``delay_s``
#: (seconds each input takes longer, so a test can act while a run is busy).
TEST_FAULTS_ENV = "GPUFEED_TEST_FAULTS"
#: Why an input isolated by bisection is skipped.
CRASH_REASON = "crashes the worker (found by bisecting its shard)"


def _test_faults() -> dict | None:
    import json

    text = os.environ.get(TEST_FAULTS_ENV)
    return json.loads(text) if text else None


def _worker_setup() -> None:
    import cv2

    # One Ray worker per core: OpenCV's own thread pool would only make workers fight over cores.
    cv2.setNumThreads(1)


def _warm_worker() -> None:
    """Run once per worker while the driver is still listing: what a first shard would otherwise wait for
    (OpenCV, the transforms, every format's module)."""
    import importlib

    from gpufeed.formats import _REGISTRY

    _worker_setup()
    import gpufeed.pipelines.transforms  # noqa: F401

    for target in _REGISTRY.values():
        importlib.import_module(target.split(":")[0])


class _FileSizeLimit:
    """The ``fsize`` test fault: lower the soft RLIMIT_FSIZE for one shard, then restore it (workers are
    reused). Python ignores SIGXFSZ, so a write past the limit fails with EFBIG, as on a full disk."""

    def __init__(self, faults: dict | None):
        self.limit = (faults or {}).get("fsize")
        self.saved = None

    def __enter__(self):
        if self.limit is not None:
            import resource

            self.saved = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(self.limit), self.saved[1]))

    def __exit__(self, *exc):
        if self.saved is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)


def _maybe_crash(job: ShardJob, item) -> None:
    delay = (job.faults or {}).get("delay_s")
    if delay:
        time.sleep(delay)
    crash_on = (job.faults or {}).get("crash_on")
    if crash_on and item.origin.endswith(crash_on):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _records(job: ShardJob, fmts, item, index, stats, data=None):
    """``(records, converted)``: one record per format of ``fmts`` (``job.formats``) from one input (``data``,
    its bytes when already read), and why pass-through stored it re-encoded (``None`` when it did not).
    Formats that store the same encoding share one sample; the input is read and transformed once per
    encoding (CIFAR's defaults differ per format, each ecosystem's own). Crashes on purpose under the
    ``crash_on`` test fault."""
    _maybe_crash(job, item)
    opts = job.image_options
    samples, records = {}, []
    for fmt, encode in zip(fmts, job.encodes or [opts.encode] * len(fmts)):
        if encode not in samples:
            one = opts if encode == opts.encode else dataclasses.replace(opts, encode=encode)
            samples[encode] = _sample(one, item, index, stats if not samples else None, data)
        records.append(fmt.encode(samples[encode]))
    converted = next((s.meta["converted"] for s in samples.values() if "converted" in s.meta), None)
    return records, converted


def _sample(opts, item, index, stats, data):
    from gpufeed.pipelines.transforms import decode_image, make_sample

    if stats is not None and opts.encode == "pass":
        # Pass-through with statistics: the full decode that gathers them also validates, so the
        # 1/8-scale validation decode is left out (each image is decoded once).
        # Stored bytes are decoded to RGB by their readers, so that is what is counted.
        sample = make_sample(item, dataclasses.replace(opts, validate=False), index, data=data)
        stats.update(decode_image(sample.payload, item.origin, max_pixels=opts.max_pixels))
        return sample
    return make_sample(item, opts, index, stats=stats, data=data)


def _open_outputs(job: ShardJob, out: str, spool_dir: str) -> list:
    """``[(format, writer, final path)]`` for one shard: its own output, or the spool of a split sink."""
    sp = job.plan
    outputs = []
    path = out
    try:
        for fmt in job.formats:
            if fmt.layout == PER_SHARD:
                path = fmt.output_path(out, sp.split, sp.shard, sp.count)
                writer = fmt.writer(path)
            else:
                path = sinks.spool_path(spool_dir, sp.split, fmt.name, sp.shard)
                writer = sinks.SPLIT_SINKS[fmt.name].spool_writer(fmt, path)
            outputs.append((fmt, writer, path))
    except OSError as e:
        for _, w, _ in outputs:
            w.abort()
        raise sinks.output_error(path, e) from e
    except BaseException:
        for _, w, _ in outputs:
            w.abort()
        raise
    return outputs


def run_shard(job: ShardJob, items: list) -> dict:
    """Convert one shard (runs in a Ray worker). Returns a small dict; raises gpufeed errors on failure.

    With ``job.driver_writes`` the files are written into a worker-local directory and returned as bytes
    (``blobs``: relative path and content), for the driver to write to the destination."""
    import tempfile

    _worker_setup()
    from gpufeed.pipelines.transforms import ChannelStats

    t0, c0, started = time.perf_counter(), time.process_time(), time.time()
    q0 = run_queue_seconds()
    local = tempfile.mkdtemp(prefix="gpufeed-shard-") if job.driver_writes else None
    try:
        out, spool_dir = job.out, job.spool_dir
        if local is not None:
            out, spool_dir = local, os.path.join(local, sinks.SPOOL_DIR)
            for d in (*(f.name for f in job.formats), sinks.SPOOL_DIR):
                os.makedirs(os.path.join(local, d), exist_ok=True)
        # Before the inputs are read: a file replaced while the shard converts is noticed by a resume.
        digest = shard_digest(_identities(items, job.identify == "content")) if job.identify else None
        with _FileSizeLimit(job.faults):
            result = _convert_items(job, items, out, spool_dir, ChannelStats() if job.stats else None)
        if digest is not None:
            result["digest"] = digest
        result.update(seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0, started=started)
        q1 = run_queue_seconds()
        if q0 is not None and q1 is not None:
            # The converting thread's wait for a core: wall = its CPU + this + waits for reads and writes.
            result["run_queue_seconds"] = q1 - q0
        if local is not None:
            result["blobs"] = _collect(local)
            for f in result["files"]:
                f["path"] = os.path.relpath(f["path"], local).replace(os.sep, "/")
        return result
    finally:
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)


def _collect(root: str) -> list:
    """``[(relative path, bytes)]`` of every file under ``root``, in a fixed order."""
    blobs = []
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                blobs.append((os.path.relpath(p, root).replace(os.sep, "/"), f.read()))
    return sorted(blobs)


class _ReadAhead:
    """Has a shard's inputs read a few items ahead of the one being converted, so a cold read overlaps
    decoding instead of stalling it. At most ``depth`` items, and no more than ``max_bytes`` of them, are
    ahead and not yet taken.

    A local regular file (or a local archive's member) is announced to the kernel (``POSIX_FADV_WILLNEED``:
    it starts reading into the page cache and returns), and read as usual when its turn comes. That costs
    a few system calls per input where a reading thread costs a future, two wake-ups and the GIL: 3-5% of a
    worker's CPU per image, measured. Remote inputs, and every input while a tier is emulated (whose delays
    only a thread can overlap), are read by threads; a read's error is then raised by :meth:`take` for that
    item, where ``--on-error`` handles it as if the worker had read it itself."""

    def __init__(self, items: list, skip, depth: int = READ_AHEAD, max_bytes: int = READ_AHEAD_BYTES):
        self._items = [(i, it) for i, it in enumerate(items) if not skip(i) and needs_read(it)]
        self._kernel = hasattr(os, "posix_fadvise") and io.throttle() is None
        self._pool = None  # reading threads, started for the first input the kernel cannot be asked for
        self._depth, self._max_bytes = depth, max_bytes
        self._ahead = {}  # item position -> its read's future, or None where the kernel was asked
        self._stalled = False
        self._next = 0  # the next item (position in self._items) to announce or submit
        self._bytes = 0

    def _fill(self) -> None:
        while (self._next < len(self._items) and len(self._ahead) < self._depth
               and (not self._ahead or self._bytes < self._max_bytes)):
            i, item = self._items[self._next]
            self._ahead[i] = None if self._kernel and _advise(item.ref) else self._submit(item)
            self._bytes += item_size(item)
            self._next += 1

    def _submit(self, item):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="gpufeed-read")
        return self._pool.submit(read_item, item)

    def take(self, i: int, item):
        """The data of item ``i`` (raising what reading it raised; a threaded read that stalls for
        :data:`READ_TIMEOUT_S` is an input error naming the item)."""
        from concurrent.futures import TimeoutError as FutureTimeout

        self._fill()
        if i not in self._ahead:
            return read_item(item)
        future = self._ahead.pop(i)
        self._bytes -= item_size(item)
        try:
            if future is None:
                return read_item(item)
            return future.result(timeout=READ_TIMEOUT_S)
        except FutureTimeout:
            self._stalled = True
            raise InputError(item.origin, f"reading it stalled for {READ_TIMEOUT_S} s",
                             "check the storage it is on (a hung network mount?), or leave it out with "
                             "--on-error skip") from None
        finally:
            self._fill()

    def close(self) -> None:
        if self._pool is None:
            return
        for f in self._ahead.values():
            if f is not None:
                f.cancel()
        # A thread stuck in a stalled read cannot be stopped: it is left behind rather than waited for.
        self._pool.shutdown(wait=not self._stalled, cancel_futures=True)


def _advise(ref) -> bool:
    """Ask the kernel to start reading the local regular file (or archive member) ``ref`` names into the
    page cache; false where it cannot be asked (a remote URL). Anything else wrong with the input is left
    for its read to report: special files are not opened here (opening one can block or act), and a
    failure to open or advise is ignored."""
    import stat as stat_mod

    if isinstance(ref, FileRef):
        url, offset, size = ref.url, 0, 0
    elif isinstance(ref, TarMemberRef):
        url, offset, size = ref.url, ref.offset, ref.size
    else:
        return False
    if not io.is_local(url):
        return False
    path = io.local_path(url)
    try:
        if not stat_mod.S_ISREG(os.stat(path).st_mode):
            return True
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return True
    try:
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
    return True


def _convert_items(job: ShardJob, items: list, out: str, spool_dir: str, stats) -> dict:
    from gpufeed.pipelines.transforms import ChannelStats

    sp = job.plan
    outputs = _open_outputs(job, out, spool_dir)
    fmts = [fmt for fmt, _, _ in outputs]
    skipped, converted, written, out_bytes = [], [], 0, 0
    counts = [0] * len(outputs)
    ahead = _ReadAhead(items, lambda i: sp.start + i in job.exclude)
    read_s = 0.0  # in reads (the bytes of an input not read ahead yet: waits for the disk, or its CPU)
    try:
        for index, item in zip(range(sp.start, sp.stop), items):
            if index in job.exclude:
                skipped.append((item.origin, CRASH_REASON))
                continue
            # Statistics of one input join the shard's only once it is written, so a sample skipped after
            # its pixels were seen (an encode that fails) is not counted.
            one = ChannelStats() if stats is not None else None
            try:
                t = time.perf_counter()
                data = ahead.take(index - sp.start, item)
                read_s += time.perf_counter() - t
                records, change = _records(job, fmts, item, index, one, data)
            except _INPUT_ERRORS as e:
                if job.on_error == "fail":
                    raise
                skipped.append((item.origin, getattr(e, "reason", None) or str(e)))
                continue
            for k, ((_, writer, path), record) in enumerate(zip(outputs, records)):
                try:
                    writer.write_encoded(record)
                except OSError as e:
                    raise sinks.output_error(path, e) from e
                out_bytes += len(record.value)
                counts[k] += 1
            if one is not None:
                stats.merge(one)
            if change is not None:
                converted.append((item.origin, change))
            written += 1
        files = []
        t = time.perf_counter()
        for _, writer, path in outputs:
            try:
                closed = writer.close()
            except OSError as e:
                raise sinks.output_error(path, e) from e
            files.extend(closed if isinstance(closed, list) else [closed])
        close_s = time.perf_counter() - t  # the outputs' last writes, fsyncs and renames
    except BaseException:
        for _, w, _ in outputs:
            w.abort()
        raise
    finally:
        ahead.close()
    return {"split": sp.split, "shard": sp.shard, "written": written, "skipped": skipped, "converted": converted,
            "records": {fmt.name: n for fmt, n in zip(fmts, counts)},
            "files": [file_entry(f) for f in files], "bytes": out_bytes, "stats": stats,
            "read_seconds": read_s, "close_seconds": close_s}


def file_entry(f) -> dict:
    """A :class:`~gpufeed.formats.base.WrittenFile` as the journal and manifest record it."""
    entry = dataclasses.asdict(f)
    if not entry["parts"]:
        del entry["parts"]
    return entry


def probe_items(job: ShardJob, pairs: list) -> None:
    """Make and encode ``pairs`` (planned index, item) without writing: bisection runs this to find the
    input that kills its worker. Inputs that merely fail are ignored here (``--on-error`` handles them)."""
    _worker_setup()
    for index, item in pairs:
        try:
            _records(job, job.formats, item, index, None)
        except _INPUT_ERRORS:
            continue


def stats_shard(job: ShardJob, items: list) -> dict:
    """The statistics pre-pass over one shard: the stored pixels (same transforms, before normalising)
    summed exactly, nothing written."""
    _worker_setup()
    from gpufeed.pipelines.transforms import ChannelStats, make_sample

    sp = job.plan
    opts = dataclasses.replace(job.image_options, encode="raw", store_dtype="uint8", mean=None, std=None)
    stats = ChannelStats()
    for index, item in zip(range(sp.start, sp.stop), items):
        if index in job.exclude:
            continue
        _maybe_crash(job, item)
        try:
            make_sample(item, opts, index, stats=stats)
        except _INPUT_ERRORS:
            if job.on_error == "fail":
                raise
    return {"split": sp.split, "shard": sp.shard, "stats": stats}


# -- driver side -----------------------------------------------------------------------------------------

def _ray_initialized() -> bool:
    """Whether this process already runs Ray, without importing it (~0.5-1 s, which the driver spends on
    the thread that starts Ray, not before it lists)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _open_ray(options: ConvertOptions):
    """Connect to Ray: reuse a runtime already initialised in this process, else start or join one.
    Returns ``(ray, started_here)``."""
    import logging

    if options.address:
        _token_auth_if_available()  # before Ray is imported: its core reads the mode once
    import ray

    if ray.is_initialized():
        return ray, False
    env = forkserver.worker_env()
    try:
        if options.address:
            # A cluster's workers are started by raylets on other machines: only runtime_env reaches them.
            ray.init(address=options.address, logging_level=logging.ERROR, log_to_driver=False,
                     runtime_env={"env_vars": env})
        else:
            # A runtime of our own inherits this process's environment (raylet, then workers). A job-level
            # runtime_env here would cost ~1.5 s: Ray could not use the workers it prestarts.
            os.environ.update(env)
            # address="local": a new runtime even when `ray start` left a cluster address behind in /tmp/ray
            # or RAY_ADDRESS, which ray.init would otherwise join (and refuse num_cpus for).
            ray.init(address="local", num_cpus=options.workers, include_dashboard=False,
                     logging_level=logging.ERROR, log_to_driver=False, object_store_memory=512 << 20)
    except ConnectionError as e:
        if _auth_refused(e):
            raise ConfigError(f"the Ray cluster at {options.address} refused this client's authentication token "
                              "(token authentication is on by default for `ray start` clusters); copy the "
                              "cluster's token to ~/.ray/auth_token here or set RAY_AUTH_TOKEN (`ray "
                              "get-auth-token` on the head node prints it)") from e
        raise ConfigError(f"cannot reach the Ray cluster at {options.address} ({e}); start it with "
                          "`ray start --head` or check --address") from e
    return ray, True


def _token_auth_if_available() -> None:
    """Send the Ray authentication token when one is at hand. A ``ray start`` cluster turns token
    authentication on by default, while a client joining it sends no token unless RAY_AUTH_MODE says
    ``token``: the join then fails with a GCS error. A client sending a token to a cluster without
    authentication still joins, so the mode is set wherever a token exists (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, or ``ray start``'s ~/.ray/auth_token) and the user has not chosen a mode."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
        os.environ["RAY_AUTH_MODE"] = "token"


def _auth_refused(err: BaseException) -> bool:
    """Whether Ray's failure to join was the cluster refusing the token (or its absence)."""
    seen = 0
    while err is not None and seen < 8:
        if "AuthenticationError" in type(err).__name__ or "InvalidAuthToken" in str(err):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _unwrap(err, sp: ShardPlan, items: list, retries: int) -> BaseException:
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
                             f"{retries + 1} times ({type(err).__name__}) and no single input crashes it alone",
                      "check the workers' memory and the Ray logs, then rerun the same command to resume")


def _crashed(err) -> bool:
    """Ray reports a dead worker (no exception of the task's own to carry)."""
    return not isinstance(getattr(err, "cause", None), BaseException)


class _LocalStart:
    """Shards converted by local processes: from the moment the plan exists, not once the local Ray runtime
    has started (~4-7 s on an idle 16-core machine, 13-22 s beside 16 busy processes).

    The processes come from a fork server that has imported the engine already (each starts in milliseconds)
    and run :func:`run_shard` itself: the same bytes as a Ray worker writes, journalled and committed alike.
    With ``--executor ray`` nothing is submitted here once Ray is up, and the pool ends when its last shard is
    back; with ``pool`` (the default) it converts every shard, and Ray is started only if one fails. A shard's
    own gpufeed error (a bad input under ``--on-error fail``, a full disk) ends the run as Ray would end it,
    with that error; any other failure (a crashed process breaking the pool) hands the shard back to Ray, whose
    retries, bisection and error messages then deal with it as with any other shard, and Ray takes the rest
    of the run."""

    def __init__(self, workers: int, fn):
        import concurrent.futures

        self.fn = fn
        # Its server may be running already: the command line starts it first thing (forkserver.start).
        self.pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=forkserver.context())
        self.futures: dict = {}  # future -> job
        self.usable = True
        self.shards = 0  # finished here
        # Started while the driver lists: the fork server imports OpenCV and the formats, processes fork.
        threading.Thread(target=self._warm, args=(workers,), name="gpufeed-local-warm", daemon=True).start()

    def _warm(self, workers: int) -> None:
        try:
            for _ in range(workers):
                self.pool.submit(_warm_worker)
        except (RuntimeError, AttributeError):
            pass  # closed already (the run needed no workers)

    def submit(self, job, items) -> bool:
        """Start ``job`` here; false (and unusable from now on) where the pool cannot take it: a process of
        it died before its future said so (the pool is broken then), or it was closed."""
        if not self.usable or self.pool is None:
            return False
        try:
            future = self.pool.submit(self.fn, job, items)
        except RuntimeError:  # BrokenProcessPool, or "cannot schedule new futures after shutdown"
            self.usable = False
            return False
        self.futures[future] = job
        return True

    def done(self, timeout: float | None):
        """One future finished within ``timeout`` seconds, ``(future, job)``, or ``None``."""
        import concurrent.futures

        if not self.futures:
            return None
        finished, _ = concurrent.futures.wait(list(self.futures), timeout=timeout,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
        if not finished:
            return None
        future = min(finished, key=lambda f: self.futures[f].plan.start)  # any order would do; this one is fixed
        return future, self.futures.pop(future)

    def close(self, kill: bool = False) -> None:
        """End the pool (again: a no-op): after its last shard, or ``kill`` at once (a stop, or an error
        elsewhere; nothing here is waited for, its files are atomic and unjournalled)."""
        self.usable = False
        if self.pool is None:
            return
        pool, self.pool = self.pool, None
        if kill:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
            self.futures.clear()
        pool.shutdown(wait=not kill, cancel_futures=True)


class _Tasks:
    """Shard tasks on Ray: at most ``workers`` running, more only while ``admit(in flight)`` allows.

    ``ray_ready(block)`` gives the Ray module once its runtime is up (``None`` while it starts and ``block``
    is false); until then shards run in ``local`` (a :class:`_LocalStart`), when given, and for the whole run
    where ``options.pool_converts``: Ray then takes only the shards the local processes fail (asking
    ``ray_ready`` for it starts it).

    A shard whose worker dies on every retry is bisected with probe tasks (no retries) down to the one
    input that kills the worker: ``--on-error fail`` stops naming it, ``skip`` reruns the shard without it.
    """

    def __init__(self, ray_ready, fn, options, items_of, admit=None, local: _LocalStart | None = None):
        self.ray_ready, self.fn, self.ray = ray_ready, fn, None
        self.local = local
        # The pool converts for the whole run (ConvertOptions.pool_converts), Ray only what it fails.
        self.pool_converts = local is not None and options.pool_converts
        self.retries = options.task_retries
        self.workers = options.workers
        self.on_error = options.on_error
        self.items_of = items_of  # ShardPlan -> its items
        self.admit = admit or (lambda inflight: True)
        self.pending = deque()
        self.inflight = {}

    def _ray(self, block: bool):
        if self.ray is None:
            ray = self.ray_ready(block)
            if ray is None:
                return None
            self.ray = ray
            self.task = ray.remote(self.fn).options(num_cpus=1, max_retries=self.retries, retry_exceptions=False)
            self.probe = ray.remote(probe_items).options(num_cpus=1, max_retries=0, retry_exceptions=False)
            if self.local is not None and not self.pool_converts:
                self.local.usable = False  # Ray takes every shard from now on
        return self.ray

    def _local_inflight(self) -> int:
        return len(self.local.futures) if self.local is not None else 0

    def __bool__(self) -> bool:
        return bool(self.pending or self.inflight or self._local_inflight())

    def submit(self) -> None:
        while self.pending:
            running = len(self.inflight) + self._local_inflight()
            if running >= self.workers or (running and not self.admit(running)):
                return
            job = self.pending[0]
            if self.local is not None and (self.pool_converts or self._ray(block=False) is None):
                if self.local.submit(job, self.items_of(job.plan)):
                    self.pending.popleft()
                    continue
            if self._ray(block=False) is None:
                return  # next() waits for Ray (the job stays first in line)
            self.pending.popleft()
            self.inflight[self.task.remote(job, self.items_of(job.plan))] = job

    def _local_result(self, timeout: float):
        """A shard finished locally ``(job, result)``, or ``None``; a failure goes back to the queue for Ray."""
        got = self.local.done(timeout)
        if got is None:
            return None
        future, job = got
        error = future.exception()
        if isinstance(error, GpufeedError):
            # The shard's own error (a bad input under --on-error fail, a full disk): Ray would end the run
            # with this same error (_unwrap), so it ends here, without starting Ray to be told it again.
            raise error
        if error is not None:
            # A dead process (the pool is broken then) or an unexpected error: from here on Ray takes every
            # shard, and its retries, bisection and messages deal with this one as with any other.
            self.local.usable = False
            self.pending.appendleft(job)
            return None
        self.local.shards += 1
        result = future.result()
        result["ran"] = "local"  # for the timeline's split of the workers' time (Ray's results say nothing)
        return job, result

    def next(self):
        """Wait for the next finished shard: ``(job, result)``. Raises one gpufeed error on failure."""
        while True:
            self.submit()
            if self._local_inflight():
                # Poll: Ray may come up (and take the next shards) while the local ones run.
                got = self._local_result(0 if self.inflight else 0.05)
                if got is not None:
                    return got
                if not self.inflight:
                    continue
            elif not self.inflight:
                self._ray(block=True)
                continue
            ready, _ = self.ray.wait(list(self.inflight), num_returns=1,
                                     timeout=0.05 if self._local_inflight() else None)
            if not ready:
                continue
            ref = ready[0]
            job = self.inflight.pop(ref)
            try:
                return job, self.ray.get(ref)
            except Exception as e:  # Ray wraps what the task raised, or reports a dead worker
                items = self.items_of(job.plan)
                if not _crashed(e):
                    raise _unwrap(e, job.plan, items, self.retries) from None
                found = self._bisect(job, items)
                if found is None:
                    raise _unwrap(e, job.plan, items, self.retries) from None
                index, item = found
                if self.on_error == "fail":
                    raise InputError(item.origin, f"this input crashes the worker (shard {job.plan.id} failed "
                                                  f"{self.retries + 1} times; bisecting its inputs isolated it)",
                                     "skip it with --on-error skip, or remove it, then rerun the same command "
                                     "to resume") from None
                self.pending.appendleft(dataclasses.replace(job, exclude=(*job.exclude, index)))

    def _bisect(self, job, items):
        sp = job.plan
        pairs = [(i, it) for i, it in zip(range(sp.start, sp.stop), items) if i not in job.exclude]
        while len(pairs) > 1:
            half = len(pairs) // 2
            # A crash that needs a specific input is in the first half or else in the second; the last
            # input is confirmed on its own, so a crash that needs several inputs together is not blamed on one.
            pairs = pairs[:half] if self._crashes(job, pairs[:half]) else pairs[half:]
        return pairs[0] if pairs and self._crashes(job, pairs) else None

    def _crashes(self, job, pairs) -> bool:
        try:
            self.ray.get(self.probe.remote(job, pairs))
        except Exception as e:
            return _crashed(e)
        return False

    def cancel(self) -> None:
        """Stop waiting for the tasks in flight, and stop the local processes. Not ``ray.cancel``: a reply
        racing a cancellation aborts Ray's core in this process ("Tried to complete task that was not pending", Ray 2.60), where a Ctrl-C
        promises a clean stop. Ray ends the workers when this driver shuts its runtime down or leaves the
        cluster; a task that finishes first writes only atomic files nobody journalled, which the next run
        redoes (same bytes) or removes."""
        self.inflight.clear()
        self.pending.clear()
        if self.local is not None:
            self.local.close(kill=True)


class _Split:
    """Driver-side state of one split: plan, items, ordered sinks and how far they have committed."""

    def __init__(self, plan: SplitPlan, items: list):
        self.plan = plan
        self.items = items
        self.sinks = {}  # "lmdb"/"recordio" -> sink
        self.next = {}  # sink -> next shard to commit
        self.taken = {}  # sink -> next shard not yet handed to it (ahead of ``next`` while a batch commits)
        self.results = {}  # shard -> journalled shard event
        self.finished = {}  # sink -> files, once the split's ordered output is final

    def shard_items(self, sp: ShardPlan) -> list:
        return [self.items[i] for i in self.plan.order[sp.start:sp.stop]]


#: Seconds Ray's control store (GCS) may stay unreachable before a run says the cluster is lost and stops
#: (Ray by itself waits 60 s, then ends the process with a line of its own).
CLUSTER_LOST_S = float(os.environ.get("GPUFEED_CLUSTER_LOST_S", 15))
#: The exit status of a run that lost its Ray cluster (2 is a bad input or option, 130 Ctrl-C).
EXIT_CLUSTER_LOST = 3


class _ClusterWatch:
    """Notices that the Ray cluster's head stopped answering (its GCS port refuses or times out for
    :data:`CLUSTER_LOST_S`) and ends the run with one line that says so and that rerunning resumes: every
    finished shard is already journalled, so nothing else needs saving."""

    def __init__(self, gcs_address: str, where: str):
        self.address, self.where = gcs_address, where
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpufeed-cluster-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import socket
        import sys

        host, _, port = self.address.rpartition(":")
        down_since = None
        while not self._stop.wait(1.0):
            try:
                socket.create_connection((host, int(port)), timeout=2).close()
                down_since = None
                continue
            except OSError:
                down_since = down_since or time.monotonic()
            if time.monotonic() - down_since >= CLUSTER_LOST_S:
                print(f"gpufeed: lost {self.where} (its head at {self.address} stopped answering for "
                      f"{CLUSTER_LOST_S:.0f} s); every finished shard is journalled: rerun the same command to "
                      "resume once the cluster is back", file=sys.stderr, flush=True)
                os._exit(EXIT_CLUSTER_LOST)

    def stop(self) -> None:
        self._stop.set()


def _stop_ray(ray) -> None:
    """Shut down a runtime started here. Its autoscaler monitor, which a single-machine runtime does not use,
    ignores Ray's polite SIGTERM until a 1 s timeout ends it (Ray 2.x): it is stopped outright first, so
    the run ends ~1 s sooner. Should Ray's internals change, the plain shutdown still runs."""
    try:
        ray._private.worker._global_node.kill_monitor(check_alive=False)
    except Exception:
        pass
    ray.shutdown()


class _RayStart:
    """Ray started (or joined) in a thread, so its seconds of start-up overlap the driver's work (joining a
    cluster: from the start; a runtime of our own: once the driver has listed); :meth:`get` waits for it.
    The thread lives until :meth:`shutdown`: the processes Ray starts (GCS, raylet) die with the thread that
    started them. A run that turns out to need no
    workers (already complete) shuts down what it started. When the runtime is started here, ``local`` is a
    :class:`_LocalStart` warming up at the same time, which converts the first shards until Ray is up, or
    every shard it can (``options.pool_converts``): Ray is then begun only when a shard needs it (one the
    pool failed), and a run that needs none never starts it."""

    def __init__(self, options: ConvertOptions):
        self.options = options
        self._result = None
        self._error = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._watch = None
        # A runtime started here takes seconds: shards run in local processes meanwhile. Joining a cluster
        # (or a runtime this process has already) is quick, and the cluster is the point.
        self.local = (_LocalStart(options.workers, run_shard)
                      if options.local_start and not options.address and not _ray_initialized() else None)
        self._thread = threading.Thread(target=self._run, name="gpufeed-ray", daemon=True)
        if self.local is None:
            self._thread.start()
        # else: :meth:`begin`, once the driver has listed. Importing and starting Ray is Python work that
        # holds the GIL the listing needs (120,000 files listed in 1.45 s beside it, 0.6-1.1 s alone), and
        # the local processes convert until Ray is up anyway.

    def begin(self) -> None:
        """Start Ray now, if it is not started yet."""
        if not self._thread.is_alive() and not self._ready.is_set():
            self._thread.start()

    def _run(self) -> None:
        try:
            self._result = _open_ray(self.options)
            ray, started = self._result
            if started:  # a runtime of our own: its workers are ours to warm up
                warm = ray.remote(_warm_worker).options(num_cpus=1, max_retries=0)
                self._warm = [warm.remote() for _ in range(self.options.workers)]
        except BaseException as e:  # handed to the caller of get()
            self._error = e
        finally:
            self._ready.set()
        self._stop.wait()
        if self._result is not None and self._result[1]:
            _stop_ray(self._result[0])

    def ready(self) -> bool:
        """Whether :meth:`get` would return (or raise) at once."""
        return self._ready.is_set()

    def get(self, progress=None):
        """``(ray, started_here)``, once Ray is up."""
        self.begin()
        if not self._ready.is_set() and progress is not None:
            progress.phase("starting Ray" if not self.options.address else f"joining Ray at {self.options.address}")
        self._ready.wait()
        if self._error is not None:
            raise self._error
        if self._watch is None:
            ray = self._result[0]
            where = f"the Ray cluster at {self.options.address}" if self.options.address else "the local Ray runtime"
            self._watch = _ClusterWatch(ray.get_runtime_context().gcs_address, where)
        return self._result

    def stop(self) -> None:
        """Let Ray go down on its thread (~1-1.5 s: its processes are stopped one after another) while the
        driver finishes the outputs; :meth:`shutdown` waits for it."""
        if self.local is not None:
            self.local.close(kill=bool(self.local.futures))
        if not self._thread.is_alive() and not self._ready.is_set():
            self._ready.set()  # never begun (the run ended before it listed): nothing to stop
            return
        self._ready.wait()
        if self._watch is not None:
            self._watch.stop()  # before Ray goes down on purpose
            self._watch = None
        self._stop.set()

    def shutdown(self) -> None:
        self.stop()
        if self._thread.is_alive():
            self._thread.join()


def _cap_workers(options: ConvertOptions, cpus: int, where: str, progress) -> ConvertOptions:
    """At most one worker per CPU that Ray can schedule: more would only queue (a cluster) or make the
    workers fight over cores (a local runtime told it has more CPUs than the machine)."""
    if options.workers <= cpus:
        return options
    if progress is not None:
        progress.warn(f"--workers {options.workers} is more than the {cpus} CPUs {where}; using {cpus}")
    return dataclasses.replace(options, workers=cpus)


class _Clock:
    """When the run reached each step (seconds since it began), and the driver's own busy time: the
    summary's ``timeline``, so a slow run shows where its time went."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.epoch = time.time()
        self.marks = {}
        self.busy = {"commit": 0.0, "finish": 0.0}
        self._lock = threading.Lock()

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, round(time.perf_counter() - self.t0, 3))

    @contextlib.contextmanager
    def timed(self, what: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:  # the sinks' commit threads add to it side by side
                self.busy[what] += time.perf_counter() - start

    def timeline(self, first_started: float | None) -> dict:
        out = dict(self.marks)
        if first_started is not None:
            out["first_shard_started"] = round(first_started - self.epoch, 3)
        out.update({f"driver_{k}_s": round(v, 3) for k, v in self.busy.items()})
        out["total"] = round(time.perf_counter() - self.t0, 3)
        return out


def convert(options: ConvertOptions, progress=None) -> Summary:
    """Run one conversion. ``progress`` is a :class:`gpufeed.convert.progress.Progress` or ``None``."""
    t0 = _Clock()
    if not options.address and not _ray_initialized():
        options = _cap_workers(options, usable_cores(), "this machine has", progress)
    ray_start = None if options.dry_run else _RayStart(options)
    try:
        return _convert(options, progress, t0, ray_start)
    finally:
        if ray_start is not None:
            ray_start.shutdown()


def _convert(options: ConvertOptions, progress, t0: _Clock, ray_start) -> Summary:
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.state import DestinationLock, Journal, state_dir_for
    from gpufeed.pipelines import open_source

    out = options.out.rstrip("/") if not io.is_local(options.out) else io.local_path(options.out)
    if progress is not None:
        progress.phase(f"listing {options.src}")
    source = open_source(options.dataset, options.source_root, on_error=options.on_error,
                         **options.source_options())
    available = source.splits()
    splits = list(options.splits or available)
    for s in splits:
        if s not in available:
            raise ConfigError(f"--split {s!r} is not in {options.src}; it holds {', '.join(available) or 'no splits'}")
    plans, items_by_split, listed = {}, {}, {}
    for s in splits:
        items = source.items(s)
        listed[s] = len(items)
        if options.limit is not None and options.limit < len(items):
            keep = split_order(len(items), s, options.seed, options.effective_shuffle)[:options.limit]
            items = [items[i] for i in sorted(keep)]
        cache = {}
        # Local files are digested by the workers that read them (a stat each, cold, is seconds per 100,000
        # inputs here); remote files, tar members and data in memory are cheaper to identify from here.
        in_workers = options.shard_bytes is None and all(
            isinstance(it.ref, FileRef) and io.is_local(it.ref.url) for it in items)
        identities = None if in_workers else _identities(items, options.strict, cache)
        shards = options.shards
        if options.shard_bytes is not None:
            shards = max(1, round(_input_bytes(items, cache) / options.shard_bytes))
        plans[s] = plan_split(s, [it.key for it in items], options.seed, options.effective_shuffle,
                              shards, options.shard_size, identities=identities)
        items_by_split[s] = items
    t0.mark("listed")
    if ray_start is not None and not options.pool_converts:
        ray_start.begin()  # (where the local processes convert, Ray starts only once a shard needs it)
    if progress is not None:
        limited = "" if options.limit is None else (
            f"; converting {', '.join(f'{s} {len(v)}' for s, v in items_by_split.items())} of them (--limit)")
        progress.phase(f"listed {sum(listed.values())} inputs "
                       f"({', '.join(f'{s} {n}' for s, n in listed.items())}){limited}; planned "
                       f"{sum(len(p.shards) for p in plans.values())} shards")
    if options.dry_run:
        return _dry_run(options, out, plans)

    try:
        sinks.makedirs(out)
    except Exception as e:  # fsspec backends raise their own errors for bad URLs, credentials, networks
        raise OutputError(f"{out}: cannot be written ({type(e).__name__}: {e}); check the path or URL, its "
                          "credentials and the network") from e
    state_dir = state_dir_for(out)
    lock = DestinationLock.acquire(state_dir, out)
    journal = None
    try:
        done = _finished_output(options, out)
        if done is not None:
            return done
        try:
            manifest_mod.remove(out)
        except OSError as e:
            raise OutputError(f"{manifest_mod.path(out)}: cannot be removed ({e.strerror or e}); the destination "
                              "must be writable: fix its permissions or mount, or choose another --out") from e
        if not options.resume:
            shutil.rmtree(state_dir, ignore_errors=True)
        journal = Journal.open(state_dir, out, options.output_key(), options.resume)
        for s, plan in plans.items():
            items = items_by_split[s]
            journal.check_plan(s, plan, items, options.strict, lambda sp, plan=plan, items=items: shard_digest(
                _identities([items[i] for i in plan.order[sp.start:sp.stop]], options.strict)))
        return _run(options, out, source, plans, items_by_split, journal, state_dir, progress, t0, ray_start)
    finally:
        if journal is not None:
            journal.close()
        lock.release()


def _finished_output(options: ConvertOptions, out: str) -> Summary | None:
    """A destination that already holds a finished conversion: the same one (nothing to do), another one
    (refused, unless ``--overwrite`` removes its files), or a ``manifest.json`` gpufeed did not write
    (refused: never overwritten). ``None`` when the run goes ahead."""
    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.convert.state import options_diff, recorded_options

    kind, doc = manifest_mod.finished(out)
    if kind == "foreign":
        raise ConfigError(f"{manifest_mod.path(out)} was not written by gpufeed, which would overwrite it; "
                          "choose another --out")
    if kind == "none":
        return None
    key = options.output_key()
    recorded = recorded_options(doc["output_options"], key)
    if recorded == key and kind == "complete" and options.resume:
        return Summary(out, doc["splits"], [tuple(s) for s in doc["skipped"]], doc["bytes_written"], 0.0,
                       unit=_unit(options), converted=[tuple(c) for c in doc.get("converted", ())],
                       note="already complete; nothing to do (add --no-resume to convert again)")
    if recorded != key and not options.overwrite:
        diff = options_diff(recorded, key, "finished run")
        raise ConfigError(f"{out} holds a finished conversion made with other options ({diff}); add --overwrite "
                          "to replace it (its files are removed first), or choose another --out")
    # Converted again (--no-resume, --overwrite, or files lost since): the old run's files go first, so
    # none of them can mix with the new output.
    manifest_mod.remove_listed(out, doc)
    return None


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
            except _INPUT_ERRORS:
                parts.append("unreadable")  # converting it will say why
    elif isinstance(ref, InlineRef):
        import numpy as np

        data = ref.data.tobytes() if isinstance(ref.data, np.ndarray) else bytes(ref.data)
        parts.append(f"{crc32c.crc32c(data)}:{len(data)}")
    return "\t".join(parts).encode("utf-8", "surrogateescape")


def _file_identity(url: str, cache: dict) -> str:
    if io.is_local(url):
        try:
            st = os.stat(io.local_path(url))
            cache[("size", url)] = st.st_size  # for --shard-bytes (_input_bytes): one stat per file
            return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        except OSError:
            return "unreadable"
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    parent = path.rsplit("/", 1)[0]
    listing = cache.get(("listing", parent))
    if listing is None:
        try:
            listing = {e["name"].rstrip("/"): e for e in fs.ls(parent, detail=True)}
        except OSError:
            listing = {}
        cache[("listing", parent)] = listing
    info = listing.get(path.rstrip("/"), {})
    fields = ("size", "ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "updated", "created")
    return ":".join(f"{k}={info[k]}" for k in fields if k in info) or "unlisted"


def _identities(items: list, strict: bool = False, cache: dict | None = None) -> list[bytes]:
    cache = {} if cache is None else cache
    return [item_identity(it, cache, strict) for it in items]


def _input_bytes(items: list, cache: dict) -> int:
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
        elif io.is_local(ref.url):
            sizes.append(cache.get(("size", ref.url)))
        else:
            import fsspec

            path = fsspec.core.url_to_fs(ref.url)[1].rstrip("/")
            listing = cache.get(("listing", path.rsplit("/", 1)[0]), {})
            sizes.append(listing.get(path, {}).get("size"))
    known = [n for n in sizes if n is not None]
    mean = sum(known) / len(known) if known else 0
    return int(sum(known) + mean * (len(sizes) - len(known)))


def _dry_run(options, out, plans) -> Summary:
    samples = {s: {"planned": len(p), "written": 0, "skipped": 0, "shards": len(p.shards),
                   "formats": {f: 0 for f in options.formats}} for s, p in plans.items()}
    return Summary(out, samples, [], 0, 0.0, complete=False, unit=_unit(options), dry_run=True,
                   note=f"dry run: would write {', '.join(options.formats)} to {out}; nothing was written")


def _unit(options) -> str:
    return "records" if options.dataset == "ptb" else "images"


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
        tasks = _Tasks(lambda block: ray_once(), stats_shard, options, st.shard_items)
        formats = tuple(options.output_formats())
        tasks.pending.extend(ShardJob(sp, out, formats, image_options, options.on_error, True,
                                      faults=_test_faults()) for sp in todo)
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

    formats = options.output_formats()
    ordered = [f.name for f in formats if f.layout == PER_SPLIT]
    prepass_split = _stats_split(options, plans) if options.statistics_prepass else None
    stats_split = None if prepass_split else _stats_split(options, plans)
    image_options = options.image_options()
    # A destination the workers cannot write (memory://, or --driver-writes): shards come back to the
    # driver as bytes, and spool files stay in the local state directory.
    driver_writes = options.driver_writes or out.startswith("memory://")
    spool_dir = (os.path.join(state_dir, sinks.SPOOL_DIR) if driver_writes
                 else sinks.join(out, ".gpufeed", sinks.SPOOL_DIR))
    float_dtype = options.store_dtype if options.store_dtype != "uint8" else None
    for fmt in options.formats:
        sinks.makedirs(sinks.join(out, fmt))
    if ordered:
        sinks.makedirs(spool_dir)
    manifest_mod.remove_temporaries(out, options.formats)

    splits = {s: _Split(p, items_by_split[s]) for s, p in plans.items()}
    shard_events = journal.shards_done()
    if not shard_events:
        manifest_mod.remove_stale_outputs(out, options.formats, list(plans))
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
            st.sinks[sink] = sinks.SPLIT_SINKS[sink](state_dir, out, s, float_dtype).open(commits)
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
                options = _cap_workers(options, cpus, "the Ray cluster has" if options.address else
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
            image_options = dataclasses.replace(image_options, mean=prepass_stats.mean, std=prepass_stats.std)
        if progress is not None:
            progress.start(total, sum(len(p) for p in plans.values()) - total,
                           unit="img" if source.modality == "image" else "seq")
        committer = _Committer(ordered, journal, spool_dir, progress, t0)
        for st in splits.values():
            committer.ready(st)
        if todo:
            local = (ray_start.local if options.pool_converts or (ray is None and not ray_start.ready())
                     else None)
            tasks = _Tasks(ray_ready, run_shard, options, lambda sp: splits[sp.split].shard_items(sp),
                           lambda inflight: inflight + _awaiting(splits) < WINDOW_PER_WORKER * options.workers,
                           local=local)
            if progress is not None:
                progress.converting()
            faults = _test_faults()
            encodes = tuple(options.encode_for(f.name) for f in formats)
            identify = "content" if options.strict else "stat"
            tasks.pending.extend(
                ShardJob(sp, out, tuple(formats), image_options, options.on_error, sp.split == stats_split,
                         spool_dir, driver_writes, faults=faults, encodes=encodes,
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
                event = _journal_shard(journal, state_dir, result)
                st.results[sp.shard] = event
                if progress is not None:
                    progress.update(result["written"] + len(result["skipped"]), result["bytes"])
                committer.ready(st)
            if local is not None:
                local.close()
                t0.marks["shards_converted_locally"] = local.shards
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
        raise
    finally:
        if progress is not None:
            progress.close()
        if ray_start.ready():
            ray_start.stop()  # down while the outputs are finished; convert() waits for it
        # else: every shard ran before Ray came up; convert() shuts it down once the outputs are finished,
        # rather than wait for it here.

    for st in splits.values():
        _commit_ready(st, journal, spool_dir, progress, t0)
        missing = [sink for sink in ordered if sink not in st.finished]
        if missing:
            raise OutputError(f"{out}: the {st.plan.split} split's {', '.join(missing)} output did not complete; "
                              "rerun the same command to resume")
    summary = _finish(options, out, source, splits, journal, state_dir, spool_dir, stats_split, t0, prepass_stats)
    summary.prepass_shards = prepass_shards
    return summary


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
    """Commits finished shards into the split sinks (and finishes each split's output) on a thread per sink,
    so the driver's loop goes on handing shards to workers while an LMDB transaction or a ``.rec`` append
    runs, and the sinks of one run (LMDB beside a ``.rec``) commit side by side. Commits stay in shard order
    per split and sink, journalled as they complete; the first failure stops its thread and is raised in the
    driver's loop (:meth:`check`)."""

    def __init__(self, sink_names, journal, spool_dir: str, progress, clock):
        import queue

        self._args = (journal, spool_dir, progress, clock)
        self.error = None
        self._queues = {name: queue.SimpleQueue() for name in sink_names}
        self._threads = [threading.Thread(target=self._loop, args=(name, q), name=f"gpufeed-commit-{name}",
                                          daemon=True) for name, q in self._queues.items()]
        for t in self._threads:
            t.start()

    def ready(self, st: _Split) -> None:
        """``st`` has a newly journalled shard: commit what is next in line."""
        for q in self._queues.values():
            q.put(st)

    def _loop(self, name: str, q) -> None:
        while (st := q.get()) is not None:
            if self.error is not None:
                continue
            try:
                _commit_ready(st, *self._args, only=name)
            except BaseException as e:  # raised in the driver's loop
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
    """The shards' wall, CPU, core-wait, read and output-closing milliseconds per sample, for those the local
    processes ran and those Ray's workers ran apart (``local_`` / ``ray_`` keys; a resumed run's earlier shards
    say neither)."""
    out = {}
    for where in ("local", "ray"):
        group = [ev for ev in events if "seconds" in ev and (ev.get("ran") == "local") == (where == "local")]
        samples = sum(ev["written"] + len(ev["skipped"]) for ev in group)
        if not samples:
            continue
        out[f"{where}_shards"] = len(group)
        for key, name in (("seconds", "wall"), ("cpu_seconds", "cpu"), ("run_queue_seconds", "run_queue"),
                          ("read_seconds", "read"), ("close_seconds", "close")):
            if all(key in ev for ev in group):
                out[f"{where}_{name}_ms_per_sample"] = round(sum(ev[key] for ev in group) / samples * 1e3, 3)
    return out


def _journal_shard(journal, state_dir, result) -> dict:
    stats = result.pop("stats")
    if stats is not None:
        from gpufeed.convert.manifest import save_stats

        save_stats(stats, os.path.join(state_dir, "stats", f"{result['split']}-{result['shard']:05d}.npz"))
    event = dict(result, event="shard", skipped=[list(x) for x in result["skipped"]],
                 converted=[list(x) for x in result["converted"]])
    journal.append(event)
    return event


def _commit_ready(st: _Split, journal, spool_dir: str, progress=None, clock: _Clock | None = None,
                  only: str | None = None) -> None:
    """Give the ordered sinks (``only`` that one) every shard that is next in line and complete; finish a
    split when done."""
    shards = st.plan.shards
    for sink_name, sink in list(st.sinks.items()):
        if only is not None and sink_name != only:
            continue
        while True:
            # The journalled shards next in line (a result still being landed or journalled has no "event"
            # yet), committed together: a sink may make them durable at once.
            batch, i = [], st.next[sink_name]
            while i < len(shards) and len(batch) < COMMIT_BATCH and st.results.get(i, {}).get("event"):
                batch.append((sinks.spool_path(spool_dir, st.plan.split, sink_name, i), st.results[i]["files"]))
                i += 1
            if not batch:
                break
            st.taken[sink_name] = i
            with clock.timed("commit") if clock else contextlib.nullcontext():
                committed = sink.commit_many(batch)
            for (spool, _), fields in zip(batch, committed):
                i = st.next[sink_name]
                journal.append({"event": "commit", "sink": sink_name, "split": st.plan.split, "shard": i,
                                **fields})
                for path in sink.spool_files(spool):
                    sinks.remove(path)
                st.next[sink_name] = i + 1
        if st.next[sink_name] == len(shards):
            if progress is not None:
                progress.phase(f"finishing the {st.plan.split} {sink_name} output")
            with clock.timed("finish") if clock else contextlib.nullcontext():
                files = [file_entry(f) for f in sink.finish()]
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


def _finish(options, out, source, splits, journal, state_dir, spool_dir, stats_split, t0,
            prepass_stats=None) -> Summary:
    from gpufeed.convert import manifest as manifest_mod

    samples, skipped, converted, files, nbytes = {}, [], [], [], 0
    for s, st in splits.items():
        written = sum(ev["written"] for ev in st.results.values())
        sk = [tuple(x) for i in sorted(st.results) for x in st.results[i]["skipped"]]
        skipped.extend(sk)
        converted.extend(tuple(x) for i in sorted(st.results) for x in st.results[i].get("converted", ()))
        samples[s] = {"planned": len(st.plan), "written": written, "skipped": len(sk), "shards": len(st.plan.shards),
                      "formats": _records_per_format(options.formats, st)}
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
    manifest_mod.write(options, summary, source.classes(), stats)
    shutil.rmtree(state_dir, ignore_errors=True)
    sinks.remove_tree(sinks.join(out, ".gpufeed"))
    return summary
