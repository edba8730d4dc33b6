"""What limited a training run: each shared resource's use over the timed steps beside its ceiling, and the one
at 90% of it or more; where none was, the loader itself (a defect to fix, never the disk's fault), or, where the
loop got its batches in time, its own steps slowed beside the loader's work.

A row of ``gpufeed bench train`` carries ``resources`` (:func:`resources`): the data's block device (MB/s read
against the disk's measured cold ceiling for the records' size at the loader's queue depth,
:func:`gpufeed.bench.hostdisk.ceiling`, or an emulated tier's own limit), the share of every core busy, the JPEG
decodes per second on each path (CPU workers, the GPU's engines) against the engines' rate and, on the CPU,
against what every core decodes at once (:func:`gpufeed.bench.cpuceiling.decode_ceiling`), the slowest
rank's share of time waiting for data and of its main thread's time running (the thread that takes each batch and
launches the model's kernels), and for several training ranks the share of the time some rank waited for its batch
(step by step the longest wait: every rank waits for it in the gradients' all-reduce). :func:`limit` names the
resource that limited a run that missed :data:`MISSED` AU, in words a report prints as they are; :func:`row_limit`
is what a report shows for a row.
"""

from __future__ import annotations

import math

#: A run is explained from AU below this (the report's "fed" line is gpufeed.bench.AU_TARGET).
MISSED = 0.90
#: A resource limits a run when its use reaches this share of its ceiling.
NEAR = 0.90
#: A disk read faster than this share of its measured ceiling says the ceiling was measured shallower than the
#: loader read (the ceiling then is no proof the disk was at its limit).
OVER = 1.05
#: A run marked cold counts as a cold measurement only where the block device read at least this share of the
#: bytes of the records it consumed: below it, the records came from the page cache (batches read before the
#: timed steps, or a dataset built in the same call that eviction did not reach).
COLD_DEVICE_SHARE = 0.5
#: A run's loop took its batches faster than the loader's workers made them over the timed steps when it took
#: more than this share over what they made: it ate into the batches they made before (two a worker), and its
#: rate and AU are what the workers made (:class:`gpufeed.bench.train_loop.LoopRun`).
BEHIND = 0.02
#: The shorter side (``--resize``) a row whose records the disk could not feed says to store them at: on 4 H200s
#: training from 64 cores, records stored so (52 KB from 118 KB captured) fed every rank at 0.98-1.00 AU from each
#: format where the captured ones could not pass 0.875 (results/gpu-ranks-h200x4.txt, session 18).
SMALLER = 256
#: :func:`limit`'s resource for a run whose loop got its batches in time and lost its AU in its own steps, which
#: ran slower than the model alone beside the loader's work on the same node (its workers, its decoder threads and
#: the GPU's JPEG engines; 4 H200s, results/gpu-ranks-h200x4.txt).
BESIDE = "beside the model"


def _median(row: dict, name: str) -> float | None:
    block = (row.get("metrics") or {}).get(name)
    return block.get("median") if isinstance(block, dict) else None


def device_share(row: dict) -> float | None:
    """Of the record bytes a training row marked cold consumed over its timed steps (every rank's), the share the
    block device read meanwhile; None where the row is not cold or does not say."""
    if not (row.get("params") or {}).get("cold") or not row.get("record_bytes"):
        return None
    read = _median(row, "disk_read_mb_per_s")
    rate = row.get("total_per_s") or _median(row, "images_per_s")
    if read is None or not rate:
        return None
    return read * 1e6 / (rate * row["record_bytes"])


def ate_ahead(row: dict) -> tuple[float, float] | None:
    """``(made, taken)``, img/s over the timed steps, for a row whose loop took its batches faster than its
    loader's workers made them (by more than :data:`BEHIND`); None otherwise, or where the row does not say."""
    made, taken = _median(row, "made_per_s"), _median(row, "taken_per_s")
    return (made, taken) if made is not None and taken and taken > made * (1 + BEHIND) else None


def served_from_cache(row: dict) -> bool:
    """A row marked cold whose records came from the page cache instead (:data:`COLD_DEVICE_SHARE`)."""
    share = device_share(row)
    return share is not None and share < COLD_DEVICE_SHARE


def cache_text(row: dict) -> str:
    return (f"not a cold measurement: the disk read {device_share(row):.0%} of the bytes of the records the run "
            "consumed, the rest came from the page cache")


def resources(row: dict, ceiling: dict | None, engines_per_s: float | None, cores: int,
              cpu_decode: dict | None = None, gpu_busy_alone: float | None = None) -> dict:
    """The ``resources`` block of a train row from its (slowest rank's) metrics: ``ceiling`` the disk's
    (``mb_per_s``, ``pattern``, ``source``), ``engines_per_s`` one GPU's JPEG engines' rate where they decode,
    ``cpu_decode`` what every core decodes at once (:func:`gpufeed.bench.cpuceiling.decode_ceiling`), set
    beside the CPU workers' decodes on the whole node (every rank's, ``node_cpu_decodes_per_s``);
    ``gpu_busy_alone`` the share of time the GPU ran kernels with the model alone, beside the row's ``gpu_busy``."""
    m = row.get("metrics") or {}

    def median(name):
        return (m.get(name) or {}).get("median")

    p = row.get("params") or {}
    decode, rate = p.get("decode"), row.get("median")
    share = median("cpu_share")
    decodes = {}
    if decode and rate:
        cpu = 1.0 if decode == "cpu" else (share or 0.0) if decode == "hybrid" else 0.0
        if cpu:
            decodes["cpu"] = rate * cpu
        if decode in ("hw", "hybrid"):
            decodes["hw"] = rate * (1.0 - cpu)
        if decode == "gpu":
            decodes["gpu"] = rate
    node_cpu = decodes["cpu"] * int(p.get("gpus") or 1) if "cpu" in decodes else None
    out = {"disk_read_mb_per_s": median("disk_read_mb_per_s"), "disk_busy": median("disk_busy"),
           "disk_reads_in_flight": median("disk_reads_in_flight"), "disk_read_request_kb": median("disk_read_request_kb"),
           "disk_ceiling": ceiling, "cpu_busy": median("cpu_busy"), "cores": cores,
           "decodes_per_s": decodes, "engines_per_s": engines_per_s if "hw" in decodes else None,
           "node_cpu_decodes_per_s": node_cpu, "cpu_decode_ceiling": cpu_decode if node_cpu else None,
           "main_thread_busy": median("main_thread_busy"), "main_thread_waited": median("main_thread_waited"),
           "gpu_busy": median("gpu_busy"), "gpu_sm_mhz": median("gpu_sm_mhz"),
           "gpu_busy_alone": gpu_busy_alone if median("gpu_busy") is not None else None,
           "wait_share": median("data_wait_share"), "any_rank_wait_share": median("any_rank_wait_share")}
    return {k: v for k, v in out.items() if v not in (None, {})}


def disk_bound(row: dict) -> dict | None:
    """What the disk could feed at most, read at its measured ceiling, for a cold training or inference row:
    ``{"au", "need_mb_per_s", "ceiling_mb_per_s", "ranks", "alone_per_s"}``, where ``need`` is every rank's
    demand with the model alone (its rate at AU 1) times the records' stored size, and ``au`` the share of it
    the ceiling gives each rank (the records alone: a disk that reads more than them feeds less). None where the
    row does not say enough, or its records came from the page cache."""
    r, p = row.get("resources") or {}, row.get("params") or {}
    ceiling = (r.get("disk_ceiling") or {}).get("mb_per_s")
    au, rate, size = _median(row, "au"), row.get("median"), row.get("record_bytes")
    if not (ceiling and au and rate and size and p.get("cold")) or served_from_cache(row):
        return None
    ranks = int(p.get("gpus") or 1)
    alone = rate / au
    need = ranks * alone * size / 1e6
    return {"au": ceiling / need, "need_mb_per_s": need, "ceiling_mb_per_s": ceiling, "ranks": ranks,
            "alone_per_s": alone}


def bound_text(bound: dict, record_bytes: float, params: dict | None = None) -> str:
    """:func:`disk_bound` in words; for images stored larger than :data:`SMALLER` keeps them (the row's
    ``params``: as captured, or resized to a longer side), the option that stores them so."""
    ranks = bound["ranks"]
    who = "one rank" if ranks == 1 else f"each of {ranks} ranks"
    demand = (f"{ranks} x " if ranks > 1 else "") + f"{bound['alone_per_s']:,.0f} img/s"
    at_most = math.floor(bound["au"] * 1000) / 10  # rounded down: 0.8996 is not "90%"
    # The stored size at which the same demand needs no more than the ceiling, rounded down.
    fits = math.floor(record_bytes * bound["au"] / 1e3)
    p = params or {}
    larger = p.get("image_size") and not p.get("store") and (not p.get("resize") or p["resize"] > SMALLER)
    how = (f" (`gpufeed convert ... --resize {SMALLER}` stores each photo's shorter side at {SMALLER})"
           if larger else "")
    return (f"even read at its ceiling ({bound['ceiling_mb_per_s'] / 1e3:.2f} GB/s) the disk feeds {who} at most "
            f"{at_most:.1f}% AU: {demand} of {record_bytes / 1e3:.0f} KB records need "
            f"{bound['need_mb_per_s'] / 1e3:.2f} GB/s; records of {fits} KB or less would need no more than its "
            f"ceiling{how}")


def limit(row: dict) -> dict | None:
    """``{"resource": "disk" | "cpu" | "engines" | "main thread" | BESIDE | None, "text": ...}`` for a row whose AU
    missed :data:`MISSED`: the resources at :data:`NEAR` of their ceilings; or none, and then either the loop
    waited for its batches (None: the loader limited it) or, where it lost more time in its steps than in waiting,
    :data:`BESIDE` (the steps ran slower beside the loader's work). Where the disk could not feed the row's ranks
    at :data:`MISSED` AU even read at its ceiling (:func:`disk_bound`), the text ends saying so: no loader would
    meet the target from that disk."""
    found = _limit(row)
    if not found or found["resource"] == "page cache":
        return found
    uneven = uneven_text(row)
    if uneven:
        found = {**found, "text": f"{found['text']}; {uneven}"}
    bound = disk_bound(row)
    if bound is not None and bound["au"] < MISSED:
        found = {**found, "text": f"{found['text']}; {bound_text(bound, row['record_bytes'], row.get('params'))}"}
    return found


#: Ranks were fed unevenly where one waited for its batches this much more of the time than the rank that waited
#: least, which waited under :data:`EVEN_WAIT`.
UNEVEN = 0.2
EVEN_WAIT = 0.05


def uneven_text(row: dict) -> str | None:
    """For a row of several training ranks whose waits for their batches differed widely (:data:`UNEVEN`), what
    that says: each rank's workers make only its own batches, so a rank whose records cost more to read or decode
    holds every rank back in the all-reduce while the others' workers idle. On 4 H200s, a benchmark dataset whose
    large photos all fell to ranks 1 and 3 showed it (results/gpu-ranks-h200x4.txt, session 17)."""
    p = row.get("params") or {}
    waits = [(r.get("wait_share"), r.get("rank")) for r in row.get("ranks") or []]
    waits = [(w, k) for w, k in waits if w is not None and k is not None]
    if len(waits) < 2 or p.get("task", "train") != "train":
        return None
    (least, calm), (most, late) = min(waits), max(waits)
    if most - least < UNEVEN or least >= EVEN_WAIT:
        return None
    return (f"the ranks were fed unevenly (rank {late} waited for its batches {most:.0%} of the time, rank {calm} "
            f"{least:.0%}): each rank's workers make only its own batches, so where one rank's records cost more to "
            "read or decode, every rank waits for it")


def _limit(row: dict) -> dict | None:
    au = ((row.get("metrics") or {}).get("au") or {}).get("median")
    r = row.get("resources")
    if au is None or au >= MISSED or not r:
        return None
    if served_from_cache(row):
        return {"resource": "page cache", "text": cache_text(row)}
    disk, ceiling = r.get("disk_read_mb_per_s"), (r.get("disk_ceiling") or {}).get("mb_per_s")
    hw, engines = (r.get("decodes_per_s") or {}).get("hw"), r.get("engines_per_s")
    busy, main = r.get("cpu_busy"), r.get("main_thread_busy")
    decoded, decode_top = r.get("node_cpu_decodes_per_s"), (r.get("cpu_decode_ceiling") or {}).get("img_per_s")

    def over():  # a ceiling measured shallower than the loader read (rows before 2026-11-27's deeper ceilings)
        pattern = (r.get("disk_ceiling") or {}).get("pattern")
        if disk <= ceiling * OVER or not pattern:
            return ""
        return (f" (more than the ceiling measured at {pattern.rsplit('_', 1)[-1]}: the loader kept more reads in "
                "flight, so the disk may read faster still)")

    # (resource, its use, its ceiling, what to print): a share of the cores, or the thread that takes the GPU's
    # batches and launches its kernels (the GPU starved while it was this busy: with the launch queue empty it
    # does not spin, so its time went to the loop's own host work).
    checks = [("disk", disk, ceiling, lambda: f"disk: {disk / 1e3:.2f} of {ceiling / 1e3:.2f} GB/s" + over()),
              ("cpu", busy, 1.0, lambda: f"CPU: {busy:.0%} of {r.get('cores', '?')} cores busy"),
              # The cores' busy share under-states a CPU of hyper-threads: set their decodes beside what every
              # core decodes at once, measured.
              ("cpu", decoded, decode_top,
               lambda: f"CPU decode: {decoded:,.0f} of {decode_top:,.0f} img/s (every core decoding at once)"),
              ("engines", hw, engines, lambda: f"JPEG engines: {hw:,.0f} of {engines:,.0f} img/s"),
              ("main thread", main, 1.0, lambda: f"the rank's main thread: {main:.0%} of one core")]
    found, seen = [], []
    for name, used, top, text in checks:
        if used is not None and top:
            (found if used >= NEAR * top else seen).append((name, text()))
    # The loop hardly waited because it ate the batches made before the timed steps: its waits and steps say
    # nothing of what limits the rate the workers keep up.
    ate = ate_ahead(row)
    behind = (f"the workers made {ate[0]:,.0f} img/s over the timed steps and the loop took {ate[1]:,.0f}, the rest "
              "from batches made before them" if ate else None)
    # The AU a run lost is the loop's time waiting for batches plus its steps' time beyond the model's alone.
    wait = r.get("wait_share")
    params = row.get("params") or {}
    ahead, paced = params.get("run_ahead"), _median(row, "paced_share")
    ranks = int(params.get("gpus") or 1)
    # Training ranks meet in the gradients' all-reduce every step; inference ranks never meet.
    reduced = ranks > 1 and params.get("task", "train") == "train"
    # So a training rank loses each step the longest of every rank's waits for its batch, not its own alone.
    late = r.get("any_rank_wait_share") if reduced and wait is not None else None
    late = late if late is not None and late > wait else None
    held = late if late is not None else wait
    # How the loop's wait is said, with the other ranks' where they held it longer.
    waited = (f"{wait:.0%} of its time" + (f", and some rank waited for its batch {late:.0%} of the time (each "
                                           f"step's all-reduce waits for the latest rank)" if late is not None else "")
              if wait is not None else "")
    if found:
        text = "; ".join(t for _, t in found)
        if behind:
            text += f" ({behind})"
        elif wait is not None and 1.0 - au - held > held:
            # A resource at its ceiling while the batches still came in time: the run is balanced on it, but most
            # of its loss is in its steps (4 H200s training: the disk at its ceiling, the loop waiting 1%).
            text += (f"; yet the batches came in time (the loop waited for them {waited}"
                     f"{_steps(row, r, ahead, paced, reduced)}): most of the AU went to steps slowed beside the loader's "
                     f"work, so relieving the {found[0][0]} alone wins back at most the {held:.0%} "
                     + ("the ranks waited" if late is not None else "the loop waited"))
        return {"resource": found[0][0], "text": text}
    what = f"no resource at {NEAR:.0%} of its ceiling ({'; '.join(t for _, t in seen) or 'nothing measured'})"
    loader = _loader_verdict(r, found)
    if behind:
        return {"resource": None, "text": f"{behind}; {what}: {loader}"}
    if wait is None:
        return {"resource": None, "text": f"{what}: {loader}"}
    if 1.0 - au - held <= held:
        if ahead is not None and paced is None:  # bench train before 2026-11-27 counted the pacing as waiting
            return {"resource": None, "text": f"the loop waited {wait:.0%} of its time for its batches or for its GPU "
                                              f"(the loader paced it, run_ahead {ahead}, and this row does not tell "
                                              f"the two apart); {what}"}
        # With the model as one CUDA graph the loop's thread launches a step in one call and then waits for the
        # next batch while the GPU runs it: part of that wait was never the GPU's loss.
        graph = (" (the model ran as one CUDA graph: the GPU ran while the loop waited, so not all of that was "
                 "lost)" if params.get("cuda_graph") else "")
        return {"resource": None, "text": f"the loop waited for its batches {waited}{graph}; {what}: {loader}"}
    steps = _steps(row, r, ahead, paced, reduced)
    # With several training ranks each step lasts as long as its latest rank's (the all-reduce waits for it), so
    # one rank's late step is every rank's: traced on 4 H100s, a different rank came late each step.
    if reduced:
        slowed = (f"slowed its steps (each of the {ranks} ranks waits in the gradients' all-reduce for whichever "
                  f"rank came late; --trace DIR records where)")
    elif ranks > 1:
        slowed = f"slowed its steps (each of the {ranks} ranks runs its own steps: inference has no all-reduce)"
    else:
        slowed = "slowed its steps"
    return {"resource": BESIDE, "text": f"the batches came in time (the loop waited for them {waited}"
                                        f"{steps}): the loader's work beside the model {slowed}, not the "
                                        f"feeding; {what}, so a faster disk would not help"}


#: A disk busy this share of the time read its ceiling's way only where its reads in flight reached this share of
#: the ceiling's queue depth, and its requests this share of the ceiling's request size.
SHALLOW = 0.5
SMALL_REQUESTS = 0.75


def _loader_verdict(r: dict, found: list) -> str:
    """Whom :func:`limit` names for a run that waited for its batches with no resource at its ceiling: the loader.
    Where the disk was busy :data:`NEAR` of the time or more while it read under its ceiling, the disk was the
    limit at the way the loader read: what the row measured of that way is said against the ceiling's (the reads
    in flight on average, :data:`SHALLOW`; their mean size, :data:`SMALL_REQUESTS`). 4 H200s on 64 cores: 15
    workers a rank read 1.52 of 1.94 GB/s, 28 read 1.87 (results/gpu-ranks-h200x4.txt, session 17)."""
    busy, disk = r.get("disk_busy"), r.get("disk_read_mb_per_s")
    if busy is None or busy < NEAR or not disk or any(name == "disk" for name, _ in found):
        return "the loader itself limits this run, not the disk"
    from gpufeed.bench.hostdisk import pattern_shape

    request_bytes, depth = pattern_shape((r.get("disk_ceiling") or {}).get("pattern"))
    size = request_bytes / 1e3 if request_bytes else None
    measured = f" at qd{depth}" if depth else ""
    kept = f"the loader itself limits this run: its reads kept the disk busy {busy:.0%} of the time"
    in_flight, request = r.get("disk_reads_in_flight"), r.get("disk_read_request_kb")
    if in_flight is None or request is None:  # rows before 2026-11-27's session 18 measured neither
        return (f"{kept} below the ceiling measured{measured}: they came fewer at once or smaller than that "
                "measurement's")
    said = f"{in_flight:.0f} reads in flight on average, of {request:.0f} KB"
    if depth and in_flight < SHALLOW * depth:
        return (f"{kept} with {said}, too few at once to reach the ceiling measured{measured}; more workers a rank "
                "keep more reads in flight")
    if size and request < SMALL_REQUESTS * size:
        return f"{kept} with {said}, smaller than the ceiling's {size:.0f} KB reads"
    return f"{kept} with {said}, near the ceiling's depth and size, yet below it"


def _steps(row: dict, r: dict, ahead: int | None, paced: float | None, reduced: bool) -> str:
    """What a row's steps did beside the loop's wait, as :func:`limit` words it: each step's time against the
    model's alone, the pacing, the main thread's wait for a core, the GPU's kernel time against the model alone's
    (``reduced``: training ranks, whose all-reduce's wait counts as kernel time)."""
    step, alone = _median(row, "step_ms"), row.get("compute_step_s")
    steps = (f", and each step took {step:.1f} ms against the model's {alone * 1e3:.1f} ms alone" if step and alone
             else "")
    if paced:
        steps += f"; the loader held it back for its GPU {paced:.0%} of its time (run_ahead {ahead})"
    queued = r.get("main_thread_waited")
    if queued is not None:  # the loop's own thread ready to launch the model's work but without a core
        steps += f"; its main thread waited for a core {queued:.0%} of its time"
    gpu, gpu_alone = r.get("gpu_busy"), r.get("gpu_busy_alone")
    if gpu is not None and gpu_alone is not None:  # less kernel time at the same step count: work came late
        steps += f"; the GPU ran kernels {gpu:.0%} of the time against {gpu_alone:.0%} with the model alone"
        if reduced:  # NCCL's kernels spin while they wait for the other ranks
            steps += " (a rank's all-reduce waiting for the others counts as kernel time)"
    return steps


def row_limit(row: dict) -> dict | None:
    """What limited ``row`` as a report says it: :func:`limit` from the row's measured ``resources`` (so rows
    written by an earlier build are read the way this one reads them), else the ``limit`` the row carries."""
    return limit(row) if row.get("resources") else row.get("limit")
