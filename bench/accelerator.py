"""Emulated accelerators: the compute time of one training or inference step, from a measured profile.

Where no GPU is present, ``gpufeed bench train`` replaces the model's step by a sleep of the step's compute
time, as DLIO and MLPerf Storage do, so the data pipeline still has to keep pace with a real accelerator's
demand and every machine gives an answer. Accelerator utilisation is then AU = compute time / wall time, the
MLPerf Storage definition (ResNet-50 passes at AU >= 90%).

A profile is measured at one batch size; at another batch size the step time scales linearly with the batch
(per-image cost constant), which holds for ResNet-50 from batch 128 upward on these GPUs and is what DLIO
assumes when a config's batch size is changed.
"""

from __future__ import annotations

import dataclasses

from gpufeed.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """One task of one model on one accelerator: ``step_s`` seconds per step at ``batch`` images."""

    batch: int
    step_s: float

    @property
    def images_per_s(self) -> float:
        return self.batch / self.step_s

    def step_time(self, batch: int) -> float:
        """Compute seconds for one step of ``batch`` images."""
        return self.step_s * batch / self.batch


@dataclasses.dataclass(frozen=True)
class AcceleratorProfile:
    name: str
    device: str
    model: str
    train: StepProfile
    infer: StepProfile | None
    source: str

    def task(self, task: str) -> StepProfile:
        step = self.train if task == "train" else self.infer
        if step is None:
            raise ConfigError(f"accelerator profile {self.name!r} has no {task} measurement; use --task train "
                              f"or a profile with one: {', '.join(p.name for p in PROFILES.values() if p.infer)}")
        return step


PROFILES = {p.name: p for p in (
    AcceleratorProfile(
        name="h200", device="NVIDIA H200", model="resnet50",
        train=StepProfile(batch=256, step_s=0.0545),
        infer=StepProfile(batch=512, step_s=512 / 15929),
        source="measured on one H200, PyTorch 2.11, bf16 autocast, channels_last, eager: 4,701 img/s "
               "training at batch 256, 15,929 img/s inference at 512"),
    AcceleratorProfile(
        name="h100-mlperf", device="NVIDIA H100", model="resnet50",
        train=StepProfile(batch=400, step_s=0.224), infer=None,
        source="MLPerf Storage / DLIO ResNet-50 workload config for H100: batch 400, 0.224 s per step"),
    AcceleratorProfile(
        name="a100-mlperf", device="NVIDIA A100", model="resnet50",
        train=StepProfile(batch=400, step_s=0.435), infer=None,
        source="MLPerf Storage / DLIO ResNet-50 workload config for A100: batch 400, 0.435 s per step"),
)}


def get_profile(name: str) -> AcceleratorProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown accelerator profile {name!r}; choose one of {', '.join(PROFILES)}") from None
