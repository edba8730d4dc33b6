"""``gpufeed bench train``: how well each format, read from each tier, keeps an accelerator busy.

A real input pipeline (a format's :class:`gpufeed.formats.torch.MapDataset`, a torch ``DataLoader`` with
worker processes, decode + ``RandomResizedCrop(224)`` + flip for training, centre crop for inference) feeds a
step of ResNet-50. The step is either real, on CUDA (torchvision ResNet-50, bf16 autocast, channels_last, SGD
for training, ``inference_mode`` for inference), or emulated where there is no GPU: a sleep of the step's
compute time from a measured profile (:mod:`gpufeed.bench.accelerator`), as DLIO / MLPerf Storage do.

The same loop first runs on synthetic tensors already in accelerator memory: that is the step's compute time,
and for every format and tier

    AU = steps x compute step time / wall time        (accelerator utilisation, MLPerf Storage)

so AU is images/s relative to a loop that never waits for data. Each step's wait for its batch is recorded
(p50/p99). ``--decode gpu`` ships the undecoded JPEG bytes to the GPU and decodes them there with
``torchvision.io.decode_jpeg(device="cuda")`` (nvJPEG), cropping and resizing on the GPU, in a background
thread on a side stream so decoding overlaps the previous step's compute. The other two datasets of the
mission have models of their own: ``--model cifar-resnet18`` (CIFAR-10, 32x32, augmentation in the workers or
on the GPU) and ``--model ptb-lstm`` (Penn Treebank windows into a 2-layer LSTM language model). Every row also
records the CPU cores the run used (CPU seconds of this process and its workers per second) and the memory the
workers hold of their own (USS).

Nothing here imports Ray; torch and torchvision are imported only when a benchmark runs, and the emulated
accelerator needs no torchvision.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import os
import statistics
import sys
from collections.abc import Callable, Iterator


from gpufeed.bench import MEMORY_TIER, SYNTHETIC
from gpufeed.bench.bottleneck import ate_ahead
from gpufeed.errors import ConfigError, GpufeedError
from gpufeed.machine import free_port, usable_cores
from gpufeed.bench.train_loop import LoopRun, timed_loop
from gpufeed.bench.train_models import CIFAR_MODELS, PTB_MODELS, make_accelerator, resolve_accelerator, synthetic_batches
from gpufeed.pipelines.loader import (AUTO, CPU_ENOUGH_WORKERS, CPU_ENOUGH_WORKERS_REGION, DECODES, RATES,
                                      REGION_CARRIES_RANKS, LoaderOptions, default_read_ahead, default_workers,
                                      hybrid_split, region_decode_on)

#: ``--read-ahead``: each DataLoader worker starts every record of its batch reading before it reads the
#: first (``on``), or reads record by record (``off``), or as the loader does by default (``auto``: on for
#: several ranks, :func:`~gpufeed.pipelines.loader.default_read_ahead`).
READ_AHEADS = ("auto", "on", "off")

TASKS = ("train", "infer")
#: Batch sizes of the published H200 measurements (shared/PERFORMANCE.md).
DEFAULT_BATCH = {"train": 256, "infer": 512}
#: Reads in flight at which a disk's ceiling is measured for a loader reading ahead, where the device does not say
#: how many it queues (``nr_requests``: 256 on the GPU machines' virtio disks), and at most.
READ_AHEAD_DEPTH = 256
CIFAR_SIZE = 32
#: Batch sizes of the language model (Zaremba et al. train the medium model with 20 sequences per step).
PTB_BATCH = {"train": 20, "infer": 20}
#: Least warm-up time of every timed loop on a real GPU, after ``--warmup-steps``.
CUDA_WARMUP_S = 2.0
_UNITS = {"images_per_s": "img/s", "au": "fraction", "data_wait_p50_ms": "ms", "data_wait_p99_ms": "ms",
          "data_wait_share": "fraction", "step_ms": "ms", "cpu_share": "fraction", "cpu_cores": "cores",
          "loader_mem_mb": "MB", "disk_read_mb_per_s": "MB/s", "disk_read_bytes": "bytes", "disk_busy": "fraction",
          "disk_reads_in_flight": "reads", "disk_read_request_kb": "KB",
          "cpu_busy": "fraction", "main_thread_busy": "fraction", "main_thread_waited": "fraction",
          "gpu_busy": "fraction", "gpu_sm_mhz": "MHz", "paced_share": "fraction", "made_per_s": "img/s",
          "taken_per_s": "img/s", "au_taken": "fraction"}


def _cycle(loader) -> Iterator:
    """Endless batches: a run may span epochs (the next epoch of a persistent-worker loader starts at once)."""
    while True:
        yield from loader


# ---------------------------------------------------------------------------------------------- the benchmark


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    tasks: tuple[str, ...] = TASKS
    decodes: tuple[str, ...] = ("cpu",)
    accelerator: str = "auto"
    profile: str = "h200"
    model: str = "resnet50"
    batch_size: int | None = None
    steps: int = 50
    warmup_steps: int = 10
    #: Neither given: fitted to a dataset too small for them (cold runs read each record once).
    fit_steps: bool = False
    repeats: int = 3
    warmup_runs: int = 0
    workers: int = 0
    image_size: int = 224
    cold: bool = True
    allow_invalid: bool = False
    seed: int = 0
    augment_ons: tuple[str, ...] = ("cpu",)
    decode_threads: int = 2
    decode_priority: int = 0
    read_aheads: tuple[str, ...] = ("off",)
    cuda_graph: bool = False
    cpu_share: float | str | None = None  # hybrid: a fixed CPU share, "rates" or None (the loader's default)
    worker_nice: int | None = None  # the DataLoader workers' added niceness (None: the loader's default)
    loop_cores: int | None = None  # physical cores each rank keeps from every worker (None: the loader's default)
    run_ahead: int | str | None = None  # steps the loop may queue ahead of its GPU ("off": no limit; None: default)
    region_decode: bool | None = None  # the CPU workers decode only each crop's box (None: where nvImageCodec is)
    in_order: bool | None = None  # the DataLoader hands out batches in order (False: each as soon as it is made)
    vocab: int | None = None  # language models: the dataset's vocabulary and window length (from its manifest)
    seq_len: int | None = None
    gpus: int = 1  # ranks of DistributedDataParallel, one GPU each
    trace: str | None = None  # a folder for each timed window's profiler trace (gpufeed.bench.trace)
    trace_steps: int = 8
    gpu_sample: bool = True  # nvidia-smi samples each timed window's GPU (kernel-time share, SM clock)
    auto_decodes: tuple[tuple[str, str], ...] = ()  # (task, decode path) that --decode auto chose for each task

    def decodes_for(self, task: str) -> tuple[str, ...]:
        """The decode paths a task's runs take: ``decodes`` with ``auto`` as chosen for the task (once each)."""
        auto = dict(self.auto_decodes).get(task, AUTO)
        return tuple(dict.fromkeys(auto if d == AUTO else d for d in self.decodes))

    def trace_of(self, label: str, run: int, ranks: "Ranks") -> tuple[str, int, dict] | None:
        """The trace of one timed window (``label``: what was measured), for :func:`timed_loop`."""
        if not self.trace:
            return None
        name = f"{label}-run{run}-rank{ranks.rank}.json"
        return (os.path.join(self.trace, name), self.trace_steps,
                {"what": label, "run": run, "rank": ranks.rank, "ranks": ranks.world})

    @property
    def cifar(self) -> bool:
        return self.model in CIFAR_MODELS

    @property
    def ptb(self) -> bool:
        return self.model in PTB_MODELS

    @property
    def dataset_image(self) -> str:
        """The benchmark dataset kind the model reads (``bench dataset --image``)."""
        return "cifar" if self.cifar else "ptb" if self.ptb else "imagenet"

    def batch(self, task: str) -> int:
        return self.batch_size or (PTB_BATCH if self.ptb else DEFAULT_BATCH)[task]

    def _region_decode(self, task: str, decode: str | None) -> dict:
        """``region_decode``: whether a row's CPU workers decoded only each crop's box of a JPEG (rows from before
        it existed decoded whole images); nothing where no JPEG is decoded on the CPU."""
        if decode not in ("cpu", "hybrid") or self.cifar or self.ptb:
            return {}
        return {"region_decode": region_decode_on(self.region_decode)}

    def _hybrid_split(self, task: str, decode: str | None) -> dict:
        """A hybrid row's split: ``cpu_share_fixed`` where the loader held the CPU share fixed (given, or its
        default for the task), nothing where the measured rates set it (as every hybrid row before 2026-11-26)."""
        if decode != "hybrid":
            return {}
        split = hybrid_split(self.cpu_share, augment_of(task), self.workers, self.gpus, region=self.region_decode)
        return {} if split == RATES else {"cpu_share_fixed": split}

    def params(self, task: str, decode: str | None, described: dict, read_ahead: str | None = None) -> dict:
        """A row's params; ``described`` is the accelerator's :meth:`describe`; ``read_ahead`` whether the
        loader's workers read each batch ahead (rows from before it existed read record by record)."""
        return {"task": task, "decode": decode, "batch_size": self.batch(task), "steps": self.steps,
                "warmup_steps": self.warmup_steps, "workers": self.workers,
                "image_size": None if self.ptb else self.image_size, "cold": self.cold if decode else None,
                **({"seq_len": self.seq_len} if self.ptb else {}),
                **({"augment": "cifar" if task == "train" else "eval"} if self.cifar else {}),
                **({"decode_threads": self.decode_threads, "decode_priority": self.decode_priority}
                   if decode in ("gpu", "hw", "hybrid") else {}),
                **self._hybrid_split(task, decode),
                **({"gpus": self.gpus} if self.gpus > 1 else {}),
                **({"read_ahead": read_ahead == "on"} if read_ahead else {}),
                **({"worker_nice": self.nice} if decode else {}),
                **self._region_decode(task, decode),
                **({"in_order": False} if decode and self.in_order is False and self.workers else {}),
                **({"loop_cores": self.kept} if decode and self.kept else {}),
                **self._run_ahead(decode, described),
                **described}

    def _run_ahead(self, decode: str | None, described: dict) -> dict:
        """A measured row's ``run_ahead``: the steps its loop could queue ahead of the GPU (None: no limit), as the
        loader sets them for this decode path and rank count (rows before 2026-11-27 have none: no limit)."""
        if not decode or described.get("accelerator_mode") != "measured":
            return {}
        from gpufeed.pipelines.loader import default_run_ahead

        return {"run_ahead": default_run_ahead(self.run_ahead, decode, self.gpus)}

    @property
    def nice(self) -> int:
        """The niceness the loader's workers run at."""
        from gpufeed.pipelines.loader import WORKER_NICE

        return WORKER_NICE if self.worker_nice is None else self.worker_nice

    @property
    def kept(self) -> int:
        """The physical cores each rank keeps for its own process, none of the workers' (the loader's
        ``loop_cores``)."""
        from gpufeed.pipelines.loader import LOOP_CORES

        return LOOP_CORES if self.loop_cores is None else self.loop_cores


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place among the benchmark's DistributedDataParallel ranks (one rank: ``Ranks()``):
    which share of the data its loader reads, and the collectives that keep the ranks in step."""

    rank: int = 0
    world: int = 1

    def agree(self, more: bool) -> bool:
        """Whether any rank wants another warm-up step (every rank then takes it)."""
        if self.world == 1:
            return more
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(more)], device=_collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def _collective_device():
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def make_loader(fmt: str, paths: list[str], task: str, decode: str, opts: TrainOptions, accel,
                augment_on: str = "cpu", ranks: Ranks = Ranks(), read_ahead: str = "off"):
    """The same :class:`gpufeed.pipelines.loader.Loader` users train from, for this task and decode path
    (CIFAR models: CIFAR's augmentation, in the workers or on the GPU as ``augment_on`` says), reading this
    rank's share of the records."""
    from gpufeed.pipelines.loader import Loader

    batch = opts.batch(task)
    augment = augment_of(task)
    if opts.cifar and task == "train":
        augment = "cifar"
    if opts.ptb:
        augment = "tokens"
    loader = Loader(paths, format=fmt, batch_size=batch, decode=decode, augment=augment,
                    augment_on=augment_on if augment == "cifar" else "cpu", size=opts.image_size, rank=ranks.rank,
                    world_size=ranks.world, workers=opts.workers, device=accel.device if accel.kind == "cuda" else "cpu",
                    seed=opts.seed, shuffle=task == "train", decode_threads=opts.decode_threads,
                    decode_priority=opts.decode_priority,
                    window=opts.seq_len + 1 if opts.ptb and opts.seq_len else None, vocab=opts.vocab,
                    read_ahead=read_ahead == "on", cpu_share=opts.cpu_share if decode == "hybrid" else None,
                    worker_nice=opts.nice, loop_cores=opts.kept, run_ahead=opts.run_ahead,
                    region_decode=opts.region_decode, in_order=opts.in_order)
    return loader


def require_fit(loader, paths: list[str], task: str, opts: TrainOptions, ranks: Ranks = Ranks()) -> None:
    """Raise where this rank's share of the records cannot feed a run: fewer than one batch, or (cold) fewer
    batches than the warm-up, timed and traced steps and what the workers read ahead, each record read once."""
    batch = opts.batch(task)
    if len(loader.dataset) < batch:
        raise ConfigError(f"{paths[0]}: {len(loader.dataset)} samples is fewer than one batch of {batch}"
                          + (f" for each of {ranks.world} ranks" if ranks.world > 1 else "")
                          + "; build a larger dataset or pass --batch-size")
    need = opts.warmup_steps + opts.steps + loader.batches_ahead + (opts.trace_steps if opts.trace else 0)
    if opts.cold and need > len(loader):
        raise ConfigError(
            f"{paths[0]}: {len(loader.dataset)} records{' per rank' if ranks.world > 1 else ''} make "
            f"{len(loader)} batches of {batch}, fewer than the {opts.warmup_steps} warm-up + "
            f"{opts.steps} timed steps{f' + {opts.trace_steps} traced' if opts.trace else ''} + the "
            f"{loader.batches_ahead} batches its {loader.workers} workers hold ahead, which a cold run reads once "
            f"(a second epoch would read the page cache, and batches read ahead before the timed steps would "
            f"leave them nothing to read from the disk): build a larger "
            f"dataset (gpufeed bench dataset -n), or pass fewer --steps / --warmup-steps / --workers, "
            f"or --no-cold")


def check_grid(accel, dst: str, info: dict, formats: list[str], opts: TrainOptions, ranks: Ranks = Ranks()) -> None:
    """Build (not start) every loader the grid runs, every task's, before anything is measured: a dataset too
    small for a batch or a cold run, or a loader option that does not apply, stops the run at once, not after
    the synthetic baseline and every configuration before the one it fails (a second task's larger batch: after
    the first task's whole grid). Every tier holds the same records, so ``dst``'s stand for them all."""
    from gpufeed.bench.read import dataset_paths

    for task in opts.tasks:
        for decode, read_ahead, augment_on, fmt in _configurations(task, opts, formats):
            paths = dataset_paths(info, dst, fmt)
            loader = make_loader(fmt, paths, task, decode, opts, accel, augment_on, ranks, read_ahead)
            try:
                require_fit(loader, paths, task, opts, ranks)
            finally:
                loader.close()


def _configurations(task: str, opts: TrainOptions, formats: list[str]):
    """(decode, read-ahead, augmentation side, format) of every configuration of ``task`` on one tier."""
    cifar_train = opts.cifar and task == "train"  # the one case where augmentation has a place
    return itertools.product(opts.decodes_for(task), opts.read_aheads, opts.augment_ons if cifar_train else ("cpu",),
                             formats)


def _warmup_s(accel) -> float:
    """Seconds of warm-up steps for a GPU's clocks to rise (:data:`CUDA_WARMUP_S`); none for a model on the CPU
    (DistributedDataParallel ranks over gloo, where no GPU is), whose steps were warmed up for nothing."""
    device = getattr(accel, "device", None)
    return CUDA_WARMUP_S if accel.kind == "cuda" and getattr(device, "type", "cuda") == "cuda" else 0.0


def _gpu(accel, opts: TrainOptions) -> str | None:
    """nvidia-smi's name for the accelerator's GPU, whose kernel-time share the timed windows sample (None: no
    sampling, off CUDA or with ``--no-gpu-sample``)."""
    from gpufeed.bench.results import gpu_name

    return gpu_name(getattr(accel, "device", None)) if accel.kind == "cuda" and opts.gpu_sample else None


def measure_synthetic(accel, task: str, opts: TrainOptions, ranks: Ranks = Ranks()) -> list[LoopRun]:
    from gpufeed.bench.results import repeat

    batch = opts.batch(task)
    runs = repeat(lambda _i: {"run": timed_loop(synthetic_batches(accel, batch, opts.image_size, opts.seed,
                                                                  opts.seq_len if opts.ptb else None),
                                                accel.step, accel.synchronize, batch, opts.steps,
                                                opts.warmup_steps, _warmup_s(accel), ranks.agree, gpu=_gpu(accel, opts),
                                                trace=opts.trace_of(f"{task}-synthetic", _i, ranks))},
                  opts.repeats, warmup=opts.warmup_runs, before_each=ranks.barrier)
    return [r["run"] for r in runs]


def measure_format(accel, fmt: str, paths: list[str], task: str, decode: str, opts: TrainOptions,
                   augment_on: str = "cpu", ranks: Ranks = Ranks(), read_ahead: str = "off",
                   label: str = "") -> list[LoopRun]:
    """``repeats`` runs, each with a fresh DataLoader and, with ``opts.cold``, the dataset evicted from the
    page cache first (the previous run's workers and readers are gone by then: mapped pages would stay; with
    several ranks, every rank's are gone before rank 0 evicts)."""
    from gpufeed.bench.cache import evict
    from gpufeed.bench.results import repeat

    def one(_i):
        loader = make_loader(fmt, paths, task, decode, opts, accel, augment_on, ranks, read_ahead)
        try:
            require_fit(loader, paths, task, opts, ranks)
        except ConfigError:
            loader.close()
            raise
        batches = _cycle(loader)
        try:
            run = timed_loop(batches, accel.step, accel.synchronize, opts.batch(task), opts.steps, opts.warmup_steps,
                             _warmup_s(accel), ranks.agree, epoch_batches=len(loader), data_path=paths[0],
                             gpu=_gpu(accel, opts), trace=opts.trace_of(label or f"{task}-{fmt}-{decode}", _i, ranks),
                             paced=(lambda: loader.paced_s) if loader.paced_s is not None else None,
                             made=lambda: loader.samples_made)
            return {"run": dataclasses.replace(run, cpu_share=loader.cpu_share)}
        finally:
            batches.close()
            loader.close()
            del batches, loader
            gc.collect()

    def before_each():
        ranks.barrier()
        if opts.cold and ranks.rank == 0:
            evict(*paths)
        ranks.barrier()

    runs = repeat(one, opts.repeats, warmup=opts.warmup_runs, before_each=before_each)
    return [r["run"] for r in runs]


@dataclasses.dataclass
class Cell:
    """One rank's runs of one configuration: the synthetic baseline (``tier`` None) or a format read from
    ``tiers[tier]``. Rows are made from the cells of every rank."""

    task: str
    tier: int | None
    decode: str | None
    augment_on: str | None
    fmt: str
    runs: list[LoopRun]
    compute_s: float
    described: dict
    validity: dict
    read_ahead: str | None = None

    @property
    def key(self) -> tuple:
        return self.task, self.tier, self.decode, self.read_ahead, self.augment_on, self.fmt


def measure_cells(kind: str, dst: str, info: dict, formats: list[str], tiers: list, opts: TrainOptions,
                  shared: dict | None = None, ranks: Ranks = Ranks(), device: str = "cuda",
                  wrap: Callable | None = None) -> Iterator[Cell]:
    """The grid as this rank measures it: per task, the synthetic baseline, then every tier x decode x
    format (x augmentation side for CIFAR training). ``wrap`` turns the accelerator's model into a
    DistributedDataParallel one; ``shared``: the emulated tiers' devices every rank joins (:func:`shared_tiers`)."""
    from gpufeed.bench.read import dataset_paths, tier_dataset

    for i, task in enumerate(opts.tasks):
        accel = make_accelerator(kind, task, opts.batch(task), opts.profile, opts.model, opts.seed, opts.vocab, device,
                                 graph=opts.cuda_graph and task == "infer")
        if i == 0:
            check_grid(accel, dst, info, formats, opts, ranks)
        if wrap is not None:
            wrap(accel)
        described = accel.describe()
        synthetic = measure_synthetic(accel, task, opts, ranks)
        compute_s = compute_step_time(synthetic)
        yield Cell(task, None, None, None, SYNTHETIC, synthetic, compute_s, described, {})
        cifar_train = opts.cifar and task == "train"
        for t, tier in enumerate(tiers):
            data_dir = tier_dataset(tier, dst)
            with tier_scope(tier, data_dir, opts.allow_invalid, shared=(shared or {}).get(t)) as validity:
                for decode, read_ahead, augment_on, fmt in _configurations(task, opts, formats):
                    label = "-".join([task, tier.name, fmt, decode, f"read-ahead-{read_ahead}"]
                                     + ([f"augment-{augment_on}"] if cifar_train else []))
                    runs = measure_format(accel, fmt, dataset_paths(info, data_dir, fmt), task, decode, opts,
                                          augment_on, ranks, read_ahead, label)
                    yield Cell(task, t, decode, augment_on if cifar_train else None, fmt, runs, compute_s, described,
                               validity, read_ahead)
        del accel
        gc.collect()


def summarize_runs(runs: list[LoopRun], compute_step_s: float, unit: str = "img/s") -> dict:
    """Row fields: samples/s as the primary metric (``images_per_s``, in ``unit``: img/s, or seq/s for token
    windows), AU, data-wait, CPU-core and worker-memory figures under ``metrics``, the per-step waits of every
    run under ``samples`` (for latency distributions)."""
    from gpufeed.bench.results import metrics_block, summarize

    figures = [r.figures(compute_step_s) for r in runs]
    metric = "sequences_per_s" if unit == "seq/s" else "images_per_s"
    return {**summarize(metric, unit, [f["images_per_s"] for f in figures]),
            "metrics": metrics_block(figures, _UNITS),
            "compute_step_s": compute_step_s,
            "samples": {"data_wait_ms": [round(w * 1e3, 3) for r in runs for w in r.waits_s]}}


def compute_step_time(synthetic_runs: list[LoopRun]) -> float:
    """Seconds of compute per step: the synthetic loop's median, real or emulated alike, so its own overhead
    (and a sleep's overshoot) counts as compute and the synthetic loop itself sits at AU = 1."""
    return statistics.median(r.wall_s / r.steps for r in synthetic_runs)


def tier_validity(tier, data_dir: str, allow_invalid: bool) -> dict:
    """An emulated tier's validity fields for its rows: whether the host disk under ``data_dir`` outruns it
    (raising where it does not, unless ``allow_invalid``), and the host disk's figures."""
    from gpufeed.bench.hostdisk import measure_host, require_valid, row_figures

    host = measure_host(data_dir)
    reason = require_valid(tier, host, allow_invalid)
    return {"valid": reason is None, "invalid_reason": reason, "host_disk": row_figures(host)}


@contextlib.contextmanager
def tier_scope(tier, data_dir: str, allow_invalid: bool, accounting: str = "device", shared: dict | None = None):
    """Run inside ``tier``: nothing to do for a real mount; for an emulated profile, check that the host disk
    under ``data_dir`` outruns it, then throttle this process and its DataLoader workers (they inherit the
    emulator through the environment; ``accounting`` as :meth:`Throttle.emulate` takes it). Yields the rows'
    validity fields (and the host disk's figures). ``shared`` (``{"state": path, "validity": fields}``): the
    device :func:`shared_tiers` made for every rank of the run, joined instead of made."""
    if tier.limits is None:
        yield {"valid": True, "invalid_reason": None}
        return
    from gpufeed.bench.emulate import Throttle

    if shared is not None:
        with Throttle.joined(shared["state"]):
            yield shared["validity"]
        return
    validity = tier_validity(tier, data_dir, allow_invalid)
    with Throttle.emulate(tier.limits, accounting=accounting, state_dir=data_dir):
        yield validity


@contextlib.contextmanager
def shared_tiers(tiers: list, dst: str, allow_invalid: bool, accounting: str = "device"):
    """``{tier index: {"state", "validity"}}`` for the emulated ``tiers``: one device each, made here (each
    checked against the host disk once) and joined by every rank, so N ranks share the tier's one budget of
    requests and bytes as N GPUs of one node share its disk. Removed afterwards. Nothing is exported to this
    process's environment: a rank is throttled only inside its tier's scope."""
    import tempfile

    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.read import tier_dataset

    made = {}
    try:
        for t, tier in enumerate(tiers):
            if tier.limits is None:
                continue
            data_dir = tier_dataset(tier, dst)
            validity = tier_validity(tier, data_dir, allow_invalid)
            fd, path = tempfile.mkstemp(prefix="gpufeed-tier-", suffix=".state", dir=data_dir)
            os.close(fd)
            made[t] = {"state": path, "validity": validity}
            Throttle.create(path, tier.limits, accounting=accounting)
        yield made
    finally:
        for entry in made.values():
            Throttle._attached.pop(entry["state"], None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry["state"])


def run_benchmark(dst: str, formats: list[str] | str | None, tiers: list, opts: TrainOptions, writer=None,
                  log: Callable[[str], None] = print) -> list[dict]:
    """The whole grid: per task, the synthetic baseline, then every tier x decode x format (``formats``: a list,
    --formats' text, or None for every format the dataset holds). Returns the rows,
    appending each to ``writer`` as soon as it is measured, so a run cut short keeps what it finished."""
    from gpufeed.bench.dataset import dataset_fields, formats_of, load_dataset_info

    kind = resolve_accelerator(opts.accelerator, emulable=opts.dataset_image == "imagenet")
    chosen: dict[str, tuple[str, str]] = {}  # task: (path, why) where --decode auto chose
    if AUTO in opts.decodes:
        from gpufeed.pipelines.loader import choose_decode

        for task in opts.tasks:
            chosen[task] = ("cpu", "the model reads no JPEGs") if opts.dataset_image != "imagenet" else (
                choose_decode("cuda" if kind == "cuda" else "cpu", opts.gpus, augment_of(task), opts.region_decode))
            log(f"decode auto{f' ({task})' if len(opts.tasks) > 1 else ''}: {chosen[task][0]} ({chosen[task][1]})")
        opts = dataclasses.replace(opts, auto_decodes=tuple((t, d) for t, (d, _why) in chosen.items()))
    if "gpu" in opts.decodes and kind != "cuda":
        raise ConfigError("--decode gpu needs a CUDA GPU with torchvision (nvJPEG); on this machine use "
                          "--decode cpu (the accelerator is emulated here)")
    info = load_dataset_info(dst)
    formats = formats_of(info, formats, dst)
    image = info.get("image", "imagenet")
    if image != opts.dataset_image:
        readers = {"imagenet": "resnet50 (or another torchvision ImageNet model)", "cifar": ", ".join(CIFAR_MODELS),
                   "ptb": ", ".join(PTB_MODELS)}
        raise ConfigError(f"{dst} holds {image} samples and --model {opts.model} reads {opts.dataset_image}: use "
                          f"--model {readers[image]}, or build a dataset with `gpufeed bench dataset OUT --image "
                          f"{opts.dataset_image}`")
    if opts.gpus > 1:
        import torch

        have = torch.cuda.device_count() if kind == "cuda" else 0
        if have < opts.gpus:
            raise ConfigError(f"--gpus {opts.gpus} runs one DistributedDataParallel rank per GPU and this machine has "
                              f"{have}; use --gpus {max(1, have)}, or `gpufeed bench feed` for emulated accelerators "
                              "sharing the disk")
    if opts.dataset_image != "imagenet" and kind != "cuda":
        raise ConfigError(f"--model {opts.model} needs a CUDA GPU with torch and torchvision; the emulated "
                          "accelerators model ResNet-50 on ImageNet")
    if opts.ptb:
        if not info.get("seq_len"):
            raise ConfigError(f"{dst} holds Penn Treebank sentences of different lengths; --model {opts.model} "
                              "trains on windows: convert with --ptb-mode window")
        opts = dataclasses.replace(opts, vocab=int(info["vocab"]), seq_len=int(info["seq_len"]))
    opts = _fitted_steps(opts, info, log)
    rows = []
    unit = "seq/s" if opts.ptb else "img/s"
    ceilings = _disk_ceilings(dst, info, formats, tiers, opts)
    cpu_ceilings = _cpu_decode_ceilings(dst, info, formats, opts)

    def emit(row):
        row = writer.write(row) if writer is not None else row
        rows.append(row)
        log(_one_line(row))

    busy_alone: dict[str, float] = {}  # each task's model-alone share of time its GPU ran kernels

    def row_of(cells: list[Cell]) -> dict:
        first = cells[0]
        if first.tier is None:
            head = {"tier": MEMORY_TIER, "mode": "measured", "profile": None, "format": SYNTHETIC,
                    "params": opts.params(first.task, None, first.described)}
        else:
            head = {**tiers[first.tier].row_fields(), "format": first.fmt,
                    "params": {**opts.params(first.task, first.decode, first.described, first.read_ahead),
                               **({"decode_auto": chosen[first.task][1]}
                                  if chosen.get(first.task, ("",))[0] == first.decode else {}),
                               "resize": info.get("resize"),
                               "store": info.get("store"),
                               **({"augment_on": first.augment_on} if first.augment_on else {})},
                    **dataset_fields(info, first.fmt), **first.validity}
        row = {"bench": "train", **head, **rank_summary(cells, unit)}
        busy = (row["metrics"].get("gpu_busy") or {}).get("median")
        if first.tier is None and busy is not None:
            busy_alone[first.task] = busy
        if first.tier is not None and not opts.ptb:
            from gpufeed.bench.bottleneck import limit, resources
            from gpufeed.pipelines.loader import HW_RATE

            row["resources"] = resources(row, ceilings.get((first.tier, first.fmt, first.task, first.read_ahead)),
                                         HW_RATE, usable_cores(),
                                         cpu_ceilings.get(first.task), busy_alone.get(first.task))
            row["limit"] = limit(row)
        return row

    dst = os.path.abspath(dst)
    if opts.gpus > 1:
        with shared_tiers(tiers, dst, opts.allow_invalid) as shared:
            run_ranks(opts.gpus, (kind, dst, info, formats, tiers, opts, shared), lambda cells: emit(row_of(cells)))
    else:
        for cell in measure_cells(kind, dst, info, formats, tiers, opts):
            emit(row_of([cell]))
    return rows


#: Fewest timed steps a fitted run keeps (below, the dataset is too small and the run says so).
MIN_FITTED_STEPS = 3


def _fitted_steps(opts: TrainOptions, info: dict, log: Callable[[str], None]) -> TrainOptions:
    """The default 10 warm-up and 50 timed steps, or, where neither was given and a cold run (each record read
    once) of each rank's share of the dataset holds fewer batches, as many as it holds: a quarter warm-up (at most
    10), the rest timed; `gpufeed bench dataset`'s default 2,000 records then make 1 + 6 training steps of 256."""
    if not opts.fit_steps or not opts.cold:
        return opts
    from gpufeed.pipelines.loader import PREFETCH_FACTOR

    ahead = opts.workers * PREFETCH_FACTOR
    held = min((int(info["n"]) // opts.gpus) // opts.batch(task) for task in opts.tasks)
    batches = held - ahead - (opts.trace_steps if opts.trace else 0)
    if batches >= opts.warmup_steps + opts.steps:
        return opts
    warmup = min(opts.warmup_steps, batches // 4)
    if batches - warmup < MIN_FITTED_STEPS:
        return opts  # check_grid says what to do, before anything is measured
    traced = f", {opts.trace_steps} traced" if opts.trace else ""
    log(f"the dataset holds {held} batches per rank, {ahead} of them read ahead by the workers: {warmup} warm-up "
        f"and {batches - warmup} timed steps{traced} (a larger dataset, `gpufeed bench dataset -n`, measures more)")
    return dataclasses.replace(opts, warmup_steps=warmup, steps=batches - warmup)


def _cpu_decode_ceilings(dst: str, info: dict, formats: list[str], opts: TrainOptions) -> dict:
    """``{task: ceiling}``: what every core decodes and crops at once from this dataset's records, for the tasks
    whose rows decode on the CPU (:func:`gpufeed.bench.cpuceiling.decode_ceiling`, measured once per machine and
    kept); nothing for CIFAR's and Penn Treebank's stored pixels and ids."""
    if opts.cifar or opts.ptb or not set(opts.decodes) & {"cpu", "hybrid", AUTO} or not formats:
        return {}
    from gpufeed.bench.cpuceiling import decode_ceiling

    fmt = formats[0]
    described = info["formats"][fmt]
    out = {}
    for task in opts.tasks:
        found = decode_ceiling(fmt, described["paths"][0], task == "train", opts.image_size,
                               record_bytes=described.get("record_bytes"),
                               region=region_decode_on(opts.region_decode))
        if found:
            out[task] = {**found, "source": "measured on this machine, every core decoding at once"}
    return out


def _disk_ceilings(dst: str, info: dict, formats: list[str], tiers: list, opts: TrainOptions) -> dict:
    """``{(tier index, format): ceiling}``: what the disk under each tier's data reads cold for that format's
    records at the loader's queue depth (every rank's workers, a record each), measured once per machine and
    disk (:func:`gpufeed.bench.hostdisk.ceiling`), or an emulated tier's own limit for that pattern. Measured
    before the grid, so no measurement runs beside a timed one."""
    from gpufeed.bench.hostdisk import ceiling, random_pattern
    from gpufeed.bench.read import tier_dataset
    from gpufeed.bench.results import disk_info

    out = {}
    for t, tier in enumerate(tiers):
        queue = disk_info(tier_dataset(tier, dst)).get("queue_requests") if tier.limits is None else None
        for fmt, task, ahead in itertools.product(formats, opts.tasks, opts.read_aheads):
            record = int(info["formats"][fmt]["record_bytes"])
            depth = ceiling_depth(opts, task, ahead, queue)
            if tier.limits is not None:
                iops = tier.limits.qd_iops(record, depth)
                out[(t, fmt, task, ahead)] = {"mb_per_s": iops * record / 1e6, "source": f"the {tier.name} profile",
                                              "pattern": random_pattern(record, depth)}
                continue
            try:
                found = ceiling(tier_dataset(tier, dst), record, depth)
            except OSError:
                found = None  # no room or no rights for the test file: the rows say nothing of the disk's ceiling
            if found:
                out[(t, fmt, task, ahead)] = {**found, "source": "measured cold on this machine"}
    return out


def ceiling_depth(opts: TrainOptions, task: str, read_ahead: str | None, queue: int | None) -> int:
    """The reads the loader keeps in flight, at which the disk's ceiling is measured: a record per worker of every
    rank; with read-ahead each worker asks for its whole batch at once, so as many as the device queues
    (``queue``: the block device's ``nr_requests``, else :data:`READ_AHEAD_DEPTH`), never fewer than without it.
    Measured at one record per worker instead, 4 H200 ranks read 1.62 GB/s from a disk "at most" 1.43 GB/s."""
    depth = max(1, opts.workers) * opts.gpus
    if read_ahead == "on":
        depth = min(depth * opts.batch(task), max(depth, min(queue or READ_AHEAD_DEPTH, READ_AHEAD_DEPTH)))
    return depth


def rank_summary(cells: list, unit: str) -> dict:
    """Row fields of one configuration measured on every rank: the slowest rank's figures (its AU against its
    own baseline: MLPerf Storage counts a configuration fed when every rank is), and with several ranks
    ``ranks`` (each rank's median samples/s and AU) and ``total_per_s`` (the ranks' rates added)."""
    worst = min(cells, key=lambda c: statistics.median(r.figures(c.compute_s)["au"] for r in c.runs))
    out = summarize_runs(worst.runs, worst.compute_s, unit)
    if len(cells) > 1:
        per_rank = [{"rank": rank, "per_s": statistics.median(r.images_per_s for r in c.runs),
                     "au": statistics.median(r.figures(c.compute_s)["au"] for r in c.runs),
                     "wait_share": statistics.median(r.wait_share for r in c.runs)}
                    for rank, c in enumerate(cells)]
        out.update(ranks=per_rank, total_per_s=sum(r["per_s"] for r in per_rank))
        late = late_shares(cells, worst)
        if late:
            from gpufeed.bench.results import stat

            out["metrics"]["any_rank_wait_share"] = {"unit": "fraction", **stat(late)}
    return out


def late_shares(cells: list, worst) -> list[float]:
    """Each run's share of the slowest rank's timed steps that some rank spent waiting for its batch: step by
    step, the longest of the ranks' waits. Training ranks meet in the gradients' all-reduce every step, so each
    step lasts at least as long as its latest rank's wait, whichever rank that was: one rank's own waits
    (``data_wait_share``) count only its own late batches. Empty where the ranks' runs do not line up (another
    number of runs or steps)."""
    if len({tuple(len(r.waits_s) for r in c.runs) for c in cells}) != 1:
        return []
    return [sum(map(max, zip(*(c.runs[i].waits_s for c in cells)))) / run.wall_s for i, run in enumerate(worst.runs)]


def run_ranks(world: int, grid: tuple, emit: Callable[[list], None], device_kind: str = "cuda") -> None:
    """Measure ``grid`` (``measure_cells``'s arguments) on ``world`` DistributedDataParallel ranks, one process
    and one GPU each (NCCL; ``device_kind="cpu"``: gloo on the CPU, for machines without GPUs), and call
    ``emit`` with every rank's :class:`Cell` of a configuration as soon as the last rank has measured it."""
    import queue as queue_mod

    import torch.multiprocessing as tmp

    results = tmp.get_context("spawn").Queue()
    ctx = tmp.start_processes(_rank_main, args=(world, free_port(), grid, device_kind, results), nprocs=world,
                              join=False, start_method="spawn")
    pending: dict[tuple, dict[int, Cell]] = {}

    def take(rank: int, cell: Cell) -> None:
        got = pending.setdefault(cell.key, {})
        got[rank] = cell
        if len(got) == world:
            emit([got[r] for r in range(world)])
            del pending[cell.key]

    try:
        done = False
        while not done:
            try:
                take(*results.get(timeout=1.0))
            except queue_mod.Empty:
                done = ctx.join(timeout=0)
        while True:  # what the ranks put before they exited
            try:
                take(*results.get(timeout=0.1))
            except queue_mod.Empty:
                break
    except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as e:
        raise ConfigError(f"a DistributedDataParallel rank failed: {str(e).strip().splitlines()[-1]}") from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def _rank_main(rank: int, world: int, port: int, grid: tuple, device_kind: str, results) -> None:
    """One rank: its GPU (or the CPU), the process group, the accelerator's model wrapped in
    DistributedDataParallel (gradients all-reduced every training step), its loader's share of the data."""
    import torch
    import torch.distributed as dist

    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    else:  # the ranks share the machine's cores: one intra-op pool each as large as the whole would oversubscribe it
        torch.set_num_threads(max(1, usable_cores() // world))
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)

    def wrap(accel):
        from torch.nn.parallel import DistributedDataParallel

        if accel.task == "train":
            accel.model = DistributedDataParallel(accel.model, device_ids=[rank] if device_kind == "cuda" else None)

    try:
        for cell in measure_cells(*grid, ranks=Ranks(rank, world),
                                  device="cuda" if device_kind == "cuda" else "cpu", wrap=wrap):
            results.put((rank, cell))
    finally:
        dist.destroy_process_group()


def _one_line(row: dict) -> str:
    p, m = row["params"], row["metrics"]
    cores = m.get("cpu_cores", {}).get("median")
    ate = ate_ahead(row)
    return (f"{p['task']:5s} {row['format']:9s} {row['tier']:8s} decode={p['decode'] or '-':3s} "
            + (f"read-ahead={'on' if p['read_ahead'] else 'off'} " if "read_ahead" in p else "")
            + ("graph " if p.get("cuda_graph") else "")
            + (f"augment={p['augment_on']} " if p.get("augment_on") else "")
            + (f"nice={p['worker_nice']} " if p.get("worker_nice") else "")
            + (f"loop-cores={p['loop_cores']} " if p.get("loop_cores") else "")
            + (f"run-ahead={p['run_ahead']} " if p.get("run_ahead") is not None else "")
            + (f"region={'on' if p['region_decode'] else 'off'} " if "region_decode" in p else "")
            + ("in-order=off " if p.get("in_order") is False else "") +
            f"workers={p.get('workers')} "
            f"{row['median']:9.1f} {row['unit']}  AU {m['au']['median']:.3f}  "
            f"wait p50 {m['data_wait_p50_ms']['median']:.1f} ms p99 {m['data_wait_p99_ms']['median']:.1f} ms"
            + (f"  {cores:.2f} cores" if cores is not None else "")
            + (f"  (the loop took {ate[1]:.1f} {row['unit']}, partly batches made before the timed steps)"
               if ate else "")
            + f"  ({p['accelerator_mode']} {p['accelerator']})"
            + (f"  limit: {row['limit']['text']}" if row.get("limit") else ""))


# ------------------------------------------------------------------------------------------------------ the CLI


def _csv(choices: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)} (comma-separated)")
        return items
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gpufeed.bench.cli import add_tier_arguments
    from gpufeed.formats import FORMATS

    parser.add_argument("dst", help="benchmark dataset directory, written by `gpufeed bench dataset DST`")
    add_tier_arguments(parser)
    parser.add_argument("--formats", default=None,
                        help=f"formats to feed from, comma-separated, of {', '.join(FORMATS)} (default: every format "
                             "DST holds)")
    parser.add_argument("--task", type=_csv(TASKS), default=",".join(TASKS), help="train, infer or both")
    parser.add_argument("--decode", type=_csv((AUTO, *DECODES)), default=AUTO,
                        help="where JPEGs are decoded, one or several: auto (what gpufeed.loader picks for each task "
                             "from the cores, the ranks and the GPU's JPEG engines: cpu for training where each rank "
                             f"gets {CPU_ENOUGH_WORKERS} workers or more, or {CPU_ENOUGH_WORKERS_REGION} decoding "
                             f"only each crop's box with up to {REGION_CARRIES_RANKS} ranks, else hybrid), "
                             "cpu (DataLoader workers), gpu (nvJPEG on the SMs), hw (the GPU's JPEG engines, "
                             "nvImageCodec), hybrid (CPU workers and engines)")
    parser.add_argument("--accelerator", choices=("auto", "cuda", "emulated"), default="auto",
                        help="auto: CUDA when torch sees a GPU and torchvision is installed, else emulated")
    parser.add_argument("--profile", default="h200",
                        help="emulated accelerator profile (gpufeed.bench.accelerator.PROFILES)")
    parser.add_argument("--model", default=None,
                        help="default: the one that reads what DST holds (resnet50, cifar-resnet18 or ptb-lstm); "
                             "on CUDA: a torchvision ImageNet model (resnet50), "
                             f"{', '.join(CIFAR_MODELS)} (bench dataset --image cifar) or {', '.join(PTB_MODELS)} "
                             "(a 2-layer 650-unit LSTM language model; --image ptb or a converted Penn Treebank)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per step (default 256 for train, 512 for infer; 20 for ptb-lstm)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per run (default 50, or with --warmup-steps not given either, as many as a "
                             "cold run of a smaller dataset holds)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="untimed steps at the start of every run (worker start-up, cuDNN autotuning; default "
                             "10, fitted with --steps)")
    parser.add_argument("--image-size", type=int, default=None,
                        help=f"crop size fed to the model (default 224; {CIFAR_SIZE} for the CIFAR models)")
    parser.add_argument("--augment-on", type=_csv(("cpu", "gpu")), default="cpu",
                        help="CIFAR models: where training augmentation (pad 4, crop, flip) runs, one or both: "
                             "cpu (DataLoader workers) or gpu (whole batches on the GPU)")
    parser.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                        help="evict the dataset from the page cache before every run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the crops, the model weights and the synthetic batches")
    parser.add_argument("--gpus", type=int, default=1,
                        help="DistributedDataParallel ranks, one GPU each (NCCL): each rank's loader reads its share "
                             "of the format with --workers workers; a row reports the slowest rank's AU and every "
                             "rank's under `ranks`")
    parser.add_argument("--read-ahead", type=_csv(READ_AHEADS), default="auto",
                        help="on: each DataLoader worker starts reading every record of its batch before it uses the "
                             "first; off: record by record; auto: the loader's default (on where --gpus ranks share "
                             "the node); on,off measures both")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="inference: run the model's step as one CUDA graph (the synthetic baseline too), as "
                             "inference servers do; the loop's thread then launches one graph per batch")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="after each timed window, --trace-steps more steps of every rank recorded by torch's "
                             "profiler (the GPU's kernels and copies on every stream) as Chrome traces in DIR; "
                             "`python -m gpufeed.bench.trace ALONE.json FED.json` compares the model's kernels "
                             "alone and fed (the traced steps count in no figure; a name already in DIR gets -2, "
                             "-3, ...: no file is written over)")
    parser.add_argument("--trace-steps", type=int, default=8, help="steps each --trace records (default 8)")
    parser.add_argument("--gpu-sample", action=argparse.BooleanOptionalAction, default=True,
                        help="sample each timed window's GPU with nvidia-smi every 200 ms (its kernel-time share "
                             "and SM clock in the row); --no-gpu-sample leaves the driver's tool out of the run")
    # The loader's own settings, their flags made from LoaderOptions' fields.
    LoaderOptions.add_arguments(parser)


def augment_of(task: str) -> str:
    """The loader's augmentation for a task: training crops, or evaluation's centre crop for inference."""
    return "train" if task == "train" else "eval"


def _read_aheads(asked, gpus: int) -> tuple[str, ...]:
    """``--read-ahead`` as the runs use it: ``auto`` becomes the loader's default for ``gpus`` ranks, so each
    row records what its workers did."""
    auto = "on" if default_read_ahead(gpus) else "off"
    return tuple(dict.fromkeys(auto if r == "auto" else r for r in asked))


def options_from_args(args) -> TrainOptions:
    fit_steps = args.steps is None and args.warmup_steps is None
    args.steps = 50 if args.steps is None else args.steps
    args.warmup_steps = 10 if args.warmup_steps is None else args.warmup_steps
    if args.model is None:
        args.model = _model_for(args.dst)
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.warmup_steps < 0 or args.warmup < 0:
        raise ConfigError("--warmup-steps and --warmup must be >= 0")
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, not {args.gpus}")
    if args.gpus > 1 and args.accelerator == "emulated":
        raise ConfigError("--gpus runs real GPUs; for several emulated accelerators sharing the disk use "
                          "`gpufeed bench feed`")
    if args.cuda_graph and (args.accelerator == "emulated" or args.model in PTB_MODELS
                            or "infer" not in args.task):
        raise ConfigError("--cuda-graph captures a CUDA image model's inference step: use it with --task infer (or "
                          "train,infer: training stays eager) on a GPU, and an image model")
    if args.trace is not None:
        if args.accelerator == "emulated":
            raise ConfigError("--trace records what a real model's steps did on the device: drop --accelerator "
                              "emulated (the emulated accelerator only sleeps)")
        if args.trace_steps < 1:
            raise ConfigError(f"--trace-steps {args.trace_steps}: at least 1 step is traced")
        try:
            os.makedirs(args.trace, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--trace {args.trace}: cannot make the folder ({e.strerror}); name a writable one")
    if args.model in CIFAR_MODELS + PTB_MODELS and args.accelerator == "emulated":
        raise ConfigError(f"--model {args.model} runs on a CUDA GPU; the emulated accelerators model "
                          "ResNet-50 on ImageNet (drop --accelerator emulated)")
    if args.model in PTB_MODELS:
        if tuple(args.decode) not in (("cpu",), (AUTO,)) or tuple(args.augment_on) != ("cpu",):
            raise ConfigError(f"--model {args.model} reads token ids, which need no decoding and no augmentation: "
                              "drop --decode and --augment-on")
        if args.image_size is not None:
            raise ConfigError(f"--image-size is for the image models; --model {args.model} reads windows of the "
                              "length they were converted with (--seq-len)")
    elif args.model in CIFAR_MODELS:
        if tuple(args.decode) not in (("cpu",), (AUTO,)):
            raise ConfigError(f"--model {args.model} reads CIFAR's stored pixels: --decode cpu (choose where the "
                              "augmentation runs with --augment-on cpu,gpu)")
    elif tuple(args.augment_on) != ("cpu",):
        raise ConfigError(f"--augment-on is for the CIFAR models ({', '.join(CIFAR_MODELS)}); ImageNet "
                          "augmentation runs on the GPU with --decode gpu, hw or hybrid")
    # The loader's own rules, spelled as this command's flags: --cpu-share applies to the hybrid rows.
    given = {k: v for k, v in (("batch_size", args.batch_size), ("worker_nice", args.worker_nice),
                               ("loop_cores", args.loop_cores), ("run_ahead", args.run_ahead),
                               ("region_decode", args.region_decode), ("in_order", args.in_order))
             if v is not None}
    if args.workers is None:
        from gpufeed.pipelines.loader import LOOP_CORES

        kept = max(0, LOOP_CORES if args.loop_cores is None else args.loop_cores)  # below 0: refused below
        workers = default_workers(args.gpus, kept, f"--loop-cores {kept}")
    else:
        workers = args.workers
    LoaderOptions(decode="hybrid" if {"hybrid", AUTO} & set(args.decode) else "cpu", cpu_share=args.cpu_share,
                  workers=workers, decode_threads=args.decode_threads, decode_priority=args.decode_priority,
                  spelling="cli", **given)
    if args.accelerator != "cuda":
        from gpufeed.bench.accelerator import get_profile

        get_profile(args.profile)
    return TrainOptions(tasks=tuple(args.task), decodes=tuple(args.decode), accelerator=args.accelerator,
                        profile=args.profile, model=args.model, batch_size=args.batch_size, steps=args.steps,
                        warmup_steps=args.warmup_steps, repeats=args.repeats, warmup_runs=args.warmup,
                        workers=workers, cold=args.cold, augment_ons=tuple(args.augment_on),
                        image_size=args.image_size or (CIFAR_SIZE if args.model in CIFAR_MODELS else 224),
                        allow_invalid=args.allow_invalid, seed=args.seed, decode_threads=args.decode_threads,
                        decode_priority=args.decode_priority, gpus=args.gpus,
                        read_aheads=_read_aheads(args.read_ahead, args.gpus), cuda_graph=args.cuda_graph,
                        cpu_share=args.cpu_share, worker_nice=args.worker_nice, loop_cores=args.loop_cores,
                        run_ahead=args.run_ahead, region_decode=args.region_decode, in_order=args.in_order,
                        fit_steps=fit_steps,
                        trace=args.trace, trace_steps=args.trace_steps,
                        gpu_sample=args.gpu_sample)


def _model_for(dst: str) -> str:
    """The model that reads what ``dst`` holds, where ``--model`` is not given: ResNet-50 for ImageNet-like images,
    the first CIFAR ResNet for CIFAR, the LSTM for Penn Treebank."""
    from gpufeed.bench.dataset import load_dataset_info

    try:
        image = load_dataset_info(dst).get("image", "imagenet")
    except (GpufeedError, OSError, ValueError, KeyError):
        return "resnet50"  # what is wrong with DST is said where it is read
    return {"cifar": CIFAR_MODELS[0], "ptb": PTB_MODELS[0]}.get(image, "resnet50")


def run(args) -> int:
    from gpufeed.bench.cli import tiers_from_args
    from gpufeed.bench.results import ResultWriter

    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConfigError("`gpufeed bench train` needs PyTorch: pip install 'gpufeed[gpu]' (torch and "
                          "torchvision; the CPU build is enough for the emulated accelerator)") from None
    opts = options_from_args(args)
    tiers = tiers_from_args(args, args.dst)
    writer = ResultWriter(args.results, data_path=args.dst)
    run_benchmark(args.dst, args.formats, tiers, opts, writer=writer,
                  log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"results appended to {args.results}; turn them into a report with: gpufeed report {args.results} "
          "-o report.html")
    return 0
