"""``python -m gpufeed.bench.experiments.append_copy FOLDER``: what the single ``.rec``'s commit thread pays to
append the workers' fragments, side by side in one run: fragments in the memory spool folder (``/dev/shm``)
appended to a file in FOLDER (the disk) by the kernel (:func:`gpufeed.formats.assembly.append_file`: sendfile
across filesystems) and streamed through Python (what it did where copy_file_range refused the two
filesystems), the ways alternated, each commit's writeback started and synced as the sink does; and past the
page cache (``direct``: :class:`gpufeed.formats.assembly.DirectAppend`, what the sink uses where the filesystem
takes ``O_DIRECT``, its default writes in flight; ``direct-1``: one 16 MB write at a time, as it was before
session 24; ``direct-8``: eight in flight), each fragment flushed and fsync'd as a commit is; and
``direct-sealed``, as the sink commits: each fragment sealed (its writes left in flight) while another thread
waits for the writes of every fragment sealed meanwhile and fsyncs them together.

One JSON line per way and round: GB/s appended, the process's CPU seconds per GB (the writers' threads
included) and the appending thread's own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time


def run(folder: str, fragment_mb: int = 16, fragments: int = 64, rounds: int = 3, emit=print) -> list[dict]:
    from gpufeed.convert.sinks import MEMORY_ROOT
    from gpufeed.formats.assembly import append_file, fsync_together, start_writeback, stream_file

    spools = tempfile.mkdtemp(dir=MEMORY_ROOT if os.path.isdir(MEMORY_ROOT) else None, prefix="gpufeed-append-")
    rows = []
    try:
        paths = []
        for i in range(fragments):
            paths.append(os.path.join(spools, f"{i:05d}.rec"))
            with open(paths[-1], "wb") as f:
                f.write(os.urandom(fragment_mb << 20))
        cross = os.stat(spools).st_dev != os.stat(folder).st_dev
        ways = [("kernel", append_file), ("stream", stream_file), ("direct", {}),
                ("direct-1", {"depth": 1, "chunk": 16 << 20}), ("direct-8", {"depth": 8}),
                ("direct-sealed", {"sealed": True})]
        for r in range(rounds):
            for way, append in ways:
                out = os.path.join(folder, f"append-copy-{way}.rec")
                if way.startswith("direct"):
                    wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
                    size = _append_direct(paths, out, **append)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    own = time.thread_time() - own
                    os.remove(out)
                    if not size:
                        continue  # the filesystem refuses O_DIRECT
                else:
                    with open(out, "w+b") as dst:
                        wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
                        for p in paths:
                            start = dst.tell()
                            append(p, dst)
                            start_writeback(dst, start, dst.tell() - start)
                            dst.flush()
                            fsync_together([dst.fileno()])
                        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                        own = time.thread_time() - own
                        size = dst.tell()
                    os.remove(out)
                row = {"bench": "append-copy", "way": way, "round": r, "across_filesystems": cross,
                       "fragment_mb": fragment_mb, "fragments": fragments, "gb": round(size / 1e9, 3),
                       "gb_per_s": round(size / 1e9 / wall, 3), "cpu_s_per_gb": round(cpu / (size / 1e9), 3),
                       "thread_cpu_s_per_gb": round(own / (size / 1e9), 3)}
                rows.append(row)
                emit(json.dumps(row))
    finally:
        shutil.rmtree(spools, ignore_errors=True)
    return rows


def _append_direct(paths: list[str], out: str, sealed: bool = False, **kw) -> int:
    """Append ``paths`` to ``out`` past the page cache, each fragment made durable before the next (``sealed``:
    made durable on another thread while the next are appended); returns the file's length (0 where the
    filesystem does not take O_DIRECT)."""
    import queue
    import threading

    from gpufeed.formats.assembly import DirectAppend, wait_all

    open(out, "wb").close()
    direct = DirectAppend.open(out, 0, **kw)
    if direct is None:
        return 0
    try:
        if sealed:
            written, failed = queue.Queue(), []

            def sync():
                done = False
                while not done:
                    batch = [written.get()]
                    while not written.empty():
                        batch.append(written.get())
                    done = None in batch
                    try:
                        wait_all([f for futures in batch if futures is not None for f in futures])
                        os.fsync(direct.fd)
                    except OSError as e:  # raised here once the appends end: a figure of failed writes is none
                        failed.append(e)

            syncing = threading.Thread(target=sync)
            syncing.start()
            try:
                for p in paths:
                    direct.append(p)
                    written.put(direct.seal())
            finally:
                written.put(None)
                syncing.join()
            if failed:
                raise failed[0]
        else:
            for p in paths:
                direct.append(p)
                direct.flush()
                os.fsync(direct.fd)
    finally:
        direct.close()
    return direct.end


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpufeed.bench.experiments.append_copy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a folder on the disk the .rec would be on")
    p.add_argument("--fragment-mb", type=int, default=16, help="each fragment's size (a shard of ~300 images at "
                   "--resize 256 is ~16 MB)")
    p.add_argument("--fragments", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    run(a.folder, a.fragment_mb, a.fragments, a.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
