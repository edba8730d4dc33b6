"""``python -m gpufeed.bench.experiments.append_copy FOLDER``: what the single ``.rec``'s commit thread pays to
append the workers' fragments, side by side in one run: fragments in the memory spool folder (``/dev/shm``)
appended to a file in FOLDER (the disk) by the kernel (:func:`gpufeed.formats.assembly.append_file`: sendfile
across filesystems) and streamed through Python (what it did where copy_file_range refused the two
filesystems), the ways alternated, each commit's writeback started and synced as the sink does.

One JSON line per way and round: GB/s appended and the commit thread's CPU seconds per GB.
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
        for r in range(rounds):
            for way, append in (("kernel", append_file), ("stream", stream_file)):
                out = os.path.join(folder, f"append-copy-{way}.rec")
                with open(out, "w+b") as dst:
                    wall, cpu = time.perf_counter(), time.thread_time()
                    for p in paths:
                        start = dst.tell()
                        append(p, dst)
                        start_writeback(dst, start, dst.tell() - start)
                        fsync_together([dst])
                    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                    size = dst.tell()
                os.remove(out)
                row = {"bench": "append-copy", "way": way, "round": r, "across_filesystems": cross,
                       "fragment_mb": fragment_mb, "fragments": fragments, "gb": round(size / 1e9, 3),
                       "gb_per_s": round(size / 1e9 / wall, 3), "cpu_s_per_gb": round(cpu / (size / 1e9), 3)}
                rows.append(row)
                emit(json.dumps(row))
    finally:
        shutil.rmtree(spools, ignore_errors=True)
    return rows


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
