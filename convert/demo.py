"""``gpufeed demo [OUT]``: the main job end to end on a small synthetic ImageNet, in about a minute.

It writes a small ILSVRC2012 in its shipped layout (``ILSVRC2012_img_train.tar`` of per-class tars,
``ILSVRC2012_img_val.tar``, the devkit, and the known kinds of bad file), then runs what
``convert imagenet SRC --to <every format> --resize 256 --workers <cores> --on-error skip`` runs
(with small shards, so that every worker gets some),
then ``gpufeed verify``, and prints where everything is.
"""

from __future__ import annotations

import argparse
import os
import shlex

from gpufeed.machine import usable_cores


def add_arguments(p) -> None:
    p.add_argument("out", nargs="?", default="gpufeed-demo", metavar="OUT",
                   help="directory for the synthetic source (OUT/src) and the converted output (OUT/out)")
    p.add_argument("--classes", type=int, default=10, help="synthetic ImageNet classes")
    p.add_argument("--per-class", type=int, default=20, help="train images per class")
    p.add_argument("--workers", type=int, default=usable_cores(), help="parallel workers (local processes)")


def run(args) -> int:
    from gpufeed.convert import command
    from gpufeed.convert.engine import convert
    from gpufeed.convert.progress import Progress, format_summary
    from gpufeed.convert.verify import verify
    from gpufeed.formats import FORMATS
    from gpufeed.pipelines.synth import describe_planted, synth_imagenet

    src = os.path.join(args.out, "src")
    dst = os.path.join(args.out, "out")
    made = synth_imagenet(src, classes=args.classes, per_class=args.per_class,
                          val_per_class=max(1, args.per_class // 4), layout="archives", bad_files=True)
    print(f"synthesised {made['images']} ImageNet-like images ({made['image_bytes'] / 1e6:.1f} MB; "
          f"{describe_planted(made['bad_files'])}) in {src}")
    # The command printed is the command run: parsed as `gpufeed convert` parses it.
    argv = ["imagenet", src, "--to", ",".join(FORMATS), "--out", dst, "--resize", "256", "--shard-size", "50",
            "--workers", str(args.workers), "--on-error", "skip", "--no-resume"]
    print(f"running: convert {shlex.join(argv)}")
    parser = argparse.ArgumentParser(prog="gpufeed convert")
    command.add_arguments(parser)
    options = command.options_from_args(parser.parse_args(argv))
    summary = convert(options, Progress(options.progress))
    print(format_summary(summary))
    print(f"running: gpufeed verify {shlex.quote(dst)}")
    print(verify(dst, workers=args.workers).text())
    print("outputs:")
    for fmt in options.formats:
        print(f"  {fmt:10s} {os.path.join(dst, fmt)}")
    print(f"  manifest   {os.path.join(dst, 'manifest.json')}")
    return 0
