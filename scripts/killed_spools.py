"""A 64-worker run killed outright (SIGKILL) at node scale: the memory its spools hold in /dev/shm afterwards,
the next run of another destination freeing them (its line), and the killed run's rerun finishing to a
destination `gpufeed verify` passes (scripts/killed_spools.sh runs it on the GPU machine). With ``--signal term``
the run is stopped as a scheduler stops it (SIGTERM): what it says its spools hold against what they hold, its
advice to free them followed (``rm -r``), and the rerun, which then converts those shards again. With ``--then
clean`` the stopped run is given up instead (``gpufeed clean``, timed), and a fresh run converts into the same
destination.

    python3 scripts/killed_spools.py --n 100000 --workers 64 --results OUT/killed-spools.jsonl
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time


def spool_bytes() -> tuple[int, int]:
    """This user's memory spool folders and the bytes in them."""
    folders = glob.glob(f"/dev/shm/gpufeed-spool-{os.getuid()}-*")
    size = 0
    for d in folders:
        for e in os.scandir(d):
            try:
                size += e.stat(follow_symlinks=False).st_size
            except OSError:
                pass
    return len(folders), size


def journal_shards(out: str) -> int:
    try:
        with open(os.path.join(out, ".gpufeed", "journal.jsonl"), "rb") as f:
            return f.read().count(b'"event":"shard"')
    except FileNotFoundError:
        return 0


def command(src: str, out: str, workers: int, formats: str) -> list[str]:
    return [sys.executable, "-m", "gpufeed", "convert", "imagenet", src, "--to", formats, "--out", out,
            "--workers", str(workers), "--resize", "256", "--no-progress"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100000)
    p.add_argument("--unique", type=int, default=2000)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--formats", default="recordio,lmdb")
    p.add_argument("--kill-after", type=float, default=0.5, help="of the planned shards journalled")
    p.add_argument("--signal", choices=("kill", "term"), default="kill")
    p.add_argument("--then", choices=("rerun", "clean"), default="rerun",
                   help="clean: the stopped run given up with `gpufeed clean` (timed; what it said, what is left), "
                        "then a fresh run into the same destination")
    p.add_argument("--work", default="/tmp/gpufeed-killed")
    p.add_argument("--results")
    a = p.parse_args()
    from gpufeed.bench.experiments.convert_node import build_corpus

    src = os.path.join(a.work, "src")
    if not os.path.isdir(src):
        t = time.perf_counter()
        total, _ = build_corpus(src, a.n, a.unique, min(a.workers, 32), layout="imagenet", mix="imagenet")
        print(f"corpus: {a.n} files, {total / 1e9:.1f} GB in {time.perf_counter() - t:.0f} s", flush=True)
    killed, other = os.path.join(a.work, "killed"), os.path.join(a.work, "other")
    for d in (killed, other):
        shutil.rmtree(d, ignore_errors=True)
    row = {"bench": "killed-spools", "n": a.n, "workers": a.workers, "formats": a.formats, "signal": a.signal,
           "spools_before": spool_bytes()}
    # 1. killed outright halfway
    t = time.perf_counter()
    proc = subprocess.Popen(command(src, killed, a.workers, a.formats), stderr=subprocess.PIPE, text=True)
    shards = None
    while proc.poll() is None:
        if shards is None:
            shards = _planned(killed)
        if shards and journal_shards(killed) >= a.kill_after * shards:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGKILL if a.signal == "kill" else signal.SIGTERM)
    _, err = proc.communicate()
    time.sleep(1.0)  # its local processes see the driver's end and exit
    row.update(killed_after_s=round(time.perf_counter() - t, 2), shards_planned=shards,
               shards_journalled=journal_shards(killed), spools_left=spool_bytes())
    if a.then == "clean":
        # 2. given up: gpufeed clean, timed, and what it left
        row.update(stopped_rc=proc.returncode, stopped_said=err.strip().splitlines()[-3:],
                   dst_files=_files(killed), dst_bytes=_bytes(killed))
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "gpufeed", "clean", killed], capture_output=True, text=True)
        row.update(clean_rc=done.returncode, clean_s=round(time.perf_counter() - t, 2),
                   clean_said=(done.stdout + done.stderr).strip()[-600:], left_after_clean=_files(killed),
                   spools_after_clean=spool_bytes())
    elif a.signal == "term":
        # 2. what the stopped run said, and its advice followed
        row.update(stopped_rc=proc.returncode, stopped_said=err.strip().splitlines()[-2:])
        advice = [line.rsplit("rm -r ", 1)[1] for line in err.splitlines() if "rm -r " in line]
        if advice:
            subprocess.run(["rm", "-r", advice[0]], check=True)
        row["spools_after_advice"] = spool_bytes()
    else:
        # 2. another destination's run
        t = time.perf_counter()
        # with its progress lines, the sweep's among them
        done = subprocess.run(command(src, other, a.workers, "recordio")[:-1], capture_output=True, text=True)
        said = [line for line in done.stderr.splitlines() if "spool folder" in line]
        row.update(other_rc=done.returncode, other_s=round(time.perf_counter() - t, 2), other_said=said,
                   spools_after_other=spool_bytes())
    # 3. the killed run's rerun, then verify
    t = time.perf_counter()
    rerun = subprocess.run(command(src, killed, a.workers, a.formats), capture_output=True, text=True)
    row.update(rerun_rc=rerun.returncode, rerun_s=round(time.perf_counter() - t, 2),
               rerun_tail=rerun.stderr.strip().splitlines()[-1:] if rerun.returncode else [])
    verify = subprocess.run([sys.executable, "-m", "gpufeed", "verify", killed], capture_output=True, text=True)
    row.update(verify_rc=verify.returncode, verify=(verify.stdout + verify.stderr).strip()[:300],
               spools_at_end=spool_bytes())
    print(json.dumps(row), flush=True)
    if a.results:
        with open(a.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    for d in (killed, other):
        shutil.rmtree(d, ignore_errors=True)


def _files(root: str) -> int:
    return sum(len(names) for _, _, names in os.walk(root))


def _bytes(root: str) -> int:
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(root) for n in names)


def _planned(out: str) -> int | None:
    """Shards the journal's plan events give, once they are there."""
    try:
        with open(os.path.join(out, ".gpufeed", "journal.jsonl"), "rb") as f:
            events = [json.loads(line) for line in f if b'"event":"plan"' in line]
    except (FileNotFoundError, ValueError):
        return None
    return sum(e["shards"] for e in events) or None


if __name__ == "__main__":
    main()
