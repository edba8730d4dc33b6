"""``gpufeed bench convert|read|train|tiers|dataset``: benchmarks on real and emulated storage tiers.

Each benchmark takes repeated ``--tier NAME[@GIB][=PATH]`` options (``--tier ssd`` emulates the ``ssd``
profile on the host disk, ``--tier ssd=/mnt/ssd`` measures that mount) and appends rows to ``--results``
(JSON lines, schema in :mod:`gpufeed.bench.results`). Benchmark modules are imported when their subcommand
runs, so ``gpufeed --help`` never pays for torch; none of them imports Ray at module level.
"""

from __future__ import annotations

import argparse
import importlib

from gpufeed.cli import add_command

#: sub-subcommand -> (module, one-line help). each module holds its own arguments and run().
SUBCOMMANDS = {
    "convert": ("gpufeed.bench.convert_bench", "time `gpufeed convert` per format, tier and worker count"),
    "read": ("gpufeed.bench.read", "read throughput and latency per format and tier, cold and warm"),
    "train": ("gpufeed.bench.train", "a real training / inference loop fed from each format and tier"),
    "feed": ("gpufeed.bench.feed", "how many emulated accelerators a disk keeps at >= 90% AU (MLPerf Storage style)"),
    "tiers": ("gpufeed.bench.tiers_cmd", "list tier profiles, self-test the emulator, measure the host disk"),
    "dataset": ("gpufeed.bench.dataset", "build a benchmark dataset in every format without Ray"),
}


def add_tier_arguments(parser: argparse.ArgumentParser, results: bool = True) -> None:
    """The options every benchmark shares: ``--tier`` (repeatable), ``--results``, ``--repeats``, ``--warmup``,
    ``--allow-invalid``. :func:`tiers_from_args` turns them into :class:`gpufeed.bench.tiers.TierSpec`."""
    parser.add_argument("--tier", action="append", default=None, metavar="NAME[@GIB[:iops=N,mbps=N]][=PATH]",
                        help="storage tier to run on; repeat for a comparison. NAME alone emulates that profile "
                             "on the host disk (NAME@GIB for a disk of GIB GiB; gp3@GIB:iops=N,mbps=N with provisioned "
                             "performance); NAME=PATH measures a real mount. "
                             "Default: the host disk itself, measured, as tier 'host'")
    if results:
        parser.add_argument("--results", metavar="FILE.jsonl", required=True,
                            help="JSON-lines file the result rows are appended to")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="discarded runs before the measured ones")
    parser.add_argument("--allow-invalid", action="store_true",
                        help="run emulated tiers even where the host disk is not clearly faster than the "
                             "profile; their rows are written with valid=false and the reason")


def tiers_from_args(args, host_dir: str) -> list:
    """``--tier`` options as TierSpecs; no option means the host disk under ``host_dir``, measured."""
    from gpufeed.bench.tiers import TierSpec, parse_tier

    if not args.tier:
        return [TierSpec(name="host", path=host_dir)]
    return [parse_tier(s) for s in args.tier]


def int_list(text: str) -> list[int]:
    """``"0,2,4"`` -> ``[0, 2, 4]`` (argparse type for worker-count grids)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more non-negative integers")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = add_command(sub, name, help_)
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            if e.name != module:
                raise
            p.set_defaults(_bench_missing=f"`gpufeed bench {name}` is not installed in this build ({module} "
                                         "is missing)")
            continue
        mod.add_arguments(p)
        p.set_defaults(_bench_module=mod)


def run(args) -> int:
    from gpufeed.errors import ConfigError

    missing = getattr(args, "_bench_missing", None)
    if missing:
        raise ConfigError(missing)
    return int(args._bench_module.run(args) or 0)
