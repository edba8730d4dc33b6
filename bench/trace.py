"""What the GPU did during a few training steps, from torch's profiler: ``gpufeed bench train --trace DIR`` records,
after each timed window, ``--trace-steps`` more steps of every rank (the GPU's kernels, copies and sets on every
stream, those of libraries such as nvImageCodec and NCCL included) as one Chrome trace per rank and configuration;
this module sums one up, or compares two (the model alone against the model fed by a loader), so a slow step can
be told apart as kernels that ran slower beside other streams' work, or the model's stream left idle: while other
streams ran (with several ranks, the gradients' all-reduce spinning until the last rank arrives) or while nothing
ran at all (the GPU waiting for the process's own launches).

    python -m gpufeed.bench.trace TRACE.json [FED.json]
    python -m gpufeed.bench.trace --ranks RANK0.json RANK1.json ...   # one run's ranks: who came last, each step

With several ranks a step lasts as long as the latest rank's: the gradients' all-reduce kernels of the others spin
until it arrives. ``--ranks`` reads that from every rank's trace of one run: per step, each rank's all-reduce time,
the rank with the least (it came last; its own reduction is all it ran) and how long the others waited for it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator

#: Chrome-trace categories of work on the GPU, as torch's profiler (kineto) writes them.
GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "set"}
#: In a kernel's name: NCCL's all-reduce, the gradients' reduction, which waits for every rank.
ALLREDUCE = "AllReduce"


def _new_file(path: str) -> str:
    """``path``, or where a file of that name exists already (an earlier run's trace, or anyone's file), the first
    free ``NAME-2.json``, ``NAME-3.json``, ...: made empty here, so no file is ever written over."""
    base, ext = os.path.splitext(path)
    candidate, n = path, 1
    while True:
        try:
            os.close(os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{base}-{n}{ext}"


def record(batches: Iterator, step: Callable, synchronize: Callable, steps: int, path: str, meta: dict) -> str:
    """``steps`` steps under torch's profiler (the GPU's activity where CUDA is in use, else the CPU's), written
    as a Chrome trace with ``meta`` (and the step count) under the ``gpufeed`` key to ``path``, or beside it where
    that name is taken (:func:`_new_file`); returns the file written."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(*next(batches))
        synchronize()
    path = _new_file(path)
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    trace["gpufeed"] = {**meta, "steps": steps}
    with open(path, "w") as f:
        json.dump(trace, f)
    return path


@dataclasses.dataclass
class Stream:
    """One stream's work in a trace: busy microseconds per kind (the union of its intervals), and per kernel name
    the summed duration and count."""

    busy_us: dict[str, float]
    kernels: dict[str, tuple[float, int]]
    intervals: list[tuple[float, float]]

    @property
    def kernel_us(self) -> float:
        return sum(d for d, _ in self.kernels.values())


@dataclasses.dataclass
class Trace:
    """One Chrome trace's GPU work: its streams, the time line's span from the first GPU event's start
    (``start_us``) to the last one's end, and the steps it covers (from :func:`record`'s ``gpufeed`` key)."""

    path: str
    steps: int
    span_us: float
    streams: dict[int, Stream]
    meta: dict
    start_us: float = 0.0  # the first GPU event's start
    #: Each all-reduce kernel's (start, duration) in microseconds, in time order.
    allreduces: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def allreduce_per_step(self) -> list[float] | None:
        """Microseconds the all-reduce kernels ran in each step, their kernels split evenly among the steps in time
        order (DistributedDataParallel reduces the same buckets every step); None where they do not split evenly."""
        n = len(self.allreduces)
        if not n or n % max(1, self.steps):
            return None
        per = n // max(1, self.steps)
        return [sum(d for _, d in self.allreduces[k:k + per]) for k in range(0, n, per)]

    @functools.cached_property
    def main(self) -> int:
        """The model's stream: the one whose kernels ran longest."""
        return max(self.streams, key=lambda s: self.streams[s].kernel_us)

    @functools.cached_property
    def others(self) -> list[tuple[float, float]]:
        """The union of every other stream's work."""
        return _union([x for sid, s in self.streams.items() if sid != self.main for x in s.intervals])

    def per_step(self, us: float) -> float:
        return us / max(1, self.steps) / 1e3

    def idle(self) -> tuple[float, float]:
        """Microseconds of the time line in which the model's stream ran nothing: ``(beside, alone)``, the part in
        which another stream ran work (with several ranks, mostly the all-reduce spinning until the other ranks
        arrive; the decoder's copies and kernels) and the part in which the GPU ran nothing at all (it waited for
        this process: its launches, or a copy or the JPEG engines' work, which is no kernel)."""
        main = self.streams[self.main].intervals
        start = self.start_us
        gaps, at = [], start
        for a, b in main:
            if a > at:
                gaps.append((at, a))
            at = max(at, b)
        if start + self.span_us > at:
            gaps.append((at, start + self.span_us))
        beside = _overlap(gaps, self.others)
        return beside, _length(gaps) - beside


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Microseconds in both unions ``a`` and ``b`` (each sorted and disjoint)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def load(path: str) -> Trace:
    """A Chrome trace written by :func:`record` (or by torch's profiler directly: one step assumed)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not a readable Chrome trace ({e}); record one with gpufeed bench train --trace DIR")
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    by_stream: dict[int, dict] = collections.defaultdict(
        lambda: {"intervals": collections.defaultdict(list), "kernels": collections.defaultdict(lambda: [0.0, 0])})
    first, last = float("inf"), float("-inf")
    allreduces = []
    for ev in events:
        kind = GPU_CATEGORIES.get(str(ev.get("cat", "")).lower())
        if kind is None or ev.get("ph") != "X":
            continue
        start, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        stream = int((ev.get("args") or {}).get("stream", ev.get("tid", 0)))
        entry = by_stream[stream]
        entry["intervals"][kind].append((start, start + dur))
        if kind == "kernel":
            k = entry["kernels"][ev.get("name", "?")]
            k[0] += dur
            k[1] += 1
            if ALLREDUCE in str(ev.get("name", "")):
                allreduces.append((start, dur))
        first, last = min(first, start), max(last, start + dur)
    streams = {}
    for sid, entry in by_stream.items():
        unions = {kind: _union(iv) for kind, iv in entry["intervals"].items()}
        streams[sid] = Stream(busy_us={kind: _length(u) for kind, u in unions.items()},
                              kernels={name: (d, n) for name, (d, n) in entry["kernels"].items()},
                              intervals=_union([x for iv in entry["intervals"].values() for x in iv]))
    meta = data.get("gpufeed", {}) if isinstance(data, dict) else {}
    if not streams:
        return Trace(path, int(meta.get("steps", 1)), 0.0, streams, meta)
    return Trace(path, int(meta.get("steps", 1)), last - first, streams, meta, first, sorted(allreduces))


def summary(trace: Trace) -> list[str]:
    """Per step: the span, each stream's kernel/copy time, the model stream's idle time, and how much of its
    kernel time other streams' work ran beside it."""
    if not trace.streams:
        return [f"{trace.path}: no GPU work recorded (a trace of the CPU only, or an empty one)"]
    main = trace.main
    ms = trace.per_step
    label = " ".join(f"{k}={v}" for k, v in trace.meta.items() if k != "steps")
    lines = [f"{trace.path}: {trace.steps} steps{' (' + label + ')' if label else ''}, "
             f"{ms(trace.span_us):.2f} ms of GPU time line per step"]
    main_iv = trace.streams[main].intervals
    # Streams with under 1% of the model's kernel time (nvImageCodec's per-image streams) are summed in one line.
    small = {sid for sid, s in trace.streams.items()
             if sid != main and sum(s.busy_us.values()) < 0.01 * trace.streams[main].kernel_us}
    for sid, s in sorted(trace.streams.items(), key=lambda kv: -kv[1].kernel_us):
        if sid in small:
            continue
        parts = ", ".join(f"{kind} {ms(us):.2f} ms" for kind, us in sorted(s.busy_us.items()))
        top = sorted(s.kernels.items(), key=lambda kv: -kv[1][0])[:3]
        names = "; ".join(f"{_short(n)} {ms(d):.2f} ms x{n_ / max(1, trace.steps):.3g}" for n, (d, n_) in top)
        lines.append(f"  stream {sid}{' (model)' if sid == main else ''}: {parts}" + (f"  [{names}]" if names else ""))
    if small:
        kinds = collections.Counter()
        for sid in small:
            kinds.update(trace.streams[sid].busy_us)
        lines.append(f"  {len(small)} more streams: "
                     + ", ".join(f"{kind} {ms(us):.2f} ms" for kind, us in sorted(kinds.items())))
    beside, alone = trace.idle()
    lines.append(f"  the model's stream idle {ms(beside + alone):.2f} ms per step "
                 f"({(beside + alone) / trace.span_us:.0%} of the line): {ms(beside):.2f} ms while other streams ran, "
                 f"{ms(alone):.2f} ms with nothing on the GPU running; other streams' work beside its kernels "
                 f"{ms(_overlap(main_iv, trace.others)):.2f} ms per step")
    return lines


def compare(alone: Trace, fed: Trace) -> list[str]:
    """The model stream's kernels matched by name: how much longer the same kernels ran in ``fed`` than in
    ``alone`` per step, the largest differences first, and the idle time each left on that stream."""
    a, b = alone.streams[alone.main], fed.streams[fed.main]
    ms_a, ms_b = alone.per_step, fed.per_step
    (beside_a, nothing_a), (beside_b, nothing_b) = alone.idle(), fed.idle()
    lines = [f"the model's stream, per step: kernels {ms_a(a.kernel_us):.2f} ms alone, {ms_b(b.kernel_us):.2f} ms fed; "
             f"idle while other streams ran {ms_a(beside_a):.2f} ms alone, {ms_b(beside_b):.2f} ms fed; idle with "
             f"nothing on the GPU running {ms_a(nothing_a):.2f} ms alone, {ms_b(nothing_b):.2f} ms fed; time line "
             f"{ms_a(alone.span_us):.2f} against {ms_b(fed.span_us):.2f} ms"]
    diffs = []
    for name, (d, _n) in b.kernels.items():
        before = a.kernels.get(name, (0.0, 0))[0]
        diffs.append((ms_b(d) - ms_a(before), name, ms_a(before), ms_b(d)))
    for delta, name, x, y in sorted(diffs, reverse=True)[:8]:
        lines.append(f"  {_short(name)}: {x:.2f} -> {y:.2f} ms ({delta:+.2f})")
    return lines


def ranks(traces: list[Trace]) -> list[str]:
    """One run's ranks (a trace each, any order; each knows its rank from :func:`record`'s ``gpufeed`` key): per
    step, each rank's all-reduce time, which rank came last (the least: it waited for no one) and how long the
    others waited for it; then how often each rank came last and the mean wait a step."""
    traces = sorted(traces, key=lambda t: t.meta.get("rank", 0))
    names = [f"rank {t.meta['rank']}" if "rank" in t.meta else os.path.basename(t.path) for t in traces]
    per = [t.allreduce_per_step() for t in traces]
    missing = [n for n, p in zip(names, per) if p is None]
    if missing:
        return [f"{', '.join(missing)}: no all-reduce kernels ({ALLREDUCE}) that split evenly into the trace's "
                "steps: traces of a run on several GPUs (bench train --gpus N --trace DIR), all ranks of one run"]
    steps = min(len(p) for p in per)
    lines = [f"{len(traces)} ranks, {steps} steps: all-reduce ms per step by rank ({' / '.join(names)}); the rank "
             "with the least came last of these, the others waited for it (where even the least is well above what "
             "the reduction takes alone, a rank not given came later still)"]
    last_count, waits = collections.Counter(), []
    for k in range(steps):
        times = [p[k] / 1e3 for p in per]
        last = min(range(len(times)), key=times.__getitem__)
        waited = [t - times[last] for i, t in enumerate(times) if i != last]
        last_count[names[last]] += 1
        waits.append(sum(waited) / len(waited) if waited else 0.0)
        lines.append(f"  step {k + 1}: {' / '.join(f'{t:.1f}' for t in times)} ms: {names[last]} last, the others "
                     f"waited {min(waited, default=0):.1f}-{max(waited, default=0):.1f} ms")
    lines.append("came last: " + ", ".join(f"{n} {last_count[n]}x" for n in names)
                 + f"; the others waited {sum(waits) / max(1, steps):.1f} ms a step on average")
    return lines


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpufeed.bench.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="Chrome traces from gpufeed bench train --trace DIR; with two, "
                        "the first is the model alone and the second the model fed, compared kernel by kernel")
    parser.add_argument("--ranks", action="store_true",
                        help="the traces are one run's ranks: per step, which rank came last to the all-reduce and "
                             "how long the others waited for it")
    args = parser.parse_args(argv)
    traces = [load(p) for p in args.traces]
    if args.ranks:
        print("\n".join(ranks(traces)))
        return 0
    for t in traces:
        print("\n".join(summary(t)))
    if len(traces) == 2 and all(t.streams for t in traces):
        print("\n".join(compare(*traces)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
