"""The report's tables (training, every benchmark, emulated tiers, machines) and the published finding of
shared/TIERS.md checked claim by claim against the rows."""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Sequence

from gpufeed.bench import AU_TARGET, MEMORY_TIER
from gpufeed.bench.bottleneck import cache_text, row_limit, served_from_cache
from gpufeed.bench.report_model import Table, fmt_bytes, fmt_num, fmt_pct, fmt_ratio
from gpufeed.bench.report_rows import (PATH_PARAMS, PREFERRED_BASELINE, accelerator, accelerator_emulated, config_key,
                                       describe_config, fastest_tier, figure, fmt_spread, is_synthetic, loader_label,
                                       of_bench, params, ratio_to_baseline, stored, tier_label)


#: "Insensitive to the disk" is confirmed when tiers differ by at most this much (TIERS.md says ~1%; runs on a
#: shared machine move by a few percent).
INSENSITIVE_TOLERANCE = 0.03


#: The published finding of shared/TIERS.md, claim by claim: (bench, task, faster tier, slower tier, how much
#: faster the first is, in words).
PUBLISHED = (
    ("convert", None, "nvme", "ssd", 0.25, "Preprocessing: local NVMe ~25% faster than SSD cloud disk"),
    ("convert", None, "ssd", "ultra", 0.10, "Preprocessing: SSD cloud disk ~10% faster than ultra"),
    ("train", "train", "nvme", "ultra", 0.01, "Training: insensitive to the disk (~1%)"),
    ("train", "infer", "nvme", "ultra", 0.15, "Inference: ~15% slower on ultra disk"),
)


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
    best = fastest_tier((r for r in of_bench(rows, bench) if r.get("mode") == "measured" and not is_synthetic(r)),
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
            by_tier[r["tier"]][config_key(r)] = r
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
              "then the loader itself limited it, not the disk; or, where the loop waited less than its steps "
              "ran beyond the model's alone, the loader's work beside the model slowed the steps.")
    return t


def limit_text(row: dict) -> str:
    """What limited a training row that missed 90% AU (:func:`gpufeed.bench.bottleneck.row_limit`); "-" for one
    that did not, or one measured before rows said."""
    if served_from_cache(row):
        return cache_text(row)
    found = row_limit(row)
    return found["text"] if found else "-"


def _accelerator_cell(row: dict) -> str:
    return f"{accelerator(row)}{' (emulated)' if accelerator_emulated(row) else ''}"


def generic_table(rows: Sequence[dict], bench: str, title: str, baseline: str | None,
                  extra: Sequence[str] = ()) -> Table:
    """One line per row of ``bench``: the parameters that vary, primary metric, chosen secondary metrics, the
    ratio to the baseline tier; parameters shared by every row go in the note."""
    rows = of_bench(rows, bench)
    ratios = ratio_to_baseline(rows, baseline)
    keys = sorted({k for r in rows for k in params(r)} - PATH_PARAMS)
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
