"""``gpufeed report RESULTS.jsonl -o report.html|report.md``: a storage-tier comparison people can act on.

The report answers, in plain words first: for this model and accelerator, which format and tier keep it at
>= 90% accelerator utilisation (AU, MLPerf Storage's pass mark), how many CPU cores the decoding needs, what
storing images smaller changes, and whether our numbers confirm a published finding on cloud disks.
Then the evidence: tables (median and spread of every row, ratios against a baseline tier), plots (images/s per
format x tier, AU per tier, conversion time per tier, latency distributions), which rows were emulated, and the
machines. HTML embeds its plots as base64 PNG, so the report is one self-contained file; Markdown writes them
beside it in ``<name>_files/``.

This module assembles the report (:func:`build_report`) and writes it (:func:`write_report`); the analysis
is :mod:`.report_rows` (rows read), :mod:`.report_analysis` (the answers) and :mod:`.report_tables` (tables, the
published finding), the model :mod:`.report_model`, the plots :mod:`.report_plots`, the HTML and Markdown
:mod:`.report_render`. Their
building blocks are public here (``__all__``), so ``notebooks/storage_tiers.ipynb`` reuses them:
:func:`train_table`, :func:`plot_throughput`, :func:`plot_au`, :func:`finding_checks`, :func:`answer` ...
each takes the rows of :func:`gpufeed.bench.results.load_results`.
"""

from __future__ import annotations

import os
import shlex
import time
from collections import defaultdict
from collections.abc import Sequence

from gpufeed.bench import AU_TARGET
from gpufeed.bench.report_model import Block, Plot, Report, Section, Table, fmt_num, fmt_pct
from gpufeed.bench.report_rows import (choose_baseline, demands, figure, fmt_spread, loader_label, of_bench, params,
                                       ratio_to_baseline, side_dataset, storage_tiers, stored_size, tier_label)
from gpufeed.bench.report_tables import (emulated_table, finding_checks, finding_table, generic_table, machine_table,
                                         train_table)
from gpufeed.bench.report_analysis import answer, every_configuration, real_gpus_fed, side_sections, sized_disks
from gpufeed.bench.report_plots import (plot_au, plot_convert_time, plot_latency, plot_read_throughput,
                                        plot_throughput, png_bytes)
from gpufeed.bench.report_render import blocks_html, render_html, render_markdown, table_html
from gpufeed.errors import ConfigError

#: The building blocks a notebook or script composes its own views from, besides the whole report.
__all__ = ["AU_TARGET", "Block", "Plot", "Report", "Section", "Table", "answer", "blocks_html", "build_report",
           "choose_baseline", "demands", "every_configuration", "figure", "finding_checks", "finding_table",
           "fmt_num", "fmt_pct", "fmt_spread", "generic_table", "loader_label", "of_bench", "params",
           "plot_au", "plot_convert_time", "plot_latency", "plot_read_throughput", "plot_throughput", "png_bytes",
           "ratio_to_baseline", "render_html", "render_markdown", "storage_tiers", "stored_size", "table_html",
           "tier_label", "train_table", "write_report"]


def build_report(rows: Sequence[dict], baseline: str | None = None, sources: Sequence[str] = (),
                 resize_to: int = 160) -> Report:
    if not rows:
        raise ConfigError("no result rows to report; run `gpufeed bench convert|read|train ... --results FILE` "
                          "first")
    everything = rows
    sides = side_sections(rows)
    rows = [r for r in rows if side_dataset(r) is None]
    if not rows:  # only the CIFAR and/or PTB benchmarks ran
        names = " and ".join(s.title.split(" into ")[0] for s in sides)
        return Report("gpufeed storage-tier report", f"{len(everything)} result rows ({names} only)",
                      [*sides, Section("Machines and versions", [machine_table(everything),
                                                                  _versions_text(everything)])])
    base = choose_baseline(rows, baseline)
    sections = [Section("The answer", real_gpus_fed(everything) + answer(rows, resize_to)), *sides]
    sized = sized_disks(rows, demands(rows), resize_to)[1]
    if sized:
        sections.append(Section("Disks sized as bought", sized))
    listed = every_configuration(rows)
    if listed:
        sections.append(Section("Every configuration measured", listed))

    checks = finding_checks(rows)
    finding = Section("The published finding, checked", [
        "A published comparison of cloud disk tiers for deep learning, made on P100-era GPUs, reports: "
        "preprocessing is IO-bound, local NVMe ~25% faster than SSD cloud disk and "
        "SSD ~10% faster than ultra; training is insensitive to the disk (~1%); inference is ~15% slower on ultra. "
        "Our numbers, claim by claim:", finding_table(checks)])
    confirmed = [c.claim for c in checks if c.verdict == "confirmed"]
    refuted = [c.claim for c in checks if c.verdict == "refuted"]
    missing = [c.claim for c in checks if c.verdict in ("no data", "inconclusive")]
    finding.blocks.append([f"Our data confirm: {'; '.join(confirmed) if confirmed else 'none of the claims'}.",
                           f"Our data refute: {'; '.join(refuted) if refuted else 'none of the claims'}.",
                           "No data, or too noisy to say: "
                           f"{'; '.join(missing) if missing else 'none, every claim was tested'}."])
    ds = demands(rows)
    if any(not d.emulated for d in ds):
        gpu = next(d for d in ds if not d.emulated)
        finding.blocks.append(
            f"Why it can differ: a P100 trained ResNet-50 at a few hundred images/s, which even an ultra disk "
            f"(140 MB/s, about 1,200 images/s of ~114 KB) could feed. {gpu.accelerator} consumes "
            f"{fmt_num(gpu.images_per_s)} img/s ({gpu.task}), so the same disks now starve it.")
    sections.append(finding)

    train = Section("Training and inference")
    if of_bench(rows, "train"):
        train.blocks.append(train_table(rows, base))
        for maker, title in ((plot_throughput, "Images/s per format and tier"),
                             (plot_au, "Accelerator utilisation per tier"),
                             (plot_latency, "Latency distributions")):
            fig = maker(rows)
            if fig is not None:
                train.blocks.append(Plot(title, png_bytes(fig)))
    else:
        train.blocks.append("No training rows.")
    sections.append(train)

    for bench, title, extra, maker, plot_title in (
            ("read", "Reading", ("mb_per_s", "read_p50_ms", "read_p99_ms", "iops", "device_fraction"),
             plot_read_throughput, "Read throughput per format and tier"),
            ("convert", "Conversion", ("wall_s", "cpu_user_s", "cpu_sys_s", "machine_iowait_share",
                                       "emulated_wait_share", "write_mb_per_s", "device_mb_per_s"),
             plot_convert_time, "Conversion time per tier")):
        section = Section(title)
        if of_bench(rows, bench):
            section.blocks.append(generic_table(rows, bench, f"{title} benchmark", base, extra=extra))
            fig = maker(rows)
            if fig is not None:
                section.blocks.append(Plot(plot_title, png_bytes(fig)))
        else:
            section.blocks.append(f"No {bench} rows.")
        sections.append(section)

    emul = emulated_table(rows)
    sections.append(Section("Which rows were emulated", [
        "Emulated storage applies a tier's published IOPS, MB/s and latency inside gpufeed's own I/O on a faster "
        "host disk; an emulated accelerator replaces the model step by a sleep of a measured step time (MLPerf "
        "Storage / DLIO). Everything else was measured.",
        emul if emul.rows else "None: every row was measured."]))
    sections.append(Section("Machines and versions", [machine_table(everything), _versions_text(everything)]))

    generated = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    subtitle = (f"{len(everything)} result rows from {', '.join(os.path.basename(s) for s in sources) or 'memory'}; "
                f"baseline tier for ratios: {base or 'none'}; generated {generated}")
    return Report("gpufeed storage-tier report", subtitle, sections)


def _versions_text(rows: Sequence[dict]) -> str:
    versions: dict[str, set] = defaultdict(set)
    for r in rows:
        for k, v in (r.get("versions") or {}).items():
            if v:
                versions[k].add(str(v))
    return "Versions: " + (", ".join(f"{k} {'/'.join(sorted(v))}" for k, v in sorted(versions.items())) or "n/a")


def write_report(rows: Sequence[dict], out: str, baseline: str | None = None, sources: Sequence[str] = (),
                 resize_to: int = 160) -> str:
    """Build and write the report to ``out`` (.html or .md); returns the path written."""
    report = build_report(rows, baseline, sources, resize_to)
    ext = os.path.splitext(out)[1].lower()
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    if ext in (".html", ".htm"):
        text = render_html(report)
    elif ext == ".md":
        stem = os.path.splitext(os.path.basename(out))[0]
        text = render_markdown(report, os.path.join(parent, f"{stem}_files"), f"{stem}_files")
    else:
        raise ConfigError(f"-o {out}: the report is written as .html or .md; name the file report.html or report.md")
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out)
    return out


def add_arguments(parser) -> None:
    parser.add_argument("results", nargs="+", help="JSON-lines results file(s) written by `gpufeed bench`")
    parser.add_argument("-o", "--output", default="report.html", help="report file: .html (self-contained) or .md")
    parser.add_argument("--baseline", default=None,
                        help="tier the ratios are taken against (default: nvme if present, else the fastest)")
    parser.add_argument("--resize", type=int, default=160,
                        help="the smaller stored image size (shorter side, px) whose bandwidth the answer estimates")


def run(args) -> int:
    from gpufeed.bench.results import load_results

    for path in args.results:
        if not os.path.exists(path):
            raise ConfigError(f"{path}: results file not found; write one with `gpufeed bench ... --results "
                              f"{shlex.quote(path)}`")
    rows = load_results(args.results)
    out = write_report(rows, args.output, args.baseline, args.results, args.resize)
    print(f"wrote {out} from {len(rows)} rows")
    return 0
