"""Helpers shared by the conversion tests: a tiny synthetic ImageNet, output comparison, CLI runs."""

from __future__ import annotations

import os
import subprocess
import sys

from gpufeed.convert.options import ConvertOptions
from gpufeed.convert.progress import Progress

CLASSES, PER_CLASS, VAL_PER_CLASS = 3, 8, 2
#: Small shards so that a tiny split still makes several shards (and a single .rec of several fragments).
SHARD_SIZE = 5


def synth_source(root) -> str:
    from gpufeed.pipelines.synth import synth_imagenet

    src = os.path.join(str(root), "imagenet")
    if not os.path.exists(os.path.join(src, "synth.json")):
        synth_imagenet(src, classes=CLASSES, per_class=PER_CLASS, val_per_class=VAL_PER_CLASS, seed=7,
                       layout="tree", bad_files=True)
    return src


def conversion(**kw) -> ConvertOptions:
    """ConvertOptions from keywords, the image options' among them (``resize=48``) given to its ImageOptions."""
    from gpufeed.pipelines.image_options import ImageOptions

    image = {k: kw.pop(k) for k in ImageOptions.names() if k in kw}
    return ConvertOptions(**kw, image=ImageOptions(**{"encode": None, **image}))


def options(src, out, **kw) -> ConvertOptions:
    base = dict(dataset="imagenet", src=str(src), formats=("lmdb", "recordio", "tfrecord"), out=str(out),
                workers=2, resize=48, on_error="skip", shard_size=SHARD_SIZE, progress=False)
    base.update(kw)
    return conversion(**base)


def tree_bytes(out) -> dict[str, bytes]:
    """Every file under ``out`` except the manifest (which records timings), by relative path."""
    files = {}
    for dirpath, _, names in os.walk(out):
        for n in names:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, out)
            if rel != "manifest.json":
                with open(p, "rb") as f:
                    files[rel] = f.read()
    return files


#: The child's Ctrl-C as a terminal delivers it. A shell that runs the test suite in the background ignores
#: SIGINT in what it starts, and a child inherits that: its Ctrl-C tests would then test nothing.
_SIGINT_AS_IN_A_TERMINAL = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                            "sys.argv[0] = 'gpufeed'; runpy.run_module('gpufeed', run_name='__main__', alter_sys=True)")


def cli(args, address=None, **kw) -> subprocess.Popen:
    """``gpufeed convert ...`` in a child process, joined to the session's Ray cluster when given."""
    cmd = [sys.executable, "-c", _SIGINT_AS_IN_A_TERMINAL, "convert", *map(str, args), "--no-progress"]
    if address:
        cmd += ["--address", address]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def cli_args(src, out, *extra):
    return ["imagenet", src, "--to", "lmdb,recordio,tfrecord", "--out", out, "--workers", "2", "--resize", "48",
            "--on-error", "skip", "--shard-size", str(SHARD_SIZE), *extra]


def journal_shards(out) -> int:
    """Shards the destination's journal records as done (0 before the journal exists)."""
    try:
        with open(os.path.join(out, ".gpufeed", "journal.jsonl"), "rb") as f:
            return f.read().count(b'"event":"shard"')
    except FileNotFoundError:
        return 0


def wait_for_shards(proc, out, n: int, timeout: float = 120.0) -> None:
    """Wait until the run ``proc`` has journalled ``n`` shards into ``out`` (or ended, or ``timeout`` passed)."""
    import time

    deadline = time.time() + timeout
    while journal_shards(out) < n and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)


class StopAfter(Progress):
    """Interrupts the run (as Ctrl-C would) once ``n`` shards are done."""

    def __init__(self, n: int):
        super().__init__(enabled=False)
        self.n = n

    def update(self, samples, nbytes):
        self.n -= 1
        if self.n <= 0:
            raise KeyboardInterrupt
