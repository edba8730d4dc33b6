"""The storage-tier report's plots (matplotlib, Agg): each takes the rows of
:func:`gpufeed.bench.results.load_results` and returns a Figure, or ``None`` when it has nothing to draw."""

from __future__ import annotations

import inspect
import io
import statistics
from collections.abc import Sequence

from gpufeed.bench import AU_TARGET
from gpufeed.bench.report_rows import (describe_config, demands, figure, is_synthetic, of_bench, params, storage_tiers,
                                       tier_label)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig) -> bytes:
    """A matplotlib figure as PNG bytes (and the figure closed): what the report embeds."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()


def _grouped_bars(ax, groups: list[str], series: dict[str, list[float | None]], ylabel: str):
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v or 0 for v in values], width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def plot_throughput(rows: Sequence[dict], task: str | None = None):
    """Images/s per format x tier (one bar per tier) for the train rows of ``task`` (all tasks: one panel
    each); the synthetic baseline is a dashed line. Returns a matplotlib Figure, or None without train rows."""
    plt = _pyplot()
    tasks = [task] if task else sorted({params(r).get("task") for r in of_bench(rows, "train")} - {None})
    if not tasks:
        return None
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        tr = [r for r in of_bench(rows, "train") if params(r).get("task") == t]
        def config(r):
            return r["format"], params(r).get("decode"), params(r).get("resize")

        configs = sorted({config(r) for r in tr if not is_synthetic(r)}, key=str)
        tiers = sorted({tier_label(r) for r in tr if not is_synthetic(r)})
        series = {tier: [next((r["median"] for r in tr if not is_synthetic(r) and config(r) == c
                               and tier_label(r) == tier), None) for c in configs] for tier in tiers}
        _grouped_bars(ax, [f"{f}\n{d} decode{f' @{z}' if z else ''}" for f, d, z in configs], series, "images/s")
        for d in demands(tr):
            ax.axhline(d.images_per_s, ls="--", color="k", lw=1)
            ax.text(0.01, d.images_per_s, f" synthetic data ({d.accelerator})", va="bottom",
                    transform=ax.get_yaxis_transform(), fontsize=8)
        ax.set_title(f"ResNet-50 {t}: images/s per format and tier")
    fig.tight_layout()
    return fig


def plot_au(rows: Sequence[dict]):
    """Accelerator utilisation of every configuration (one bar each, coloured by tier), with the 90% mark."""
    plt = _pyplot()
    tr = [r for r in of_bench(rows, "train") if not is_synthetic(r) and figure(r, "au") is not None]
    if not tr:
        return None
    tr.sort(key=lambda r: (str(params(r).get("task")), figure(r, "au")))
    tiers = sorted({tier_label(r) for r in tr})
    colours = {t: plt.get_cmap("tab10")(i % 10) for i, t in enumerate(tiers)}
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(tr) + 1.2))
    ys = range(len(tr))
    ax.barh(list(ys), [figure(r, "au") for r in tr], color=[colours[tier_label(r)] for r in tr])
    ax.set_yticks(list(ys))
    ax.set_yticklabels([f"{params(r).get('task')}  {describe_config(r)}" for r in tr], fontsize=8)
    ax.axvline(AU_TARGET, color="r", ls="--", lw=1)
    ax.text(AU_TARGET, len(tr) - 0.4, f" {AU_TARGET:.0%} pass mark", color="r", fontsize=8)
    ax.set_xlim(0, 1.05)
    ax.set_xlabel("AU (compute time / wall time)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[t]) for t in tiers], labels=tiers, fontsize=8,
              loc="lower right", title="tier")
    ax.set_title("Accelerator utilisation per configuration (* = emulated tier)")
    fig.tight_layout()
    return fig


def plot_convert_time(rows: Sequence[dict]):
    """Conversion wall time per tier and format (lower is better)."""
    plt = _pyplot()
    cr = of_bench(rows, "convert")
    if not cr:
        return None
    tiers = storage_tiers(cr)
    formats = sorted({r["format"] for r in cr})

    def seconds(r):
        wall = figure(r, "wall_s")
        if wall is not None:
            return wall
        return r["median"] if (r.get("unit") or "") == "s" else None

    series = {tier: [statistics.median([s for r in cr if r["format"] == f and r["tier"] == tier
                                        if (s := seconds(r)) is not None] or [0]) for f in formats]
              for tier in tiers}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    _grouped_bars(ax, formats, series, "conversion wall time (s)")
    ax.set_title("Conversion time per tier (median over worker counts)")
    fig.tight_layout()
    return fig


def plot_latency(rows: Sequence[dict]):
    """Latency distributions: each configuration's wait for its next batch per training step (box: quartiles,
    whiskers: 1st-99th percentile), and read latency p50/p99 per record from the read benchmark."""
    plt = _pyplot()
    tr = [r for r in of_bench(rows, "train") if (r.get("samples") or {}).get("data_wait_ms")
          and not is_synthetic(r)]
    rd = [r for r in of_bench(rows, "read") if figure(r, "read_p50_ms") is not None]
    if not tr and not rd:
        return None
    height = max(4.0, 0.3 * len(tr) + 1.2)
    fig, axes = plt.subplots(1, int(bool(tr)) + int(bool(rd)), figsize=(13 if tr and rd else 8, height),
                             squeeze=False, gridspec_kw={"width_ratios": [3, 2]} if tr and rd else None)
    i = 0
    if tr:
        ax = axes[0][i]
        i += 1
        tr.sort(key=lambda r: (str(params(r).get("task")), -statistics.median(r["samples"]["data_wait_ms"])))
        # Matplotlib 3.10 renamed vert=False to orientation="horizontal".
        horizontal = ({"orientation": "horizontal"} if "orientation" in inspect.signature(ax.boxplot).parameters
                      else {"vert": False})
        ax.boxplot([[max(w, 1e-3) for w in r["samples"]["data_wait_ms"]] for r in tr], whis=(1, 99),
                   showfliers=False, widths=0.6, **horizontal)
        ax.set_yticks(range(1, len(tr) + 1))
        ax.set_yticklabels([f"{params(r).get('task')}  {describe_config(r)}" for r in tr], fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("wait for the next batch per step (ms, log; whiskers 1st-99th percentile)")
        ax.set_title("Data wait per step")
        ax.grid(axis="x", alpha=0.3)
    if rd:
        ax = axes[0][i]
        labels = [f"{r['format']} {tier_label(r)} {params(r).get('mode', '')} w{params(r).get('workers', '')} "
                  f"{params(r).get('cache', '')}" for r in rd]
        ys = list(range(len(rd)))
        ax.scatter([figure(r, "read_p50_ms") for r in rd], ys, marker="o", label="p50")
        ax.scatter([figure(r, "read_p99_ms") or float("nan") for r in rd], ys, marker=">", label="p99")
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_ylim(-0.7, len(rd) - 0.3)
        ax.set_xscale("log")
        ax.set_xlabel("read latency per record (ms, log)")
        ax.set_title("Read latency per record")
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_read_throughput(rows: Sequence[dict]):
    """Read samples/s per format x tier (best worker count), the read benchmark's headline."""
    plt = _pyplot()
    rd = [r for r in of_bench(rows, "read") if r.get("median")]
    if not rd:
        return None
    def kind(r):
        return r["format"], bool(params(r).get("decode")), params(r).get("cache") == "cold"

    kinds = sorted({kind(r) for r in rd}, key=str)
    tiers = sorted({tier_label(r) for r in rd})
    series = {tier: [max((r["median"] for r in rd if tier_label(r) == tier and kind(r) == k), default=None)
                     for k in kinds] for tier in tiers}
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(kinds)), 4))
    _grouped_bars(ax, [f"{f}\n{'decode' if d else 'bytes'} {'cold' if c else 'warm'}" for f, d, c in kinds],
                  series, "samples/s (best worker count)")
    ax.set_title("Read throughput per format and tier")
    fig.tight_layout()
    return fig
