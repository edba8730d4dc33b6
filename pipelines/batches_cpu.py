"""What the loader's DataLoader worker processes do to records: decode and crop on the CPU
(:class:`CpuDecode`), CIFAR's augmentation, token windows, and the collation of a batch for each path (the
encoded bytes and crop parameters the GPU paths take, the hybrid split). Each sample's crop and flip are drawn
from ``(seed, index)``, so every path crops the same boxes. Used through :func:`gpufeed.loader`
(:mod:`gpufeed.pipelines.loader`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import numpy as np

from gpufeed.errors import ConfigError

#: Columns of a crop drawn in the workers for the GPU paths: height, width (upright), the box (top, left, h, w),
#: flip, EXIF orientation.
CROP_COLUMNS = 8
#: CIFAR training augmentation: zero padding on each side before the random crop of the stored size.
CIFAR_PAD = 4
#: Standard evaluation crop: the centre 224 of an image resized to 256 on its shorter side.
CENTER_FRACTION = 224 / 256


def center_box(height: int, width: int, fraction: float = CENTER_FRACTION) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of the square centre crop that resize-256-then-crop-224 keeps, in source pixels."""
    side = max(1, int(round(min(height, width) * fraction)))
    return (height - side) // 2, (width - side) // 2, side, side

@dataclasses.dataclass(frozen=True)
class CpuDecode:
    """Runs in DataLoader workers: decode, then RandomResizedCrop + flip (``train``) or the centre crop; with
    ``cifar``, CIFAR's pad-4 / random-crop / flip at the stored size instead (``augment=False``: the stored
    pixels, for the GPU to augment).

    The crop of sample ``i`` is drawn from a generator seeded with ``(seed, i)``, so runs are repeatable.
    Returns ``(HWC uint8 RGB, label)``; :class:`CpuBatch` writes a batch's pixels into one NHWC uint8 tensor
    instead (:meth:`pixels` with ``out``). With ``with_index``, ``(pixels, label, index)`` for
    :class:`CifarCollate`.
    """

    train: bool
    size: int = 224
    seed: int = 0
    cifar: bool = False
    augment: bool = True
    with_index: bool = False
    reduce: bool = True  # JPEGs decode at a DCT scale-down where the crop allows (transforms.decode_crop)
    region: bool = True  # else only the crop's box of a JPEG, where nvImageCodec is installed (the same pixels)

    def __call__(self, sample):
        if self.with_index:
            return self.pixels(sample), int(sample.labels[0]), int(sample.index)
        return self.pixels(sample), int(sample.labels[0])

    def pixels(self, sample, out: np.ndarray | None = None) -> np.ndarray:
        """The sample's pixels, written into ``out`` (a batch's slot of the output's shape) where given."""
        import cv2

        from gpufeed.pipelines.transforms import (crop_resize, decode_crop, decode_image, random_resized_crop_choice,
                                                  written_into)

        if out is not None and (self.cifar or sample.kind == "raw"):
            return written_into(out, self.pixels(sample))

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
            return decode_crop(sample.payload, sample.key, self.size, choose, self.reduce, out, self.region)
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


@dataclasses.dataclass(frozen=True)
class CpuBatch:
    """Runs in DataLoader workers for the CPU path (:class:`~gpufeed.formats.torch.MapDataset`'s
    ``batch_transform``): a batch's samples, as they are read, decoded and cropped by ``decode`` straight into
    one N x size x size x 3 uint8 tensor, returned with an int64 tensor of their labels: the batch
    :class:`CpuDecode` and the default collate make, without copying each image into it afterwards. In a worker
    the tensor is made in shared memory, the one block that crosses to the loop's process, as the default
    collate makes it; with a ``pool`` (where the DataLoader pins its batches) in one of its blocks, the batch
    then crossing as a :class:`PooledBatch`."""

    decode: CpuDecode
    pool: BatchPool | None = None

    def __call__(self, count: int, samples):
        import torch

        size = self.decode.size
        pixels, flag = batch_block((count, size, size, 3), self.pool)
        slots = pixels.numpy()
        labels = []
        for i, sample in enumerate(samples):
            self.decode.pixels(sample, out=slots[i])
            labels.append(int(sample.labels[0]))
        return as_batch((pixels, torch.tensor(labels, dtype=torch.int64)), flag)


def batch_tensor(shape: tuple[int, ...]):
    """An uninitialised uint8 tensor of ``shape``: in shared memory in a DataLoader worker (where the default
    collate puts its batches: handing it to the main process then moves no bytes), in this process's memory
    elsewhere."""
    import torch

    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    return shared_uint8(math.prod(shape)).view(shape)


def shared_uint8(nbytes: int):
    """A uint8 tensor of ``nbytes`` in a new block of shared memory (as the DataLoader's default collate makes
    its batches in a worker)."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


#: Blocks of each size a worker's :class:`BatchPool` keeps: the batches a worker has in flight (the DataLoader's
#: prefetch factor, 2) and one more; a block is free again as soon as the loop's process has pinned its batch.
POOLED_BLOCKS = 3


class BatchPool:
    """A worker's blocks of shared memory for its batches, each used again once the loop's process has copied
    the batch out of it (the DataLoader's pin-memory step, :class:`PooledBatch`) and marked it free. A new block
    costs the worker the first touch of each of its pages: filling 77 MB (a batch of 512 crops of 224 x 224)
    took 47-53 ms in a new block against 11-12 ms in one used before, ~0.07 ms an image on the 2-core
    development machine. Up to :data:`POOLED_BLOCKS` blocks of each size; where none is free, a new one outside
    the pool. Each process has blocks of its own: a pool crosses to a worker empty (pickled, or forked)."""

    def __init__(self, keep: int = POOLED_BLOCKS):
        import os

        self.keep, self.pid, self.blocks = keep, os.getpid(), {}

    def __getstate__(self) -> dict:
        return {"keep": self.keep}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["keep"])

    def take(self, nbytes: int):
        """``(block, flag)``: a uint8 tensor of ``nbytes`` in shared memory and the one-byte tensor after it,
        which whoever is done with the block sets to 1 (:meth:`PooledBatch.pin_memory`)."""
        import os

        if self.pid != os.getpid():  # a forked copy: the blocks are its parent's
            self.__init__(self.keep)
        blocks = self.blocks.setdefault(nbytes, [])
        for block, flag in blocks:
            if flag.numpy()[0] == 1:
                flag.numpy()[0] = 0
                return block, flag
        whole = shared_uint8(nbytes + 1)
        block, flag = whole[:nbytes], whole[nbytes:]
        flag.numpy()[0] = 0
        if len(blocks) < self.keep:
            blocks.append((block, flag))
        return block, flag


def batch_block(shape: tuple[int, ...], pool: BatchPool | None):
    """``(tensor, flag)``: an uninitialised uint8 tensor of ``shape`` for a batch, from ``pool`` with the flag
    that frees it, or without a pool :func:`batch_tensor` and None."""
    if pool is None:
        return batch_tensor(shape), None
    block, flag = pool.take(math.prod(shape))
    return block.view(shape), flag


def as_batch(parts: tuple, flag):
    """The batch a worker hands over: ``parts`` as they are, or, made in a pooled block (``flag``), a
    :class:`PooledBatch` of them."""
    return parts if flag is None else PooledBatch(parts, flag)


class PooledBatch:
    """A batch made in a block of a worker's :class:`BatchPool`, as it crosses to the loop's process. The
    DataLoader's pin-memory step calls :meth:`pin_memory` (on any object that has one), which copies the
    batch's tensors into pinned memory, as it pins a plain batch, and then frees the block for the worker's next
    batch; the loop sees the pinned tuple only. Made only where the DataLoader pins (a CUDA device): unpinned,
    the loop would hold tensors in a block the worker writes again."""

    def __init__(self, parts: tuple, flag):
        self.parts, self.flag = parts, flag

    def pin_memory(self, device=None) -> tuple:
        return self.copied(lambda t: t.pin_memory())

    def copied(self, copy) -> tuple:
        """The parts with every tensor replaced by ``copy(tensor)``; the block is free once they are made."""
        import torch

        out = tuple(copy(p) if isinstance(p, torch.Tensor) else p for p in self.parts)
        self.flag.fill_(1)
        return out


def as_made(batch):
    """The DataLoader's collate for datasets that make whole batches (:class:`CpuBatch`): the batch as it is."""
    return batch


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

    def __init__(self, cpu: CpuDecode, share, pool: BatchPool | None = None):
        self.cpu, self.share, self.pool = cpu, share, pool

    def __call__(self, sample, out: np.ndarray | None = None):
        """``("px", pixels, label, index, seconds)`` (the pixels written into ``out`` where given) or ``("jpeg",
        bytes, label, index, crop)``."""
        if self.on_cpu(sample):
            t0 = time.perf_counter()
            pixels = self.cpu.pixels(sample, out)
            return "px", pixels, int(sample.labels[0]), int(sample.index), time.perf_counter() - t0
        return ("jpeg", *EncodedBytes(self.cpu.train, self.cpu.seed)(sample))

    def on_cpu(self, sample) -> bool:
        # The golden-ratio sequence spreads any share evenly over consecutive indices.
        return (sample.index * 0.6180339887498949) % 1.0 < self.share.value

    def batch(self, count: int, samples) -> tuple:
        """A whole batch (:class:`~gpufeed.formats.torch.MapDataset`'s ``batch_transform``): its CPU images decoded
        straight into one tensor (as :class:`CpuBatch` does, pooled likewise), packed as :func:`collate_hybrid`
        packs them."""
        size = self.cpu.size
        pixels, flag = batch_block((count, size, size, 3), self.pool)
        slots = pixels.numpy()
        items, made = [], 0
        for sample in samples:
            items.append(self(sample, slots[made]))  # a JPEG left to the engines leaves the slot to the next
            made += items[-1][0] == "px"
        return as_batch(collate_hybrid(items, pixels[:made] if made else None), flag)


def collate_hybrid(batch, pixels=None):
    """``[("px", pixels, label, index, seconds) | ("jpeg", bytes, label, index, crop)]`` -> (NHWC uint8 pixels,
    their batch positions, the other images as :func:`collate_encoded` packs them, their positions, all labels,
    their indices and crops, the seconds the worker spent decoding the pixels). ``pixels``: the CPU images already
    in one tensor, in order (:meth:`HybridSplit.batch`)."""
    import torch

    px = [(i, item[1]) for i, item in enumerate(batch) if item[0] == "px"]
    enc = [(i, item) for i, item in enumerate(batch) if item[0] == "jpeg"]
    if pixels is None:
        pixels = torch.from_numpy(np.stack([p for _, p in px])) if px else None
    flat, sizes, _, indices, crops = collate_encoded([item[1:] for _, item in enc])
    return (pixels, torch.tensor([i for i, _ in px], dtype=torch.int64), flat, sizes,
            torch.tensor([i for i, _ in enc], dtype=torch.int64),
            torch.tensor([item[2] for item in batch], dtype=torch.int64), indices, crops,
            torch.tensor([sum(item[4] for item in batch if item[0] == "px")], dtype=torch.float64))


class MadeCount:
    """The samples a loader's DataLoader workers have made so far, each worker counting its own in one slot of
    ``slots`` (a shared ``multiprocessing`` array of int64, one slot a worker: no two processes write one slot).
    A sample counts once its transform is done. A loop that takes batches faster than the workers make them
    first eats the batches they made ahead (a worker holds two): over a short timed window the batches it took
    then overstate what the workers keep up; the samples they made over the same window do not (with the
    workers ahead of the loop they make what it takes, each refilling the batch it took)."""

    def __init__(self, slots):
        self.slots = slots

    @property
    def total(self) -> int:
        return sum(self.slots)

    def slot(self) -> int:
        """This process's slot: its DataLoader worker's id (0 in the loop's own process)."""
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        return 0 if info is None else info.id % len(self.slots)

    def counted(self, samples):
        """``samples`` as they come, each counted when the next is asked for (its transform is then done)."""
        slots, i = self.slots, self.slot()
        for sample in samples:
            yield sample
            slots[i] += 1

    def batches(self, batch_transform):
        """``batch_transform(count, samples)`` counting each sample it makes."""
        return functools.partial(_counted_batch, self, batch_transform)

    def samples(self, transform):
        """``transform(sample)`` counting each sample it makes."""
        return functools.partial(_counted_sample, self, transform)


def _counted_batch(made: MadeCount, batch_transform, count: int, samples):
    return batch_transform(count, made.counted(samples))


def _counted_sample(made: MadeCount, transform, sample):
    out = transform(sample)
    made.slots[made.slot()] += 1
    return out
