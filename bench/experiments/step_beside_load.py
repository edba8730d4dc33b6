"""``python -m gpufeed.bench.experiments.step_beside_load DST``: the model's own training step on one GPU while K
other processes decode and crop the dataset's JPEGs as the loader's CPU workers do, feeding nothing, for each K
of ``--loads``: whether a busy node alone slows the step.

Several ranks on one node lost their AU in their steps, not in waiting for batches: on 4 H200s the loop waited
~1% of its time while each step took 63-89 ms against the model's 58-60 ms alone, and two ranks fed by the CPU
workers alone, with no engine work, lost as much (results/gpu-ranks-h200x4.txt). This separates the cores'
load from everything else the loader does: the same synthetic batch already on the GPU (no disk, no
DataLoader, no engines), the decode processes started before CUDA is, then told how many of them work. With
``--copy`` each step also copies a pinned host batch of the same size to the GPU first, as the loader does. With
``--reserve N`` no decode process may run on N physical cores (with their hyper-thread siblings, where the kernel
lists them), as the loader's ``loop_cores`` keeps them, and with ``--pin-loop`` the loop's process runs on those
alone: whether a core of its own gives the step back. ``--nice N``: the decode processes at niceness N, as the
loader's ``worker_nice`` sets its workers.

``--threads hw`` (or ``cpu``) runs the K decoders as threads of the model's own process instead, as the loader's
``hw`` and ``hybrid`` decode threads run beside the launching thread: each decodes batches of the records on the
GPU's JPEG engines and crops them on its own stream (``hw``: what a decode thread does, and how often it takes the
interpreter lock), the same without the crop (``hw-decode``), or decodes and crops them on the CPU (``cpu``). Set
beside the same K as processes, it tells the interpreter lock's share of a fed step's loss from the cores'.
``--gpu-procs`` runs the K ``hw`` decoders as processes of their own instead, each with its own CUDA context on the
model's GPU (and its own interpreter lock): what the step loses to the engines' and the crop's GPU work alone.

One row per window (JSON lines, ``--results``): ``processes`` decoding, ``reserved`` (the loop's own cores, if
any) and ``decode_cores`` (those the decode processes may use), their ``decodes_per_s``, the model's
``images_per_s`` and ``step_ms``, ``of_alone`` (against the mean of the windows with none decoding, measured
first and last to bracket the GPU's drift), the share of every core busy, of the loop's main thread running and
of it waiting for a core.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

#: Records held in memory and decoded in turn by each process (another crop each time).
SAMPLES = 64


def _count_while(index: int, active, stop, counts, work) -> None:
    """``work(n)`` (the images it decoded, ``n`` those so far) while ``index < active.value``, idle otherwise,
    until ``stop`` is set; the running count in ``counts[index]``."""
    n = 0
    while not stop.is_set():
        if index < active.value:
            n += work(n)
            counts[index] = n
        else:
            time.sleep(0.005)


def _cpu_work(samples: list, train: bool, size: int):
    """One record at a time, decoded and cropped as the CPU workers do (another crop each time)."""
    from gpufeed.pipelines.batches_cpu import CpuDecode

    decode = CpuDecode(train, size)
    decode(samples[0])  # imports and first-call costs before any window

    def work(n: int) -> int:
        decode(dataclasses.replace(samples[n % len(samples)], index=n))
        return 1
    return work


def _decode_while(index: int, samples: list, train: bool, size: int, active, stop, counts, cpus=None,
                  nice: int = 0) -> None:
    """One process: decode while ``index < active.value``, idle otherwise, until ``stop`` is set; its count of
    images decoded in ``counts[index]``; on ``cpus`` only, where given, at niceness ``nice``."""
    from gpufeed.machine import default_sigterm

    default_sigterm()
    if cpus:
        os.sched_setaffinity(0, cpus)
    if nice:
        os.nice(nice)
    _count_while(index, active, stop, counts, _cpu_work(samples, train, size))


#: Records in each batch a decode thread decodes (the engines' share of a hybrid batch of 256 at 0.75 on the CPU).
THREAD_BATCH = 64


def _hw_work(samples: list, train: bool, size: int, device, crop: bool = True):
    """Batches of ``samples`` decoded on the GPU's JPEG engines (and, with ``crop``, cropped) on a stream of the
    decoder's own, as the loader's decode threads do."""
    import torch

    from gpufeed.pipelines import batches_cpu as C
    from gpufeed.pipelines.batches_gpu import HwJpegDecoder

    decoder = HwJpegDecoder(device, train, size)
    encode = C.EncodedBytes(train, 0)
    flat, sizes, _, indices, crops = C.collate_encoded([encode(dataclasses.replace(samples[k % len(samples)], index=k))
                                                        for k in range(THREAD_BATCH)])

    def work(_n: int) -> int:
        with torch.cuda.device(decoder.device), torch.cuda.stream(decoder.stream):
            if crop:
                decoder.decoded(flat, sizes, indices, crops)
            else:
                decoder.images(flat, sizes)
        decoder.stream.synchronize()  # as the loader's decode threads do where they time the split
        return THREAD_BATCH
    return work


def _decode_in_thread(index: int, samples: list, train: bool, size: int, path: str, device, active, stop,
                      counts) -> None:
    """One thread of this process, as :func:`_decode_while` but ``hw``: batches decoded on the engines and
    cropped (:func:`_hw_work`); ``hw-decode``: decoded only, not cropped (the crop's calls into torch apart from
    the engines'); ``cpu``: one record at a time on the CPU."""
    if path == "cpu":
        work = _cpu_work(samples, train, size)
    else:
        work = _hw_work(samples, train, size, device, crop=path == "hw")
    _count_while(index, active, stop, counts, work)


def _hw_process(index: int, samples: list, train: bool, size: int, device_index: int, active, stop,
                counts) -> None:
    """One process of its own (spawned: its own CUDA context on the model's GPU, its own interpreter lock) doing
    what a ``hw`` decode thread does (:func:`_hw_work`)."""
    import torch

    from gpufeed.machine import default_sigterm

    default_sigterm()
    torch.cuda.set_device(device_index)
    work = _hw_work(samples, train, size, torch.device("cuda", device_index))
    counts[index] = 0  # ready
    _count_while(index, active, stop, counts, work)


def default_loads(cores: int) -> list[int]:
    """None, a quarter, half, three quarters and all of the cores but the loop's own, then none again."""
    top = max(1, cores - 1)
    return sorted({0, top // 4, top // 2, 3 * top // 4, top}) + [0]


def _window(accel, x, y, seconds: float, copy, decoded) -> tuple[int, float, int, dict]:
    """Three untimed steps, then steps for ``seconds``: ``(steps, wall seconds, images decoded meanwhile (the
    ``decoded()`` count's growth), resources)``."""
    from gpufeed.bench.results import ResourceWindow

    for _ in range(3):
        if copy:
            copy()
        accel.step(x, y)
    accel.synchronize()
    window, steps, before, t0 = ResourceWindow(None), 0, decoded(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if copy:
            copy()
        accel.step(x, y)
        steps += 1
    accel.synchronize()
    wall = time.perf_counter() - t0
    return steps, wall, decoded() - before, window.stop()


def run(dst: str, loads: list[int] | None = None, seconds: float = 5.0, batch: int = 256, task: str = "train",
        accelerator: str = "auto", profile: str = "h200", copy: bool = False, reserve: int = 0,
        pin_loop: bool = False, nice: int = 0, threads: str | None = None, gpu_procs: bool = False,
        emit=print) -> list[dict]:
    """The rows described in the module's docstring, each also passed to ``emit`` as a JSON line."""
    import multiprocessing
    import threading

    from gpufeed.bench.cpuceiling import _read_samples
    from gpufeed.bench.dataset import load_dataset_info
    from gpufeed.bench.train_models import make_accelerator, resolve_accelerator, synthetic_batches
    from gpufeed.machine import reserved_cores, sigterm_held, usable_cores

    cores = usable_cores()
    try:
        kept, rest = reserved_cores(reserve)
    except ValueError as e:
        raise SystemExit(f"--reserve {reserve}: {e}") from None
    reserved = kept[0]
    loads = default_loads(len(rest) + 1 if reserved else cores) if loads is None else loads
    fmt, built = next(iter(load_dataset_info(dst)["formats"].items()))  # any format: the records are the same
    samples = _read_samples(fmt, built["paths"][0], SAMPLES)
    if not samples:
        raise SystemExit(f"{dst}: the benchmark dataset holds no records")
    # The CPU decode processes fork before CUDA starts in this one (the threads start after it); the engines'
    # processes are spawned, each starting CUDA of its own.
    ctx = multiprocessing.get_context("spawn" if gpu_procs else "fork")
    active, stop = ctx.Value("i", 0), ctx.Event()
    counts = ctx.Array("q", max(loads), lock=False)
    procs = [] if threads or gpu_procs else [
        ctx.Process(target=_decode_while, daemon=True,
                    args=(i, samples, task == "train", 224, active, stop, counts, rest if reserved else None, nice))
        for i in range(max(loads))]
    with sigterm_held():  # until each has SIGTERM's default (machine.sigterm_held)
        for p in procs:
            p.start()
    workers: list = []
    before_affinity = os.sched_getaffinity(0)
    if reserved and pin_loop:  # before CUDA starts: its threads keep this process's cores
        os.sched_setaffinity(0, reserved)
    rows = []
    try:
        kind = resolve_accelerator(accelerator)
        accel = make_accelerator(kind, task, batch, profile, "resnet50", 0)
        x, y = next(synthetic_batches(accel, batch, 224, 0))
        if gpu_procs:
            device = getattr(accel, "device", None)
            if device is None or device.type != "cuda":
                raise SystemExit("--gpu-procs decodes on the model's GPU: it needs a CUDA accelerator")
            procs = [ctx.Process(target=_hw_process, daemon=True,
                                 args=(i, samples, task == "train", 224, device.index or 0, active, stop, counts))
                     for i in range(max(loads))]
            for i in range(len(procs)):
                counts[i] = -1  # until the process has its decoder
            with sigterm_held():
                for p in procs:
                    p.start()
            deadline = time.monotonic() + 120
            while any(counts[i] < 0 for i in range(len(procs))):
                if not all(p.is_alive() for p in procs) or time.monotonic() > deadline:
                    raise SystemExit("--gpu-procs: a decode process ended or took over 120 s to start its decoder")
                time.sleep(0.1)
        if threads:
            workers = [threading.Thread(target=_decode_in_thread, daemon=True, name=f"decode-{i}",
                                        args=(i, samples, task == "train", 224, threads, getattr(accel, "device", None),
                                              active, stop, counts))
                       for i in range(max(loads))]
            for w in workers:
                w.start()
        pinned = None
        if copy and kind == "cuda":
            import torch

            pinned = torch.empty(tuple(x.shape), dtype=torch.uint8).pin_memory()
        copy_step = (lambda: x.copy_(pinned, non_blocking=True)) if pinned is not None else None
        for k in loads:
            active.value = k
            time.sleep(0.5)  # the processes told to start (or stop) have
            steps, wall, decoded, seen = _window(accel, x, y, seconds, copy_step, lambda: sum(counts))
            row = {"bench": "step-beside-load", "task": task, "batch": batch, "cores": cores, "processes": k,
                   "in_process": threads or None, "gpu_processes": gpu_procs,
                   "reserved": sorted(reserved), "pin_loop": bool(reserved and pin_loop), "nice": nice,
                   "decode_cores": len(rest) if reserved else cores,
                   "decodes_per_s": round(decoded / wall, 1),
                   "images_per_s": round(steps * batch / wall, 1), "step_ms": round(wall / steps * 1e3, 2),
                   "copy": bool(copy_step), **{n: round(v, 3) for n, v in seen.items()}, **accel.describe()}
            rows.append(row)
        alone = [r["images_per_s"] for r in rows if r["processes"] == 0]
        for r in rows:
            if alone:
                r["of_alone"] = round(r["images_per_s"] / (sum(alone) / len(alone)), 3)
            emit(json.dumps(r))
    finally:
        os.sched_setaffinity(0, before_affinity)
        stop.set()
        for w in workers:
            w.join(10)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    return rows


def main(argv=None) -> int:
    from gpufeed.bench.experiments import dataset_parser

    p = dataset_parser("gpufeed.bench.experiments.step_beside_load", __doc__)
    p.add_argument("--loads", default=None,
                   help="decode processes per window, comma-separated (default: 0, a quarter, half, three quarters "
                        "and all of the cores less one, then 0)")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each window")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--task", choices=("train", "infer"), default="train")
    p.add_argument("--accelerator", choices=("auto", "cuda", "emulated"), default="auto")
    p.add_argument("--copy", action="store_true", help="copy a pinned host batch to the GPU before each step")
    p.add_argument("--reserve", type=int, default=0,
                   help="physical cores (with their hyper-thread siblings) no decode process may run on (default 0: "
                        "all shared)")
    p.add_argument("--pin-loop", action="store_true", help="with --reserve: the loop's process on those cores alone")
    p.add_argument("--nice", type=int, default=0, help="niceness of the decode processes (default 0)")
    p.add_argument("--threads", choices=("hw", "hw-decode", "cpu"), default=None,
                   help="the decoders as threads of the model's own process: on the JPEG engines (hw, as the loader's "
                        "decode threads; hw-decode: the engines without the crop) or on the CPU (cpu); default: "
                        "processes decoding on the CPU")
    p.add_argument("--gpu-procs", action="store_true",
                   help="the decoders as processes of their own doing what a hw decode thread does, each with its own "
                        "CUDA context on the model's GPU")
    p.add_argument("--results", default=None, help="JSON-lines file to append the rows to")
    args = p.parse_args(argv)
    if (args.threads or args.gpu_procs) and (args.nice or args.reserve):
        p.error("--nice and --reserve place CPU decode processes, not --threads or --gpu-procs")
    if args.threads and args.gpu_procs:
        p.error("--threads and --gpu-procs are two places for the decoders: name one")
    loads = None if args.loads is None else [int(v) for v in args.loads.split(",")]
    out = open(args.results, "a") if args.results else None

    def emit(line: str) -> None:
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    try:
        run(args.dst, loads, args.seconds, args.batch, args.task, args.accelerator, copy=args.copy,
            reserve=args.reserve, pin_loop=args.pin_loop, nice=args.nice, threads=args.threads,
            gpu_procs=args.gpu_procs, emit=emit)
    finally:
        if out:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
