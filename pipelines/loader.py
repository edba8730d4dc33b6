"""Training and inference batches on the GPU from any gpufeed format: ``gpufeed.loader(...)``.

::

    import gpufeed
    train = gpufeed.loader(["out/tfrecord/train-00000-of-00004", ...], batch_size=256, decode="hw",
                           augment="train", rank=rank, world_size=world)
    for epoch in range(90):
        train.set_epoch(epoch)
        for x, y in train:            # x: N x 224 x 224 x 3 uint8 on the GPU (NHWC), y: int64 labels
            ...

Where the JPEGs are decoded (``decode``):

* ``cpu``: in DataLoader worker processes, one OpenCV thread each (DCT-domain downscale where the crop allows),
  then one pinned, asynchronous copy per batch on a stream of its own, a batch ahead of the model.
* ``gpu``: nvJPEG through ``torchvision.io.decode_jpeg(device="cuda")``: fast, but its kernels run on the
  SMs the model needs.
* ``hw``: the GPU's JPEG engines (NVJPG on A100/H100/H200) through NVIDIA nvImageCodec
  (``BackendKind.HW_GPU_ONLY``), which leave the SMs to the model; images the engines do not take
  (progressive JPEGs, some subsamplings) fall back to nvImageCodec's CUDA decoder, one batch call each.
* ``hybrid``: each batch split between the CPU workers and the engines: by default a fixed CPU share measured
  best for the task (:data:`HYBRID_CPU_SHARE`; every image on the CPU where a rank has the workers for it), or
  ``cpu_share="rates"``, the share from both sides' measured rates (the workers time each image they decode, the
  engines' batches are timed as they run beside the model). :func:`hybrid_split`, docs/loader.md.
* ``auto`` (the default): ``cpu`` for training where each rank on the node gets 28 workers or more by default
  (enough to feed an H200 training ResNet-50: one rank on 28 cores, 2 ranks on 64), or 15 where the workers decode
  only each crop's box and at most 4 ranks share the node (:func:`cpu_carries`), or where no GPU has JPEG
  engines; else ``hybrid`` (:func:`choose_decode`; ``Loader.decode_reason`` says why), inference always (its
  demand outruns the CPU workers).
  Raw pixels, CIFAR's and token ids always go the ``cpu`` way. The DataLoader workers per rank are the rank's
  share of the usable cores (:func:`default_workers`), less one for its own process where ranks share the node.

Where 4 ranks or more share the node and decode on their GPUs, each batch is handed out only once the loop's GPU
has done the step before (``run_ahead=0``, :func:`default_run_ahead`; ``run_ahead="off"`` for no limit): the
step's launches then begin on an idle GPU, and 4 ranks were fed better that way (docs/loader.md).

``augment="train"`` is torchvision's ``RandomResizedCrop(size)`` (scale 0.08-1, ratio 3/4-4/3) plus a
horizontal flip with p = 0.5, the crop of sample ``i`` drawn from ``(seed, i)`` on the CPU path; ``"eval"``
is the centre crop that resize-256-then-crop-224 keeps, resized to ``size``; an image stored at
``size`` x ``size`` already (``convert --size 224x224 --center-crop``, the inference recipe) is used as it
is. Raw pixel records (``--encode raw``) need ``decode="cpu"``, which then only crops. ``"cifar"`` is the
CIFAR ResNets' training augmentation at the stored size (zero-pad 4, random crop, flip, drawn from
``(seed, i)``), in the DataLoader workers or, with ``augment_on="gpu"``, over whole batches on the GPU (the
same pixels; two CPU workers then only read records). All four paths give the same
NHWC uint8 batches (the GPU paths crop and resize with bilinear ``roi_align``); ``normalize=True`` gives
NCHW float32 ``(x / 255 - mean) / std`` with ImageNet's statistics instead.

``augment="tokens"`` reads language-model windows (Penn Treebank converted with ``ptb_mode="window"``: ``seq_len
+ 1`` token ids per record) and yields ``(inputs, targets)``: two N x seq_len int64 tensors, ``ids[:-1]`` and
``ids[1:]``, on the device (shuffled by default: each window is one sample, its hidden state starting at zero).

Without torch, or without a GPU or nvImageCodec for the GPU paths, :func:`loader` raises one line naming
``pip install 'gpufeed[gpu]'`` and ``decode="cpu"``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence

import numpy as np

from gpufeed import io as gpufeed_io
from gpufeed.errors import ConfigError
from gpufeed.formats import format_of
from gpufeed.machine import default_sigterm, sigterm_held
from gpufeed.pipelines.batches_cpu import (BatchPool, CifarCollate, CpuBatch, CpuDecode, EncodedBytes, HybridSplit,
                                           MadeCount, TokenWindow, as_made, cifar_augment, collate_encoded,
                                           collate_tokens)
from gpufeed.pipelines.batches_gpu import (GPU_EXTRA, HwJpegDecoder, HybridDecoder, HybridRates,
                                           NvJpegDecoder, import_torch, decoded_batches, import_nvimgcodec,
                                           resolve_device)

DECODES = ("cpu", "gpu", "hw", "hybrid")
#: ``decode="auto"``: one of :data:`DECODES`, chosen by :func:`choose_decode`.
AUTO = "auto"
AUGMENTS = ("train", "eval", "cifar", "tokens")
#: Where ``augment="cifar"`` runs: in the DataLoader workers, or on the GPU over whole batches.
AUGMENT_ON = ("cpu", "gpu")
#: ImageNet channel statistics (RGB, 0-255 scale), what torchvision's models are trained with.
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
#: Expected rates for the first hybrid split, before measured waits steer it: one CPU worker decoding and
#: cropping a ~500x375 JPEG, and the H100/H200 JPEG engines together (nvImageCodec, ~140 KB photos).
CPU_WORKER_RATE = 300.0
HW_RATE = 13_000.0
#: ``cpu_share="rates"``: the hybrid split set from both sides' measured rates (:class:`HybridRates`).
RATES = "rates"
#: The hybrid path's CPU share of each batch by default, by augmentation. Every image the engines decode costs
#: the model time on the GPU (their work advances in the model's gaps: docs/loader.md), so the split that
#: balances both sides' rates gives them too much. Measured on ResNet-50 from recordio, side by side with that
#: split: training on 4 H100s sharing 64 cores, warm cache, 0.913 (0.7) and 0.914 (0.8) per rank against 0.862
#: (results/gpu-ranks-h100x4.txt); on one H200 with 16 cores 0.951 (0.8) against 0.896; inference on one H200
#: 0.700 (0.6) against 0.511 (results/gpu-feed-h200.txt).
HYBRID_CPU_SHARE = {"train": 0.75, "eval": 0.6}
#: Below this many DataLoader workers per rank the fixed shares above were never measured: the measured-rate
#: split, which follows what the workers decode, is used instead.
FIXED_SHARE_MIN_WORKERS = 12
#: A rank with :data:`CPU_ENOUGH_WORKERS` workers or more, each on a core of its own: its CPU workers decode every
#: image (the engines' part would only slow the model). One H100 on 32 cores, 32 workers, recordio, in one call:
#: hybrid at this share 0.980, at 0.75 0.931, cpu 0.950 (results/gpu-ranks-h100x2.txt).
ALONE_CPU_SHARE = 1.0


def default_read_ahead(ranks: int = 1) -> bool:
    """Whether the DataLoader workers read each batch ahead by default: where several ranks share the node
    (their cold reads together are what the disk limits; see :class:`Loader`)."""
    return ranks > 1


def region_decode_on(asked: bool | None, says: str = "region_decode=True") -> bool:
    """Whether the CPU workers decode only each crop's box of a JPEG (:func:`~gpufeed.pipelines.imageio.decode_region`,
    the same pixels for less work): ``asked``, or by default (None) wherever nvImageCodec is installed. Asked for
    where it is not: a :class:`ConfigError` naming the fix (``says``: how the caller spelt the setting)."""
    from gpufeed.pipelines.imageio import nvimgcodec_module

    if asked is False:
        return False
    installed = nvimgcodec_module() is not None
    if asked and not installed:
        raise ConfigError(f"{says} decodes only each crop's box with NVIDIA nvImageCodec's CPU backend, which is not "
                          f"installed: {GPU_EXTRA} (adds nvidia-nvimgcodec-cu13), or leave it out to decode whole "
                          "images")
    return installed


def parse_switch(text: str) -> bool | None:
    """An argparse ``type`` for a setting that is on, off or left to gpufeed (``auto``: None)."""
    import argparse

    choices = {"on": True, "off": False, "auto": None}
    if text not in choices:
        raise argparse.ArgumentTypeError(f"{text!r}: use on, off or auto")
    return choices[text]


#: ``run_ahead`` for no limit on how far the loop may queue work ahead of its GPU.
NO_LIMIT = "off"
#: The fewest ranks on a node whose loops the loader paces to their GPUs by default (:func:`default_run_ahead`):
#: measured to help at 4; 2 and 3 were not measured, and one rank loses the gap it opens.
PACED_RANKS = 4


def _number_or(word: str, number: type, what: str):
    """An argparse ``type``: the text ``word`` as it is, else the text as ``number`` (``what`` names it in the
    error)."""
    def parse(text: str):
        import argparse

        if text == word:
            return word
        try:
            return number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither {what} nor {word!r}") from None
    return parse


#: ``--run-ahead``'s text: a number of steps (0 or more), or :data:`NO_LIMIT`.
parse_run_ahead = _number_or(NO_LIMIT, int, "a number of steps")


def default_run_ahead(run_ahead, decode: str, ranks: int = 1) -> int | None:
    """How many steps the loop may queue ahead of its GPU (None: no limit) for a loader asked for ``run_ahead``
    (steps, :data:`NO_LIMIT`, or None for the default) decoding with ``decode`` in each of ``ranks`` ranks on the
    node. By default 0 where :data:`PACED_RANKS` ranks or more share the node and decode on their GPUs: each
    rank's launches then begin after its previous step is done, which fed 4 H100 ranks better in each of 7
    alternated pairs on three hosts (results/gpu-ranks-h100x4.txt, session 10); one rank alone has no all-reduce
    to wait in and loses the gap (~4 ms of a 66 ms ResNet-50 step), and 2 or 3 ranks were not measured, so no
    limit there."""
    if run_ahead == NO_LIMIT:
        return None
    if run_ahead is not None:
        return run_ahead
    return 0 if ranks >= PACED_RANKS and decode in ("gpu", "hw", "hybrid") else None


def hybrid_split(cpu_share, augment: str, workers: int, ranks: int = 1, cores: int | None = None,
                 region: bool | None = None):
    """The hybrid path's split for a loader asked for ``cpu_share`` (a float, ``"rates"`` or None for the
    default) with ``workers`` DataLoader workers in each of ``ranks`` ranks on a node of ``cores`` usable cores
    (None: this machine's): a fixed CPU share of each batch, or :data:`RATES`. The default never feeds a rank
    worse than the better of ``cpu`` and ``hw`` alone where that was measured: all on the CPU where the rank's
    workers carry it (:func:`cpu_carries`, decoding boxes alone as ``region`` says; :data:`ALONE_CPU_SHARE`), else
    the share measured best for the task."""
    if cpu_share is not None:
        return cpu_share
    if cpu_carries(workers, ranks, cores, augment, region):
        return ALONE_CPU_SHARE
    if workers >= FIXED_SHARE_MIN_WORKERS and augment in HYBRID_CPU_SHARE:
        return HYBRID_CPU_SHARE[augment]
    return RATES


#: Niceness the DataLoader workers add to their own (:func:`_init_worker`); 0 leaves them at the loop's. At 10
#: every training run fed less on the GPU machine (results/gpu-nice-h100.txt): the loop is not short of cores.
WORKER_NICE = 0
#: Physical cores each rank on the node keeps for its own process by default (``loop_cores``): none, so the
#: DataLoader workers may run on any core.
LOOP_CORES = 0
#: DataLoader workers per rank by default: its share of the usable cores, at most this many. One H200 on 32 cores
#: fed from 16 CPU workers kept only 44% of the cores busy and waited for its batches (AU 0.86); the cap bounds
#: the pinned batches the workers hold ahead (two each, 38 MB apiece at 256 x 224 x 224 x 3).
MAX_DEFAULT_WORKERS = 32
#: Batches each DataLoader worker prepares ahead of the loop (the DataLoader's ``prefetch_factor``).
PREFETCH_FACTOR = 2


def default_workers(ranks: int = 1, loop_cores: int = LOOP_CORES, says: str | None = None,
                    cores: frozenset[int] | None = None, usable: int | None = None) -> int:
    """DataLoader workers per rank when none are given: one per core of the rank's share of the usable cores, at
    most :data:`MAX_DEFAULT_WORKERS`. Where several ranks share the node, each rank's own process (the training
    loop, the engines' decoder threads, NCCL) keeps a core of its share: 16 workers for each of 4 ranks took all
    64 cores of the 4-GPU node before the main processes had any. One rank alone shares its cores with its
    workers, as measured best on 16 cores (results/gpu-nice-h100.txt). With ``loop_cores`` kept for each rank's
    process (:func:`worker_cores`; ``says`` names the setting in its error; ``cores``: those cores where the caller
    has them already), the share is of the cores the workers may use. ``usable``: another machine's usable cores
    (a results row's) instead of this one's."""
    from gpufeed.machine import usable_cores

    ranks = max(1, ranks)
    if loop_cores:
        share = len(cores if cores is not None else worker_cores(loop_cores, ranks, says)) // ranks
    else:
        share = (usable or usable_cores()) // ranks - (1 if ranks > 1 else 0)
    return max(1, min(MAX_DEFAULT_WORKERS, share))


def ranks_on_node(world_size: int | None = None) -> int:
    """The ranks sharing this node: torchrun's ``LOCAL_WORLD_SIZE`` where set, else ``world_size`` (every rank on
    one node)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or world_size or 1))


def worker_cores(loop_cores: int, ranks: int = 1, says: str | None = None) -> frozenset[int]:
    """The cores DataLoader workers may run on where each of the node's ``ranks`` keeps ``loop_cores`` physical
    cores (with their hyper-thread siblings) for its own process (:func:`gpufeed.machine.reserved_cores`): every
    usable core none of the ranks keeps, the same set in every rank. ``says``: how an error names the setting."""
    from gpufeed.machine import reserved_cores

    try:
        return frozenset(reserved_cores(loop_cores, ranks)[1])
    except ValueError as e:
        raise ConfigError(f"{says or f'loop_cores={loop_cores}'}: {e}; keep fewer (0: the workers may use every "
                          "core)") from None


#: GPUs with hardware JPEG decoders (NVJPG engines), as nvImageCodec's hardware backend drives them.
ENGINE_GPUS = ("A100", "A800", "A30", "H100", "H800", "H200", "H20", "GH200", "B100", "B200", "GB200", "L4", "L40")
#: DataLoader workers per rank from which the CPU workers alone feed each GPU training ResNet-50, however many
#: ranks share the node, where the node has a core for each (:func:`cpu_carries`). 4 H200s on 64 cores, recordio,
#: cold, the rate the workers made counted (session 14, results/gpu-ranks-h200x4.txt): 2 ranks x 31 workers, cpu
#: 0.967 against hybrid (0.75) 0.802; 3 ranks x 20, cpu 0.536 and 0.736 against 0.721, the workers making 122-167
#: img/s each, which puts an H200's 4,500 img/s at 27-37 workers. (Session 13's 3 x 20 at cpu 1.001 / 0.975, which
#: had set 20, counted only what the loop took: over its 30 timed steps it ate the 40 batches made before them.)
#: One H200 on 32 cores, 32 workers: 0.967 against 0.90 (results/gpu-ranks-h200x2.txt, the loop's rate).
CPU_ENOUGH_WORKERS = 28
#: Where the workers decode only each crop's box (:func:`region_decode_on`) and at most
#: :data:`REGION_CARRIES_RANKS` ranks share the node, this many workers a rank carry its training alone. 2 H200s on
#: 32 cores, 15 workers a rank, cold, counted, on two hosts in one session each (results/gpu-ranks-h200x2.txt,
#: session 15): cpu with boxes alone 1.000 and 0.945 (tfrecord 0.930, lmdb 0.911), whole JPEGs 0.990 and 0.918,
#: against hybrid's 0.895 and 0.893. 3 H200s on 64 cores, one host, counted (results/gpu-ranks-h200x4.txt, session
#: 16): cpu with boxes alone 0.897 from 20 workers and 0.852 from 12, against hybrid's 0.777 and the engines' 0.645.
#: 4 H200s on 64 cores, 15 workers a rank, one host, counted, 300,000 records and 200 timed steps (session 18):
#: cpu with boxes alone 0.999 against hybrid's 0.871 from records stored at 256 (52 KB), and 0.698 against 0.590
#: from captured 118 KB records, where the disk bounds every path (at its ceiling at most 0.875 a rank).
CPU_ENOUGH_WORKERS_REGION = 15
#: The most ranks of one node measured with :data:`CPU_ENOUGH_WORKERS_REGION` workers each (4 H200s, above); more
#: ranks keep the engines' share until measured.
REGION_CARRIES_RANKS = 4
#: The loader's augmentations whose demand the CPU workers alone may carry (:func:`cpu_carries`). Inference
#: takes 3.5 times training's images a step: one H200 rank with 32 CPU workers made 5,507 img/s against the
#: model's 15,800 (the engines alone 6,564), 2 ranks of 31 workers 3,341 each against hybrid's 5,654 (session 14).
CPU_CARRIES = ("train",)


def cpu_carries(workers: int, ranks: int = 1, cores: int | None = None, augment: str = "train",
                region: bool | None = None) -> bool:
    """Whether ``workers`` DataLoader workers in each of ``ranks`` ranks on a node of ``cores`` usable cores (None:
    this machine's) decode every image of ``augment``'s batches on the CPU faster than the engines would help:
    training only (:data:`CPU_CARRIES`), with :data:`CPU_ENOUGH_WORKERS` workers or more, each with a core of the
    rank's share (more workers than cores do not decode faster); :data:`CPU_ENOUGH_WORKERS_REGION` where they
    decode each crop's box alone (``region``, the loader's ``region_decode``: None where nvImageCodec is installed)
    and at most :data:`REGION_CARRIES_RANKS` ranks share the node."""
    from gpufeed.machine import usable_cores

    if augment not in CPU_CARRIES:
        return False
    ranks = max(1, ranks)
    cores = usable_cores() if cores is None else cores
    enough = CPU_ENOUGH_WORKERS
    if ranks <= REGION_CARRIES_RANKS and region_decode_on(region):
        enough = CPU_ENOUGH_WORKERS_REGION
    return min(workers, cores // ranks) >= enough


def choose_decode(device=None, ranks: int = 1, augment: str = "train", region: bool | None = None) -> tuple[str, str]:
    """``decode="auto"``: ``(path, why)`` from the cores, whether the GPU has JPEG engines, how many ranks share
    the node and the augmentation (the task): ``cpu`` where each rank's default workers carry it alone
    (:func:`cpu_carries`: training, 28 workers or more, e.g. 1 or 2 ranks on 64 cores, or 15 with ``region``
    decoding for 1 to 4 ranks, e.g. 2 on 32 cores or 4 on 64), or without a GPU; else
    ``hybrid`` (CPU workers and engines sharing each batch, :func:`hybrid_split`) on a GPU with engines and
    nvImageCodec installed; else ``cpu``."""
    from gpufeed.machine import usable_cores

    torch = import_torch()
    ranks = max(1, ranks)
    per_rank = usable_cores() // ranks
    device = resolve_device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "cpu", "no CUDA GPU"
    workers = default_workers(ranks)
    if cpu_carries(workers, ranks, augment=augment, region=region):
        each = "the node's one GPU" if ranks == 1 else f"each of the node's {ranks} ranks"
        boxes = ", decoding only each crop's box" if min(workers, per_rank) < CPU_ENOUGH_WORKERS else ""
        return "cpu", f"{per_rank} cores per rank: {workers} CPU workers feed {each} alone{boxes}"
    name = torch.cuda.get_device_name(device)
    if not any(gpu in name for gpu in ENGINE_GPUS):
        return "cpu", f"{per_rank} cores per rank, and the {name} has no JPEG engines gpufeed drives"
    try:
        import_nvimgcodec()
        import torchvision.ops  # noqa: F401
    except (ConfigError, ImportError):
        return "cpu", f"{per_rank} cores per rank; the engines need {GPU_EXTRA}"
    return "hybrid", f"{per_rank} cores per rank: the CPU workers and the {name}'s JPEG engines share each batch"


def data_paths(paths, format: str | None = None, split: str | None = None) -> tuple[list[str], str | None]:
    """``paths`` as a list of data files, and the format where that tells it: a conversion's destination or one
    format's folder in it (one folder holding gpufeed outputs, :func:`gpufeed.formats.outputs_in`) stands for
    the data files of its one format and split, or of the ``format`` and ``split`` asked for."""
    from gpufeed.formats import outputs_in

    paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if not paths:
        raise ConfigError("no input paths given to the loader")
    held = outputs_in(paths[0]) if len(paths) == 1 and os.path.isdir(paths[0]) else {}
    if not held:
        if split is not None:
            raise ConfigError(f"split={split!r} picks a split of a conversion's destination given as the one path; "
                              "these paths are data files already: leave split out")
        return paths, format
    picked = [key for key in held if format in (None, key[0]) and split in (None, key[1])]
    if len(picked) == 1:
        return held[picked[0]], picked[0][0]
    there = "; ".join(f"format={f!r}, split={s!r}" for f, s in held)
    asked = ", ".join(f"{k}={v!r}" for k, v in (("format", format), ("split", split)) if v is not None)
    raise ConfigError(f"{paths[0]} is a folder of gpufeed outputs ({there}): "
                      + (f"none is {asked}; " if not picked else "")
                      + "pick one with format= and split= (or give its data files)")


def _first_record_kind(paths: list[str], format: str | None) -> str:
    """What the first record of ``paths`` (data files) holds (``encoded``, ``raw``, ``tokens``)."""
    from gpufeed.formats import get_format

    with get_format(format or format_of(paths)).reader(paths[0]) as reader:
        return next(iter(reader)).kind


#: ``--cpu-share``'s text: a share from 0 to 1, or :data:`RATES`.
parse_cpu_share = _number_or(RATES, float, "a share from 0 to 1")


def _flag(default, cli_default=None, **cli):
    """A field a command line also takes (argparse's keywords in ``cli``; its default there ``cli_default``:
    None leaves the choice to the loader, as Python's None does)."""
    return dataclasses.field(default=default, metadata={"cli": {"default": cli_default, **cli}})


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """What a :class:`Loader` is asked for, checked once, here, whoever asks: ``gpufeed.loader(...)`` and
    ``gpufeed bench train`` (which builds one per grid point and checks its flags with one before running).
    ``decode`` may be ``"auto"`` here; the loader checks again with the path it chose. ``spelling`` is how the
    messages name a setting: as the Python keyword (``cpu_share=0.5``) or the command line's flag
    (``--cpu-share 0.5``)."""

    batch_size: int = 256
    decode: str = AUTO
    augment: str = "train"
    size: int = 224
    workers: int | None = _flag(None, type=int, help=(
        "DataLoader worker processes per rank (default: each rank's share of the usable cores, less one for its own "
        f"process where ranks share the node; at most {MAX_DEFAULT_WORKERS})"))
    seed: int = 0
    shuffle: bool | None = None
    drop_last: bool = True
    normalize: bool = False
    decode_threads: int = _flag(2, 2, type=int, help=(
        "GPU decode paths: decoders working on consecutive batches (threads, streams)"))
    decode_priority: int = _flag(0, 0, type=int, help=(
        "GPU decode paths: CUDA priority of the decoders' streams (negative: ahead of the model)"))
    augment_on: str = "cpu"
    window: int | None = None
    vocab: int | None = None
    read_ahead: bool = False
    cpu_share: float | str | None = _flag(None, type=parse_cpu_share, help=(
        f"hybrid: the share (0-1) of each batch decoded by the CPU workers, or {RATES} (the split set from both "
        "sides' measured rates); with --decode auto, where auto picks hybrid (default: every image on the CPU for "
        f"a rank with {CPU_ENOUGH_WORKERS} workers or more, each with a core; else {HYBRID_CPU_SHARE['train']} "
        f"training and {HYBRID_CPU_SHARE['eval']} inference with {FIXED_SHARE_MIN_WORKERS} workers or more; else "
        f"{RATES})"))
    worker_nice: int = _flag(WORKER_NICE, metavar="N", type=int, help=(
        "niceness the DataLoader workers add to their own (0-19), so the training loop's process gets a core first "
        f"when it needs one (default: {WORKER_NICE})"))
    loop_cores: int = _flag(LOOP_CORES, metavar="N", type=int, help=(
        "physical cores (with their hyper-thread siblings) each rank on the node keeps for its own process (the "
        "training loop, which launches the model's work): no DataLoader worker of any rank runs on them "
        f"(default: {LOOP_CORES}, the workers may run on every core)"))
    run_ahead: int | str | None = _flag(None, metavar="STEPS", type=parse_run_ahead, help=(
        "GPU devices: steps the training loop may queue on its GPU ahead of the one running; before handing out "
        "each batch the loader waits until the loop's stream has finished the work queued that many batches "
        f"before (0: all of it, so each step's launches begin on an idle GPU; {NO_LIMIT}: no limit; default: 0 "
        f"where {PACED_RANKS} ranks or more share the node and decode on their GPUs, else {NO_LIMIT})"))
    region_decode: bool | None = _flag(None, metavar="on|off|auto", type=parse_switch, help=(
        "CPU decoding: decode only each crop's box of a JPEG (NVIDIA nvImageCodec's libjpeg-turbo backend: the same "
        "pixels as decoding the whole image, ~15%% less CPU time for a random-resized crop of a 500x375 photo); "
        "default (auto): wherever nvImageCodec is installed (the gpu extra)"))
    in_order: bool | None = _flag(None, metavar="on|off|auto", type=parse_switch, help=(
        "DataLoader workers: hand out the batches in the order they were drawn (on), or each as soon as a worker has "
        "made it (off: a late batch holds no other back, and every worker that is done gets its next one); default "
        "(auto): in order"))
    spelling: str = dataclasses.field(default="python", compare=False, repr=False)

    @classmethod
    def add_arguments(cls, parser) -> None:
        """The command-line flags of the options a command takes as they are (``--workers``, ``--decode-threads``,
        ``--decode-priority``, ``--cpu-share``, ``--worker-nice``, ``--loop-cores``), one per field, from the
        fields' metadata."""
        for f in dataclasses.fields(cls):
            if "cli" in f.metadata:
                parser.add_argument(f"--{f.name.replace('_', '-')}", **f.metadata["cli"])

    def _says(self, name: str, value=None) -> str:
        value = getattr(self, name) if value is None else value
        if self.spelling == "cli":
            return f"--{name.replace('_', '-')} {value}"
        return f"{name}={value!r}"

    def __post_init__(self):
        decode, augment = self.decode, self.augment
        if decode not in (*DECODES, AUTO):
            raise ConfigError(f"{self._says('decode')} is not one of {', '.join((*DECODES, AUTO))}")
        if augment not in AUGMENTS:
            raise ConfigError(f"{self._says('augment')} is not one of {', '.join(AUGMENTS)}")
        if self.augment_on not in AUGMENT_ON:
            raise ConfigError(f"{self._says('augment_on')} is not one of {', '.join(AUGMENT_ON)}")
        if self.augment_on == "gpu" and (augment != "cifar" or decode not in ("cpu", AUTO)):
            raise ConfigError("augment_on='gpu' is for augment='cifar' with decode='cpu' (the ImageNet "
                              "augmentation runs on the GPU with decode='gpu', 'hw' or 'hybrid')")
        if augment == "cifar" and decode not in ("cpu", AUTO):
            raise ConfigError(f"augment='cifar' reads stored pixels: use decode='cpu' (not {decode!r}), and "
                              "augment_on='gpu' to augment on the GPU")
        if augment == "tokens" and decode not in ("cpu", AUTO):
            raise ConfigError(f"augment='tokens' reads token ids, which need no decoding: use decode='cpu' (not "
                              f"{decode!r})")
        share = self.cpu_share
        if share is not None and (decode not in ("hybrid", AUTO) or not (
                share == RATES or isinstance(share, (int, float)) and 0.0 <= share <= 1.0)):
            raise ConfigError(f"{self._says('cpu_share')}: a fixed share of each batch for the CPU workers, between "
                              f"0 and 1, or {RATES!r} (the split set from both sides' measured rates), for "
                              f"{self._says('decode', 'hybrid')} (None: {HYBRID_CPU_SHARE['train']} training, "
                              f"{HYBRID_CPU_SHARE['eval']} evaluation)")
        if self.batch_size < 1:
            raise ConfigError(f"{self._says('batch_size')}: must be at least 1")
        if not 0 <= self.worker_nice <= 19:
            raise ConfigError(f"{self._says('worker_nice')}: a niceness from 0 (the training loop's own priority) "
                              "to 19")
        if self.loop_cores < 0:
            raise ConfigError(f"{self._says('loop_cores')}: must be 0 (the workers may use every core) or more")
        if self.decode_threads < 1:
            raise ConfigError(f"{self._says('decode_threads')}: need at least 1")
        if self.workers is not None and self.workers < 0:
            raise ConfigError(f"{self._says('workers')}: must be 0 (read in the loop's own process) or more")
        ahead = self.run_ahead
        if ahead is not None and ahead != NO_LIMIT and not (isinstance(ahead, int) and ahead >= 0):
            off = NO_LIMIT if self.spelling == "cli" else repr(NO_LIMIT)
            raise ConfigError(f"{self._says('run_ahead')}: 0 (each batch after the loop's queued work is done) or "
                              f"more steps, or {off} (no limit)")
        for name, auto in (("region_decode", "where nvImageCodec is installed"), ("in_order", "in order")):
            if getattr(self, name) not in (None, True, False):  # the on/off/auto settings (parse_switch)
                on = "on, off or auto" if self.spelling == "cli" else f"True, False or None ({auto})"
                raise ConfigError(f"{self._says(name)}: {on}")
        if self.region_decode:  # asked for: nvImageCodec must be there, said as the caller spelt it
            region_decode_on(True, self._says("region_decode", "on" if self.spelling == "cli" else True))
        if self.normalize and augment == "tokens":
            raise ConfigError("normalize=True scales image pixels; token ids (augment='tokens') are not normalised")


class Loader:
    """Batches of one rank's share of ``paths``; iterate it once per epoch (:meth:`set_epoch` reshuffles).

    ``paths``: one format's data files (``.rec`` files, TFRecord or WebDataset shards, LMDB folders), or a
    conversion's destination (or one format's folder in it), which stands for its data files of the one format
    and split it holds, or of ``format`` and ``split`` (:func:`data_paths`).

    ``read_ahead``: each DataLoader worker asks the kernel for every record of its batch before reading the
    first (:meth:`~gpufeed.formats.base.Reader.prefetch`), so a cold batch is read at the disk's queue depth,
    not one record at a time. By default (None) on where several ranks share the node (``world_size`` > 1):
    4 H100 ranks from a cold virtio disk got 0.923 each with it against 0.628 without, 2 ranks 0.941 against
    0.946 (results/gpu-ranks-h100x4.txt); off for one rank, which on the H200 machine's local NVMe fed no
    better with it (16 workers reading one record each already keep that disk busy). Measure a mount with
    ``gpufeed bench train --read-ahead on,off``.

    ``cpu_share``: ``hybrid`` only, the share of each batch the CPU workers decode. By default
    (:func:`hybrid_split`) every image where the rank's workers carry it alone (:func:`cpu_carries`),
    else a fixed share measured best for the task (:data:`HYBRID_CPU_SHARE`: the engines'
    work serialises with the model's, so a split that balances both sides' rates gives them too much), or, with
    fewer than :data:`FIXED_SHARE_MIN_WORKERS` workers, the split from both sides' measured rates
    (:class:`HybridRates`), which ``cpu_share="rates"`` asks for anywhere; a number fixes it.

    ``run_ahead``: how many steps the training loop may queue on its GPU ahead of the one running: before handing
    out each batch the loader waits until the loop's stream has done the work queued that many batches before
    (0: all of it). By default (None) 0 where :data:`PACED_RANKS` ranks or more share the node and decode on their GPUs
    (:func:`default_run_ahead`: measured better there), else no limit (:data:`NO_LIMIT`).

    ``region_decode``: the CPU workers (``cpu``, and ``hybrid``'s CPU share) decode only each crop's box of a JPEG
    (:func:`~gpufeed.pipelines.imageio.decode_region`: the same pixels as decoding the whole image, 13-27% more
    images a second from a 2x H200 host's cores); by default (None) wherever nvImageCodec is installed,
    ``False`` never, ``True`` refuses to run without it. ``Loader.region_decode`` says what the workers do.

    ``in_order``: with DataLoader workers, False hands out each batch as soon as a worker has made it (the
    DataLoader's ``in_order=False``): a batch that comes late holds back neither the loop nor the workers that
    are done (in order, a worker gets its next batch only as the loop takes one, so while the loop waits for a late
    batch the others stop). Every batch is still handed out once, in the same stream of epochs, but near a late
    batch in another order, which a run's seed no longer fixes, and up to ``workers`` x 2 batches of one epoch (those
    in flight) may come in a later pass. None (default) and True: in order.

    ``decode_threads``: on the GPU paths, how many decoders (each a thread with its own stream) work on
    consecutive batches, so that one batch's engine work overlaps the next one's host-side work;
    ``decode_priority`` their streams' CUDA priority (:class:`GpuCrop`). ``augment="tokens"``: ``window`` is
    the ids every record must hold (``seq_len + 1``) and ``vocab`` the model's vocabulary size, both checked
    per record in the workers when given (:class:`TokenWindow`)."""

    def __init__(self, paths, format: str | None = None, batch_size: int = 256, decode: str = AUTO,
                 augment: str = "train", size: int = 224, rank: int | None = None, world_size: int | None = None,
                 workers: int | None = None, device=None, seed: int = 0, shuffle: bool | None = None,
                 drop_last: bool = True, normalize: bool = False, decode_threads: int = 2, decode_priority: int = 0,
                 augment_on: str = "cpu", window: int | None = None, vocab: int | None = None,
                 read_ahead: bool | None = None, cpu_share: float | str | None = None,
                 worker_nice: int = WORKER_NICE, loop_cores: int = LOOP_CORES, run_ahead: int | str | None = None,
                 split: str | None = None, region_decode: bool | None = None, in_order: bool | None = None):
        paths, format = data_paths(paths, format, split)
        read_ahead = default_read_ahead(world_size or 1) if read_ahead is None else read_ahead
        opts = LoaderOptions(batch_size=batch_size, decode=decode, augment=augment, size=size, workers=workers,
                             seed=seed, shuffle=shuffle, drop_last=drop_last, normalize=normalize,
                             decode_threads=decode_threads, decode_priority=decode_priority, augment_on=augment_on,
                             window=window, vocab=vocab, read_ahead=read_ahead, cpu_share=cpu_share,
                             worker_nice=worker_nice, loop_cores=loop_cores, run_ahead=run_ahead,
                             region_decode=region_decode, in_order=in_order)
        torch = import_torch()
        on_node = ranks_on_node(world_size)  # the ranks sharing this node's cores (torchrun's LOCAL_WORLD_SIZE)
        self.decode_reason = None
        if decode == AUTO:
            decode, self.decode_reason = (
                ("cpu", "stored pixels and token ids need no JPEG decoding") if augment in ("cifar", "tokens")
                else choose_decode(device, on_node, augment, region_decode))
            if decode != "cpu" and _first_record_kind(paths, format) != "encoded":
                decode, self.decode_reason = "cpu", "raw pixel records need no JPEG decoding"
            if cpu_share is not None and decode != "hybrid":
                raise ConfigError(f"{opts._says('cpu_share')} splits batches for decode='hybrid'; decode='auto' "
                                  f"chose {decode!r} here ({self.decode_reason}): pass decode='hybrid' to split "
                                  "them, or leave cpu_share out")
            opts = dataclasses.replace(opts, decode=decode)  # checked again with the path chosen
        self.options = opts
        self.augment_on = augment_on
        self.worker_nice = worker_nice
        self.format = format or format_of(paths)
        self.decode, self.augment, self.size, self.seed = decode, augment, size, seed
        self.batch_size, self.drop_last, self.normalize = batch_size, drop_last, normalize
        self.decode_threads, self.decode_priority = decode_threads, decode_priority
        self._ranks = world_size or 1  # every rank of the process group, on this node or not (its threads)
        self.shuffle = augment in ("train", "cifar", "tokens") if shuffle is None else shuffle
        self.device = resolve_device(device)
        # How far the loop may queue work ahead of its GPU (None: no limit); nothing to pace on a CPU device, which
        # runs each step as it is called.
        self.run_ahead = default_run_ahead(run_ahead, decode, on_node)
        self._pace = (StepPace(self.device, self.run_ahead) if self.run_ahead is not None and self.device.type == "cuda"
                      else None)
        if decode != "cpu":
            _require_cuda(torch, self.device, decode)
        if decode in ("hw", "hybrid"):
            import_nvimgcodec()
        # The cores this rank's workers may run on: all, or those no rank on the node keeps for its own process.
        self.worker_cpus = worker_cores(loop_cores, on_node, opts._says("loop_cores")) if loop_cores else None
        self.workers = default_workers(on_node, loop_cores, cores=self.worker_cpus) if workers is None else workers
        self.in_order = in_order is not False or not self.workers  # without workers, the loop makes them in order
        train = augment == "train"
        # The DataLoader pins the CPU paths' batches for a GPU; made in its workers' pooled blocks, which each
        # batch's pinning frees (batches_cpu.BatchPool).
        self._pins = self.device.type == "cuda" and decode in ("cpu", "hybrid")
        pool = BatchPool() if self._pins else None
        batch_transform = None
        shared = multiprocessing.get_context(self._start_method())  # how its workers will start: their shared values
        self._share = None
        self._rates = None  # hybrid with the split from measured rates: its HybridRates
        # The CPU workers decode only each crop's box of a JPEG where they can (the same pixels, less work).
        self.region_decode = (augment not in ("cifar", "tokens") and decode in ("cpu", "hybrid")
                              and region_decode_on(region_decode))  # asked for and missing: refused above
        if augment == "tokens":
            transform, self._collate = TokenWindow(window, vocab), collate_tokens
        elif augment == "cifar":
            on_gpu = augment_on == "gpu"
            transform = CpuDecode(True, size, seed, cifar=True, augment=not on_gpu, with_index=on_gpu)
            self._collate = CifarCollate(seed) if on_gpu else None
        elif decode == "cpu":  # each batch decoded straight into one tensor
            transform = CpuDecode(train, size, seed, region=self.region_decode)
            batch_transform, self._collate = CpuBatch(transform, pool), as_made
        elif decode == "hybrid":
            self._share = shared.Value("d", 0.0, lock=False)
            split = hybrid_split(cpu_share, augment, self.workers, on_node, region=self.region_decode)
            if split == RATES:
                self._rates = HybridRates(self._share, self.workers, decode_threads,
                                          self.workers * CPU_WORKER_RATE, HW_RATE)
            else:
                self._share.value = split
            transform = HybridSplit(CpuDecode(train, size, seed, region=self.region_decode), self._share, pool)
            batch_transform, self._collate = transform.batch, as_made
        else:
            transform, self._collate = EncodedBytes(train, seed), collate_encoded
        from gpufeed.formats.torch import MapDataset

        # The samples this loader's workers have made (samples_made), for a measurement to set beside the ones
        # its loop took.
        self._made = MadeCount(shared.RawArray("q", max(1, self.workers)))
        if batch_transform is not None:
            batch_transform = self._made.batches(batch_transform)
        else:
            transform = self._made.samples(transform)
        self.dataset = MapDataset(self.format, paths, transform=transform, rank=rank, world_size=world_size,
                                  even=True, read_ahead=read_ahead, batch_transform=batch_transform)
        self.dataset.close()  # workers open their own readers
        self.epoch = 0
        # The emulated storage tier this loader was made in, handed to its workers as they start: one started
        # from a fork server has the server's environment, which may predate the tier.
        self._tier = {var: os.environ.get(var) for var in gpufeed_io.TIER_VARS}
        self._order = _EpochBatches(len(self.dataset), seed, self.shuffle, batch_size, drop_last)
        self._decoder = None
        self._batches = None
        # The batches of every epoch from ``_stream_epoch`` on, decoded ahead across each epoch's end; None
        # until the first pass, and after a pass left before its end (the next one starts them afresh).
        self._stream = None
        self._stream_epoch = None

    def _start_method(self) -> str:
        """How DataLoader workers start. A worker forked while another thread of this process holds a lock
        keeps that lock held, and hangs where it takes it: the GPU paths run decoder threads (nvImageCodec's,
        the decode thread) here, and a rank of several runs its process group's threads (gloo's, NCCL's; a
        rank's forked worker was seen blocked on a futex mid-run, the rank waiting for its batch and the other
        rank in the all-reduce; the same hang is pytorch/pytorch#130610), so those start from a fork server (a
        clean process). The CPU path of a lone rank forks, which starts fastest."""
        return "fork" if self.decode == "cpu" and self._ranks == 1 else "forkserver"

    @property
    def cpu_share(self) -> float | None:
        """``hybrid``: the share of each batch the CPU workers decode now."""
        return None if self._share is None else self._share.value

    @property
    def paced_s(self) -> float | None:
        """Seconds this loader has held the loop back for its GPU so far (``run_ahead``); None where it does not
        pace the loop (no limit, or a CPU device)."""
        return self._pace.waited_s if self._pace is not None else None

    @property
    def samples_made(self) -> int:
        """Samples this loader's workers have made so far (decoded, or read for the GPU to decode), every epoch's,
        counted as each is done; where the loop takes batches faster than the workers make them, the count over a
        window is what they keep up, the batches taken also those made before it (:class:`MadeCount`)."""
        return self._made.total

    @property
    def batches_ahead(self) -> int:
        """Batches the workers hold ready ahead of the loop once it runs: a measurement that starts after them
        reads from the disk only what comes after these."""
        return self.workers * PREFETCH_FACTOR

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass delivers (its order drawn from ``(seed, epoch)``). A pass that ends moves to
        the next epoch by itself; the epoch after the one that just ended is the one the workers already
        started."""
        self.epoch = epoch

    def close(self) -> None:
        """Stop the DataLoader's workers now (they otherwise live as long as the loader)."""
        self._end_stream()
        self._batches = None
        self._decoder = None

    def _end_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()  # its decoder threads end
        self._stream = self._stream_epoch = None

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _dataloader(self):
        """One DataLoader for the loader's life: its workers persist across epochs, and its batch sampler draws
        each epoch's order from ``(seed, epoch)``, one epoch after another without end, so the workers go on
        into the next epoch while the loop takes the last batches of this one."""
        import torch

        if self._batches is None:
            self._batches = torch.utils.data.DataLoader(
                self.dataset, batch_sampler=self._order, num_workers=self.workers, collate_fn=self._collate,
                prefetch_factor=PREFETCH_FACTOR if self.workers else None,
                pin_memory=self._pins,
                persistent_workers=self.workers > 0,
                **({} if self.in_order else {"in_order": False}),
                worker_init_fn=functools.partial(_init_worker, nice=self.worker_nice, tier=self._tier,
                                                 cpus=self.worker_cpus),
                multiprocessing_context=self._start_method() if self.workers else None)
        return self._batches

    def _gpu_decoders(self) -> list:
        if self._decoder is None:
            args = (self.device, self.augment == "train", self.size, self.seed, self.decode_priority)
            if self.decode == "gpu":
                make = lambda: NvJpegDecoder(*args)  # noqa: E731
            elif self.decode == "hw":
                make = lambda: HwJpegDecoder(*args)  # noqa: E731
            else:
                make = lambda: HybridDecoder(HwJpegDecoder(*args))  # noqa: E731
            self._decoder = [make() for _ in range(self.decode_threads)]
        return self._decoder

    def __iter__(self) -> Iterator:
        """One epoch's batches (:meth:`set_epoch`'s, else the one after the last pass's). The workers' batches
        flow on across the epoch's end: a new epoch stalls the loop only where a pass was left before its end
        or :meth:`set_epoch` asked for another epoch than the next."""
        if not len(self):
            return
        if self._stream is None or self._stream_epoch != self.epoch:
            self._end_stream()
            self._order.start = self.epoch
            self._stream = self._batches_from_here()
        stream, self._stream_epoch = self._stream, None  # mid-pass: a pass left here restarts the stream
        for _ in range(len(self)):  # the stream has no end: every epoch's batches, one after another
            x, y = next(stream)
            if self._pace is not None:
                self._pace.wait()
            yield (normalise(x) if self.normalize else x), y
        self.epoch += 1
        self._stream_epoch = self.epoch

    def _batches_from_here(self) -> Iterator:
        """The decoded batches of every epoch from ``self._order.start`` on."""
        # The workers start (fork) here, with SIGTERM held until they have its default (machine.sigterm_held).
        # A fork server they start from is started first, outside it: it is no worker, and starting it starts
        # multiprocessing's resource tracker, which lets SIGTERM through in the calling thread when done.
        if self.workers and self._start_method() == "forkserver":
            from multiprocessing import forkserver

            forkserver.ensure_running()
        with opencv_threads(1), sigterm_held():
            batches = iter(self._dataloader())
        if self.decode != "cpu":
            decoders = self._gpu_decoders()
            gen = decoded_batches(batches, decoders, self.device,
                                  timing=self._rates.timing if self._rates else None)
        else:
            if self.augment == "tokens":
                batches, finish = ((ids,) for ids in batches), _shifted
            elif self.augment_on == "gpu":
                finish = _cifar_on_device
            else:
                finish = _as_is
            if self.device.type == "cuda":
                gen = decoded_batches(batches, [DeviceCopy(self.device, finish)], self.device)
            else:
                device = self.device  # the stream holds no reference to the loader (close() ends it)
                gen = (finish(*(t.to(device) for t in batch)) for batch in batches)
        return gen


class StepPace:
    """How far a training loop may run ahead of its GPU (:class:`Loader`'s ``run_ahead``): each time the loop asks
    for a batch, the work it queued since the last one (a step) is marked on its stream, and the host waits for
    the mark ``steps`` batches back (0: the one just made, so the loop's next launches begin on an idle GPU)."""

    def __init__(self, device, steps: int):
        import torch

        self.torch, self.device, self.steps = torch, device, steps
        self.marks: collections.deque = collections.deque()
        self.waited_s = 0.0  # seconds the loop was held back so far

    def wait(self) -> None:
        torch = self.torch
        t0 = time.perf_counter()
        stream = torch.cuda.current_stream(self.device)  # the loop's: this runs in the thread iterating the loader
        if self.steps == 0:
            stream.synchronize()
        else:
            mark = torch.cuda.Event()
            mark.record(stream)
            self.marks.append(mark)
            while len(self.marks) > self.steps:
                self.marks.popleft().synchronize()
        self.waited_s += time.perf_counter() - t0


def _init_worker(worker_id: int, nice: int = 0, tier: dict | None = None, cpus=None) -> None:
    """A DataLoader worker's start: the loader's emulated storage tier (``tier``: the variables of
    :data:`gpufeed.io.TIER_VARS` as the loader saw them, None for unset), one OpenCV thread
    (:func:`one_thread_per_worker`), then ``nice`` added to its niceness, so that the training loop's process,
    which launches the model's kernels, takes a core the moment it needs one instead of waiting behind busy
    workers (they still use every core it leaves idle), and the worker kept to ``cpus`` where given (the cores
    no rank keeps for its own process, :func:`worker_cores`). SIGTERM gets its default (:func:`default_sigterm`): a
    forked worker keeps the training process's handler (a Ray driver's raises SystemExit), and the DataLoader
    terminates a worker that does not stop when asked."""
    default_sigterm()
    for var, value in (tier or {}).items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    one_thread_per_worker(worker_id)
    if nice:
        os.nice(nice)
    if cpus:
        os.sched_setaffinity(0, cpus)


def one_thread_per_worker(_worker_id: int) -> None:
    """DataLoader workers are one per core already: OpenCV's own thread pool in each (a thread per core by
    default, for resizes and colour conversions) would put cores x workers threads on the cores. A worker
    started from a fork server sets one thread here; a forked one has it already (:func:`opencv_threads`
    around the fork): calling ``cv2.setNumThreads`` in a child forked after the parent's pool ran hangs."""
    import cv2

    if cv2.getNumThreads() != 1:
        cv2.setNumThreads(1)


@contextlib.contextmanager
def opencv_threads(n: int):
    """OpenCV's thread count set to ``n`` in this process for the block (DataLoader workers forked in it
    inherit ``n``), then restored."""
    import cv2

    before = cv2.getNumThreads()
    cv2.setNumThreads(n)
    try:
        yield
    finally:
        cv2.setNumThreads(before)


class DeviceCopy:
    """The CPU paths' copy of each (pinned) batch to the GPU, on a stream of its own and one batch ahead
    (:func:`decoded_batches`), then ``finish`` on the device tensors: the copy of the next batch overlaps the
    model's work on this one, where on the model's stream it would wait behind that work and hold the model up."""

    def __init__(self, device, finish):
        import torch

        self.device, self.finish = device, finish
        self.stream = torch.cuda.Stream(device)

    def decode(self, *tensors):
        return self.finish(*(t.to(self.device, non_blocking=True) for t in tensors))


def _as_is(x, y):
    return x, y


def _shifted(ids):
    """Token windows: inputs and next-token targets."""
    return ids[:, :-1], ids[:, 1:]


def _cifar_on_device(x, y, params):
    return cifar_augment(x, params), y


class _EpochBatches:
    """The DataLoader's batch sampler: epoch ``start``'s batches of sample indices, then the next epoch's, without
    end; each epoch's order a permutation drawn from ``(seed, epoch)`` when shuffling, else file order, cut into
    batches of ``batch_size`` (the last one of each epoch dropped where short, with ``drop_last``). An epoch's
    batches never mix with the next's. It holds no reference to the loader, so dropping a loader frees its
    DataLoader (and stops its workers) at once rather than at the next garbage collection."""

    def __init__(self, n: int, seed: int, shuffle: bool, batch_size: int, drop_last: bool):
        self.n, self.seed, self.shuffle, self.start = n, seed, shuffle, 0
        self.batch_size, self.drop_last = batch_size, drop_last

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        return np.random.default_rng((self.seed, epoch)).permutation(self.n).tolist()

    def __iter__(self):
        epoch, size = self.start, self.batch_size
        end = self.n - self.n % size if self.drop_last else self.n
        while end > 0:
            order = self.order(epoch)
            for i in range(0, end, size):
                yield order[i:i + size]
            epoch += 1


@functools.lru_cache(maxsize=None)
def imagenet_stats(device):
    """ImageNet's channel mean and std as 1 x 3 x 1 x 1 float32 tensors on ``device``, made once per device (read
    only; callers never write them). Made anew per batch they cost the loop its lead over the GPU: a tensor built
    from a Python list is copied from pageable host memory, and that copy waits for everything queued on the
    stream, the previous step's kernels included, so each step's launches began on an idle GPU."""
    import torch

    return (torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1),
            torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1))


def normalise(x_nhwc_u8, stats=None):
    """NHWC uint8 -> NCHW float32 ``(x - mean) / std`` with ImageNet's statistics (0-255 scale); ``stats``:
    :func:`imagenet_stats` made beforehand (where nothing may be copied from the host, e.g. in a CUDA graph)."""
    mean, std = stats if stats is not None else imagenet_stats(x_nhwc_u8.device)
    return x_nhwc_u8.permute(0, 3, 1, 2).float().sub_(mean).div_(std)


def _require_cuda(torch, device, decode: str) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"decode={decode!r} decodes on an NVIDIA GPU and torch sees none (device {device}); "
                          f"use decode='cpu', or on a GPU machine {GPU_EXTRA}")
    try:
        import torchvision.ops  # noqa: F401  (the GPU paths crop with roi_align)
    except ImportError:
        raise ConfigError(f"decode={decode!r} crops on the GPU with torchvision: {GPU_EXTRA}") from None


def loader(paths: str | Sequence[str], format: str | None = None, batch_size: int = 256, decode: str = AUTO,
           augment: str = "train", **options) -> Loader:
    """Batches ``(x, y)`` on the GPU from gpufeed files; see this module's documentation and :class:`Loader`."""
    return Loader(paths, format=format, batch_size=batch_size, decode=decode, augment=augment, **options)
