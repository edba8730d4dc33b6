"""The storage-tier report's answers: GPUs fed per disk (emulated and with real ranks), cores for decoding,
bandwidth, disks sized as bought, the side sections (CIFAR, Penn Treebank, several GPUs at once).
:mod:`gpufeed.bench.report` assembles them with the tables (:mod:`.report_tables`), :mod:`.report_plots` draws
the plots and :mod:`.report_render` writes HTML or Markdown."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from gpufeed.bench import AU_TARGET
from gpufeed.bench.report_model import Block, GiB, MB, Section, Table, fmt_bytes, fmt_num, fmt_pct, fmt_ratio
from gpufeed.bench.bottleneck import BESIDE, COLD_DEVICE_SHARE, device_share, row_limit, served_from_cache
from gpufeed.bench.report_rows import (Demand, accelerator, accelerator_emulated, demands, describe_config, figure,
                                       counts_made, fmt_runs, is_synthetic, loader_label, of_bench, params, plain,
                                       runs_of_each_config, side_dataset, stored, stored_at, stored_size, tier_label,
                                       train_rows_for, typical)
from gpufeed.bench.report_tables import limit_text


def _cores(row: dict) -> str:
    cores = figure(row, "cpu_cores")
    return "n/a" if cores is None else f"{cores:.2f}"


def _worker_memory(row: dict) -> str:
    mb = figure(row, "loader_mem_mb")
    return "n/a" if mb is None else fmt_bytes(mb * 1e6)


def cifar_blocks(rows: Sequence[dict]) -> list[Block]:
    """The CIFAR section: the model's no-wait rate, then per run its workers, where the augmentation ran and
    the AU, and a sentence per worker count comparing CPU and GPU augmentation."""
    synthetic = [r for r in of_bench(rows, "train") if is_synthetic(r) and r.get("median")]
    runs = [r for r in of_bench(rows, "train") if not is_synthetic(r)]
    if not runs:
        return ["CIFAR rows without a training run: nothing to compare."]
    blocks: list[Block] = []
    if synthetic:
        blocks.append(f"{params(synthetic[0]).get('model')} on {params(synthetic[0]).get('accelerator')} trains at "
                      f"{_rate_range([r['median'] for r in synthetic])} img/s on batches already on the device (batch "
                      f"{params(synthetic[0]).get('batch_size')}).")
    by_workers: dict[Any, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    table = Table("CIFAR-10 into the CIFAR ResNet, per run",
                  ["format", "tier", "workers", "augmentation on", "img/s", "AU", "wait p50 ms", "cores used"], [])
    for r in sorted(runs, key=lambda r: (int(params(r).get("workers") or 0), str(params(r).get("augment_on")),
                                         str(r.get("format")), tier_label(r))):
        p = params(r)
        on = str(p.get("augment_on") or "cpu")
        by_workers[p.get("workers")][on].append(r)
        table.rows.append([str(r.get("format")), tier_label(r), str(p.get("workers")), on, fmt_num(r.get("median")),
                           fmt_pct(figure(r, "au")), fmt_num(figure(r, "data_wait_p50_ms")), _cores(r)])
    for workers, sides in sorted(by_workers.items(), key=lambda kv: int(kv[0] or 0)):
        parts = []
        for on in ("cpu", "gpu"):
            if sides.get(on):
                best = max(sides[on], key=lambda r: figure(r, "au") or 0)
                parts.append(f"augmentation on the {on.upper()}: AU {fmt_pct(figure(best, 'au'))} at best "
                             f"({best.get('format')})")
        blocks.append(f"With {workers} DataLoader worker(s): " + "; ".join(parts) + ".")
    blocks.append(table)
    return blocks


def ptb_blocks(rows: Sequence[dict]) -> list[Block]:
    """The Penn Treebank section: the language model's no-wait rate in sequences and tokens per second and
    what that asks of the disk, then per run its workers, AU, the CPU cores the run used and the workers'
    memory, and per worker count whether that many workers keep the model fed (AU >= 90%)."""
    synthetic = [r for r in of_bench(rows, "train") if is_synthetic(r) and r.get("median")]
    runs = [r for r in of_bench(rows, "train") if not is_synthetic(r)]
    if not runs:
        return ["Penn Treebank rows without a training run: nothing to compare."]
    blocks: list[Block] = []
    for task in sorted({params(r).get("task") for r in synthetic}):
        mine = [r for r in synthetic if params(r).get("task") == task]
        p = params(mine[0])
        rates = [r["median"] for r in mine]
        demand = statistics.median(rates)
        record = statistics.median(r["record_bytes"] for r in runs if params(r).get("task") == task
                                   and r.get("record_bytes")) if any(r.get("record_bytes") for r in runs) else None
        blocks.append(f"{p.get('model')} ({task}, batch {p.get('batch_size')} windows of {p.get('seq_len')} tokens) "
                      f"on {p.get('accelerator')} consumes {_rate_range(rates)} windows/s "
                      f"({fmt_num(demand * (p.get('seq_len') or 0))} tokens/s at the median) when its batches are "
                      "already on the device" + (f": {fmt_bytes(demand * record)}/s of records of {fmt_bytes(record)}."
                                                 if record else ".") + _baseline_noise(rates, runs, task))
    table = Table("Penn Treebank into the LSTM language model, per run",
                  ["task", "format", "tier", "workers", "windows/s", "AU", "wait p50 ms", "cores used",
                   "workers' memory"], [])
    by_workers: dict[tuple, list[dict]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: (str(params(r).get("task")), int(params(r).get("workers") or 0),
                                         str(r.get("format")), tier_label(r))):
        p = params(r)
        by_workers[(p.get("task"), p.get("workers"))].append(r)
        table.rows.append([str(p.get("task")), str(r.get("format")), tier_label(r), str(p.get("workers")),
                           fmt_num(r.get("median")), fmt_pct(figure(r, "au")), fmt_num(figure(r, "data_wait_p50_ms")),
                           _cores(r), _worker_memory(r)])
    for (task, workers), mine in sorted(by_workers.items(), key=lambda kv: (str(kv[0][0]), int(kv[0][1] or 0))):
        fed = [r for r in mine if (figure(r, "au") or 0) >= AU_TARGET]
        worst = min(mine, key=lambda r: figure(r, "au") or 0)
        verdict = (f"every format keeps it fed (lowest AU {fmt_pct(figure(worst, 'au'))}, {worst.get('format')})"
                   if len(fed) == len(mine) else
                   f"{len(fed)} of {len(mine)} formats keep it at AU >= {fmt_pct(AU_TARGET)} (lowest "
                   f"{fmt_pct(figure(worst, 'au'))}, {worst.get('format')})")
        cores = [figure(r, "cpu_cores") for r in mine if figure(r, "cpu_cores") is not None]
        memory = [figure(r, "loader_mem_mb") for r in mine if figure(r, "loader_mem_mb") is not None]
        blocks.append(f"{str(task).capitalize()} with {workers} DataLoader worker(s): {verdict}"
                      + (f", using {min(cores):.2f}-{max(cores):.2f} cores in all" if cores else "")
                      + (f" and {fmt_bytes(max(memory) * 1e6)} in the workers" if memory else "") + ".")
    blocks.append(table)
    return blocks


def _rate_range(rates: Sequence[float]) -> str:
    """One figure, or the range of a model's no-wait rate measured in several runs."""
    lo, hi = min(rates), max(rates)
    return fmt_num(lo) if hi <= lo * 1.02 else f"{fmt_num(lo)}-{fmt_num(hi)}"


def _baseline_noise(rates: Sequence[float], runs: Sequence[dict], task: str) -> str:
    """A sentence on how far the model's own rate moved between its baseline runs (one per benchmark
    command), when that is more than 5% or a run's AU came out above 100%: AU differences smaller than that
    are noise, not the data path."""
    over = [r for r in runs if params(r).get("task") == task and (figure(r, "au") or 0) > 1.0]
    moved = (max(rates) - min(rates)) / min(rates) if rates and min(rates) > 0 else 0.0
    if moved <= 0.05 and not over:
        return ""
    text = f" Its own rate, measured once per benchmark command, moved by {fmt_pct(moved)}"
    if over:
        text += f" and {len(over)} run(s) came out above AU 100% (faster than the baseline of their command)"
    return text + ("; its small steps are bound by the host that launches them: AU differences smaller than that "
                   "are noise, not the data path.")


def ranks_blocks(rows: Sequence[dict]) -> list[Block]:
    """Runs on several GPUs at once: per task the model's no-wait rate per rank, then per configuration each
    rank's rate and AU, the slowest rank's AU (a configuration is fed when every rank is), the ranks' total and
    the CPU cores the slowest rank's process and workers used."""
    train = of_bench(rows, "train")
    synthetic = [r for r in train if is_synthetic(r) and r.get("ranks")]
    runs = [r for r in train if not is_synthetic(r)]
    if not runs:
        return ["Rows from several GPUs without a run from a format: nothing to compare."]
    blocks: list[Block] = []
    table = Table("Several GPUs, one DistributedDataParallel rank and one loader each, per configuration",
                  ["task", "GPUs", "format (stored)", "tier", "cache", "decode", "each rank img/s", "each rank AU",
                   "slowest AU", "total img/s", "cores (slowest rank)", "what limits it"], [])
    for task in sorted({params(r).get("task") for r in runs}):
        base = [x["per_s"] for r in synthetic if params(r).get("task") == task for x in r["ranks"]]
        mine = [r for r in runs if params(r).get("task") == task]
        best = max(typical(mine), key=lambda r: figure(r, "au") or 0)  # repeated runs at their median
        p = params(best)
        gpus = p.get("gpus")
        blocks.append(f"{p.get('model')} {task} on {gpus} x {p.get('accelerator')}"
                      + (f": each rank consumes {_rate_range(base)} img/s when it never waits" if base else "")
                      + f". Best: {best.get('format')} with {p.get('decode')} decoding, slowest rank at AU "
                      f"{fmt_pct(figure(best, 'au'))}, {fmt_num(best.get('total_per_s'))} img/s in all; "
                      + ("every rank fed." if (figure(best, "au") or 0) >= AU_TARGET else
                         f"below {AU_TARGET:.0%}: not fed."))
        for r in sorted(mine, key=lambda r: (str(params(r).get("decode")), str(r.get("format")))):
            q, ranks = params(r), r.get("ranks") or []
            how = stored(r)
            table.rows.append([str(task), str(q.get("gpus")), str(r.get("format")) + (f" ({how})" if how else ""),
                               tier_label(r), "cold" if q.get("cold") else "warm (--no-cold)",
                               loader_label(r), " / ".join(fmt_num(x["per_s"]) for x in ranks),
                               " / ".join(fmt_pct(x["au"]) for x in ranks), fmt_pct(figure(r, "au")),
                               fmt_num(r.get("total_per_s")), _cores(r), limit_text(r)])
    blocks.append(table)
    return blocks


#: Datasets reported in sections of their own, after the ImageNet answer: title and blocks.
SIDE_SECTIONS = {"ranks": ("Several GPUs at once (bench train --gpus N)", ranks_blocks),
                 "cifar": ("CIFAR-10 into a CIFAR ResNet", cifar_blocks),
                 "ptb": ("Penn Treebank into an LSTM language model", ptb_blocks)}


def side_sections(rows: Sequence[dict]) -> list[Section]:
    sections = []
    for name, (title, blocks) in SIDE_SECTIONS.items():
        mine = [r for r in rows if side_dataset(r) == name]
        if mine:
            sections.append(Section(title, blocks(mine)))
    return sections


def bytes_per_image(rows: Sequence[dict]) -> dict[Any, float]:
    """Mean stored bytes per image, by the dataset's stored size (``params.resize``; None = as captured)."""
    sizes = defaultdict(list)
    for r in rows:
        b = r.get("sample_bytes")
        if b and plain(r):
            sizes[stored_size(r)].append(b)
    return {k: statistics.median(v) for k, v in sizes.items()}


def decode_rate_per_core(rows: Sequence[dict], task: str = "train", resize: int | None = None
                         ) -> tuple[float, str] | None:
    """Images/s one CPU core prepares for ``task`` from images stored at ``resize`` (None: as captured), and
    where the figure comes from.

    Two sources. A CPU-decode loop of ``task`` on a measured tier that was starved (AU < target): its images/s
    per worker is the workers' own rate, for exactly this task's transform. The read benchmark with decode +
    RandomResizedCrop + flip (the training transform), at the largest worker count measured: workers share
    the cores, memory bandwidth and caches with each other and the main process, so one worker alone is
    faster per core than a machine full of them, and sizing a machine from it would promise too few cores.
    Training prefers the read benchmark, inference the loop (its centre crop is cheaper than the training
    augmentation).
    """
    reads = [r for r in of_bench(rows, "read") if params(r).get("decode") and r.get("median")
             and stored_at(r, resize) and r.get("valid", True)]
    # Warm-cache reads measure the CPU, not the disk; use them when there are any.
    warm = [r for r in reads if params(r).get("cache") == "warm"]
    from_read = None
    if warm or reads:
        pool = warm or reads
        r = max(pool, key=lambda r: (max(1, int(params(r).get("workers") or 1)), r["median"]))
        workers = max(1, int(params(r).get("workers") or 1))
        alone = [x["median"] for x in pool if max(1, int(params(x).get("workers") or 1)) == 1]
        note = f"; one worker alone: {fmt_num(max(alone))} img/s" if alone and workers > 1 else ""
        from_read = (r["median"] / workers, f"read benchmark, {r.get('format')} with decode + RandomResizedCrop + "
                                            f"flip, {fmt_num(r['median'])} img/s with {workers} worker(s){note}")
    starved = []
    for r in of_bench(rows, "train"):
        p = params(r)
        au = figure(r, "au")
        if p.get("decode") == "cpu" and p.get("task") == task and au is not None and au < AU_TARGET \
                and p.get("workers") and r.get("median") and r.get("mode") == "measured" \
                and stored_at(r, resize):
            starved.append((r["median"] / p["workers"], r))
    from_loop = None
    if starved:
        rate, r = max(starved, key=lambda x: x[0])
        from_loop = (rate, f"the {task} loop fed by {r.get('format')} on {tier_label(r)}, CPU-bound at "
                           f"{fmt_num(r['median'])} img/s with {params(r)['workers']} workers")
    first, second = (from_read, from_loop) if task == "train" else (from_loop, from_read)
    return first or second


def tier_caps(rows: Sequence[dict]) -> dict[str, tuple[float, str]]:
    """Read MB/s each tier can give: the emulated profile's cap, else the best read-benchmark MB/s measured."""
    from gpufeed.bench import tiers as tier_profiles

    caps: dict[str, tuple[float, str]] = {}
    for r in rows:
        lim = r.get("tier_limits")
        if r.get("mode") == "emulated" and lim and lim.get("mb_per_s"):
            caps[r["tier"]] = (lim["mb_per_s"], "profile cap")
    for r in of_bench(rows, "read"):
        mbps = figure(r, "mb_per_s")
        # Only cold reads of stored bytes say what the disk gives (warm ones come from the page cache).
        if r.get("mode") == "measured" and mbps and params(r).get("cache") == "cold" \
                and not params(r).get("decode") and mbps > caps.get(r["tier"], (0, ""))[0]:
            caps[r["tier"]] = (mbps, "measured cold read")
    host = [r["host_disk"] for r in rows if isinstance(r.get("host_disk"), dict) and "rand_128k_x16" in r["host_disk"]]
    if host:
        # Random 128 KiB reads from 16 threads: the pattern of 16 workers reading ~120 KB records.
        mbps = statistics.median(h["rand_128k_x16"]["mb_per_s"] for h in host)
        caps["host disk"] = (mbps, "measured, cold 128 KiB random reads x16 (the disk emulation ran on)")
    for name in ("nvme", "ssd", "ultra"):
        if name not in caps and name in tier_profiles.PROFILES:
            caps[name] = (tier_profiles.PROFILES[name].limits().bytes_per_s / MB, "published profile")
    return caps


def answer(rows: Sequence[dict], resize_to: int = 160) -> list[Block]:
    """The plain-language answer, as paragraphs and bullet lists."""
    blocks: list[Block] = []
    ds = demands(rows)
    if not ds:
        blocks.append("These results hold no training benchmark (`gpufeed bench train`), so they cannot say "
                      "whether storage keeps an accelerator busy; only the read and conversion figures below apply.")
    for d in ds:
        tr = train_rows_for(rows, d)
        kind = "an emulated" if d.emulated else "a measured"
        head = (f"**ResNet-50 {d.task} on {d.accelerator}** ({kind} accelerator): it consumes "
                f"{fmt_num(d.images_per_s)} img/s when it never waits for data.")
        if not tr:
            blocks.append(head + " No format was fed to it in these results.")
            continue
        blocks.append(head + " " + _recommendation(rows, tr))
        blocks.append(au_matrix(tr, d))
        blocks.extend(_gpus_fed_line(rows, d))
        blocks.extend(_cores_answer(rows, d, resize_to))
    blocks.extend(_gpus_fed(rows))
    blocks.extend(_bandwidth_answer(rows, ds, resize_to))
    blocks.extend(sized_disks(rows, ds, resize_to)[0])
    return blocks


def _fed_up_to(au_by_count: dict[int, float]) -> tuple[int, int | None]:
    """``(N, first missed)`` for the slowest rank's AU measured with each GPU count: N GPUs are fed where every
    count measured up to N reached :data:`AU_TARGET` (4 ranks at 0.93 beside 3 at 0.88, the same loader in runs
    a minute apart, make a disk that feeds 2, not 4), and the first count that missed (None: none did)."""
    missed = min((n for n, au in au_by_count.items() if au < AU_TARGET), default=None)
    return max((n for n in au_by_count if missed is None or n < missed), default=0), missed


def _tier_fed(formats: dict[str, dict[int, float]], recipes: dict[str, str] | None = None
              ) -> list[tuple[int, dict[int, tuple[float, str]]]]:
    """How many GPUs a tier feeds from the AU each format gave at each GPU count, and the counts that say so
    (``{n: (AU, format)}``), for each way the records were stored (``recipes[format]``: as captured, ``--resize
    256``, ...), the furthest-reaching first. Within one stored size each format is judged on its own figures, the
    counts it was not measured with taken from the format of the same records that did best there: a format
    measured with 4 GPUs only does not feed 4 where 3 missed from every format measured with 3, nor does a format
    that missed with 3 feed 4 because another format fed 3. Records stored otherwise ask other bytes and decoding
    of the disk and cores, so their counts fill none of these (4 inference ranks fed from records stored at 160 px
    are not held back by 2 ranks that missed from the captured photos). A stored size's answer is the format whose
    counts reach furthest (on a tie, the one measured with more counts itself, then the one with the higher AU at
    the answer's count)."""
    recipes = recipes or {}
    by_recipe: dict[str, dict[str, dict[int, float]]] = defaultdict(dict)
    for fmt, aus in formats.items():
        by_recipe[recipes.get(fmt, "")][fmt] = aus
    answers = []
    for group in by_recipe.values():
        best: dict[int, tuple[float, str]] = {}
        for fmt, aus in group.items():
            for n, au in aus.items():
                if n not in best or au > best[n][0]:
                    best[n] = (au, fmt)
        candidates = []
        for fmt, aus in group.items():
            counts = {**best, **{n: (au, fmt) for n, au in aus.items()}}
            most, _ = _fed_up_to({n: au for n, (au, _f) in counts.items()})
            candidates.append((most, len(aus), counts[most][0] if most else 0.0, counts))
        answers.append(max(candidates, key=lambda a: a[:3]))
    answers.sort(key=lambda a: a[:3], reverse=True)
    return [(most, counts) for most, _own, _au, counts in answers]


def _measured_with(counts: dict[int, tuple[float, str]]) -> str:
    """``measured with 1, 2 GPUs``, or where each count's figure came from another format or stored size, which:
    ``measured with 1, 2 GPUs from recordio and 3 from lmdb``."""
    froms = list(dict.fromkeys(counts[n][1] for n in sorted(counts)))
    if len(froms) == 1:
        return f"measured with {', '.join(map(str, sorted(counts)))} GPU{'' if list(counts) == [1] else 's'}"
    parts = []
    for f in froms:
        ns = [n for n in sorted(counts) if counts[n][1] == f]
        noun = "" if parts else (" GPU" if ns == [1] else " GPUs")
        parts.append(f"{', '.join(map(str, ns))}{noun} from {f}")
    return "measured with " + " and ".join(parts)


#: How the GPUs-fed table names a count's figure from a row that did not count what its workers made.
LOOPS_RATE = "loop's rate"


def real_gpus_fed(rows: Sequence[dict]) -> list[Block]:
    """How many real GPUs of one node each disk fed, from `bench train` runs with 1, 2, ... ranks (``--gpus N``)
    of one model, task and GPU: per tier and format, the most ranks N such that the slowest rank reached 90% AU
    with every count measured up to N (the best configuration for each count, named with the loader settings that
    tell it from the others: :func:`loader_label`), every count measured with its slowest rank's AU, and what
    limited the first count that missed. Nothing where no run used more than one
    GPU: one GPU alone says nothing about the node."""
    train = [r for r in of_bench(rows, "train") if not is_synthetic(r) and not accelerator_emulated(r)
             and side_dataset(r) in (None, "ranks") and figure(r, "au") is not None]
    if not any((params(r).get("gpus") or 1) > 1 for r in train):
        return []
    warm = [r for r in train if served_from_cache(r)]
    asked_warm = [r for r in train if not params(r).get("cold")]  # --no-cold: the page cache, by request
    train = [r for r in train if params(r).get("cold") and not served_from_cache(r)]
    def where(r):
        p, how = params(r), stored(r)
        return (str(p.get("model")), str(p.get("task")), str(accelerator(r)), tier_label(r),
                str(r.get("format")) + (f" ({how})" if how else "")), int(p.get("gpus") or 1)

    # Where rows that counted what their workers made exist for a count, only they count: the others' rates may
    # include batches made before their timed steps.
    counted = {where(r) for r in train if counts_made(r)}
    train = [r for r in train if counts_made(r) or where(r) not in counted]
    # Per model, task, GPU (a CUDA graph's apart: another demand), tier, format and GPU count: the configuration
    # (decode path and loader settings) whose runs' median was best, with every run's AU.
    groups: dict[tuple, dict[int, tuple[dict, list[float]]]] = defaultdict(dict)
    for r, runs in runs_of_each_config(train):
        key, n = where(r)
        if n not in groups[key] or figure(r, "au") > figure(groups[key][n][0], "au"):
            groups[key][n] = (r, runs)
    table = Table("GPUs fed, measured with real GPUs (bench train --gpus N: one DistributedDataParallel rank and "
                  "one loader per GPU, reading cold)",
                  ["model", "task", "GPU", "tier", "format", "GPUs fed (every rank AU >= 90% with each count up to it)",
                   "slowest rank's AU with N GPUs", "what limits the first N below"], [])
    # Per model, task, GPU and tier: each format's AU at each count it was measured with.
    of_format: dict[tuple, dict[str, dict[int, float]]] = defaultdict(dict)
    recipes: dict[str, str] = {}  # each format label's stored size ("" as captured)
    for key in sorted(groups, key=lambda k: (k[1] != "train", k)):
        model, task, gpu, tier, fmt = key
        by_n = {n: r for n, (r, _runs) in groups[key].items()}
        most, missed = _fed_up_to({n: figure(r, "au") for n, r in by_n.items()})
        measured = ", ".join(f"{n}: {fmt_pct(figure(r, 'au'))} ("
                             + "; ".join(filter(None, [loader_label(r), fmt_runs(runs),
                                                       None if counts_made(r) else LOOPS_RATE])) + ")"
                             for n, (r, runs) in sorted(groups[key].items()))
        table.rows.append([model, task, gpu, tier, fmt, str(most), measured,
                           limit_text(by_n[missed]) if missed is not None else "-"])
        of_format[(model, task, gpu, tier)][fmt] = {n: figure(r, "au") for n, r in by_n.items()}
        recipes[fmt] = stored(by_n[min(by_n)]) or ""
    sentences = []
    for where, formats in of_format.items():
        model, task, gpu, tier = where
        (most, counts), *others = _tier_fed(formats, recipes)
        doing = {"train": "training", "infer": "running inference of"}.get(task, task)
        sentence = (f"{tier} feeds **{most}** {gpu}{'s' if most != 1 else ''} {doing} {model}"
                    + (f" (from {counts[most][1]})" if most else "") + f", {_measured_with(counts)}")
        elsewise = []  # the same disk's answer for records stored otherwise
        for n, other in others:
            how = recipes[next(iter(other.values()))[1]]
            elsewise.append(f"{'stored ' + how if how else 'as captured'}: {n}" + (f" from {other[n][1]}" if n else "")
                            + f", {_measured_with(other)}")
        sentences.append(sentence + (f" ({'; '.join(elsewise)})" if elsewise else ""))
    blocks = ["**GPUs fed, measured with real GPUs on one node:** " + "; ".join(sentences) + ".", table]
    if any(not counts_made(r) for by_n in groups.values() for r, _runs in by_n.values()):
        blocks.append(f"\"{LOOPS_RATE}\": a run written before `bench train` counted what the loader's workers made "
                      "over the timed steps; its figure is the rate its loop took, which over a short window includes "
                      "the batches they had made before it, so it may be higher than the workers keep up "
                      "(docs/loader.md, 'What a run's rate counts').")
    if warm:
        blocks.append(f"Left out: {len(warm)} run{'s' if len(warm) > 1 else ''} marked cold whose disk read under "
                      f"{COLD_DEVICE_SHARE:.0%} of the bytes of the records consumed (served from the page cache: "
                      + ", ".join(sorted({f"{params(r).get('gpus') or 1} GPU{'s' if (params(r).get('gpus') or 1) > 1 else ''}"
                                          f" {params(r).get('decode')} {fmt_pct(device_share(r))}" for r in warm}))
                      + ").")
    if asked_warm:
        blocks.append(f"Left out: {len(asked_warm)} run{'s' if len(asked_warm) > 1 else ''} with the data in the page "
                      "cache by request (`--no-cold`): what the loader feeds with the disk out of the way, listed "
                      "under 'Several GPUs on one node'.")
    return blocks


def _gpus_fed_line(rows: Sequence[dict], d: Demand) -> list[Block]:
    """One sentence under a task's AU matrix: how many of its accelerators each disk keeps at >= 90% AU
    (`gpufeed bench feed` rows of that task and accelerator), per stored record size; nothing without them."""
    acc = d.accelerator.lower()
    feed = [r for r in of_bench(rows, "feed") if params(r).get("task") == d.task and r.get("valid", True)
            and str(params(r).get("accelerator") or "").lower() in acc]
    if not feed:
        return []
    table = Table(f"GPUs fed per disk at AU >= {AU_TARGET:.0%} ({d.accelerator} {d.task}, emulated accelerators "
                  "reading cold, `gpufeed bench feed`)", ["record", "format", "disk", "size", "GPUs fed"], [])
    for r in sorted(feed, key=lambda r: (-(r.get("record_bytes") or 0), -(r.get("gpus_fed") or 0),
                                         str(r.get("tier")), str(r.get("format")))):
        lim = r.get("tier_limits") or {}
        fed = f">= {r.get('gpus_fed')}" if r.get("capped_at_max") else str(r.get("gpus_fed"))
        table.rows.append([fmt_bytes(r.get("record_bytes")), str(r.get("format")), tier_label(r),
                           f"{fmt_num(lim['size_gib'])} GiB" if lim.get("size_gib") else "measured mount", f"**{fed}**"])
    table.note = "Details under 'Accelerators fed per disk'."
    return [table]


def _gpus_fed(rows: Sequence[dict]) -> list[Block]:
    """The `gpufeed bench feed` rows: how many emulated accelerators each tier kept at >= 90% AU."""
    from gpufeed.bench.feed import caps_shortfall

    feed = of_bench(rows, "feed")
    if not feed:
        return []
    t = Table("Accelerators fed per disk (gpufeed bench feed: emulated accelerators reading stored bytes)",
              ["task", "record", "tier", "disk", "format", "accelerator", "fed at AU >= 90%", "first N below", "note"],
              [])
    for r in sorted(feed, key=lambda r: (str(params(r).get("task")), -(r.get("record_bytes") or 0),
                                         str(r.get("tier")), str(r.get("format")))):
        lim = r.get("tier_limits") or {}
        disk = (f"{fmt_num(lim.get('size_gib'))} GiB: {fmt_num(lim.get('mb_per_s'))} MB/s, "
                f"{fmt_num(lim.get('iops'))} IOPS" if lim else "measured mount")
        note = []
        if r.get("cpu_limited"):
            note.append("this machine's CPUs were busy > 90%: the disk may feed more")
        if r.get("capped_at_max"):
            cold, top = r.get("cold_max_gpus"), params(r).get("max_gpus")
            note.append(f"search stopped at {cold}: the dataset holds records for {cold} to read cold, the disk may "
                        "feed more" if cold is not None and cold < top else f"search stopped at {top}")
        shortfall = caps_shortfall(r)
        if shortfall:
            note.append(shortfall)
        if not r.get("valid", True):
            note.append("invalid: " + str(r.get("invalid_reason")))
        t.rows.append([str(params(r).get("task")), fmt_bytes(r.get("record_bytes")), tier_label(r), disk,
                       str(r.get("format")), str(params(r).get("accelerator")), str(r.get("gpus_fed")),
                       str(r.get("first_failing") or "-"), "; ".join(note) or "-"])
    return [t]


def _recommendation(rows: Sequence[dict], tr: Sequence[dict]) -> str:
    """One line: the slowest disk measured that keeps the accelerator at >= 90% AU, with its format, decoding,
    stored size and workers; or, when nothing passes, the closest configuration. A configuration run several
    times counts at its median run."""
    tr = typical(tr)
    passing = [r for r in tr if (figure(r, "au") or 0) >= AU_TARGET]
    if not passing:
        best = max(tr, key=lambda r: figure(r, "au") or 0)
        found = row_limit(best) or {}
        what = {"disk": "the disk limits it: a faster disk (the sizes below)",
                "cpu": "the CPU limits it: more cores, or the GPU's JPEG engines (the cores below)",
                "engines": "the JPEG engines limit it: more CPU workers beside them (decode hybrid)",
                "main thread": "the rank's own main thread limits it",
                BESIDE: "not the disk: its batches came in time and its own steps ran slower beside the loader's "
                        "work"}.get(found.get("resource"))
        limited = (f" What its row measured: {found['text']}" + (f"; {what}." if what else ".") if found else
                   " Faster disks, more cores or smaller stored images: see the disk sizes and the cores below.")
        return (f"**Recommendation:** nothing measured reaches {AU_TARGET:.0%} AU; the closest is "
                f"{describe_config(best)} at {fmt_pct(figure(best, 'au'))}.{limited}")
    caps = tier_caps(rows)

    def cost(r):  # slowest disk first, images as captured before resized ones, then the best AU
        return caps.get(r.get("tier"), (math.inf, ""))[0], stored(r) is not None, -(figure(r, "au") or 0)

    pick = min(passing, key=cost)
    workers = params(pick).get("workers")
    return (f"**Recommendation:** {describe_config(pick)}, {workers} workers: AU {fmt_pct(figure(pick, 'au'))}, the "
            f"slowest disk measured that keeps it at >= {AU_TARGET:.0%} ({len(passing)} of {len(tr)} configurations "
            "pass; all of them under 'Every configuration measured').")


def au_matrix(tr: Sequence[dict], d: Demand) -> Table:
    """Format (and stored size) x tier: the best AU measured (of a configuration run several times, its median
    run), with the decode path that gave it; bold at >= 90%."""
    tiers = sorted({tier_label(r) for r in tr})
    keys = sorted({(str(r.get("format")), stored(r) or "") for r in tr})
    t = Table(f"AU of ResNet-50 {d.task} on {d.accelerator}, best decode path per cell",
              ["format", "stored", *tiers], [])
    for fmt, size in keys:
        cells = []
        for tier in tiers:
            here = [r for r in tr if str(r.get("format")) == fmt and (stored(r) or "") == size
                    and tier_label(r) == tier]
            cold = [r for r in here if params(r).get("cold") is not False]
            if not here:
                cells.append("")
                continue
            best = max(typical(cold or here), key=lambda r: figure(r, "au") or 0)
            au = figure(best, "au")
            text = f"{fmt_pct(au)} ({params(best).get('decode')}{'' if cold else ', page-cached'})"
            cells.append(f"**{text}**" if au is not None and au >= AU_TARGET else text)
        t.rows.append([fmt, size or "as captured", *cells])
    t.note = (f"Cold page cache unless marked. Tiers marked * are emulated. Bold: AU >= {AU_TARGET:.0%}. Every run is "
              "listed under 'Every configuration measured'.")
    return t


def every_configuration(rows: Sequence[dict]) -> list[Block]:
    """Per demand, every configuration measured, passing ones first."""
    blocks: list[Block] = []
    for d in demands(rows):
        tr = sorted(train_rows_for(rows, d), key=lambda r: -(figure(r, "au") or 0))
        if not tr:
            continue
        blocks.append(f"ResNet-50 {d.task} on {d.accelerator} ({fmt_num(d.images_per_s)} img/s without waiting):")
        blocks.append([f"{'passes' if (figure(r, 'au') or 0) >= AU_TARGET else 'below the mark'}: "
                       f"{describe_config(r)}: AU {fmt_pct(figure(r, 'au'))}, {fmt_num(r['median'])} img/s"
                       for r in tr])
    return blocks


def _cores_answer(rows: Sequence[dict], d: Demand, resize_to: int) -> list[Block]:
    rate = decode_rate_per_core(rows, d.task)
    if rate is None:
        text = (f"CPU cores for {d.task}: no CPU-bound measurement in these results (every CPU-decode run kept "
                "up, or none ran), so the cores needed cannot be derived; run `gpufeed bench read` with decode.")
    else:
        per_core, source = rate
        need = math.ceil(AU_TARGET * d.images_per_s / per_core)
        text = (f"CPU cores for {d.task}: estimated from the read benchmark, one core prepares about "
                f"{fmt_num(per_core)} img/s ({source}), so {AU_TARGET:.0%} of this demand needs about **{need} "
                "cores** for decoding alone, plus one for the process driving the accelerator.")
    captured = [r for r in train_rows_for(rows, d) if params(r).get("decode") == "cpu" and stored(r) is None
                and r.get("mode") == "measured" and (figure(r, "au") or 0) >= AU_TARGET]
    if captured and rate is not None:
        best = max(captured, key=lambda r: figure(r, "au") or 0)
        text += (f" Measured in the training loop, as captured: {params(best).get('workers')} workers already kept "
                 f"it at AU {fmt_pct(figure(best, 'au'))} ({describe_config(best)}{_busy(best)}), so the "
                 f"measured {params(best).get('workers')} are enough where the estimate says {need}: trust the "
                 "measurement, the estimate counts a core's rate outside the loop.")
    ran = [r for r in train_rows_for(rows, d) if params(r).get("decode") == "cpu" and stored_at(r, resize_to)
           and r.get("mode") == "measured"]
    if ran:
        best = max(ran, key=lambda r: figure(r, "au") or 0)
        if (figure(best, "au") or 0) >= AU_TARGET:
            text += (f" Stored at --resize {resize_to}, {params(best).get('workers')} workers already kept it at AU "
                     f"{fmt_pct(figure(best, 'au'))}, so at most that many cores.")
        else:
            small = decode_rate_per_core(rows, d.task, resize_to)
            if small:
                text += (f" Stored at --resize {resize_to}, a core prepares {fmt_num(small[0])} img/s, so about "
                         f"{math.ceil(AU_TARGET * d.images_per_s / small[0])} cores.")
    paths = {"gpu": "nvJPEG on the SMs", "hw": "the GPU's JPEG engines", "hybrid": "CPU workers and the JPEG engines"}
    for decode, what in paths.items():
        ran = [r for r in train_rows_for(rows, d) if params(r).get("decode") == decode]
        if ran:
            best = max(ran, key=lambda r: figure(r, "au") or 0)
            workers = params(best).get("workers")
            share = figure(best, "cpu_share")
            cores = (f"{workers} DataLoader workers" + (" only reading bytes" if decode != "hybrid" else
                                                         f" decoding {fmt_pct(share)} of each batch" if share is not None
                                                         else "")
                     if workers else "no DataLoader workers")
            text += (f" Decoding with `{decode}` ({what}) reached AU {fmt_pct(figure(best, 'au'))} at best "
                     f"({describe_config(best)}) with {cores}, plus the main process{_busy(best)}.")
    return [text]


def _busy(row: dict) -> str:
    """``"; 7.2 cores busy in all"`` where the run measured its CPU time (the process driving the accelerator
    and its DataLoader workers), else nothing."""
    cores = figure(row, "cpu_cores")
    return "" if cores is None else f"; {cores:.1f} cores busy in all, measured"


def _bandwidth_answer(rows: Sequence[dict], ds: list[Demand], resize_to: int) -> list[Block]:
    sizes = bytes_per_image(rows)
    if not sizes or not ds:
        return []
    as_captured = sizes.get(None) or max(sizes.values())
    small = sizes.get(resize_to)
    if small:
        small_note = f"measured on a dataset stored with --resize {resize_to}"
    else:
        stored_side = _stored_side(rows)
        small = as_captured * (resize_to / stored_side) ** 2
        small_note = (f"estimated: JPEG bytes scale roughly with pixel count, ({resize_to}/{stored_side})^2 of "
                      "the stored images; build one with --resize to measure it")
    caps = tier_caps(rows)
    blocks: list[Block] = [
        f"Storage bandwidth: images here average {fmt_bytes(as_captured)}; stored with --resize {resize_to} "
        f"about {fmt_bytes(small)} ({small_note}). Each tier's read bandwidth caps the images/s it can serve, "
        "and so the AU it allows (before any CPU limit):"]
    table = Table("Storage bandwidth needed and AU ceiling per tier",
                  ["tier", "read MB/s", "source"] + [f"{d.task} on {d.accelerator}: needs MB/s (full / {resize_to})"
                                                      for d in ds]
                  + [f"AU ceiling {d.task} (full / {resize_to})" for d in ds], [])
    for tier, (mbps, source) in sorted(caps.items(), key=lambda kv: -kv[1][0]):
        cells = [tier, fmt_num(mbps), source]
        cells += [f"{fmt_num(d.images_per_s * as_captured / MB)} / {fmt_num(d.images_per_s * small / MB)}"
                  for d in ds]
        cells += [f"{fmt_pct(min(1.0, mbps * MB / as_captured / d.images_per_s))} / "
                  f"{fmt_pct(min(1.0, mbps * MB / small / d.images_per_s))}" for d in ds]
        table.rows.append(cells)
    blocks.append(table)
    compared = _resize_comparison(rows)
    if compared:
        blocks.append("Measured with the smaller stored images (same loop, format, tier and decoding):")
        blocks.append(compared)
    return blocks


#: GPU counts the sized-disk table answers for.
GPU_COUNTS = (1, 2, 4, 8)


#: Images a disk sized for ImageNet-1k must hold (train and val).
IMAGENET_IMAGES = 1_281_167 + 50_000


def sized_disks(rows: Sequence[dict], ds: list[Demand], resize_to: int) -> tuple[list[Block], list[Block]]:
    """The smallest disk of each kind that feeds 1, 2, 4 and 8 accelerators, by the vendors' formulas: each
    accelerator asks its no-wait images/s, each image one random read of the stored image's bytes (one request
    up to the tier's I/O unit). A capacity model, not a measurement: the AU rows on emulated tiers check it.
    Returns (one sentence per demand and image size, for the answer; the tables, for a section of their own)."""
    from gpufeed.bench import tiers as tier_profiles

    sizes = bytes_per_image(rows)
    if not sizes or not ds:
        return [], []
    as_captured = sizes.get(None) or max(sizes.values())
    small = sizes.get(resize_to) or as_captured * (resize_to / _stored_side(rows)) ** 2
    sentences: list[Block] = []
    tables: list[Block] = []
    for d in ds:
        for label, nbytes in (("as captured", as_captured), (f"--resize {resize_to}", small)):
            # The disk must hold the dataset too: ImageNet-1k at this stored size, one format.
            hold = math.ceil(IMAGENET_IMAGES * nbytes / GiB)
            table = Table(f"Smallest disk that holds ImageNet-1k ({hold:,} GiB at {fmt_bytes(nbytes)} an image) and "
                          f"feeds N x {d.accelerator} ({d.task}, images {label})",
                          ["disk", *[f"{n} GPU{'s' if n > 1 else ''}" for n in GPU_COUNTS], "per-disk max"], [])
            feeds_one = []
            for name, prof in tier_profiles.PROFILES.items():
                ops = math.ceil(nbytes / prof.io_unit)
                cells = []
                for n in GPU_COUNTS:
                    gib = prof.smallest_gib(n * d.images_per_s * nbytes / MB, n * d.images_per_s * ops)
                    fixed = not prof.iops_per_gib and not prof.mbps_per_gib
                    gib = None if gib is None else max(gib, hold)
                    cells.append("-" if gib is None else ("yes (fixed)" if fixed else f"{int(gib):,} GiB"))
                    if n == 1 and gib is not None:
                        feeds_one.append(f"{name} {'(fixed size)' if fixed else f'of {int(gib):,} GiB'}")
                top = prof.limits(1e9)
                table.rows.append([name, *cells, f"{fmt_num(top.bytes_per_s / MB)} MB/s, {fmt_num(top.iops)} IOPS"])
                if prof.provisioning is not None:
                    # Bought performance: the smallest size that may carry the IOPS, and what to provision.
                    unit = "MiB/s" if prof.mb != MB else "MB/s"
                    bought = [prof.provisioned_for(n * d.images_per_s * nbytes / MB, n * d.images_per_s * ops)
                              for n in GPU_COUNTS]
                    bought = [None if b is None else (max(b[0], hold), *b[1:]) for b in bought]
                    cells = ["-" if b is None else f"{int(b[0]):,} GiB + {fmt_num(b[1])} IOPS, {fmt_num(b[2])} {unit}"
                             for b in bought]
                    if bought[0] is not None:
                        feeds_one.append(f"{name} of {int(bought[0][0]):,} GiB provisioned with "
                                         f"{fmt_num(bought[0][1])} IOPS and {fmt_num(bought[0][2])} {unit}")
                    prov = prof.provisioning
                    table.rows.append([f"{name}, provisioned", *cells,
                                       f"{fmt_num(prov.mbps_max)} {unit}, {fmt_num(prov.iops_max)} IOPS"])
            table.note = ("By the vendors' formulas (min(base + per-GiB x size, per-disk max)), and never smaller "
                          f"than the {hold:,} GiB that ImageNet-1k's {IMAGENET_IMAGES:,} images take at this size; '-' "
                          "= no size of that disk reaches it; a fixed-size disk (local NVMe) must hold it as sold. A "
                          "model of the disk alone: an instance may cap lower, and the CPU or the loader may limit "
                          "first (see the AU rows).")
            need = d.images_per_s * nbytes / MB
            sentences.append(f"Disks sized as bought: one {d.accelerator} {d.task} ({fmt_num(d.images_per_s)} img/s) "
                             f"from images {label} needs {fmt_num(need)} MB/s of random reads; by the vendors' "
                             "formulas the smallest disks that feed one are "
                             + (", ".join(feeds_one) if feeds_one else "none of the profiles")
                             + " (2, 4 and 8 GPUs: the tables under 'Disks sized as bought').")
            tables.append(table)
    return sentences, tables


def _resize_comparison(rows: Sequence[dict]) -> list[str]:
    """One line per training row on resized images that has an as-captured twin."""
    def key(r):
        p = params(r)
        return p.get("task"), r.get("format"), loader_label(r), r.get("tier"), p.get("cold"), accelerator(r)

    full = {key(r): r for r in of_bench(rows, "train") if not is_synthetic(r) and not stored(r)}
    lines = []
    for r in of_bench(rows, "train"):
        twin = full.get(key(r))
        size = stored_size(r)
        if size and plain(r) and twin is not None and twin.get("median") and r.get("median"):
            task, fmt, decode, *_ = key(r)
            lines.append(f"{task}, {fmt} on {tier_label(r)}, {decode} decode: {fmt_num(r['median'])} img/s stored at "
                         f"--resize {size} vs {fmt_num(twin['median'])} as captured "
                         f"({fmt_ratio(r['median'] / twin['median'])}); AU {fmt_pct(figure(twin, 'au'))} -> "
                         f"{fmt_pct(figure(r, 'au'))}; {fmt_bytes(r.get('sample_bytes'))} vs "
                         f"{fmt_bytes(twin.get('sample_bytes'))} per image")
    return lines


def _stored_side(rows: Sequence[dict]) -> int:
    """Shorter side of the stored images: the dataset's --resize, else ImageNet's typical 375-500 px (375)."""
    for r in rows:
        if stored_size(r):
            return int(stored_size(r))
    return 375
