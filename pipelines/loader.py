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
* ``hybrid``: each batch split between the CPU workers and the engines by their measured rates, so both are
  busy: the workers time each image they decode, the engines' batches are timed as they run beside the model,
  and the CPU share is the workers' rate over the sum of both (it starts from expected rates). docs/loader.md.
* ``auto`` (the default): ``cpu`` for a node's only GPU with 24 cores or more (enough for one H200 training
  ResNet-50), or where no GPU has JPEG engines; else ``hybrid`` (:func:`choose_decode`; ``Loader.decode_reason``
  says why).
  Raw pixels, CIFAR's and token ids always go the ``cpu`` way. The DataLoader workers per rank are the rank's
  share of the usable cores (:func:`default_workers`), less one for its own process where ranks share the node.

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
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Iterator, Sequence

import numpy as np

from gpufeed import io as gpufeed_io
from gpufeed.errors import ConfigError
from gpufeed.formats import format_of

DECODES = ("cpu", "gpu", "hw", "hybrid")
#: ``decode="auto"``: one of :data:`DECODES`, chosen by :func:`choose_decode`.
AUTO = "auto"
#: Columns of a crop drawn in the workers for the GPU paths: height, width (upright), the box (top, left, h, w),
#: flip, EXIF orientation.
CROP_COLUMNS = 8
AUGMENTS = ("train", "eval", "cifar", "tokens")
#: Where ``augment="cifar"`` runs: in the DataLoader workers, or on the GPU over whole batches.
AUGMENT_ON = ("cpu", "gpu")
#: CIFAR training augmentation: zero padding on each side before the random crop of the stored size.
CIFAR_PAD = 4
#: Standard evaluation crop: the centre 224 of an image resized to 256 on its shorter side.
CENTER_FRACTION = 224 / 256
#: ImageNet channel statistics (RGB, 0-255 scale), what torchvision's models are trained with.
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
#: Expected rates for the first hybrid split, before measured waits steer it: one CPU worker decoding and
#: cropping a ~500x375 JPEG, and the H100/H200 JPEG engines together (nvImageCodec, ~140 KB photos).
CPU_WORKER_RATE = 300.0
HW_RATE = 13_000.0
#: Niceness the DataLoader workers add to their own (:func:`_init_worker`); 0 leaves them at the loop's. At 10
#: every training run fed less on the GPU machine (results/gpu-nice-h100.txt): the loop is not short of cores.
WORKER_NICE = 0
#: DataLoader workers per rank by default: its share of the usable cores, at most this many. One H200 on 32 cores
#: fed from 16 CPU workers kept only 44% of the cores busy and waited for its batches (AU 0.86); the cap bounds
#: the pinned batches the workers hold ahead (two each, 38 MB apiece at 256 x 224 x 224 x 3).
MAX_DEFAULT_WORKERS = 32
#: Batches each DataLoader worker prepares ahead of the loop (the DataLoader's ``prefetch_factor``).
PREFETCH_FACTOR = 2
_INSTALL = "pip install 'gpufeed[gpu]'"


def default_workers(ranks: int = 1) -> int:
    """DataLoader workers per rank when none are given: one per core of the rank's share of the usable cores, at
    most :data:`MAX_DEFAULT_WORKERS`. Where several ranks share the node, each rank's own process (the training
    loop, the engines' decoder threads, NCCL) keeps a core of its share: 16 workers for each of 4 ranks took all
    64 cores of the 4-GPU node before the main processes had any. One rank alone shares its cores with its
    workers, as measured best on 16 cores (results/gpu-nice-h100.txt)."""
    from gpufeed.machine import usable_cores

    ranks = max(1, ranks)
    share = usable_cores() // ranks - (1 if ranks > 1 else 0)
    return max(1, min(MAX_DEFAULT_WORKERS, share))


#: GPUs with hardware JPEG decoders (NVJPG engines), as nvImageCodec's hardware backend drives them.
ENGINE_GPUS = ("A100", "A800", "A30", "H100", "H800", "H200", "H20", "GH200", "B100", "B200", "GB200", "L4", "L40")
#: Cores from which the CPU workers alone feed one GPU training ResNet-50 when it is the node's only rank (one
#: H200 on 32 cores, 32 workers: AU 0.967 against 0.90 with the engines; results/gpu-ranks-h200x2.txt). Where
#: ranks share a node, the engines take a share whatever the cores: 2 ranks on 64 cores fed from 31 CPU
#: workers each got 0.82, from the engines 0.88 (results/gpu-ranks-h100x4.txt).
CPU_ENOUGH_CORES = 24


def choose_decode(device=None, ranks: int = 1) -> tuple[str, str]:
    """``decode="auto"``: ``(path, why)`` from the cores, whether the GPU has JPEG engines, and how many ranks
    share the node: ``cpu`` for the node's only rank with :data:`CPU_ENOUGH_CORES` cores or more (or without a
    GPU); else ``hybrid`` (CPU workers and engines, each batch split by their measured rates) on a GPU with
    engines and nvImageCodec installed; else ``cpu``."""
    from gpufeed.machine import usable_cores

    torch = _import_torch()
    per_rank = usable_cores() // max(1, ranks)
    device = resolve_device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "cpu", "no CUDA GPU"
    if ranks <= 1 and per_rank >= CPU_ENOUGH_CORES:
        return "cpu", f"{per_rank} cores feed the node's one GPU from the CPU workers alone"
    name = torch.cuda.get_device_name(device)
    if not any(gpu in name for gpu in ENGINE_GPUS):
        return "cpu", f"{per_rank} cores per rank, and the {name} has no JPEG engines gpufeed drives"
    try:
        import_nvimgcodec()
        import torchvision.ops  # noqa: F401
    except (ConfigError, ImportError):
        return "cpu", f"{per_rank} cores per rank; the engines need {_INSTALL}"
    return "hybrid", f"{per_rank} cores per rank: the CPU workers and the {name}'s JPEG engines share each batch"


def center_box(height: int, width: int, fraction: float = CENTER_FRACTION) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of the square centre crop that resize-256-then-crop-224 keeps, in source pixels."""
    side = max(1, int(round(min(height, width) * fraction)))
    return (height - side) // 2, (width - side) // 2, side, side


# --------------------------------------------------------------------------------------- in DataLoader workers


@dataclasses.dataclass(frozen=True)
class CpuDecode:
    """Runs in DataLoader workers: decode, then RandomResizedCrop + flip (``train``) or the centre crop; with
    ``cifar``, CIFAR's pad-4 / random-crop / flip at the stored size instead (``augment=False``: the stored
    pixels, for the GPU to augment).

    The crop of sample ``i`` is drawn from a generator seeded with ``(seed, i)``, so runs are repeatable.
    Returns ``(HWC uint8 RGB, label)``; the default collate stacks them into an NHWC uint8 batch. With
    ``with_index``, ``(pixels, label, index)`` for :class:`CifarCollate`.
    """

    train: bool
    size: int = 224
    seed: int = 0
    cifar: bool = False
    augment: bool = True
    with_index: bool = False
    reduce: bool = True  # JPEGs decode at a DCT scale-down where the crop allows (transforms.decode_crop)

    def __call__(self, sample):
        if self.with_index:
            return self.pixels(sample), int(sample.labels[0]), int(sample.index)
        return self.pixels(sample), int(sample.labels[0])

    def pixels(self, sample) -> np.ndarray:
        import cv2

        from gpufeed.pipelines.transforms import crop_resize, decode_crop, decode_image, random_resized_crop_choice

        if self.cifar:
            img = np.asarray(sample.payload) if sample.kind == "raw" else decode_image(sample.payload, sample.key)
            if not (self.train and self.augment):
                return _owned(img)
            (top,), (left,), (flip,) = cifar_params([sample.index], self.seed)
            padded = np.pad(img, ((CIFAR_PAD, CIFAR_PAD), (CIFAR_PAD, CIFAR_PAD), (0, 0)))
            out = padded[top:top + img.shape[0], left:left + img.shape[1]]
            return np.ascontiguousarray(out[:, ::-1] if flip else out)
        choose = (random_resized_crop_choice(np.random.default_rng((self.seed, sample.index))) if self.train
                  else self._centre)
        if sample.kind != "raw":
            return decode_crop(sample.payload, sample.key, self.size, choose, self.reduce)
        img = np.asarray(sample.payload)
        if img.ndim == 2 or img.shape[2] == 1:
            img = cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
        box, flip = choose(*img.shape[:2])
        out = crop_resize(img, img.shape[:2], box, (self.size, self.size))
        return cv2.flip(out, 1) if flip else _owned(out)

    def _centre(self, height: int, width: int):
        """The evaluation box: the whole image where it is stored at the output size, else :func:`center_box`."""
        if (height, width) == (self.size, self.size):
            return (0, 0, height, width), False
        return center_box(height, width), False


def _owned(img: np.ndarray) -> np.ndarray:
    """``img`` itself, or a contiguous copy where the reader's array is read-only or strided (torch's collate
    warns on read-only arrays)."""
    return img if img.flags.writeable and img.flags.c_contiguous else np.array(img)


@dataclasses.dataclass(frozen=True)
class TokenWindow:
    """Runs in DataLoader workers for ``augment="tokens"``: a record's token ids (int64), checked to be one
    language-model window: a 1-D array of ``length`` ids when ``length`` is given, each below ``vocab`` when that
    is given (an embedding table indexed past its end fails on the GPU with no sample named)."""

    length: int | None = None
    vocab: int | None = None

    def __call__(self, sample) -> np.ndarray:
        if sample.kind != "tokens":
            raise ConfigError(f"augment='tokens' reads token records, but {sample.key} holds {sample.kind} "
                              "pixels; use augment='train', 'eval' or 'cifar' for images")
        ids = np.asarray(sample.payload, dtype=np.int64)
        if ids.ndim != 1 or (self.length is not None and len(ids) != self.length):
            expected = f"a window of {self.length}" if self.length is not None else "one row"
            raise ConfigError(f"{sample.key}: {ids.size} token ids in shape {ids.shape} where {expected} is expected; "
                              "convert Penn Treebank with ptb_mode='window' (every record seq_len + 1 ids)")
        if self.vocab is not None and ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < self.vocab:
            raise ConfigError(f"{sample.key}: token ids {int(ids.min())}..{int(ids.max())} are outside the model's "
                              f"vocabulary of {self.vocab}; train a model with the dataset's vocabulary (vocab.txt)")
        return ids


def collate_tokens(batch):
    """``[ids]`` (windows of one length) -> an N x (seq_len + 1) int64 tensor."""
    import torch

    lengths = {len(ids) for ids in batch}
    if len(lengths) > 1:
        raise ConfigError(f"token records of different lengths ({', '.join(map(str, sorted(lengths)))}) in one "
                          "batch; convert Penn Treebank with ptb_mode='window' (every record seq_len + 1 ids)")
    return torch.from_numpy(np.stack(batch))


def crop_params(shapes: Sequence[tuple[int, int]], indices: Sequence[int], train: bool, seed: int = 0):
    """Per image of shape ``(h, w)`` and sample index: its crop ``(top, left, h, w)`` and whether it is flipped,
    drawn as :class:`CpuDecode` draws them (training: from ``(seed, index)``; evaluation: :func:`center_box`)."""
    drawn = [draw_crop(h, w, index, train, seed) for (h, w), index in zip(shapes, indices)]
    return [box for box, _ in drawn], [flip for _, flip in drawn]


def draw_crop(height: int, width: int, index: int, train: bool, seed: int = 0):
    """``((top, left, h, w), flip)`` of sample ``index`` in an upright ``height`` x ``width`` image: training's
    ``RandomResizedCrop`` + flip drawn from ``(seed, index)``, or evaluation's :func:`center_box`."""
    if not train:
        return center_box(height, width), False
    from gpufeed.pipelines.transforms import random_resized_crop_choice

    return random_resized_crop_choice(np.random.default_rng((seed, int(index))))(height, width)


def cifar_params(indices: Sequence[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CIFAR's training augmentation for each sample index: the crop's top and left in the image padded by
    :data:`CIFAR_PAD` on every side, and whether it is flipped. Drawn from a SplitMix64 hash of
    ``(seed, index)``, vectorised: a batch's draws cost microseconds in the main process (a generator per
    sample would cost ~10 ms per batch of 512, as long as a CIFAR ResNet step)."""
    with np.errstate(over="ignore"):
        z = np.asarray(indices, dtype=np.uint64) + np.uint64(seed % 2**64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    span = np.uint64(2 * CIFAR_PAD + 1)
    tops = (z % span).astype(np.int64)
    lefts = ((z >> np.uint64(16)) % span).astype(np.int64)
    flips = ((z >> np.uint64(32)) & np.uint64(1)).astype(bool)
    return tops, lefts, flips


def cifar_augment(x, params):
    """CIFAR's pad / random crop / flip of a whole NHWC uint8 batch in one gather, on whatever device ``x`` is
    (the GPU in the loader): the same pixels as :class:`CpuDecode` gives each sample on the CPU. ``params`` is
    :class:`CifarCollate`'s 3 x N int64 tensor (tops, lefts, flips) on ``x``'s device."""
    import torch

    n, h, w, _ = x.shape
    tops, lefts, flips = params[0], params[1], params[2].bool()
    padded = torch.nn.functional.pad(x, (0, 0, CIFAR_PAD, CIFAR_PAD, CIFAR_PAD, CIFAR_PAD))
    rows = tops[:, None] + torch.arange(h, device=x.device)
    span = torch.arange(w, device=x.device)
    cols = lefts[:, None] + torch.where(flips[:, None], w - 1 - span, span)
    return padded[torch.arange(n, device=x.device)[:, None, None], rows[:, :, None], cols[:, None, :]]


@dataclasses.dataclass(frozen=True)
class CifarCollate:
    """Runs in DataLoader workers for ``augment_on="gpu"``: ``[(pixels, label, index)]`` -> (NHWC uint8, int64
    labels, the 3 x N int64 augmentation parameters of :func:`cifar_params`). Drawn here, the parameters travel
    with the batch through pinned memory: the training loop's thread copies nothing from pageable memory per
    step (on the H200 this measured no different from drawing them there, within the runs' noise)."""

    seed: int = 0

    def __call__(self, batch):
        import torch

        indices = [item[2] for item in batch]
        tops, lefts, flips = cifar_params(indices, self.seed)
        return (torch.from_numpy(np.stack([item[0] for item in batch])),
                torch.tensor([item[1] for item in batch], dtype=torch.int64),
                torch.from_numpy(np.stack([tops, lefts, flips.astype(np.int64)])))


def encoded_bytes(sample) -> bytes:
    if not isinstance(sample.payload, (bytes, bytearray, memoryview)):
        raise ConfigError(f"GPU decoding needs encoded images, but {sample.key} is stored as raw pixels; "
                          "convert with --encode jpeg, or decode='cpu'")
    return bytes(sample.payload)


@dataclasses.dataclass(frozen=True)
class EncodedBytes:
    """Runs in DataLoader workers for the GPU paths: the record's JPEG bytes, undecoded, its label, its index,
    and its crop drawn here from the JPEG's header as :class:`CpuDecode` draws it (:func:`draw_crop`):
    ``(height, width, top, left, h, w, flip, orientation)`` (:data:`CROP_COLUMNS`; the size upright, the EXIF
    orientation as stored). Drawing 256 crops costs the main process, which the model
    needs, ~10 ms of interpreter time per batch; 16 workers draw them beside their reads."""

    train: bool = False
    seed: int = 0

    def __call__(self, sample):
        from gpufeed.pipelines.imageio import probe

        data = encoded_bytes(sample)
        info = probe(data, sample.key)
        box, flip = draw_crop(info.height, info.width, sample.index, self.train, self.seed)
        return (data, int(sample.labels[0]), int(sample.index),
                (info.height, info.width, *box, int(flip), info.orientation))


def collate_encoded(batch):
    """``[(jpeg bytes, label, index, crop)]`` -> (one flat uint8 tensor, int64 sizes, int64 labels, int64
    indices, N x CROP_COLUMNS int64 crops).

    One tensor per batch crosses from the worker (one shared-memory block, not one per image); the main process
    splits it into per-image views."""
    import torch

    sizes = [len(item[0]) for item in batch]
    flat = np.empty(sum(sizes), dtype=np.uint8)
    offset = 0
    for item, n in zip(batch, sizes):
        flat[offset:offset + n] = np.frombuffer(item[0], dtype=np.uint8)
        offset += n
    return (torch.from_numpy(flat), torch.tensor(sizes, dtype=torch.int64),
            torch.tensor([item[1] for item in batch], dtype=torch.int64),
            torch.tensor([item[2] for item in batch], dtype=torch.int64),
            torch.tensor([item[3] for item in batch], dtype=torch.int64).reshape(len(batch), CROP_COLUMNS))


class HybridSplit:
    """Runs in DataLoader workers for ``hybrid``: a sample goes to the CPU (decoded and cropped here, the
    seconds it took recorded) when its place in a fixed low-discrepancy sequence falls under the current share,
    else its bytes go to the engines. ``share`` is a shared ``multiprocessing`` value the main process sets; the
    workers, handed it when they start, see its changes."""

    def __init__(self, cpu: CpuDecode, share):
        self.cpu, self.share = cpu, share

    def __call__(self, sample):
        # The golden-ratio sequence spreads any share evenly over consecutive indices.
        if (sample.index * 0.6180339887498949) % 1.0 < self.share.value:
            t0 = time.perf_counter()
            pixels = self.cpu.pixels(sample)
            return "px", pixels, int(sample.labels[0]), int(sample.index), time.perf_counter() - t0
        return ("jpeg", *EncodedBytes(self.cpu.train, self.cpu.seed)(sample))


def collate_hybrid(batch):
    """``[("px", pixels, label, index, seconds) | ("jpeg", bytes, label, index, crop)]`` -> (NHWC uint8 pixels,
    their batch positions, the other images as :func:`collate_encoded` packs them, their positions, all labels,
    their indices and crops, the seconds the worker spent decoding the pixels)."""
    import torch

    px = [(i, item[1]) for i, item in enumerate(batch) if item[0] == "px"]
    enc = [(i, item) for i, item in enumerate(batch) if item[0] == "jpeg"]
    pixels = torch.from_numpy(np.stack([p for _, p in px])) if px else None
    flat, sizes, _, indices, crops = collate_encoded([item[1:] for _, item in enc])
    return (pixels, torch.tensor([i for i, _ in px], dtype=torch.int64), flat, sizes,
            torch.tensor([i for i, _ in enc], dtype=torch.int64),
            torch.tensor([item[2] for item in batch], dtype=torch.int64), indices, crops,
            torch.tensor([sum(item[4] for item in batch if item[0] == "px")], dtype=torch.float64))


# ------------------------------------------------------------------------------------------------- on the GPU


class GpuCrop:
    """Crop + resize (+ flip) of decoded images on the GPU: the training crop and flip of sample ``i`` drawn
    from ``(seed, i)`` as :class:`CpuDecode` draws them (same boxes, same flips), evaluation by
    :func:`center_box`. Images of one shape are stacked and cropped by one bilinear ``roi_align`` (2x2 samples per
    output pixel), one launch per shape, as DALI's batched resize does; images stored at the output size are
    copied as they are (evaluation). Output: NHWC uint8.

    Work runs on this object's own stream. ``priority`` is its CUDA priority: 0 shares the SMs with the model
    as equals; a negative value schedules the decoder's kernels ahead of the model's (measured on an H200 it
    cost ResNet-50 training more than it gave the decoder, so the default is 0)."""

    def __init__(self, device, train: bool, size: int = 224, seed: int = 0, priority: int = 0):
        import torch
        import torchvision.ops

        self.torch, self.ops = torch, torchvision.ops
        device = resolve_device(device)
        self.device, self.train, self.size, self.seed = device, train, size, seed
        # torch clamps the priority to the GPU's range. (On a CPU device, for tests, there is no stream.)
        self.stream = (torch.cuda.Stream(device=device, priority=priority) if torch.device(device).type == "cuda"
                       else None)

    def crop(self, images: list, indices, crops=None) -> object:
        """``images``: CHW uint8 tensors on the device, ``indices`` their sample indices -> N x size x size x 3
        uint8. ``crops``: the boxes and flips :class:`EncodedBytes` drew in the workers (N x CROP_COLUMNS: height,
        width, box, flip, orientation), used where the decoded image has the header's size; drawn here
        otherwise."""
        torch = self.torch
        shapes = [tuple(img.shape[1:]) for img in images]
        drawn = crops.tolist() if crops is not None else [[0] * CROP_COLUMNS] * len(images)
        boxes = [tuple(c[2:6]) for c in drawn]
        flips = [bool(c[6]) for c in drawn]
        redraw = [i for i, c in enumerate(drawn) if tuple(c[:2]) != shapes[i]]
        if redraw:
            index = indices.tolist() if hasattr(indices, "tolist") else list(indices)
            again, flipped = crop_params([shapes[i] for i in redraw], [index[i] for i in redraw], self.train, self.seed)
            for i, box, flip in zip(redraw, again, flipped):
                boxes[i], flips[i] = box, flip
        by_shape: dict[tuple, list[int]] = {}
        for i, img in enumerate(images):
            by_shape.setdefault(tuple(img.shape), []).append(i)
        out = torch.empty((len(images), self.size, self.size, 3), dtype=torch.uint8, device=self.device)
        for (_, height, width), members in by_shape.items():
            index = torch.tensor(members).to(self.device, non_blocking=True)
            if not self.train and (height, width) == (self.size, self.size):
                # Stored at the model's size (a centre crop): used as it is, as on the CPU path.
                out.index_copy_(0, index, torch.stack([images[i].permute(1, 2, 0) for i in members]))
                continue
            rois = []
            for k, i in enumerate(members):
                top, left, h, w = boxes[i]
                rois.append((k, left, top, left + w, top + h))
            stack = torch.stack([images[i] for i in members]).float()
            crops = self.ops.roi_align(stack, torch.tensor(rois, dtype=torch.float32).to(self.device),
                                       output_size=(self.size, self.size), sampling_ratio=2, aligned=True)
            out.index_copy_(0, index, crops.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1))
        if any(flips):
            flip = torch.from_numpy(np.flatnonzero(flips)).to(self.device)
            out[flip] = out[flip].flip(2)
        return out


class NvJpegDecoder(GpuCrop):
    """nvJPEG through ``torchvision.io.decode_jpeg(device="cuda")`` (CUDA kernels on the SMs)."""

    def __init__(self, device, train: bool, size: int = 224, seed: int = 0, priority: int = 0):
        super().__init__(device, train, size, seed, priority)
        import torchvision.io

        self.io = torchvision.io

    def images(self, flat, sizes) -> list:
        datas = list(self.torch.split(flat, sizes.tolist()))
        return self.io.decode_jpeg(datas, mode=self.io.ImageReadMode.RGB, device=self.device)

    def decode(self, flat, sizes, labels, indices, crops=None):
        return self.crop(self.images(flat, sizes), indices, crops), labels.to(self.device, non_blocking=True)


class HwJpegDecoder(GpuCrop):
    """The GPU's JPEG engines through nvImageCodec (``HW_GPU_ONLY``); what they refuse goes to nvImageCodec's
    CUDA decoder in one more batch call. Decoding runs on this object's stream."""

    #: nvImageCodec's decoder options (its own default: no fancy upsampling, which the CPU path matches).
    OPTIONS = ":fancy_upsampling=0"

    def __init__(self, device, train: bool, size: int = 224, seed: int = 0, priority: int = 0,
                 options: str = ""):
        super().__init__(device, train, size, seed, priority)
        nvimgcodec = import_nvimgcodec()
        index = self.device.index  # resolved by GpuCrop: the engines of the model's GPU
        self.nv = nvimgcodec
        self.hw = nvimgcodec.Decoder(device_id=index, backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)],
                                     options=" ".join(filter(None, (self.OPTIONS, options))))
        self.fallback = nvimgcodec.Decoder(device_id=index, backends=[
            nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY), nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
        self.params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB,
                                              sample_format=nvimgcodec.SampleFormat.I_RGB)
        self.fallbacks = 0  # images the engines did not take, so far
        #: Host seconds per stage of this decoder's batches so far: ``parse`` (code streams made), ``barrier``
        #: (waiting for this stream's earlier work, :attr:`barrier`), ``engines`` (nvImageCodec's decode call,
        #: fallbacks included), ``wrap`` (the images as tensors), ``crop`` (the crop's launches).
        self.stage_s: collections.Counter = collections.Counter()
        #: Wait on the host for this decoder's stream before each decode call. nvJPEG's hardware path writes
        #: an image when the call is made, not when the stream reaches it; the memory nvImageCodec takes for
        #: it (stream-ordered, from the device's pool) may be what a crop still queued on this stream reads.
        self.barrier = False
        # Evaluation: decode only each image's centre box (decoded()). Off: on an H200 with nvImageCodec 0.9 the
        # engines refuse region decoding, every image fell back to the CUDA decoder, and the evaluation step ran
        # at 4,306 img/s against 9,368 decoding whole images (bench.experiments.decode_rates, which measures both).
        self.roi = False

    def images(self, flat, sizes, regions=None) -> list:
        """The batch's images decoded (CHW uint8 on the device); ``regions[i]``, where given, a ``(top, left,
        h, w)`` box of image ``i`` (as stored) decoded alone."""
        torch = self.torch
        t0 = time.perf_counter()
        host = flat.numpy()
        bounds = np.concatenate([[0], np.cumsum(sizes.numpy())])
        streams = [self.nv.CodeStream(host[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        if regions is not None:
            for i, box in enumerate(regions):
                if box is not None:
                    top, left, h, w = box
                    streams[i] = streams[i].get_sub_code_stream(region=self.nv.Region(top, left, top + h, left + w))
        current = torch.cuda.current_stream(self.device)
        t1 = time.perf_counter()
        if self.barrier:
            current.synchronize()
        t2 = time.perf_counter()
        stream = current.cuda_stream
        decoded = self.hw.decode(streams, params=self.params, cuda_stream=stream)
        missing = [i for i, img in enumerate(decoded) if img is None]
        if missing:
            self.fallbacks += len(missing)
            again = self.fallback.decode([streams[i] for i in missing], params=self.params, cuda_stream=stream)
            for i, img in zip(missing, again):
                if img is None:
                    raise ConfigError(f"image {i} of a batch could not be decoded by nvImageCodec (corrupt?); "
                                      "check the dataset with `gpufeed verify`")
                decoded[i] = img
        t3 = time.perf_counter()
        images = [torch.from_dlpack(img).permute(2, 0, 1) for img in decoded]
        clock = self.stage_s
        clock["parse"] += t1 - t0
        clock["barrier"] += t2 - t1
        clock["engines"] += t3 - t2
        clock["wrap"] += time.perf_counter() - t3
        return images

    def decode(self, flat, sizes, labels, indices, crops=None):
        return self.decoded(flat, sizes, indices, crops), labels.to(self.device, non_blocking=True)

    def decoded(self, flat, sizes, indices, crops=None):
        """Decoded and cropped: N x size x size x 3 uint8. For evaluation, with ``roi`` (off by default), only
        each image's centre box is decoded (the crop keeps nothing else), which the crop then resizes whole."""
        regions = self.centre_regions(crops) if self.roi and not self.train and crops is not None else None
        images = self.images(flat, sizes, regions)
        if regions is not None and any(r is not None for r in regions):
            crops = crops.clone()
            for i, box in enumerate(regions):
                if box is not None:
                    h, w = box[2], box[3]
                    crops[i, :7] = self.torch.tensor([h, w, 0, 0, h, w, 0])
        t0 = time.perf_counter()
        out = self.crop(images, indices, crops)
        self.stage_s["crop"] += time.perf_counter() - t0
        return out

    @staticmethod
    def centre_regions(crops) -> list:
        """Per image, the box to decode alone: its evaluation box where that is less than the whole image and
        the image is stored upright (EXIF orientation 1: the box is then in stored coordinates), else ``None``."""
        regions = []
        for height, width, top, left, h, w, _, orientation in crops.tolist():
            whole = (top, left, h, w) == (0, 0, height, width)
            regions.append((top, left, h, w) if height > 0 and orientation == 1 and not whole else None)
        return regions


#: CUmemPool_attribute values (cuda.h) of the settings :func:`set_image_pool` changes.
_POOL_INTERNAL_DEPENDENCIES, _POOL_RELEASE_THRESHOLD = 3, 4


def set_image_pool(device, keep_bytes: int | None = None, internal_dependencies: bool | None = None) -> None:
    """Settings of ``device``'s default CUDA memory pool, from which nvImageCodec takes every decoded image
    (``cudaMallocAsync`` on the decoder's stream; PyTorch's own allocator does not use it).

    ``keep_bytes``: memory the pool keeps across synchronisations instead of returning it to the driver at
    each one (CUDA's default keeps none, so each batch's images are mapped anew). ``internal_dependencies``:
    whether the pool may hand one stream memory freed on another by making the new stream wait for the old
    one on the GPU; nvJPEG's hardware path is reported to write at the call, before such a wait (no mismatch
    showed on the H200: results/decode-contention-h200.txt), so off is the cautious setting with several
    decoder streams. Through the driver API (``libcuda``), which every CUDA process has loaded."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise ConfigError("set_image_pool needs the NVIDIA driver's libcuda.so.1, which this machine lacks") from None
    dev, pool = ctypes.c_int(), ctypes.c_void_p()
    for status in (cuda.cuDeviceGet(ctypes.byref(dev), device.index or 0),
                   cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev)):
        if status:
            raise ConfigError(f"CUDA driver error {status} while reaching the memory pool of {device}")
    settings = []
    if keep_bytes is not None:
        settings.append((_POOL_RELEASE_THRESHOLD, ctypes.c_uint64(keep_bytes)))
    if internal_dependencies is not None:
        settings.append((_POOL_INTERNAL_DEPENDENCIES, ctypes.c_int(int(internal_dependencies))))
    for attribute, value in settings:
        status = cuda.cuMemPoolSetAttribute(pool, attribute, ctypes.byref(value))
        if status:
            raise ConfigError(f"CUDA driver error {status} while setting attribute {attribute} of the memory pool "
                              f"of {device}")


def import_nvimgcodec():
    # nvImageCodec's own log lines (ANSI-coloured, on stderr): a failure to load the JPEG 2000 and TIFF
    # extensions the wheel does not ship, and a warning per image the engines hand back undecoded, which the
    # loader decodes another way and counts (HwJpegDecoder.fallbacks). Quiet unless the user asks for them.
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    try:
        from nvidia import nvimgcodec
    except ImportError:
        raise ConfigError(f"decode='hw' needs NVIDIA nvImageCodec: {_INSTALL} (adds nvidia-nvimgcodec-cu13), or "
                          "decode='cpu'") from None
    return nvimgcodec


def decoded_batches(batches: Iterator, decoders: Sequence, device, depth: int | None = None,
                    timing=None) -> Iterator:
    """``decoder.decode(*batch) -> (x, y)`` applied ahead of the consumer by one background thread per decoder,
    each on its decoder's own stream (``decoder.stream``), up to ``depth`` batches in flight (default: one more
    than the decoders), delivered in order. Two decoders let one batch's engine work overlap the next one's host
    work (bitstream parsing, launches), which one synchronous decode call cannot. The consumer's stream waits
    for each batch on the GPU (an event), never on the host. ``timing(batch, decode_s)`` gets, per batch, the
    batch as the DataLoader gave it and how long its decode took to the end of its GPU work (the hybrid split)."""
    import queue

    import torch

    main = torch.cuda.current_stream(device)
    free: queue.SimpleQueue = queue.SimpleQueue()
    for decoder in decoders:
        free.put(decoder)
    depth = depth or len(decoders) + 1

    def run(batch):
        decoder = free.get()  # one is free: there are as many threads as decoders
        try:
            t0 = time.perf_counter()
            with torch.cuda.device(device), torch.cuda.stream(decoder.stream):
                x, y = decoder.decode(*batch)
                done = torch.cuda.Event()
                done.record(decoder.stream)
            if timing is not None:
                done.synchronize()
            return x, y, done, time.perf_counter() - t0
        finally:
            free.put(decoder)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(decoders), thread_name_prefix="gpufeed-decode")
    pending: collections.deque = collections.deque()
    try:
        while True:
            while len(pending) < depth:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                pending.append((pool.submit(run, batch), batch))
            if not pending:
                return
            future, batch = pending.popleft()
            x, y, done, took = future.result()
            if timing is not None:
                timing(batch, took)
            main.wait_event(done)
            x.record_stream(main)
            y.record_stream(main)
            yield x, y
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class HybridDecoder:
    """Assembles a hybrid batch (:func:`collate_hybrid`'s tuple): the CPU-decoded part copied in, the rest decoded
    by the engines. The workers' decode seconds, the tuple's last element, are :class:`HybridRates`' to read."""

    def __init__(self, hw: HwJpegDecoder):
        self.hw, self.stream = hw, hw.stream

    def decode(self, pixels, px_pos, flat, sizes, enc_pos, labels, indices, crops=None, cpu_seconds=None):
        torch, device = self.hw.torch, self.hw.device
        x = torch.empty((len(labels), self.hw.size, self.hw.size, 3), dtype=torch.uint8, device=device)
        if pixels is not None:
            x.index_copy_(0, px_pos.to(device), pixels.to(device, non_blocking=True))
        if len(enc_pos):
            x.index_copy_(0, enc_pos.to(device), self.hw.decoded(flat, sizes, indices, crops))
        return x, labels.to(device, non_blocking=True)


class HybridRates:
    """Sets the CPU share of hybrid batches from both sides' measured rates: the workers' from the seconds they
    spent decoding a batch's CPU images (``collate_hybrid``), the engines' from each batch's decode time to the
    end of its GPU work, beside the model. The share is the workers' rate over the sum, so both sides finish a
    batch's part at once. Per-image rates do not depend on the share, so the split holds its mark even though
    the workers prepare batches far ahead of it (a DataLoader holds two per worker: steering by the loop's
    waits, one step per batch, ran into its bound before those batches reached the loop). Giving the workers
    more (90% of what they decode of the loop's demand) fed 2 H200s on 32 cores worse, 0.84 against 0.88 per
    rank: the busier cores slowed the ranks' own processes more than the engines' part slowed the GPU
    (results/gpu-ranks-h200x2.txt).

    ``cpu_rate`` and ``hw_rate`` (images/s of all workers, of all decoder threads) are the starting guesses;
    each batch's figures move them by :attr:`SMOOTHING`."""

    SMOOTHING = 0.3
    #: The engines always keep a share: with none, their rate would never be measured again.
    CAP = 0.95

    def __init__(self, share, workers: int, decoders: int, cpu_rate: float, hw_rate: float):
        self.share, self.workers, self.decoders = share, max(1, workers), max(1, decoders)
        self.cpu_rate, self.hw_rate = cpu_rate, hw_rate
        self.share.value = self.target()

    def target(self) -> float:
        return min(self.CAP, self.cpu_rate / (self.cpu_rate + self.hw_rate))

    def timing(self, batch, decode_s: float) -> None:
        cpu_images, hw_images, cpu_s = len(batch[1]), len(batch[4]), float(batch[8])
        a = self.SMOOTHING
        if cpu_images and cpu_s > 0:
            self.cpu_rate += a * (self.workers * cpu_images / cpu_s - self.cpu_rate)
        if hw_images and decode_s > 0:
            self.hw_rate += a * (self.decoders * hw_images / decode_s - self.hw_rate)
        self.share.value = self.target()


# ------------------------------------------------------------------------------------------------- the loader


def _first_record_kind(paths, format: str | None) -> str:
    """What the first record of ``paths`` holds (``encoded``, ``raw``, ``tokens``)."""
    from gpufeed.formats import get_format

    paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    with get_format(format or format_of(paths)).reader(paths[0]) as reader:
        return next(iter(reader)).kind


class Loader:
    """Batches of one rank's share of ``paths``; iterate it once per epoch (:meth:`set_epoch` reshuffles).

    ``read_ahead``: each DataLoader worker asks the kernel for every record of its batch before reading the
    first (:meth:`~gpufeed.formats.base.Reader.prefetch`), so a cold batch is read at the disk's queue depth,
    not one record at a time. Off by default: on the H200 machine's local NVMe it fed no better (16 workers
    reading one record each already keep that disk busy); for a higher-latency mount, measure it there with
    ``gpufeed bench train --read-ahead on,off``.

    ``cpu_share``: ``hybrid`` only, a fixed share of each batch for the CPU workers instead of the split set from
    both sides' measured rates (:class:`HybridRates`). Where the engines' work serialises with the model's (the
    H200's inference, docs/loader.md), the rates' split leaves cores idle that a larger fixed share uses.

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
                 read_ahead: bool = False, cpu_share: float | None = None, worker_nice: int = WORKER_NICE):
        torch = _import_torch()
        self.decode_reason = None
        if decode == AUTO:
            decode, self.decode_reason = (("cpu", "stored pixels and token ids need no JPEG decoding")
                                          if augment in ("cifar", "tokens") else choose_decode(device, world_size or 1))
            if decode != "cpu" and _first_record_kind(paths, format) != "encoded":
                decode, self.decode_reason = "cpu", "raw pixel records need no JPEG decoding"
        if decode not in DECODES:
            raise ConfigError(f"decode={decode!r} is not one of {', '.join((*DECODES, AUTO))}")
        if augment not in AUGMENTS:
            raise ConfigError(f"augment={augment!r} is not one of {', '.join(AUGMENTS)}")
        if augment_on not in AUGMENT_ON:
            raise ConfigError(f"augment_on={augment_on!r} is not one of {', '.join(AUGMENT_ON)}")
        if augment_on == "gpu" and (augment != "cifar" or decode != "cpu"):
            raise ConfigError("augment_on='gpu' is for augment='cifar' with decode='cpu' (the ImageNet "
                              "augmentation runs on the GPU with decode='gpu', 'hw' or 'hybrid')")
        if augment == "cifar" and decode != "cpu":
            raise ConfigError(f"augment='cifar' reads stored pixels: use decode='cpu' (not {decode!r}), and "
                              "augment_on='gpu' to augment on the GPU")
        if augment == "tokens" and decode != "cpu":
            raise ConfigError(f"augment='tokens' reads token ids, which need no decoding: use decode='cpu' (not "
                              f"{decode!r})")
        self.augment_on = augment_on
        if cpu_share is not None and (decode != "hybrid" or not 0.0 <= cpu_share <= 1.0):
            raise ConfigError(f"cpu_share={cpu_share!r}: a fixed share of each batch for the CPU workers, between 0 "
                              "and 1, with decode='hybrid' (None: set from both sides' measured rates)")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, not {batch_size}")
        if not 0 <= worker_nice <= 19:
            raise ConfigError(f"worker_nice={worker_nice}: a niceness from 0 (the training loop's own priority) to 19")
        self.worker_nice = worker_nice
        paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
        if not paths:
            raise ConfigError("no input paths given to the loader")
        self.format = format or format_of(paths)
        self.decode, self.augment, self.size, self.seed = decode, augment, size, seed
        self.batch_size, self.drop_last, self.normalize = batch_size, drop_last, normalize
        if decode_threads < 1:
            raise ConfigError(f"decode_threads={decode_threads}: need at least 1")
        self.decode_threads, self.decode_priority = decode_threads, decode_priority
        if normalize and augment == "tokens":
            raise ConfigError("normalize=True scales image pixels; token ids (augment='tokens') are not normalised")
        self.shuffle = augment in ("train", "cifar", "tokens") if shuffle is None else shuffle
        self.device = resolve_device(device)
        if decode != "cpu":
            _require_cuda(torch, self.device, decode)
        if decode in ("hw", "hybrid"):
            import_nvimgcodec()
        self.workers = default_workers(world_size or 1) if workers is None else workers
        train = augment == "train"
        self._share = None
        self._rates = None  # hybrid with the split from measured rates: its HybridRates
        if augment == "tokens":
            transform, self._collate = TokenWindow(window, vocab), collate_tokens
        elif augment == "cifar":
            on_gpu = augment_on == "gpu"
            transform = CpuDecode(True, size, seed, cifar=True, augment=not on_gpu, with_index=on_gpu)
            self._collate = CifarCollate(seed) if on_gpu else None
        elif decode == "cpu":
            transform, self._collate = CpuDecode(train, size, seed), None
        elif decode == "hybrid":
            import multiprocessing

            self._share = multiprocessing.get_context(self._start_method()).Value("d", 0.0, lock=False)
            if cpu_share is None:
                self._rates = HybridRates(self._share, self.workers, decode_threads,
                                          self.workers * CPU_WORKER_RATE, HW_RATE)
            else:
                self._share.value = cpu_share
            transform, self._collate = HybridSplit(CpuDecode(train, size, seed), self._share), collate_hybrid
        else:
            transform, self._collate = EncodedBytes(train, seed), collate_encoded
        from gpufeed.formats.torch import MapDataset

        self.dataset = MapDataset(self.format, paths, transform=transform, rank=rank, world_size=world_size,
                                  even=True, read_ahead=read_ahead)
        self.dataset.close()  # workers open their own readers
        self.epoch = 0
        # The emulated storage tier this loader was made in, handed to its workers as they start: one started
        # from a fork server has the server's environment, which may predate the tier.
        self._tier = {var: os.environ.get(var) for var in gpufeed_io.TIER_VARS}
        self._order = _EpochOrder(len(self.dataset), seed, self.shuffle)
        self._decoder = None
        self._batches = None

    def _start_method(self) -> str:
        """How DataLoader workers start. The GPU paths run decoder threads (nvImageCodec's, the decode thread)
        in this process; a worker forked while one of them holds a lock can hang on that lock at exit, so they
        start from a fork server (a clean process). The CPU path forks, which starts fastest."""
        return "fork" if self.decode == "cpu" else "forkserver"

    @property
    def cpu_share(self) -> float | None:
        """``hybrid``: the share of each batch the CPU workers decode now."""
        return None if self._share is None else self._share.value

    @property
    def batches_ahead(self) -> int:
        """Batches the workers hold ready ahead of the loop once it runs: a measurement that starts after them
        reads from the disk only what comes after these."""
        return self.workers * PREFETCH_FACTOR

    def set_epoch(self, epoch: int) -> None:
        self.epoch = self._order.epoch = epoch

    def close(self) -> None:
        """Stop the DataLoader's workers now (they otherwise live as long as the loader)."""
        self._batches = None
        self._decoder = None

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _dataloader(self):
        """One DataLoader for the loader's life: its workers persist across epochs (no restart stall), and
        its sampler draws each epoch's order from ``(seed, epoch)``."""
        import torch

        if self._batches is None:
            self._batches = torch.utils.data.DataLoader(
                self.dataset, batch_size=self.batch_size, sampler=self._order, num_workers=self.workers,
                drop_last=self.drop_last, collate_fn=self._collate,
                prefetch_factor=PREFETCH_FACTOR if self.workers else None,
                pin_memory=self.device.type == "cuda" and self.decode in ("cpu", "hybrid"),
                persistent_workers=self.workers > 0,
                worker_init_fn=functools.partial(_init_worker, nice=self.worker_nice, tier=self._tier),
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
        with opencv_threads(1):  # the workers start (fork) on the first iteration
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
                gen = (finish(*(t.to(self.device) for t in batch)) for batch in batches)
        for x, y in gen:
            yield (normalise(x) if self.normalize else x), y


def _init_worker(worker_id: int, nice: int = 0, tier: dict | None = None) -> None:
    """A DataLoader worker's start: the loader's emulated storage tier (``tier``: the variables of
    :data:`gpufeed.io.TIER_VARS` as the loader saw them, None for unset), one OpenCV thread
    (:func:`_one_thread_per_worker`), then ``nice`` added to its niceness, so that the training loop's process,
    which launches the model's kernels, takes a core the moment it needs one instead of waiting behind busy
    workers (they still use every core it leaves idle)."""
    for var, value in (tier or {}).items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    _one_thread_per_worker(worker_id)
    if nice:
        os.nice(nice)


def _one_thread_per_worker(_worker_id: int) -> None:
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


class _EpochOrder:
    """The sample order of the current epoch: a permutation drawn from ``(seed, epoch)`` when shuffling,
    else file order. It holds no reference to the loader, so dropping a loader frees its DataLoader (and
    stops its workers) at once rather than at the next garbage collection."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.n))
        return iter(np.random.default_rng((self.seed, self.epoch)).permutation(self.n).tolist())


def imagenet_stats(device):
    """ImageNet's channel mean and std as 1 x 3 x 1 x 1 float32 tensors on ``device``."""
    import torch

    return (torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1),
            torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1))


def normalise(x_nhwc_u8, stats=None):
    """NHWC uint8 -> NCHW float32 ``(x - mean) / std`` with ImageNet's statistics (0-255 scale); ``stats``:
    :func:`imagenet_stats` made beforehand (where nothing may be copied from the host, e.g. in a CUDA graph)."""
    mean, std = stats if stats is not None else imagenet_stats(x_nhwc_u8.device)
    return x_nhwc_u8.permute(0, 3, 1, 2).float().sub_(mean).div_(std)


def _import_torch():
    try:
        import torch
    except ImportError:
        raise ConfigError(f"gpufeed.loader needs PyTorch: {_INSTALL}") from None
    return torch


def resolve_device(device=None):
    """``device`` as a ``torch.device`` with its GPU named: an index-less ``"cuda"`` becomes the calling thread's
    current GPU (``torch.cuda.set_device``), so decoder threads and nvImageCodec, which do not share that
    setting, use the same GPU as the model (one rank per GPU); ``None``: the current GPU, or the CPU."""
    torch = _import_torch()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _require_cuda(torch, device, decode: str) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"decode={decode!r} decodes on an NVIDIA GPU and torch sees none (device {device}); "
                          f"use decode='cpu', or on a GPU machine {_INSTALL}")
    try:
        import torchvision.ops  # noqa: F401  (the GPU paths crop with roi_align)
    except ImportError:
        raise ConfigError(f"decode={decode!r} crops on the GPU with torchvision: {_INSTALL}") from None


def loader(paths: str | Sequence[str], format: str | None = None, batch_size: int = 256, decode: str = AUTO,
           augment: str = "train", **options) -> Loader:
    """Batches ``(x, y)`` on the GPU from gpufeed files; see this module's documentation and :class:`Loader`."""
    return Loader(paths, format=format, batch_size=batch_size, decode=decode, augment=augment, **options)
