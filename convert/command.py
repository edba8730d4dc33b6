"""``gpufeed convert`` / ``convert``: DATASET at SRC to LMDB, RecordIO and/or TFRecord, in parallel on Ray.

Imports nothing heavy: Ray, OpenCV and the formats load only when a conversion runs.
"""

from __future__ import annotations

import argparse

from gpufeed.convert.options import EXECUTORS, PTB_MODES, SAMPLES_PER_SHARD, TASK_RETRIES
from gpufeed.machine import usable_cores
from gpufeed.pipelines import ON_ERROR
from gpufeed.pipelines.image_options import ImageOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gpufeed.formats import FORMATS
    from gpufeed.pipelines import DATASETS

    p.description = ("Convert a dataset to Caffe LMDB, MXNet RecordIO and/or TFRecord. Each image is decoded "
                     "once for all formats; shards run in parallel in local processes (Ray takes over a "
                     "shard whose process dies) or, with --address, on a Ray cluster; a killed run resumes "
                     "where it stopped when the same command is run again.")
    p.add_argument("dataset", choices=DATASETS, metavar="DATASET",
                   help=f"what SRC holds: {', '.join(DATASETS)}")
    p.add_argument("src", metavar="SRC", help="the dataset as shipped: a directory, archive or fsspec URL; for "
                   "folder, also an im2rec .lst or Caffe list file ('path label' lines)")
    p.add_argument("--root", default=None, metavar="DIR",
                   help="folder a list file's relative paths start from, as im2rec's and convert_imageset's "
                        "root argument (default: the list file's folder)")
    p.add_argument("--to", required=True, metavar="FORMAT[,FORMAT...]",
                   help=f"output formats, comma-separated: {', '.join(FORMATS)}%(default).0s")
    p.add_argument("--out", required=True, metavar="DST",
                   help="destination directory or fsspec URL; gets <format>/..., manifest.json, classes.txt%(default).0s")
    p.add_argument("--workers", type=int, default=usable_cores(),
                   help="parallel workers (one CPU each): local processes without --address (--executor), Ray "
                        "tasks on a cluster")
    p.add_argument("--split", default=None, metavar="SPLIT[,SPLIT...]",
                   help="splits to convert, e.g. train,val (default: every split SRC holds; a list file's split is "
                        "named after the list, train.lst -> train, or by the one name given here%(default).0s)")
    ImageOptions.add_arguments(p)  # --resize/--size, --max-size, ..., --validate
    p.add_argument("--label-offset", type=int, default=0, choices=(0, 1),
                   help="TFRecord image/class/label: 0-based class indices, or 1 for TensorFlow's "
                        "build_imagenet_data convention (1..1000, 0 = background); RecordIO and LMDB stay 0-based")
    p.add_argument("--normalize", action="store_true",
                   help="compute exact per-channel mean/std of the train split: mean_std.json (MXNet "
                        "mean_r..std_b) and mean.binaryproto (Caffe) when every image has one size; with "
                        "--store-dtype float16/float32 and no --mean/--std, a first pass computes them and every "
                        "split is stored normalised with them")
    shards = p.add_mutually_exclusive_group()
    shards.add_argument("--shards", type=int, default=None, metavar="K",
                        help="shards per split (TFRecord files, units of work and of resume). Giving it also "
                             "writes RecordIO as K .rec files; without it RecordIO is one .rec per split")
    shards.add_argument("--shard-size", type=int, default=None, metavar="N",
                        help=f"without --shards: about N samples per shard (default: about {SAMPLES_PER_SHARD}, the "
                             "count a power of two from 16 up, as TensorFlow's 1,024 ImageNet shards; a quarter of "
                             "that where the only output is one .rec per split, whose shards are only units of "
                             "work; a small split still in 16 shards of 100 or more, so that several workers share "
                             "it)")
    shards.add_argument("--shard-bytes", default=None, metavar="SIZE",
                        help="about SIZE of input per shard instead (256MB, 1GiB), counted from the input files' "
                             "sizes: with pass-through, shard files come out about that size; re-encoded or "
                             "resized ones smaller")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="a quick trial: convert only N inputs of each split, a seeded sample (the first N when "
                        "not shuffled)")
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=None,
                   help="seeded global shuffle of each split at write time (sequential readers need it); "
                        "--no-shuffle keeps the source order (a list file's line order; an im2rec list's index "
                        "column is the RecordIO id either way). Default: on, except for ptb, whose windows "
                        "language models read in stream order%(default).0s")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed; same seed, same bytes")
    p.add_argument("--on-error", choices=ON_ERROR, default="fail",
                   help="a bad input: fail stops naming it; skip leaves it out and lists it in the summary "
                        "and manifest.json")
    p.add_argument("--address", default=None,
                   help="run on an existing Ray cluster: auto or ray://host:port (SRC and DST must then be "
                        "reachable from every node). Default: this machine (see --executor)%(default).0s")
    p.add_argument("--driver-writes", action="store_true",
                   help="workers return finished shards through Ray's object store and the driver writes them "
                        "to DST, for a destination the workers cannot reach (always on for memory://)")
    p.add_argument("--executor", choices=EXECUTORS, default="auto",
                   help="without --address: pool (auto) converts in local processes forked from a warm server, "
                        "and starts a local Ray runtime only for a shard whose process died (Ray retries and "
                        "bisects it, then takes the rest); ray hands every shard to Ray's workers once Ray is up. "
                        "With --address every shard runs on Ray")
    p.add_argument("--task-retries", type=int, default=TASK_RETRIES, metavar="N",
                   help="retries of a shard whose worker dies; then its inputs are bisected to find the one that "
                        "kills the worker (named, or skipped with --on-error skip)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="go on from a killed run of the same command; --no-resume starts over")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="convert an ImageNet source whose train split lacks classes its devkit lists, or a CIFAR "
                        "or Penn Treebank source that lacks files the dataset ships (each listed in the "
                        "summary); without it that is an error")
    p.add_argument("--strict", action="store_true",
                   help="identify every input by a checksum of its bytes as well as its size, modification time "
                        "and inode (local files: read again by the worker converting their shard; others: "
                        "while planning), so a resume notices an edit that kept all three")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a finished conversion in DST made with other options: its files (those its "
                        "manifest.json lists) are removed first; files gpufeed did not write are never touched")
    p.add_argument("--dry-run", action="store_true", help="list splits, samples and shards; write nothing")
    p.add_argument("--seq-len", type=int, default=35, help="ptb: tokens per window (a record holds seq_len+1)")
    p.add_argument("--ptb-mode", choices=PTB_MODES, default="window",
                   help="ptb: fixed windows of the token stream, or one record per sentence")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (where stderr is not a terminal, a log line every 30 s stands for it)")


def options_from_args(args):
    from gpufeed.convert.options import ConvertOptions, parse_bytes, parse_list

    return ConvertOptions(
        dataset=args.dataset, src=args.src, formats=parse_list(args.to, "--to"), out=args.out, root=args.root,
        workers=args.workers, splits=parse_list(args.split, "--split") if args.split else None,
        image=ImageOptions.from_args(args), label_offset=args.label_offset, normalize=args.normalize,
        shards=args.shards, shard_size=args.shard_size,
        shard_bytes=parse_bytes(args.shard_bytes, "--shard-bytes") if args.shard_bytes else None,
        limit=args.limit, shuffle=args.shuffle,
        seed=args.seed,
        on_error=args.on_error, address=args.address, resume=args.resume, overwrite=args.overwrite,
        allow_incomplete=args.allow_incomplete, strict=args.strict,
        dry_run=args.dry_run,
        seq_len=args.seq_len, ptb_mode=args.ptb_mode, progress=args.progress, driver_writes=args.driver_writes,
        task_retries=args.task_retries, local_start=True, executor=args.executor)


#: fsspec protocols whose files live only in the process that wrote them.
_IN_PROCESS = ("memory://",)


def check_lasting(out: str, flag: str = "--out") -> None:
    """A command's output must outlive the command: refuse a filesystem that lives in this process only."""
    from gpufeed.errors import ConfigError

    if str(out).startswith(_IN_PROCESS):
        raise ConfigError(f"{flag} {out}: a {str(out).split('://')[0]}:// filesystem lives only as long as this "
                          "process, so the output would be lost when the command ends; give a folder or a URL of "
                          "storage that keeps it")


def run(args) -> int:
    options = options_from_args(args)
    check_lasting(options.out)
    if options.local_start and not options.address and not options.dry_run:
        # The local processes' server imports OpenCV and the formats while this process imports the engine,
        # lists and plans (the engine would start it only once imported itself).
        from gpufeed.convert import forkserver

        forkserver.start()
    from gpufeed.convert.engine import convert
    from gpufeed.convert.progress import Progress, format_summary

    summary = convert(options, Progress(options.progress))
    print(format_summary(summary))
    empty = nothing_converted(summary)
    if empty:
        import sys

        print(f"gpufeed: error: {empty}", file=sys.stderr)
        return 1
    return 0


def nothing_converted(summary) -> str | None:
    """What to say where a split came out empty because its every input was skipped or left out while listing
    (``--on-error skip``): its outputs are complete and hold nothing, which no training wants, so the command says
    so and ends with status 1; ``None`` otherwise."""
    if getattr(summary, "dry_run", False) or not summary.complete or not summary.skipped:
        return None
    listing = len(summary.skipped) - sum(s.get("skipped", 0) for s in summary.samples.values())
    empty = [split for split, s in summary.samples.items()
             if not s.get("written") and (s.get("skipped") or (not s.get("planned") and listing > 0))]
    if not empty:
        return None
    unit = getattr(summary, "unit", "images")
    origin, reason = summary.skipped[listing if listing < len(summary.skipped) else 0]  # a conversion's skip first
    return (f"no {unit} of {' or '.join(empty)} were written: every input was skipped or left out while listing "
            f"(the reasons are listed above; the first: {origin}: {reason}). Fix or replace those inputs, or check "
            "that SRC is the dataset you meant")
