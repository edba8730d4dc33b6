"""The storage-tier report's analysis: its rows read, the answers worked out (GPUs fed per disk, cores for
decoding, bandwidth, disks sized as bought), the published finding checked, and the tables, all as the
report's model (:class:`Section` of paragraphs, bullet lists, :class:`Table` and :class:`Plot`).
:mod:`gpufeed.bench.report` assembles them, :mod:`.report_plots` draws the plots and :mod:`.report_render`
writes HTML or Markdown.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

from gpufeed.bench import AU_TARGET, MEMORY_TIER, SYNTHETIC
from gpufeed.errors import ConfigError

#: Tier tried first as the baseline of ratios, when present (the fastest of the published tiers).
PREFERRED_BASELINE = "nvme"
#: "Insensitive to the disk" is confirmed when tiers differ by at most this much (TIERS.md says ~1%; runs on a
#: shared machine move by a few percent).
INSENSITIVE_TOLERANCE = 0.03
MB = 1e6
GiB = 1 << 30

#: The published finding of shared/TIERS.md, claim by claim: (bench, task, faster tier, slower tier, how much
#: faster the first is, in words).
PUBLISHED = (
    ("convert", None, "nvme", "ssd", 0.25, "Preprocessing: local NVMe ~25% faster than SSD cloud disk"),
    ("convert", None, "ssd", "ultra", 0.10, "Preprocessing: SSD cloud disk ~10% faster than ultra"),
    ("train", "train", "nvme", "ultra", 0.01, "Training: insensitive to the disk (~1%)"),
    ("train", "infer", "nvme", "ultra", 0.15, "Inference: ~15% slower on ultra disk"),
)


# ---------------------------------------------------------------------------------------------- reading rows


def params(row: dict) -> dict:
    return row.get("params") or {}


def stored_size(row: dict) -> int | None:
    """The dataset's stored shorter side (``--resize``), None when not resized (as captured, or stored another
    way: see :func:`stored`)."""
    return params(row).get("resize", row.get("resize"))


def stored(row: dict) -> str | None:
    """How the dataset's images are stored, as the ``gpufeed convert`` flags that store them (``--resize 160``,
    ``--size 224x224 --center-crop``), None when as captured."""
    store = params(row).get("store", row.get("store"))
    if store:
        return str(store)
    size = stored_size(row)
    return f"--resize {size}" if size else None


def _stored_at(row: dict, resize: int | None) -> bool:
    """Stored only resized to ``resize`` (None: as captured), not also cropped or kept raw."""
    return stored(row) == (f"--resize {resize}" if resize else None)


def _plain(row: dict) -> bool:
    """Stored as captured or only resized: what the figures keyed by :func:`stored_size` compare."""
    return _stored_at(row, stored_size(row))


def figure(row: dict, name: str) -> float | None:
    """The median of ``name``: the row's primary metric or one of its ``metrics``; None when absent.
    ``device_mb_per_s`` is derived where a row has the emulated disk's byte counts: the MB/s it served, reads
    and writes together (to set against the profile's cap)."""
    if row.get("metric") == name:
        return row.get("median")
    block = (row.get("metrics") or {}).get(name)
    if name == "device_mb_per_s" and block is None:
        read, written, wall = (figure(row, k) for k in ("device_read_bytes", "device_written_bytes", "wall_s"))
        return (read + written) / wall / MB if read is not None and written is not None and wall else None
    return block.get("median") if isinstance(block, dict) else None


def fmt_spread(row: dict) -> str:
    """A row's spread over its repeats, or "1 run" where there was only one (a spread of 0.0% would claim a
    precision that a single run cannot show)."""
    if len(row.get("values") or ()) <= 1:
        return "1 run"
    return fmt_pct(row.get("spread"))


def spread(row: dict, name: str | None = None) -> float | None:
    if name is None or row.get("metric") == name:
        return row.get("spread")
    block = (row.get("metrics") or {}).get(name)
    return block.get("spread") if isinstance(block, dict) else None


def of_bench(rows: Iterable[dict], bench: str) -> list[dict]:
    return [r for r in rows if r.get("bench") == bench]


def is_synthetic(row: dict) -> bool:
    return row.get("tier") == MEMORY_TIER or row.get("format") == SYNTHETIC


def accelerator(row: dict) -> str | None:
    """The accelerator a train row measured, with how its model ran where that changes the demand (inference as
    one CUDA graph, ``bench train --cuda-graph``): rows of one accelerator name are compared only like with
    like."""
    name = params(row).get("accelerator")
    return f"{name} (model as a CUDA graph)" if name and params(row).get("cuda_graph") else name


def loader_label(row: dict) -> str:
    """Where a train row decoded, with the loader's variants that rows of one decode path differ by: batch
    read-ahead, a fixed hybrid CPU share, the workers' niceness, and the child-process loader measured on 2026-11-25 (since taken out of
    gpufeed)."""
    p = params(row)
    label = str(p.get("decode") or "-")
    if p.get("read_ahead"):
        label += ", read-ahead"
    if p.get("feed") == "process":
        label += ", child process"
    if p.get("cpu_share_fixed") is not None:
        label += f", CPU share {p['cpu_share_fixed']:.2f}"
    if p.get("worker_nice"):
        label += f", workers at nice {p['worker_nice']}"
    return label


def side_dataset(row: dict) -> str | None:
    """``"ranks"`` for a run on several GPUs at once (``bench train --gpus N``), ``"cifar"`` for a row of the
    CIFAR benchmark (32x32 images, a CIFAR ResNet), ``"ptb"`` for the Penn Treebank language model, None for
    ImageNet on one accelerator. Each is reported in a section of its own, so per-rank figures, small records and
    fast steps never mix with one GPU's ImageNet demand, sizes and core counts."""
    model = str(params(row).get("model", ""))
    if (params(row).get("gpus") or 1) > 1:
        return "ranks"
    if row.get("image") == "cifar" or model.startswith("cifar"):
        return "cifar"
    if row.get("image") == "ptb" or model.startswith("ptb"):
        return "ptb"
    return None


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
                  ["task", "GPUs", "format", "tier", "decode", "each rank img/s", "each rank AU", "slowest AU",
                   "total img/s", "cores (slowest rank)", "what limits it"], [])
    for task in sorted({params(r).get("task") for r in runs}):
        base = [x["per_s"] for r in synthetic if params(r).get("task") == task for x in r["ranks"]]
        mine = [r for r in runs if params(r).get("task") == task]
        best = max(mine, key=lambda r: figure(r, "au") or 0)
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
            table.rows.append([str(task), str(q.get("gpus")), str(r.get("format")), tier_label(r),
                               str(q.get("decode")), " / ".join(fmt_num(x["per_s"]) for x in ranks),
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


def accelerator_emulated(row: dict) -> bool:
    return params(row).get("accelerator_mode") == "emulated"


def tier_label(row: dict) -> str:
    tier = row.get("tier") or "?"
    return f"{tier}*" if row.get("mode") == "emulated" else tier


def storage_tiers(rows: Iterable[dict]) -> list[str]:
    """Tier names in the rows, fastest published first, synthetic 'memory' left out."""
    order = ["nvme", "essd-pl1", "ssd", "essd-pl0", "pd-balanced", "gp3", "ultra"]
    names = {r.get("tier") for r in rows if r.get("tier") and not is_synthetic(r)}
    return sorted(names, key=lambda t: (order.index(t) if t in order else -1, t))


def choose_baseline(rows: Sequence[dict], requested: str | None = None) -> str | None:
    """``requested`` if given (it must appear in the rows); else nvme when present; else the tier with the
    highest median throughput over the read and train rows it has."""
    tiers = storage_tiers(rows)
    if requested:
        if requested not in tiers:
            raise ConfigError(f"--baseline {requested!r} is not a tier in these results; they have "
                              f"{', '.join(tiers) or 'no storage tiers'}")
        return requested
    if PREFERRED_BASELINE in tiers:
        return PREFERRED_BASELINE
    fastest = _fastest_tier((r for r in rows if r.get("bench") in ("read", "train") and not is_synthetic(r)),
                            lambda r: r.get("median"))
    if fastest is not None:
        return fastest
    return tiers[0] if tiers else None


def _fastest_tier(rows: Iterable[dict], speed: Callable[[dict], float | None]) -> str | None:
    """The tier whose rows have the highest median ``speed`` (rows without one left out); None if none has."""
    by_tier = defaultdict(list)
    for r in rows:
        v = speed(r)
        if v:
            by_tier[r["tier"]].append(v)
    return max(by_tier, key=lambda t: statistics.median(by_tier[t])) if by_tier else None


#: Parameters that name paths, which differ from tier to tier for the same configuration.
_PATH_PARAMS = frozenset({"tier_path", "command"})


def _config_key(row: dict) -> tuple:
    """Everything that identifies a configuration except its tier, for matching rows across tiers."""
    p = {k: v for k, v in params(row).items() if k not in _PATH_PARAMS}
    return (row.get("bench"), row.get("format"), row.get("metric"), repr(sorted(p.items(), key=str)))


def ratio_to_baseline(rows: Sequence[dict], baseline: str | None) -> dict[int, float]:
    """``{id(row): row median / the same configuration's median on the baseline tier}`` (time metrics too:
    a ratio above 1 on seconds means slower)."""
    if baseline is None:
        return {}
    base = {_config_key(r): r.get("median") for r in rows if r.get("tier") == baseline}
    out = {}
    for r in rows:
        b = base.get(_config_key(r))
        if b and r.get("median") is not None:
            out[id(r)] = r["median"] / b
    return out


# ---------------------------------------------------------------------------------------------- formatting


def fmt_num(value: float | None, digits: int = 3) -> str:
    """A readable number: thousands separators, ``digits`` significant digits for small values."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if value == 0:
        return "0"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(value)))))
    return f"{value:,.{decimals}f}"


def fmt_pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# ------------------------------------------------------------------------------------------------ the model


@dataclasses.dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclasses.dataclass
class Plot:
    title: str
    png: bytes
    caption: str = ""


Block = Union[str, Table, Plot, list]


@dataclasses.dataclass
class Section:
    """A heading and its blocks in order: paragraphs (str), bullet lists (list of str), tables, plots."""

    title: str
    blocks: list[Block] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Report:
    title: str
    subtitle: str
    sections: list[Section]


# ------------------------------------------------------------------------------------------------ demand


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one accelerator asks of the pipeline for one task: images/s when it never waits for data."""

    accelerator: str
    emulated: bool
    task: str
    images_per_s: float
    batch: int | None


def demands(rows: Sequence[dict]) -> list[Demand]:
    """From the synthetic-baseline train rows: one per accelerator and task, the median over every synthetic
    run of it in the results (each `gpufeed bench train` call measures its own)."""
    found: dict[tuple, list[dict]] = defaultdict(list)
    for r in of_bench(rows, "train"):
        if is_synthetic(r) and r.get("median") is not None:
            found[(accelerator(r), params(r).get("task"))].append(r)
    return [Demand(str(acc), accelerator_emulated(rs[0]), str(task), statistics.median(r["median"] for r in rs),
                   params(rs[0]).get("batch_size")) for (acc, task), rs in found.items()]


def train_rows_for(rows: Sequence[dict], demand: Demand) -> list[dict]:
    return [r for r in of_bench(rows, "train") if not is_synthetic(r)
            and accelerator(r) == demand.accelerator and params(r).get("task") == demand.task]


def describe_config(row: dict) -> str:
    decode = params(row).get("decode")
    notes = [f"{decode} decode"] if decode else []
    if stored(row):
        notes.append(f"stored as {stored(row)}")
    if row.get("bench") == "train" and params(row).get("cold") is False:
        notes.append("page-cached")
    text = f"{row.get('format')} on {tier_label(row)}"
    return f"{text} ({', '.join(notes)})" if notes else text


# --------------------------------------------------------------------------------------------- the answers


def bytes_per_image(rows: Sequence[dict]) -> dict[Any, float]:
    """Mean stored bytes per image, by the dataset's stored size (``params.resize``; None = as captured)."""
    sizes = defaultdict(list)
    for r in rows:
        b = r.get("sample_bytes")
        if b and _plain(r):
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
             and _stored_at(r, resize) and r.get("valid", True)]
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
                and _stored_at(r, resize):
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


def real_gpus_fed(rows: Sequence[dict]) -> list[Block]:
    """How many real GPUs of one node each disk fed, from `bench train` runs with 1, 2, ... ranks (``--gpus N``)
    of one model, task and GPU: per tier and format, the most ranks whose slowest rank reached 90% AU (the best
    decode path for each N), every N measured with its slowest rank's AU, and what limited the first N that
    missed. Nothing where no run used more than one GPU: one GPU alone says nothing about the node."""
    train = [r for r in of_bench(rows, "train") if not is_synthetic(r) and not accelerator_emulated(r)
             and side_dataset(r) in (None, "ranks") and figure(r, "au") is not None]
    if not any((params(r).get("gpus") or 1) > 1 for r in train):
        return []
    groups: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in train:
        p = params(r)
        key = (str(p.get("model")), str(p.get("task")), str(p.get("accelerator")), tier_label(r), str(r.get("format")))
        n = int(p.get("gpus") or 1)
        if n not in groups[key] or figure(r, "au") > figure(groups[key][n], "au"):
            groups[key][n] = r
    table = Table("GPUs fed, measured with real GPUs (bench train --gpus N: one DistributedDataParallel rank and "
                  "one loader per GPU, reading cold)",
                  ["model", "task", "GPU", "tier", "format", "GPUs fed (every rank AU >= 90%)",
                   "slowest rank's AU with N GPUs", "what limits the first N below"], [])
    fed_by: dict[tuple, tuple[int, str]] = {}  # per model, task, GPU and tier: the most GPUs fed, and from which format
    counts: dict[tuple, set[int]] = defaultdict(set)  # and every GPU count measured there
    for key in sorted(groups, key=lambda k: (k[1] != "train", k)):
        model, task, gpu, tier, fmt = key
        by_n = groups[key]
        fed = [n for n, r in by_n.items() if figure(r, "au") >= AU_TARGET]
        most = max(fed) if fed else 0
        missed = sorted(n for n in by_n if n > most)
        measured = ", ".join(f"{n}: {fmt_pct(figure(by_n[n], 'au'))} ({params(by_n[n]).get('decode')})"
                             for n in sorted(by_n))
        table.rows.append([model, task, gpu, tier, fmt, str(most), measured,
                           limit_text(by_n[missed[0]]) if missed else "-"])
        where = (model, task, gpu, tier)
        counts[where] |= set(by_n)
        if where not in fed_by or most > fed_by[where][0]:
            fed_by[where] = (most, fmt)
    sentences = []
    for where, (most, fmt) in fed_by.items():
        model, task, gpu, tier = where
        ns = sorted(counts[where])
        doing = {"train": "training", "infer": "running inference of"}.get(task, task)
        sentences.append(f"{tier} feeds **{most}** {gpu}{'s' if most != 1 else ''} {doing} {model}"
                         + (f" (from {fmt})" if most else "") + f", measured with {', '.join(map(str, ns))} GPUs")
    return ["**GPUs fed, measured with real GPUs on one node:** " + "; ".join(sentences) + ".", table]


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
    stored size and workers; or, when nothing passes, the closest configuration."""
    passing = [r for r in tr if (figure(r, "au") or 0) >= AU_TARGET]
    if not passing:
        best = max(tr, key=lambda r: figure(r, "au") or 0)
        found = best.get("limit") or {}
        what = {"disk": "the disk limits it: a faster disk (the sizes below)",
                "cpu": "the CPU limits it: more cores, or the GPU's JPEG engines (the cores below)",
                "engines": "the JPEG engines limit it: more CPU workers beside them (decode hybrid)",
                "main thread": "the rank's own main thread limits it"}.get(found.get("resource"))
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
    """Format (and stored size) x tier: the best AU measured, with the decode path that gave it; bold at >= 90%."""
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
            best = max(cold or here, key=lambda r: figure(r, "au") or 0)
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
    ran = [r for r in train_rows_for(rows, d) if params(r).get("decode") == "cpu" and _stored_at(r, resize_to)
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
        if size and _plain(r) and twin is not None and twin.get("median") and r.get("median"):
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


# ----------------------------------------------------------------------------------- the published finding


@dataclasses.dataclass
class Check:
    claim: str
    verdict: str  # "confirmed", "refuted", "no data"
    measured: str
    detail: str


def _speed(row: dict) -> float | None:
    """Work per second of a row, whatever its primary metric (time metrics are inverted)."""
    m = row.get("median")
    if not m:
        return None
    unit = (row.get("unit") or "").lower()
    return 1.0 / m if unit in ("s", "seconds", "ms") else m


def _stand_in(rows: Sequence[dict], bench: str, tier: str) -> tuple[str, str]:
    """``(tier to use, note)``: ``tier`` itself when the rows have it; for a missing ``nvme``, the fastest
    measured tier of ``bench`` (a local disk is the NVMe of the published finding), said so in the note."""
    have = {r.get("tier") for r in of_bench(rows, bench)}
    if tier in have or tier != PREFERRED_BASELINE:
        return tier, ""
    best = _fastest_tier((r for r in of_bench(rows, bench) if r.get("mode") == "measured" and not is_synthetic(r)),
                         _speed)
    if best is None:
        return tier, ""
    return best, f" The measured tier '{best}' (a real local disk) stands in for NVMe."


def _tier_gap(rows: Sequence[dict], bench: str, task: str | None, fast: str, slow: str
              ) -> list[tuple[str, float, float]]:
    """``[(configuration, speed(fast) / speed(slow) - 1, the larger spread of the two rows)]`` over
    configurations measured on both tiers."""
    by_tier: dict[str, dict[tuple, dict]] = {fast: {}, slow: {}}
    for r in of_bench(rows, bench):
        if r.get("tier") in by_tier and (task is None or params(r).get("task") == task) and r.get("valid", True):
            by_tier[r["tier"]][_config_key(r)] = r
    gaps = []
    for key, rf in by_tier[fast].items():
        rs = by_tier[slow].get(key)
        if rs and _speed(rf) and _speed(rs):
            gaps.append((describe_config(rf).replace(f" on {tier_label(rf)}", ""), _speed(rf) / _speed(rs) - 1,
                         max(rf.get("spread") or 0.0, rs.get("spread") or 0.0)))
    return gaps


def finding_checks(rows: Sequence[dict]) -> list[Check]:
    """Each claim of TIERS.md's published finding against our rows.

    A "~X% faster" claim is confirmed when our median gap over matching configurations lies within half to
    twice X (same direction, same order of magnitude), refuted otherwise; "insensitive (~1%)" is confirmed when
    the gap is within 3%. When the rows' repeats spread more than the gap (or, for a confirmation, more than
    the claim), the verdict is "inconclusive". Tiers absent from the rows give "no data".
    """
    checks = []
    for bench, task, fast, slow, claimed, claim in PUBLISHED:
        fast, note = _stand_in(rows, bench, fast)
        gaps = _tier_gap(rows, bench, task, fast, slow)
        if not gaps:
            have = sorted({r.get("tier") for r in of_bench(rows, bench)
                           if task is None or params(r).get("task") == task} - {MEMORY_TIER, None})
            hint = (f" (`gpufeed bench convert SRC --tier {fast}=MOUNT --tier {slow}` makes them: NAME=MOUNT measures "
                    "a mount, a name alone emulates that profile on this disk; pass its results file to "
                    "`gpufeed report` with the others)" if bench == "convert" else "")
            checks.append(Check(claim, "no data", "n/a",
                                f"needs `gpufeed bench {bench}` rows on both {fast} and {slow}"
                                + (f" ({task})" if task else "") + f"; these results have {', '.join(have) or 'none'}"
                                + hint))
            continue
        med = statistics.median(g for _, g, _ in gaps)
        noise = statistics.median(n for _, _, n in gaps)
        if claimed <= 0.02:
            ok = abs(med) <= INSENSITIVE_TOLERANCE
            rule = f"within {INSENSITIVE_TOLERANCE:.0%}"
        else:
            ok = claimed / 2 <= med <= claimed * 2
            rule = f"between {claimed / 2:.0%} and {claimed * 2:.0%}"
        each = "; ".join(f"{name}: {fmt_pct(g, signed=True)}" for name, g, _ in gaps)
        direction = "faster" if med >= 0 else "slower"
        detail = (f"{fast} is {fmt_pct(abs(med))} {direction} than {slow} (median of {len(gaps)} configuration(s): "
                  f"{each}); the claim holds if the gap is {rule}.")
        verdict = "confirmed" if ok else "refuted"
        # Noise larger than the gap could have made a refutation; larger than the claim, a confirmation.
        if (not ok and noise > abs(med)) or (ok and noise > max(claimed, INSENSITIVE_TOLERANCE * (claimed <= 0.02))):
            verdict = "inconclusive"
            detail += (f" But the runs spread by {fmt_pct(noise)} (max - min over median), more than the gap or "
                       "the claim: repeat on a quieter machine.")
        elif not ok and med > claimed * 2:
            detail += " The gap is far larger than published: the disk matters much more here."
        detail += note
        checks.append(Check(claim, verdict, fmt_pct(med, signed=True), detail))
    return checks


# ------------------------------------------------------------------------------------------------- tables


def finding_table(checks: Sequence[Check]) -> Table:
    return Table("Published finding vs these results", ["claim", "verdict", "measured gap", "detail"],
                 [[c.claim, c.verdict.upper(), c.measured, c.detail] for c in checks])


def train_table(rows: Sequence[dict], baseline: str | None = None) -> Table:
    """One line per configuration; the synthetic baseline once per accelerator and task (median over every
    `gpufeed bench train` call, each of which measures its own; spread across those calls)."""
    from gpufeed.bench.results import stat

    train = of_bench(rows, "train")
    ratios = ratio_to_baseline(train, baseline)
    t = Table("Training and inference loop", ["task", "format", "stored", "tier", "cache", "decode",
                                              "accelerator", "img/s", "spread", "AU", f"vs {baseline or 'baseline'}",
                                              "wait p50 ms", "wait p99 ms", "workers", "batch", "what limits it"], [])
    synthetic: dict[tuple, list[dict]] = defaultdict(list)
    for r in train:
        if is_synthetic(r):
            synthetic[(params(r).get("task"), accelerator(r))].append(r)
    for (task, _acc), rs in sorted(synthetic.items(), key=lambda kv: str(kv[0])):
        p, across = params(rs[0]), stat([r["median"] for r in rs])
        t.rows.append([str(task), "synthetic", "-", "memory", "-", "-", _accelerator_cell(rs[0]),
                       fmt_num(across["median"]),
                       fmt_pct(across["spread"]) + f" ({len(rs)} calls)" if len(rs) > 1 else fmt_spread(rs[0]),
                       "100%", "-", "-", "-", str(p.get("workers", "")), str(p.get("batch_size", "")), "-"])
    for r in sorted((r for r in train if not is_synthetic(r)),
                    key=lambda r: (str(params(r).get("task")), str(r.get("format")), str(stored(r)),
                                   str(r.get("tier")), str(params(r).get("cold")), loader_label(r))):
        p = params(r)
        au = figure(r, "au")
        t.rows.append([str(p.get("task")), str(r.get("format")),
                       stored(r) or "as captured", tier_label(r),
                       "warm" if p.get("cold") is False else "cold", loader_label(r),
                       _accelerator_cell(r), fmt_num(r.get("median")), fmt_spread(r),
                       f"**{fmt_pct(au)}**" if au is not None and au >= AU_TARGET else fmt_pct(au),
                       fmt_ratio(ratios.get(id(r))), fmt_num(figure(r, "data_wait_p50_ms")),
                       fmt_num(figure(r, "data_wait_p99_ms")), str(p.get("workers", "")), str(p.get("batch_size", "")),
                       limit_text(r)])
    t.note = (f"AU = compute time / wall time, the compute time being the synthetic-data loop's (tensors already in "
              f"accelerator memory); bold marks AU >= {AU_TARGET:.0%}. Tiers marked * are emulated. spread = (max - "
              "min) / median over repeats. wait = time a step waited for its batch. what limits it: for a run "
              "below 90% AU, the resource at 90% of its ceiling over the timed steps (the disk against its "
              "measured cold rate for those records at that queue depth, the cores, the JPEG engines), or none: "
              "then the loader itself limited it, not the disk.")
    return t


def limit_text(row: dict) -> str:
    """What limited a training row that missed 90% AU (its ``limit``, :mod:`gpufeed.bench.bottleneck`); "-" for
    one that did not, or one measured before rows said."""
    found = row.get("limit")
    return found["text"] if found else "-"


def _accelerator_cell(row: dict) -> str:
    return f"{accelerator(row)}{' (emulated)' if accelerator_emulated(row) else ''}"


def generic_table(rows: Sequence[dict], bench: str, title: str, baseline: str | None,
                  extra: Sequence[str] = ()) -> Table:
    """One line per row of ``bench``: the parameters that vary, primary metric, chosen secondary metrics, the
    ratio to the baseline tier; parameters shared by every row go in the note."""
    rows = of_bench(rows, bench)
    ratios = ratio_to_baseline(rows, baseline)
    keys = sorted({k for r in rows for k in params(r)} - _PATH_PARAMS)
    shared = {k: params(rows[0]).get(k) for k in keys
              if len(rows) > 1 and len({repr(params(r).get(k)) for r in rows}) == 1}
    keys = [k for k in keys if k not in shared]
    extra = [name for name in extra if any(figure(r, name) is not None for r in rows)]
    t = Table(title, ["format", "tier", *keys, "metric", "median", "spread", *extra,
                      f"vs {baseline or 'baseline'}"], [])
    for r in sorted(rows, key=lambda r: (str(r.get("format")), str(r.get("tier")), repr(params(r)))):
        p = params(r)
        t.rows.append([str(r.get("format")), tier_label(r), *[_cell(p.get(k)) for k in keys],
                       f"{r.get('metric')} ({r.get('unit')})", fmt_num(r.get("median")), fmt_spread(r),
                       *[fmt_num(figure(r, name)) for name in extra], fmt_ratio(ratios.get(id(r)))])
    if shared:
        t.note = "Same in every row: " + ", ".join(f"{k} = {_cell(v)}" for k, v in shared.items()) + "."
    return t


def _cell(v) -> str:
    if isinstance(v, float):
        return fmt_num(v)
    return "-" if v is None else str(v)


def emulated_table(rows: Sequence[dict]) -> Table:
    t = Table("Emulated rows", ["bench", "task", "format", "tier", "storage", "accelerator", "valid"], [])
    for r in rows:
        tier_emul = r.get("mode") == "emulated"
        if not (tier_emul or accelerator_emulated(r)):
            continue
        lim = r.get("tier_limits") or {}
        storage = (f"emulated {r.get('profile')}: {fmt_num(lim.get('iops'))} IOPS, {fmt_num(lim.get('mb_per_s'))} "
                   f"MB/s, {fmt_num(lim.get('latency_ms'))} ms") if tier_emul else "measured"
        p = params(r)
        accel = (f"emulated {p.get('accelerator')} ({fmt_num(p.get('emulated_step_s'))} s/step)"
                 if accelerator_emulated(r) else (p.get("accelerator") or "-"))
        valid = "yes" if r.get("valid", True) else f"no: {r.get('invalid_reason', '')}"
        t.rows.append([str(r.get("bench")), str(p.get("task") or "-"), str(r.get("format")), str(r.get("tier")),
                       storage, str(accel), valid])
    return t


def machine_table(rows: Sequence[dict]) -> Table:
    t = Table("Machines", ["host", "CPU", "cores", "RAM", "GPU", "disk", "filesystem", "rows"], [])
    seen: dict[tuple, list] = {}
    for r in rows:
        m = r.get("machine") or {}
        disk = m.get("disk") or {}
        gpus = ", ".join(g.get("name", "?") for g in m.get("gpus") or []) or "none"
        key = (m.get("hostname"), m.get("cpu"), str(m.get("logical_cores")), fmt_bytes(m.get("ram_bytes")), gpus,
               str(disk.get("model") or disk.get("device") or "-"), str(disk.get("fstype") or "-"))
        seen.setdefault(key, []).append(r)
    for key, rs in seen.items():
        t.rows.append([str(k) for k in key] + [str(len(rs))])
    return t
