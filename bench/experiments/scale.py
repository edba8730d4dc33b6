"""Large end-to-end conversions with memory and throughput recorded over time.

``python -m gpufeed.bench.experiments.scale cifar --samples 200000 --work /data/scale`` synthesises a CIFAR-10 of that
many training samples in the official pickle layout and converts it to every format;
``python -m gpufeed.bench.experiments.scale imagenet --gigabytes 20 --work /data/scale`` does the same with an
ImageNet-like tree of that many bytes of JPEGs (resize 256, JPEG q95). While ``gpufeed convert`` runs as a
subprocess, every ``--interval`` seconds the anonymous resident memory (``RssAnon``: file pages mapped by
LMDB are page cache, not held memory) of each process of its tree (driver, Ray's raylet and GCS, each
worker) and the samples the journal says are done are recorded. The verdict is
whether peak memory is flat: the peak of each process role over the second half of the run is compared with
its peak over the first half, which would grow if memory scaled with the dataset.

Results go to ``--results`` as JSON lines (gpufeed.bench.results schema) and are printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from gpufeed.machine import usable_cores

#: Past the first half's peak by more than this (and 10%), a role's memory counts as growing.
_GROWTH_SLACK = 64 * 2**20


def _role(proc) -> str:
    try:
        name = proc.name()
        cmd = " ".join(proc.cmdline()[:3])
    except Exception:
        return "gone"
    if "raylet" in name or "raylet" in cmd:
        return "raylet"
    if "gcs_server" in name or "gcs_server" in cmd:
        return "gcs"
    if name.startswith("ray::") or "default_worker" in cmd or "ray::" in cmd:
        return "worker"
    if "gpufeed" in cmd or "convert" in cmd:
        return "driver"
    return "ray-other" if "ray" in cmd else "other"


def anon_rss(pid: int) -> int | None:
    """Private anonymous resident memory: RSS less the file pages a process maps (LMDB's memory map counts
    in RSS but is page cache the kernel can drop, not memory the process holds)."""
    from gpufeed.bench.results import proc_kib_field

    return proc_kib_field(f"/proc/{pid}/status", "RssAnon")


def _samples_done(state_dir: str) -> int:
    path = os.path.join(state_dir, "journal.jsonl")
    done = 0
    try:
        with open(path, "rb") as f:
            for line in f:
                if b'"event": "shard"' in line or b'"event":"shard"' in line:
                    try:
                        done += int(json.loads(line).get("written", 0))
                    except ValueError:
                        pass
    except FileNotFoundError:
        pass
    return done


def monitor(cmd: list[str], state_dir: str, interval: float) -> dict:
    """Run ``cmd`` and sample its process tree until it exits."""
    import psutil

    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    timeline = []
    peaks: dict[int, dict] = {}
    while proc.poll() is None:
        now = time.monotonic() - t0
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        by_role: dict[str, int] = {}
        for p in procs:
            rss = anon_rss(p.pid)
            if rss is None:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
            role = _role(p)
            by_role[role] = by_role.get(role, 0) + rss
            rec = peaks.setdefault(p.pid, {"role": role, "peak_rss": 0, "samples": []})
            rec["peak_rss"] = max(rec["peak_rss"], rss)
            rec["samples"].append((round(now, 1), rss))
        done = max(_samples_done(state_dir), timeline[-1]["done"] if timeline else 0)
        timeline.append({"t": round(now, 1), "done": done,
                         "rss_by_role": by_role, "rss_total": sum(by_role.values())})
        time.sleep(interval)
    rc = proc.wait()
    return {"returncode": rc, "wall_s": time.monotonic() - t0, "timeline": timeline, "processes": peaks}


def peak_halves(samples, wall: float) -> tuple[int, int]:
    """The largest of ``[(t, bytes)]`` samples in the first and in the second half of a ``wall``-second run."""
    first = max((r for t, r in samples if t < wall / 2), default=0)
    second = max((r for t, r in samples if t >= wall / 2), default=0)
    return first, second


def flatness(result: dict) -> dict:
    """Per role, the largest single-process peak in the first and second half of the run."""
    wall = result["wall_s"]
    halves: dict[str, list[int]] = {}
    for rec in result["processes"].values():
        first, second = peak_halves(rec["samples"], wall)
        h = halves.setdefault(rec["role"], [0, 0])
        h[0], h[1] = max(h[0], first), max(h[1], second)
    out = {}
    for role, (first, second) in halves.items():
        grows = first > 0 and second > first * 1.1 + _GROWTH_SLACK
        out[role] = {"peak_first_half_mib": round(first / 2**20, 1),
                     "peak_second_half_mib": round(second / 2**20, 1), "flat": not grows}
    return out


def throughput_windows(result: dict, windows: int = 10) -> list[dict]:
    """Samples/s over ``windows`` equal slices of the run, from the journal's progress."""
    tl = result["timeline"]
    if len(tl) < 2:
        return []
    span = tl[-1]["t"] / windows or 1.0
    out = []
    for w in range(windows):
        lo, hi = w * span, (w + 1) * span
        pts = [p for p in tl if lo <= p["t"] <= hi]
        if len(pts) >= 2:
            out.append({"from_s": round(lo), "to_s": round(hi),
                        "samples_per_s": round((pts[-1]["done"] - pts[0]["done"]) / max(pts[-1]["t"] - pts[0]["t"], 1e-9), 1)})
    return out


def _synth(kind: str, src: str, args) -> int:
    from gpufeed.pipelines import synth

    if kind == "cifar":
        per_class = -(-args.samples // 10)
        synth.synth_cifar10(src, per_class=per_class, test_per_class=100, seed=args.seed, forms=("python",))
        return per_class * 10
    # Synthesising a photo-like JPEG costs about as much as converting it, so --unique images are made and
    # then copied (real bytes, not links: the copies are read from disk like any other file) under new
    # names until the tree holds --gigabytes.
    unique = max(100, args.unique)
    synth.synth_imagenet(src, classes=100, per_class=unique // 100, val_per_class=1, seed=args.seed,
                         layout="tree", bad_files=False)
    train = os.path.join(src, "train")
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(train) for f in fs)
    have = sum(os.path.getsize(f) for f in files)
    n, copy = len(files), 0
    while have < args.gigabytes * 1e9:
        f = files[copy % len(files)]
        stem, ext = os.path.splitext(f)
        shutil.copyfile(f, f"{stem}_c{copy // len(files)}{ext}")
        have += os.path.getsize(f)
        copy += 1
    return n + copy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpufeed.bench.experiments.scale", description=__doc__.splitlines()[0])
    p.add_argument("dataset", choices=("cifar", "imagenet"))
    p.add_argument("--work", required=True, help="folder for the synthetic source and the output")
    p.add_argument("--samples", type=int, default=200_000, help="cifar: training samples")
    p.add_argument("--gigabytes", type=float, default=20.0, help="imagenet: bytes of source JPEGs")
    p.add_argument("--unique", type=int, default=20_000, help="imagenet: distinct synthetic JPEGs (then copied)")
    p.add_argument("--workers", type=int, default=usable_cores())
    p.add_argument("--to", default="lmdb,recordio,tfrecord")
    p.add_argument("--encode", default=None, help="imagenet: jpeg (resize 256, q95) or pass")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep source and output afterwards")
    p.add_argument("--results", default=None, help="append a JSON line here")
    args = p.parse_args(argv)

    src = os.path.join(args.work, f"{args.dataset}-src")
    dst = os.path.join(args.work, f"{args.dataset}-out")
    t0 = time.monotonic()
    if not os.path.exists(os.path.join(src, ".complete")):
        shutil.rmtree(src, ignore_errors=True)
        n = _synth(args.dataset, src, args)
        open(os.path.join(src, ".complete"), "w").write(str(n))
    synth_s = time.monotonic() - t0
    src_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    shutil.rmtree(dst, ignore_errors=True)
    cmd = [sys.executable, "-m", "gpufeed", "convert", "cifar10" if args.dataset == "cifar" else "imagenet",
           src, "--to", args.to, "--out", dst, "--workers", str(args.workers), "--no-progress"]
    if args.dataset == "cifar":
        cmd += ["--split", "train"]
    else:
        cmd += ["--split", "train"]
        if args.encode != "pass":
            cmd += ["--resize", "256", "--quality", "95"]
        else:
            cmd += ["--encode", "pass"]
    print("running:", " ".join(cmd), flush=True)
    result = monitor(cmd, os.path.join(dst, ".gpufeed"), args.interval)
    done = max((p["done"] for p in result["timeline"]), default=0)
    manifest = os.path.join(dst, "manifest.json")
    written = None
    if os.path.exists(manifest):
        with open(manifest) as f:
            m = json.load(f)
        written = sum(s["written"] for s in m["splits"].values())
    out_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)
    roles = flatness(result)
    row = {
        "bench": "scale", "dataset": args.dataset, "formats": args.to, "workers": args.workers,
        "source_bytes": src_bytes, "output_bytes": out_bytes, "synth_s": round(synth_s, 1),
        "convert_wall_s": round(result["wall_s"], 1), "returncode": result["returncode"],
        "samples_journalled": done, "manifest_samples": written,
        "samples_per_s": round((written or done) / result["wall_s"], 1) if result["wall_s"] else None,
        "peak_rss_mib_by_role": {r: v["peak_second_half_mib"] for r, v in roles.items()},
        "flatness": roles, "all_flat": all(v["flat"] for v in roles.values()),
        "throughput_windows": throughput_windows(result),
        "peak_rss_mib_per_process": sorted(
            ({"pid": pid, "role": rec["role"], "peak_mib": round(rec["peak_rss"] / 2**20, 1)}
             for pid, rec in result["processes"].items()), key=lambda r: -r["peak_mib"])[:12],
    }
    try:
        from gpufeed.bench.results import machine_info

        row["machine"] = machine_info(args.work)
    except Exception as e:  # the row is still worth having without machine details
        row["machine_error"] = str(e)
    print(json.dumps({k: v for k, v in row.items() if k not in ("machine", "peak_rss_mib_per_process")}, indent=1))
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    if not args.keep:
        shutil.rmtree(dst, ignore_errors=True)
    return result["returncode"]


if __name__ == "__main__":
    raise SystemExit(main())
