"""The loader's GPU side: decoding JPEGs on the GPU (nvJPEG on the SMs, :class:`NvJpegDecoder`; the JPEG engines
through nvImageCodec, :class:`HwJpegDecoder`), cropping them there as the CPU path crops (:class:`GpuCrop`), the
decoder threads that run ahead of the model (:func:`decoded_batches`) and the hybrid path's measured split
(:class:`HybridDecoder`, :class:`HybridRates`). Used through :func:`gpufeed.loader`
(:mod:`gpufeed.pipelines.loader`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Iterator, Sequence

import numpy as np

from gpufeed.errors import ConfigError
from gpufeed.pipelines.batches_cpu import CROP_COLUMNS, crop_params

#: What the GPU paths need installed.
GPU_EXTRA = "pip install 'gpufeed[gpu]'"


def import_torch():
    try:
        import torch
    except ImportError:
        raise ConfigError(f"gpufeed.loader needs PyTorch: {GPU_EXTRA}") from None
    return torch


def resolve_device(device=None):
    """``device`` as a ``torch.device`` with its GPU named: an index-less ``"cuda"`` becomes the calling thread's
    current GPU (``torch.cuda.set_device``), so decoder threads and nvImageCodec, which do not share that
    setting, use the same GPU as the model (one rank per GPU); ``None``: the current GPU, or the CPU."""
    torch = import_torch()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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

    def _to_device(self, tensor):
        """A small host tensor on the device: staged through pinned memory on a GPU, so the copy joins this
        object's stream instead of waiting on the host for it."""
        if self.stream is not None:
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def crop(self, images: list, indices, crops=None) -> object:
        """``images``: CHW uint8 tensors on the device, ``indices`` their sample indices -> N x size x size x 3
        uint8. ``crops``: the boxes and flips :class:`EncodedBytes` drew in the workers (N x CROP_COLUMNS: height,
        width, box, flip, orientation), used where the decoded image has the header's size; drawn here
        otherwise."""
        torch = self.torch
        full = [tuple(img.shape) for img in images]
        shapes = [shape[1:] for shape in full]
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
        for i, shape in enumerate(full):
            by_shape.setdefault(shape, []).append(i)
        # Each shape's images take consecutive rows of one float batch, made uint8 NHWC once at the end, and every
        # group's boxes go to the device in one copy: a handful of calls per shape (about one per image at
        # ImageNet's sizes), each of which takes the interpreter lock from the thread launching the model's work.
        rows, rois, groups = [], [], []
        for (_, height, width), members in by_shape.items():
            # Stored at the model's size (a centre crop) in evaluation: used as it is, as on the CPU path.
            whole = not self.train and (height, width) == (self.size, self.size)
            groups.append((len(rows), members, None if whole else len(rois)))
            if not whole:
                for k, i in enumerate(members):
                    top, left, h, w = boxes[i]
                    rois.append((k, left, top, left + w, top + h))
            rows.extend(members)
        batch = torch.empty((len(images), 3, self.size, self.size), dtype=torch.float32, device=self.device)
        on_device = self._to_device(torch.tensor(rois, dtype=torch.float32)) if rois else None
        for start, members, first_roi in groups:
            stack = torch.stack([images[i] for i in members])
            end = start + len(members)
            if first_roi is None:
                batch[start:end].copy_(stack)
            else:
                batch[start:end] = self.ops.roi_align(stack.float(), on_device[first_roi:first_roi + len(members)],
                                                      output_size=(self.size, self.size), sampling_ratio=2,
                                                      aligned=True)
        pixels = batch.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
        if rows == list(range(len(images))):
            out = pixels.contiguous()
        else:
            out = torch.empty_like(pixels, memory_format=torch.contiguous_format)
            out.index_copy_(0, self._to_device(torch.tensor(rows)), pixels)
        if any(flips):
            flip = self._to_device(torch.from_numpy(np.flatnonzero(flips)))
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
    """nvImageCodec, imported quietly (:func:`~gpufeed.pipelines.imageio.nvimgcodec_module`: its notices of the JPEG
    2000 and TIFF libraries the wheel does not ship, and its warning per image the engines hand back undecoded,
    which the loader decodes another way and counts in :attr:`HwJpegDecoder.fallbacks`)."""
    from gpufeed.pipelines.imageio import nvimgcodec_module

    nvimgcodec = nvimgcodec_module()
    if nvimgcodec is None:
        raise ConfigError(f"decode='hw' needs NVIDIA nvImageCodec: {GPU_EXTRA} (adds nvidia-nvimgcodec-cu13), or "
                          "decode='cpu'")
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
        # The DataLoader pinned the batch: every copy joins this stream without the thread waiting for it.
        if pixels is not None:
            x.index_copy_(0, px_pos.to(device, non_blocking=True), pixels.to(device, non_blocking=True))
        if len(enc_pos):
            x.index_copy_(0, enc_pos.to(device, non_blocking=True), self.hw.decoded(flat, sizes, indices, crops))
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

