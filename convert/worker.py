"""A conversion's worker side: one shard, in a Ray worker or a local process (:func:`run_shard`).

A shard reads its inputs (a few ahead of the one being converted: :class:`_ReadAhead`), makes each sample
once (one decode), encodes it for every requested format, and writes TFRecord / sharded RecordIO files
itself, or spool files for the driver's ordered sinks (:mod:`.sinks`). It returns a small dict: payloads
never pass through the driver except as spool files, or, for a destination the workers cannot write, as the
finished files' bytes. Also here: the probes that bisect a crashing shard (:func:`probe_items`) and the
statistics pre-pass's shard (:func:`stats_shard`). Nothing here imports Ray: the local processes' fork
server preloads this module.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Sequence

from gpufeed import io
from gpufeed.convert import faults, sinks
from gpufeed.convert.identity import identities
from gpufeed.convert.plan import ShardPlan, shard_digest
from gpufeed.errors import INPUT_ERRORS, GpufeedError, InputError
from gpufeed.formats.base import PER_SHARD
from gpufeed.machine import run_queue_seconds
from gpufeed.pipelines.base import FileRef, Item, TarMemberRef, item_size, needs_read, read_item


#: Inputs read ahead of the one being converted, inside each worker: enough to keep a cold disk's latency
#: behind decoding (an ImageNet JPEG decodes in ~4 ms, a cold read takes ~1 ms), and at most this many bytes
#: of them held (one large image is always read). Local files are left to the kernel's read-ahead; other
#: inputs (remote, or under tier emulation, whose delays are paid in the reading thread) to this many threads.
READ_AHEAD = 8
READ_THREADS = 2
READ_AHEAD_BYTES = 64 << 20
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
    faults: dict | None = None  # test-only fault injection (gpufeed.convert.faults)
    #: "stat" / "content": digest the shard's inputs as they are read (:func:`shard_digest`), where the plan
    #: did not (local files: the driver would stat every input before the first shard could start)
    identify: str = ""


#: Why an input isolated by bisection is skipped.
CRASH_REASON = "crashes the worker (found by bisecting its shard)"


def _worker_setup() -> None:
    import cv2

    # One Ray worker per core: OpenCV's own thread pool would only make workers fight over cores.
    cv2.setNumThreads(1)
    # A bad input is an error naming it (or a skip, listed), never a bare "[ERROR:0@...]" line of OpenCV's.
    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)


def warm_worker() -> tuple[int, float]:
    """Run once per worker while the driver is still listing: what a first shard would otherwise wait for
    (OpenCV, the transforms, every format's module, the CRC-32C they compute), and the pool's other processes'
    start (:func:`gpufeed.convert.forkserver.wait_for_the_others`). Returns this process's id and the time
    (``time.time()``) it was ready."""
    import importlib

    from gpufeed.convert import forkserver
    from gpufeed.formats import _crc, format_modules

    _worker_setup()
    import gpufeed.pipelines.transforms  # noqa: F401

    for module in format_modules():
        importlib.import_module(module)
    _crc.function()
    forkserver.wait_for_the_others()
    return os.getpid(), time.time()


def _records(job: ShardJob, fmts, item, index, stats, data=None):
    """``(records, converted, stored)``: one record per format of ``fmts`` (``job.formats``) from one input
    (``data``, its bytes when already read), why pass-through stored it re-encoded (``None`` when it did not),
    and per format the bytes of the sample its record stores (the image, pixels or ids, without framing).
    Formats that store the same encoding share one sample; the input is read and transformed once per
    encoding (CIFAR's defaults differ per format, each ecosystem's own). Crashes on purpose under the
    ``crash_on`` test fault."""
    faults.before_item(job.faults, item, job.plan.shard)
    opts = job.image_options
    samples, records, encodes = {}, [], job.encodes or [opts.encode] * len(fmts)
    for fmt, encode in zip(fmts, encodes):
        if encode not in samples:
            one = opts if encode == opts.encode else dataclasses.replace(opts, encode=encode)
            samples[encode] = _sample(one, item, index, stats if not samples else None, data)
        records.append(fmt.encode(samples[encode]))
    converted = next((s.meta["converted"] for s in samples.values() if "converted" in s.meta), None)
    stored = [_payload_bytes(samples[encode].payload) for encode in encodes]
    return records, converted, stored


def _payload_bytes(payload) -> int:
    return payload.nbytes if hasattr(payload, "nbytes") else len(payload)


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
                writer = fmt.assembler().spool_writer(fmt, path)
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


def run_shard(job: ShardJob, items: Sequence[Item]) -> dict:
    """Convert one shard (runs in a Ray worker). Returns a small dict; raises gpufeed errors on failure.

    With ``job.driver_writes`` the files are written into a worker-local directory and returned as bytes
    (``blobs``: relative path and content), for the driver to write to the destination."""
    import tempfile

    _worker_setup()
    items = list(items)  # an ItemBatch's items made once, here
    from gpufeed.pipelines.transforms import ChannelStats

    t0, c0, started = time.perf_counter(), time.process_time(), time.time()
    q0, u0 = run_queue_seconds(), _thread_usage()
    local = tempfile.mkdtemp(prefix="gpufeed-shard-") if job.driver_writes else None
    try:
        out, spool_dir = job.out, job.spool_dir
        if local is not None:
            out, spool_dir = local, os.path.join(local, sinks.SPOOL_DIR)
            for d in (*(f.name for f in job.formats), sinks.SPOOL_DIR):
                os.makedirs(os.path.join(local, d), exist_ok=True)
        # Before the inputs are read: a file replaced while the shard converts is noticed by a resume.
        digest = shard_digest(identities(items, job.identify == "content")) if job.identify else None
        with faults.FileSizeLimit(job.faults):
            result = _convert_items(job, items, out, spool_dir, ChannelStats() if job.stats else None)
        if digest is not None:
            result["digest"] = digest
        result.update(seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0, started=started)
        q1, u1 = run_queue_seconds(), _thread_usage()
        if q0 is not None and q1 is not None:
            # The converting thread's wait for a core: wall = its CPU + this + waits for reads and writes.
            result["run_queue_seconds"] = q1 - q0
        if u0 is not None and u1 is not None:
            # How often it slept (for a read, a write, a lock) and took a page fault: what the wall time
            # beyond CPU and core waits went to, where that is not the reads or the writes.
            result["sleeps"] = u1.ru_nvcsw - u0.ru_nvcsw
            result["page_faults"] = u1.ru_minflt + u1.ru_majflt - u0.ru_minflt - u0.ru_majflt
        if local is not None:
            result["blobs"] = _collect(local)
            for f in result["files"]:
                f["path"] = os.path.relpath(f["path"], local).replace(os.sep, "/")
        return result
    finally:
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)


def _thread_usage():
    """The calling thread's resource usage (Linux's ``RUSAGE_THREAD``), else ``None``."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who) if who is not None else None


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
    counts, stored_bytes = [0] * len(outputs), [0] * len(outputs)
    ahead = _ReadAhead(items, lambda i: sp.start + i in job.exclude)
    read_s = 0.0  # in reads (the bytes of an input not read ahead yet: waits for the disk, or its CPU)
    write_s = 0.0  # in the outputs' writes (spools and shard files, as the kernel takes them)
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
                records, change, stored = _records(job, fmts, item, index, one, data)
            except Exception as e:
                e = _input_error(e, item)
                if job.on_error == "fail":
                    raise e
                skipped.append((item.origin, e.reason))
                continue
            t = time.perf_counter()
            for k, ((_, writer, path), record) in enumerate(zip(outputs, records)):
                try:
                    writer.write_encoded(record)
                except OSError as e:
                    raise sinks.output_error(path, e) from e
                out_bytes += len(record.value)
                counts[k] += 1
                stored_bytes[k] += stored[k]
            write_s += time.perf_counter() - t
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
            "stored_bytes": {fmt.name: n for fmt, n in zip(fmts, stored_bytes)},
            "files": [file_entry(f) for f in files], "bytes": out_bytes, "stats": stats,
            "read_seconds": read_s, "write_seconds": write_s, "close_seconds": close_s}


def _input_error(e: Exception, item) -> Exception:
    """What converting one input raised, as an error of that input (``--on-error`` applies): a gpufeed input
    error as it is; any other failure of a decoder, transform or encoder (an OpenCV or protobuf error, an
    allocation refused) named after the input. gpufeed's other errors (a full disk) stay what they are."""
    if isinstance(e, INPUT_ERRORS) or isinstance(e, GpufeedError):
        return e
    return InputError(item.origin, f"could not be converted ({type(e).__name__}: {e})",
                      "leave it out with --on-error skip; if it is a valid image, please report it with this line")


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
        except INPUT_ERRORS:
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
        faults.before_item(job.faults, item, sp.shard)
        try:
            make_sample(item, opts, index, stats=stats)
        except INPUT_ERRORS:
            if job.on_error == "fail":
                raise
    return {"split": sp.split, "shard": sp.shard, "stats": stats}
