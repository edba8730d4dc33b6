"""The timed loop of ``gpufeed bench train``: steps over a stream of batches, each step's wait for its batch
recorded, after a warm-up; one :class:`LoopRun` per run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import numpy as np


@dataclasses.dataclass
class LoopRun:
    """One timed run: ``steps`` steps of ``batch`` images after a warm-up."""

    batch: int
    steps: int
    wall_s: float
    waits_s: list[float]
    cpu_share: float | None = None  # hybrid decoding: the share of each batch the CPU workers took at the end
    cpu_cores: float | None = None  # CPU seconds of this process and its workers per second of the timed steps
    loader_mem_mb: float | None = None  # memory the processes under this one (the loader's workers) hold alone (USS)
    #: The share of the timed steps the loader held the loop back for its GPU (``run_ahead``), apart from the waits.
    paced_share: float | None = None
    #: The machine's shared resources over the timed steps (:class:`gpufeed.bench.results.ResourceWindow`): the
    #: data's block device read MB/s and busy share, the share of every core busy.
    resources: dict = dataclasses.field(default_factory=dict)
    #: Samples the loader's workers made per second over the timed steps (None: no loader, or one that does not
    #: count them): below :attr:`taken_per_s`, the loop ate into batches made before the window.
    made_per_s: float | None = None

    @property
    def taken_per_s(self) -> float:
        """Samples the loop took per second over the timed steps."""
        return self.batch * self.steps / self.wall_s

    @property
    def wait_share(self) -> float:
        """The share of the timed steps the loop waited for its batches."""
        return sum(self.waits_s) / self.wall_s

    @property
    def images_per_s(self) -> float:
        """The rate the loader keeps up: what the loop took, or what the workers made where that was less (the
        rest came from batches made before the timed steps, which a longer run would not have)."""
        taken = self.taken_per_s
        return taken if self.made_per_s is None else min(taken, self.made_per_s)

    def figures(self, compute_step_s: float) -> dict[str, float]:
        waits_ms = np.asarray(self.waits_s) * 1e3
        made = {} if self.made_per_s is None else {"made_per_s": self.made_per_s, "taken_per_s": self.taken_per_s,
                                                    "au_taken": compute_step_s * self.taken_per_s / self.batch}
        return {"images_per_s": self.images_per_s,
                "au": compute_step_s * self.images_per_s / self.batch,
                **made,
                "data_wait_p50_ms": float(np.percentile(waits_ms, 50)),
                "data_wait_p99_ms": float(np.percentile(waits_ms, 99)),
                "data_wait_share": float(self.wait_share),
                "step_ms": self.wall_s / self.steps * 1e3,
                **{name: getattr(self, name) for name in ("cpu_share", "cpu_cores", "loader_mem_mb", "paced_share")
                   if getattr(self, name) is not None},
                **self.resources}


def timed_loop(batches: Iterator, step: Callable, synchronize: Callable, batch: int, steps: int,
               warmup: int, warmup_s: float = 0.0, agree: Callable[[bool], bool] | None = None,
               epoch_batches: int | None = None, data_path: str | None = None, gpu: str | None = None,
               trace: tuple[str, int, dict] | None = None, paced: Callable[[], float] | None = None,
               made: Callable[[], int] | None = None) -> LoopRun:
    """``warmup`` untimed steps (worker start-up, cuDNN autotuning), and more until ``warmup_s`` seconds have
    passed, then ``steps`` timed ones. (A GPU's clocks take a second or so to rise: ten 5 ms steps of an
    LSTM measured its rate 10-30% apart between runs; ten 55 ms steps of ResNet-50 already fill the time.)

    The wait for each batch is the time spent in ``next(batches)``: zero when the pipeline is ahead of the
    accelerator. The device is synchronised before the clock starts and before it stops, never per step, so
    host and device overlap as in real training. The CPU time of this process and its workers over the timed
    steps gives the cores the run used; the workers' own memory (USS) is taken at the end. With several ranks,
    ``agree`` makes the decision to warm up once more the same on every rank (DistributedDataParallel's
    collectives need every rank to take the same steps).

    ``epoch_batches``: the loader's batches per epoch. The timed warm-up stops short where it would push the
    timed steps past the first epoch's end: the second epoch reads what the first left in the page cache.

    ``data_path``: the data read, whose block device's reads are counted over the timed steps beside the cores'
    use (:class:`~gpufeed.bench.results.ResourceWindow`), so a row says what each resource did while it ran;
    ``gpu`` (nvidia-smi's name for the accelerator's GPU) adds how much of the time it ran kernels.

    ``paced``: the seconds the loader has so far held the loop back for its GPU (its ``run_ahead``), taken out of
    each wait (the batch was there; the loop waited for its own previous work) and given as ``paced_share``.

    ``made``: the samples the loader's workers have made so far (:attr:`gpufeed.pipelines.loader.Loader.samples_made`),
    read either side of the timed steps: where they made fewer than the loop took, the loop ate into the batches
    they had made before (a DataLoader holds two a worker), and the run's rate and AU are what they made
    (:attr:`LoopRun.images_per_s`).

    ``trace``: (path, steps, meta): after the timed window, that many more steps recorded by torch's profiler to
    ``path`` (:func:`gpufeed.bench.trace.record`); they count in no figure.
    """
    from gpufeed.bench.results import ResourceWindow, children_private_bytes, cpu_seconds

    it = iter(batches)
    start = time.perf_counter()
    done = 0
    while True:
        more = done < warmup or bool(warmup_s and time.perf_counter() - start < warmup_s
                                     and (epoch_batches is None or done + steps < epoch_batches))
        if agree is not None:
            more = agree(more)
        if not more:
            break
        step(*next(it))
        done += 1
        if done >= warmup and warmup_s:
            synchronize()  # the time is the device's, not the launch queue's
    synchronize()
    waits = []
    window = ResourceWindow(data_path, gpu)
    cpu0 = cpu_seconds()
    start = time.perf_counter()
    paced_at = paced0 = paced() if paced else 0.0
    made0 = made() if made else 0
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = next(it)
        took = time.perf_counter() - t0
        if paced:
            now = paced()
            took, paced_at = max(0.0, took - (now - paced_at)), now
        waits.append(took)
        step(x, y)
    synchronize()
    wall = time.perf_counter() - start
    made_per_s = (made() - made0) / wall if made else None
    # The CPU reading closes the window; the workers' memory is read after it (reading every worker's smaps
    # takes long enough for 16 busy workers to add over a core to a reading taken after it).
    cpu = cpu_seconds() - cpu0
    resources = window.stop()
    held = children_private_bytes()
    if trace is not None:
        from gpufeed.bench.trace import record

        record(it, step, synchronize, trace[1], trace[0], trace[2])
    return LoopRun(batch=batch, steps=steps, wall_s=wall, waits_s=waits, cpu_cores=cpu / wall,
                   loader_mem_mb=None if held is None else held / 1e6, resources=resources,
                   paced_share=(paced_at - paced0) / wall if paced else None, made_per_s=made_per_s)
