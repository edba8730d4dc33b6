"""Reading the benchmark rows a report is made of: each row's parameters, figures and spreads, which stored
size, accelerator, loader and tier it ran, the tiers present and the baseline of ratios, and the demands (a
model on a GPU at a batch size) the rows answer for."""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from gpufeed.bench import MEMORY_TIER, SYNTHETIC
from gpufeed.errors import ConfigError
from gpufeed.bench.report_model import MB, fmt_pct


#: Tier tried first as the baseline of ratios, when present (the fastest of the published tiers).
PREFERRED_BASELINE = "nvme"


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


def stored_at(row: dict, resize: int | None) -> bool:
    """Stored only resized to ``resize`` (None: as captured), not also cropped or kept raw."""
    return stored(row) == (f"--resize {resize}" if resize else None)


def plain(row: dict) -> bool:
    """Stored as captured or only resized: what the figures keyed by :func:`stored_size` compare."""
    return stored_at(row, stored_size(row))


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
    read-ahead, a fixed hybrid CPU share, the workers' niceness, the cores each rank kept from the workers, the
    steps each rank's loop could queue ahead of its GPU (rows before 2026-11-27 have no limit), the CPU workers
    decoding each crop's box alone (region decode; rows before it decoded whole JPEGs), batches handed out as each
    is made (out of order), workers other than the default, and the child-process
    loader measured on 2026-11-25 (since taken out of gpufeed)."""
    p = params(row)
    label = str(p.get("decode") or "-")
    if p.get("read_ahead"):
        label += ", read-ahead"
    if p.get("region_decode"):
        label += ", region decode"
    if p.get("in_order") is False:
        label += ", out of order"
    if p.get("feed") == "process":
        label += ", child process"
    if p.get("cpu_share_fixed") is not None:
        label += f", CPU share {p['cpu_share_fixed']:.2f}"
    if p.get("worker_nice"):
        label += f", workers at nice {p['worker_nice']}"
    if p.get("loop_cores"):
        label += f", {p['loop_cores']} core(s) kept per rank"
    if p.get("run_ahead") is not None:
        label += f", paced ({p['run_ahead']} step(s) ahead)" if p["run_ahead"] else ", paced to its GPU"
    if p.get("workers") is not None and default_workers_of(row) not in (None, p["workers"]):
        label += f", {p['workers']} workers"
    return label


def default_workers_of(row: dict) -> int | None:
    """The DataLoader workers a rank of a train row's run gets by default on the row's machine
    (:func:`gpufeed.pipelines.loader.default_workers`: the rank's share of the usable cores, less one for the
    rank's own process where ranks share the node, at most 32), None where the row does not say its cores or kept
    cores from the workers, or from before 2026-11-27's counted rows (:func:`counts_made`; the default was 16
    workers a rank before). A row whose workers differ was asked for them, and its label says how many."""
    from gpufeed.pipelines.loader import default_workers

    p = params(row)
    cores = (row.get("machine") or {}).get("usable_cores")
    if not cores or p.get("loop_cores") or not counts_made(row):
        return None
    return default_workers(p.get("gpus") or 1, usable=cores)


def counts_made(row: dict) -> bool:
    """Whether a train row's rate is the lesser of what its loop took and what its loader's workers made over the
    timed steps (bench train from 2026-11-27 on). Before, it was what the loop took, which over a short window
    includes the batches the workers had made before it: 2 inference ranks of 31 CPU workers each took 15,800
    img/s while their workers made 3,300 (results/gpu-ranks-h200x4.txt, session 14)."""
    return "made_per_s" in (row.get("metrics") or {})


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
    fastest = fastest_tier((r for r in rows if r.get("bench") in ("read", "train") and not is_synthetic(r)),
                            lambda r: r.get("median"))
    if fastest is not None:
        return fastest
    return tiers[0] if tiers else None


def fastest_tier(rows: Iterable[dict], speed: Callable[[dict], float | None]) -> str | None:
    """The tier whose rows have the highest median ``speed`` (rows without one left out); None if none has."""
    by_tier = defaultdict(list)
    for r in rows:
        v = speed(r)
        if v:
            by_tier[r["tier"]].append(v)
    return max(by_tier, key=lambda t: statistics.median(by_tier[t])) if by_tier else None


#: Parameters that name paths, which differ from tier to tier for the same configuration.
PATH_PARAMS = frozenset({"tier_path", "command"})


def config_key(row: dict) -> tuple:
    """Everything that identifies a configuration except its tier, for matching rows across tiers."""
    p = {k: v for k, v in params(row).items() if k not in PATH_PARAMS}
    return (row.get("bench"), row.get("format"), row.get("metric"), repr(sorted(p.items(), key=str)))


def runs_of_each_config(rows: Sequence[dict], name: str = "au") -> list[tuple[dict, list[float]]]:
    """Rows of one configuration (:func:`config_key`, tier and accelerator) measured in several runs (results
    files appended call after call) taken as one: ``(the run at their median, every run's figure sorted)`` per
    configuration, the median the lower middle one for an even count. A report's figure for a configuration is
    then what its runs typically gave, never the luckiest of them (three runs of one setting of 4 ranks gave
    0.548, 0.728 and 0.922, results/gpu-ranks-h200x4.txt). Rows without the figure are left out."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if figure(r, name) is not None:
            groups[(config_key(r), tier_label(r), accelerator(r))].append(r)
    out = []
    for runs in groups.values():
        runs.sort(key=lambda r: figure(r, name))
        out.append((runs[(len(runs) - 1) // 2], [figure(r, name) for r in runs]))
    return out


def typical(rows: Sequence[dict], name: str = "au") -> list[dict]:
    """One row per configuration: the run at the median of its runs (:func:`runs_of_each_config`); ``rows`` as
    they are where none has the figure."""
    return [r for r, _ in runs_of_each_config(rows, name)] or list(rows)


def fmt_runs(values: Sequence[float]) -> str:
    """How many runs gave a configuration's figure, and each of them (the median's text leaves them out where
    there is one)."""
    if len(values) < 2:
        return ""
    shown = (", ".join(fmt_pct(v) for v in values) if len(values) <= 4
             else f"{fmt_pct(values[0])} to {fmt_pct(values[-1])}")
    return f"median of {len(values)} runs: {shown}"


def ratio_to_baseline(rows: Sequence[dict], baseline: str | None) -> dict[int, float]:
    """``{id(row): row median / the same configuration's median on the baseline tier}`` (time metrics too:
    a ratio above 1 on seconds means slower)."""
    if baseline is None:
        return {}
    base = {config_key(r): r.get("median") for r in rows if r.get("tier") == baseline}
    out = {}
    for r in rows:
        b = base.get(config_key(r))
        if b and r.get("median") is not None:
            out[id(r)] = r["median"] / b
    return out


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
