"""gpufeed.loader on the CPU path (CI has no GPU), its building blocks, and its one-line refusals.

The GPU paths (nvJPEG, the JPEG engines through nvImageCodec, hybrid) run on the GPU machine:
scripts/gpu_decode.sh measures them and checks their batches against the CPU path's.
"""

from __future__ import annotations

import dataclasses

import multiprocessing
import os
import signal

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gpufeed  # noqa: E402
from gpufeed.errors import ConfigError  # noqa: E402
from gpufeed.pipelines import batches_cpu as C  # noqa: E402
from gpufeed.pipelines import batches_gpu as G  # noqa: E402
from gpufeed.pipelines import loader as L  # noqa: E402

N = 40


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from gpufeed.bench.dataset import build_dataset, load_dataset_info

    out = tmp_path_factory.mktemp("loader") / "ds"
    build_dataset(str(out), n=N, workers=2)
    return load_dataset_info(str(out))["formats"]


def test_center_box_is_resize_256_crop_224():
    top, left, h, w = C.center_box(375, 500)
    assert (h, w) == (328, 328)
    assert (top, left) == ((375 - 328) // 2, (500 - 328) // 2)


def test_cpu_decode_and_encoded_bytes_on_real_records(dataset):
    from gpufeed.formats import get_format

    sample = get_format("recordio").reader(dataset["recordio"]["paths"][0])[3]
    for train in (True, False):
        img, label = C.CpuDecode(train, 224, seed=5)(sample)
        assert img.shape == (224, 224, 3) and img.dtype == np.uint8 and label == int(sample.labels[0])
    # The crop of a sample is a function of (seed, index): runs are repeatable.
    assert np.array_equal(C.CpuDecode(True, 224, seed=5)(sample)[0], C.CpuDecode(True, 224, seed=5)(sample)[0])
    raw, label, index, crop = C.EncodedBytes(train=True, seed=5)(sample)
    assert raw == bytes(sample.payload) and raw[:3] == b"\xff\xd8\xff" and index == sample.index == 3
    # The workers draw the GPU paths' crop from the header: the box and flip the CPU path draws for this sample.
    from gpufeed.pipelines.transforms import decode_image

    shape = decode_image(raw, "x").shape[:2]
    (box,), (flip,) = C.crop_params([shape], [3], True, seed=5)
    assert crop == (*shape, *box, int(flip), 1)  # stored upright: EXIF orientation 1
    assert C.EncodedBytes()(sample)[3] == (*shape, *C.center_box(*shape), 0, 1)
    # The engines decode only the evaluation box of an upright image, never a whole image or a rotated one's.
    regions = G.HwJpegDecoder.centre_regions(torch.tensor([
        [*shape, *C.center_box(*shape), 0, 1], [*shape, 0, 0, *shape, 0, 1], [*shape, *C.center_box(*shape), 0, 6]]))
    assert regions == [C.center_box(*shape), None, None]
    flat, sizes, labels, indices, crops = C.collate_encoded([(raw, label, 3, crop), (raw[:100], 7, 9, crop)])
    assert flat.numel() == len(raw) + 100 and sizes.tolist() == [len(raw), 100] and labels.tolist() == [label, 7]
    assert indices.tolist() == [3, 9] and crops.tolist() == [list(crop)] * 2


def test_gpu_crops_are_the_cpu_paths_crops(dataset):
    """The GPU paths crop and flip sample i as CpuDecode does: the same box and flip from (seed, i)."""
    import cv2

    from gpufeed.formats import get_format
    from gpufeed.pipelines.transforms import decode_image

    reader = get_format("recordio").reader(dataset["recordio"]["paths"][0])
    samples = [reader[i] for i in range(12)]
    images = [decode_image(s.payload, s.key) for s in samples]
    boxes, flips = C.crop_params([im.shape[:2] for im in images], [s.index for s in samples], True, seed=5)
    assert 0 < sum(flips) < len(flips)
    for s, im, (top, left, h, w), flip in zip(samples, images, boxes, flips):
        want = cv2.resize(im[top:top + h, left:left + w], (64, 64), interpolation=cv2.INTER_LINEAR)
        want = cv2.flip(want, 1) if flip else want
        assert np.array_equal(C.CpuDecode(True, 64, seed=5, reduce=False).pixels(s), want)
    boxes, flips = C.crop_params([(375, 500)], [0], False)
    assert boxes == [C.center_box(375, 500)] and flips == [False]


@pytest.mark.parametrize("fmt", ["recordio", "tfrecord", "lmdb"])
def test_loader_gives_the_same_batches_from_every_format(dataset, fmt):
    ld = gpufeed.loader(dataset[fmt]["paths"], batch_size=8, decode="cpu", augment="eval", workers=2)
    assert ld.format == fmt and len(ld) == N // 8
    xs, ys = zip(*ld)
    assert all(x.shape == (8, 224, 224, 3) and x.dtype == torch.uint8 for x in xs)
    ref = gpufeed.loader(dataset["recordio"]["paths"], batch_size=8, augment="eval", workers=0)
    rx, ry = zip(*ref)
    assert torch.equal(torch.cat(ys), torch.cat(ry)) and torch.equal(torch.cat(xs), torch.cat(rx))


def test_the_loader_counts_the_samples_its_workers_made(dataset):
    """samples_made: every sample a worker (or, without workers, the loop's process) made, counted as each is done,
    on the CPU path (a batch made at once) and the engines' (each record read for them): what a measurement sets
    beside the batches its loop took."""
    paths = dataset["recordio"]["paths"]
    ld = gpufeed.loader(paths, batch_size=8, decode="cpu", augment="eval", workers=0)
    it = iter(ld)
    next(it), next(it)
    assert ld.samples_made == 16
    ld = gpufeed.loader(paths, batch_size=8, decode="cpu", augment="eval", workers=2)
    assert ld.samples_made == 0
    taken = sum(len(y) for _, y in ld)
    assert taken == N and N <= ld.samples_made <= N + 2 * 2 * 8  # and what the workers made ahead, 2 batches each
    ld.close()
    counted = C.MadeCount([0, 0])
    assert counted.batches(lambda n, samples: list(samples))(3, iter("abc")) == ["a", "b", "c"]
    assert counted.samples(str.upper)("d") == "D" and counted.total == 4


@pytest.mark.parametrize("augment", ["train", "eval"])
def test_cpu_batches_hold_each_samples_own_decode(dataset, augment):
    """The CPU path decodes each batch straight into one tensor (CpuBatch): the very pixels CpuDecode gives each
    sample on its own, flips included, in workers (the batch made in shared memory, handed over without a copy)
    and in the loop's process alike."""
    from gpufeed.formats import get_format

    path = dataset["recordio"]["paths"][0]
    with get_format("recordio").reader(path) as reader:
        want = np.stack([C.CpuDecode(augment == "train", 224, seed=7).pixels(reader[k]) for k in range(N)])
    if augment == "train":  # the crops include flipped ones
        assert any(C.draw_crop(10, 10, k, True, 7)[1] for k in range(N))
    for workers in (0, 2):
        ld = gpufeed.loader([path], batch_size=8, decode="cpu", augment=augment, workers=workers, shuffle=False,
                            seed=7, device="cpu")
        xs, ys = zip(*ld)
        assert np.array_equal(torch.cat(xs).numpy(), want)
        assert torch.cat(ys).dtype == torch.int64 and len(torch.cat(ys)) == N
        assert all(x.is_shared() for x in xs) == (workers > 0)
        ld.close()
    if torch.cuda.is_available():  # pinned for the GPU: made in the workers' pooled blocks, freed by the pinning
        for workers in (0, 2):
            ld = gpufeed.loader([path], batch_size=8, decode="cpu", augment=augment, workers=workers,
                                shuffle=False, seed=7, device="cuda")
            for _ in range(2):  # the second epoch's batches in blocks used before
                assert np.array_equal(torch.cat([x.cpu() for x, _ in ld]).numpy(), want)
            ld.close()
    # A slot OpenCV would not write into (not contiguous) still ends up holding the crop.
    with get_format("recordio").reader(path) as reader:
        slot = np.zeros((224, 448, 3), np.uint8)[:, ::2]
        C.CpuDecode(augment == "train", 224, seed=7).pixels(reader[3], out=slot)
    assert np.array_equal(slot, want[3])


def test_pooled_batches_reuse_a_block_only_once_the_loop_has_copied_its_batch(dataset):
    """Where the DataLoader pins (a GPU), the CPU path makes each batch in a block of its worker's BatchPool and
    hands it over as a PooledBatch, whose pinning copies it out and frees the block: the next batch of that
    worker is made in the same block, a block not yet copied out is never written again, and the batches hold
    each sample's own decode throughout (here copied out with torch.clone, as the pin step does on a GPU)."""
    from gpufeed.formats import get_format
    from gpufeed.formats.torch import MapDataset

    pool = C.BatchPool(keep=2)
    a, fa = pool.take(16)
    b, fb = pool.take(16)  # a is not free yet: another block
    c, _ = pool.take(16)  # the pool is full: a new block outside it
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3 and a.is_shared()
    fa.fill_(1)
    again, flag = pool.take(16)
    assert again.data_ptr() == a.data_ptr() and flag.numpy()[0] == 0  # taken again, and busy once more
    assert pool.take(16)[0].data_ptr() not in (a.data_ptr(), b.data_ptr())
    # A pool crosses to a worker empty: the blocks are each process's own.
    import pickle

    assert pickle.loads(pickle.dumps(pool)).blocks == {} and pool.blocks

    path = dataset["recordio"]["paths"][0]
    with get_format("recordio").reader(path) as reader:
        want = np.stack([C.CpuDecode(True, 224, seed=7).pixels(reader[k]) for k in range(N)])
        make = C.CpuBatch(C.CpuDecode(True, 224, seed=7), C.BatchPool())
        first = make(8, (reader[k] for k in range(8)))
        assert isinstance(first, C.PooledBatch)
        x, y = first.copied(torch.clone)
        assert np.array_equal(x.numpy(), want[:8]) and y.dtype == torch.int64
        second = make(8, (reader[k] for k in range(8, 16)))
        assert second.parts[0].data_ptr() == first.parts[0].data_ptr()  # the freed block, made again
    # In DataLoader workers (forked: each makes its own pool), every batch copied out as it arrives.
    data = MapDataset("recordio", [path], batch_transform=C.CpuBatch(C.CpuDecode(True, 224, seed=7), C.BatchPool()))
    data.close()
    batches = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2, collate_fn=C.as_made,
                                          multiprocessing_context="fork")
    got = [batch.copied(torch.clone)[0] for batch in batches]
    assert np.array_equal(torch.cat(got).numpy(), want)


def test_inference_recipes_stored_centre_crop_jpeg_and_raw(tmp_path):
    """A dataset stored at the model's size (``--size 224x224 --center-crop``, JPEG or raw) gives eval batches of
    the stored pixels themselves: the loader does not crop again."""
    from gpufeed.bench.dataset import build_dataset, load_dataset_info

    batches = {}
    for encode in ("jpeg", "raw"):
        out = tmp_path / encode
        info = build_dataset(str(out), ["lmdb", "tfrecord"], n=8, workers=1, size=(224, 224), center_crop=True,
                             encode=encode)
        assert info["store"] == "--size 224x224 --center-crop" + (" --encode raw" if encode == "raw" else "")
        paths = load_dataset_info(str(out))["formats"]["tfrecord"]["paths"]
        x, _ = next(iter(gpufeed.loader(paths, batch_size=8, augment="eval", workers=0)))
        assert x.shape == (8, 224, 224, 3)
        batches[encode] = x
        if encode == "raw":
            from gpufeed.formats import get_format

            stored = get_format("tfrecord").reader(paths[0])[0].payload
            assert np.array_equal(x[0].cpu().numpy(), np.asarray(stored))
    # The JPEG recipe decodes to (nearly) the raw recipe's pixels: both are the same stored crop.
    assert (batches["jpeg"].float() - batches["raw"].float()).abs().mean() < 8  # q95 JPEG error; another crop would differ by tens
    with pytest.raises(ConfigError, match="resize, size, center_crop and quality need jpeg"):
        build_dataset(str(tmp_path / "bad"), ["lmdb"], n=2, workers=1, resize=64, encode="pass")
    # The same crop at a lower JPEG quality: smaller records, the flags that make them (from the build and from the
    # converted output's manifest alike), and the quality refused where no JPEG is written.
    out = tmp_path / "q75"
    info = build_dataset(str(out), ["tfrecord"], n=8, workers=1, size=(224, 224), center_crop=True, quality=75)
    assert (info["store"] == load_dataset_info(str(out), described=False)["store"]
            == "--size 224x224 --center-crop --quality 75")
    assert info["sample_bytes"] < 0.7 * load_dataset_info(str(tmp_path / "jpeg"))["sample_bytes"]
    for bad in ({"encode": "raw", "quality": 75}, {"quality": 0}, {"encode": "pass", "quality": 75}):
        with pytest.raises(ConfigError, match="quality"):
            build_dataset(str(tmp_path / "bad"), ["lmdb"], n=2, workers=1, **bad)


def test_cifar_augmentation_in_the_workers_and_on_the_gpu_gives_the_same_batches(tmp_path):
    """augment="cifar" (pad 4, random crop, flip from (seed, i)) in DataLoader workers, and augment_on="gpu"
    (whole batches gathered on the device; here the CPU device) give identical batches from raw CIFAR records."""
    from gpufeed.bench.dataset import build_dataset, load_dataset_info

    build_dataset(str(tmp_path / "c"), ["tfrecord", "lmdb"], n=64, image="cifar", workers=1)
    info = load_dataset_info(str(tmp_path / "c"))["formats"]
    got = {}
    for on in ("cpu", "gpu"):
        for fmt in ("tfrecord", "lmdb"):
            ld = gpufeed.loader(info[fmt]["paths"], batch_size=16, augment="cifar", augment_on=on, size=32,
                                workers=2 if on == "cpu" else 0, device="cpu", seed=4)
            got[on, fmt] = [(x.clone(), y.clone()) for x, y in ld]
    ref = got["cpu", "tfrecord"]
    assert len(ref) == 4 and ref[0][0].shape == (16, 32, 32, 3) and ref[0][0].dtype == torch.uint8
    for key, batches in got.items():
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, ref)), key
    # It is an augmentation: the stored pixels come back shifted and flipped, not as they are.
    plain = next(iter(gpufeed.loader(info["tfrecord"]["paths"], batch_size=16, augment="eval", size=32,
                                     workers=0, device="cpu", shuffle=True, seed=4)))[0]
    assert not torch.equal(plain, ref[0][0])
    for kwargs, text in ((dict(augment="train", augment_on="gpu"), "augment_on='gpu' is for augment='cifar'"),
                         (dict(augment="cifar", decode="hw"), "reads stored pixels")):
        with pytest.raises(ConfigError, match=text):
            gpufeed.loader(info["tfrecord"]["paths"], **kwargs)


def test_epochs_reshuffle_deterministically_and_ranks_split_the_data(dataset):
    paths = dataset["tfrecord"]["paths"]

    def labels(epoch, rank=0, world=1, seed=0):
        ld = gpufeed.loader(paths, batch_size=4, workers=1, rank=rank, world_size=world, seed=seed)
        ld.set_epoch(epoch)
        return torch.cat([y for _, y in ld]).tolist()

    assert labels(0) == labels(0) and labels(0) != labels(1) and sorted(labels(0)) == sorted(labels(1))
    halves = labels(0, 0, 2) + labels(0, 1, 2)
    assert len(halves) == N and sorted(halves) == sorted(labels(0))


def test_the_workers_go_on_into_the_next_epoch_and_each_pass_delivers_its_epochs_order(dataset):
    """One DataLoader stream spans the epochs: a pass that ends moves to the next epoch, whose batches the workers
    had already begun (the DataLoader's iterator is not reset, so its prefetch never drains at an epoch's end);
    each pass still delivers exactly its epoch's order, with or without set_epoch, and a pass left half-way or a
    set_epoch to another epoch starts that epoch from its first batch."""
    paths = dataset["tfrecord"]["paths"]

    def labels_of(ld):
        return torch.cat([y for _, y in ld]).tolist()

    def epoch(e):
        ld = gpufeed.loader(paths, batch_size=4, workers=2)
        ld.set_epoch(e)
        return labels_of(ld)

    ld = gpufeed.loader(paths, batch_size=4, workers=2)
    first = labels_of(ld)
    assert ld.epoch == 1 and first == epoch(0)
    it = iter(ld)
    _, y0 = next(it)
    # The second epoch's first batch came from the same DataLoader iterator, a pass's worth of batches on.
    assert ld._batches._iterator._rcvd_idx > len(ld)
    assert torch.cat([y0] + [y for _, y in it]).tolist() == epoch(1)
    ld.set_epoch(2)  # the next one anyway: no restart
    assert labels_of(ld) == epoch(2) and ld.epoch == 3
    ld.set_epoch(0)  # back: restarted at epoch 0's first batch
    assert labels_of(ld) == first
    half = iter(ld)
    next(half)
    del half  # left after one batch of epoch 1
    assert ld.epoch == 1 and labels_of(ld) == epoch(1)
    ld.close()


def test_out_of_order_hands_out_every_batch_once_in_the_stream_of_epochs(dataset):
    """in_order=False: the DataLoader hands out each batch as a worker makes it. Every pass still has its length,
    every batch comes once, and one drawn for an epoch comes within that epoch's pass or the next (at most
    workers x 2 batches in flight), so over three passes the batches are those of epochs 0-3, epochs 0 and 1 whole;
    in order (the default) is unchanged."""
    from collections import Counter

    paths = dataset["tfrecord"]["paths"]

    def batches(ld, passes):
        return [tuple(y.tolist()) for _ in range(passes) for _, y in ld]

    ld = gpufeed.loader(paths, batch_size=4, workers=2, augment="eval", in_order=False)
    assert ld.in_order is False and ld._batches is None
    got = batches(ld, 3)
    assert ld._batches.in_order is False and len(got) == 3 * len(ld) and ld.epoch == 3
    ld.close()
    ordered = gpufeed.loader(paths, batch_size=4, workers=2, augment="eval")
    assert ordered.in_order is True
    epochs = [batches(ordered, 1) for _ in range(4)]
    assert ordered._batches.in_order is True
    ordered.close()
    assert not Counter(got) - Counter(sum(epochs, []))  # nothing else, nothing twice
    assert not Counter(epochs[0] + epochs[1]) - Counter(got)  # the first two epochs whole
    # Without workers the loop makes each batch itself, in order.
    assert gpufeed.loader(paths, batch_size=4, workers=0, augment="eval", in_order=False).in_order is True


def test_in_order_is_checked_in_the_callers_spelling():
    with pytest.raises(ConfigError, match=r"in_order='no': True, False or None"):
        L.LoaderOptions(in_order="no")
    with pytest.raises(ConfigError, match=r"--in-order maybe: on, off or auto"):
        L.LoaderOptions(in_order="maybe", spelling="cli")


def test_forked_workers_start_after_the_parents_opencv_pool_ran(dataset):
    """The workers run one OpenCV thread each; setting that inside a worker forked after the parent's pool
    ran hangs the worker, so the loader sets it around the fork and restores the parent's count."""
    import cv2

    cv2.setNumThreads(2)
    cv2.resize(np.zeros((1500, 1500, 3), np.uint8), (700, 700))  # the parent's pool has threads now
    ld = gpufeed.loader(dataset["tfrecord"]["paths"], batch_size=4, augment="eval", workers=2)
    x, _ = next(iter(ld))
    assert x.shape == (4, 224, 224, 3) and cv2.getNumThreads() == 2
    ld.close()


def test_a_rank_of_several_starts_its_workers_from_a_fork_server(dataset):
    """A rank's process runs its process group's threads: its CPU path's workers start from a fork server (a worker
    forked while one of those threads held a lock would hang on it), a lone rank's are forked; both read."""
    paths = dataset["tfrecord"]["paths"]
    for world, method in ((1, "fork"), (2, "forkserver")):
        ld = gpufeed.loader(paths, batch_size=4, workers=1, decode="cpu", rank=0, world_size=world)
        assert ld._dataloader().multiprocessing_context.get_start_method() == method
        x, _ = next(iter(ld))
        assert x.shape == (4, 224, 224, 3)
        if method == "forkserver":  # started outside the workers' held SIGTERM (machine.sigterm_held): it ends on one
            from multiprocessing import forkserver

            server = forkserver._forkserver._forkserver_pid
            blocked = int(open(f"/proc/{server}/status").read().split("SigBlk:")[1].split()[0], 16)
            assert not blocked >> (signal.SIGTERM - 1) & 1
        ld.close()


def test_workers_run_at_the_niceness_asked_and_the_loop_at_its_own(dataset):
    """The workers yield the CPU to the loop's process, which launches the model's kernels: their niceness is
    this process's plus ``worker_nice``, and this process's is unchanged."""
    import psutil

    me = psutil.Process()
    own = me.nice()
    for nice in (0, 7):
        before = {p.pid for p in me.children(recursive=True)}
        ld = gpufeed.loader(dataset["tfrecord"]["paths"], batch_size=4, workers=2, worker_nice=nice)
        next(iter(ld))
        workers = [p for p in me.children(recursive=True) if p.pid not in before]
        assert len(workers) == 2 and {p.nice() for p in workers} == {min(own + nice, 19)}
        assert me.nice() == own
        ld.close()


def test_workers_keep_off_the_cores_each_rank_keeps_for_its_loop(dataset):
    """``loop_cores``: every rank on the node keeps that many physical cores (with their hyper-thread siblings) for
    its own process; its workers, and every other rank's, run on the rest only, and this process keeps its own
    cores. The default workers are the rank's share of the cores left."""
    import psutil

    from gpufeed.machine import core_groups, reserved_cores
    from gpufeed.pipelines.loader import MAX_DEFAULT_WORKERS, default_workers, worker_cores

    groups = core_groups()
    assert sorted(c for g in groups for c in g) == sorted(os.sched_getaffinity(0))
    if len(groups) < 2:
        pytest.skip("one physical core: none to keep apart")
    kept, rest = reserved_cores(1, 1)
    assert kept == [set(groups[0])] and rest == set().union(*groups[1:])
    assert worker_cores(1) == frozenset(rest)
    assert default_workers(1, loop_cores=1) == min(len(rest), MAX_DEFAULT_WORKERS)
    me = psutil.Process()
    own = os.sched_getaffinity(0)
    before = {p.pid for p in me.children(recursive=True)}
    ld = gpufeed.loader(dataset["tfrecord"]["paths"], batch_size=4, workers=2, loop_cores=1)
    next(iter(ld))
    workers = [p for p in me.children(recursive=True) if p.pid not in before]
    assert len(workers) == 2 and all(set(p.cpu_affinity()) == rest for p in workers)
    assert os.sched_getaffinity(0) == own
    ld.close()


def test_ranks_on_one_node_keep_distinct_cores_and_too_many_is_refused_naming_the_setting(dataset, monkeypatch):
    """Each rank on a node keeps its own run of physical cores, the same partition in every rank; torchrun's
    LOCAL_WORLD_SIZE says how many ranks share a node of several; keeping every core is refused, named."""
    from gpufeed.machine import core_groups, reserved_cores
    from gpufeed.pipelines.loader import ranks_on_node

    groups = core_groups()
    if len(groups) >= 3:
        kept, rest = reserved_cores(1, 2)
        assert kept == [set(groups[0]), set(groups[1])] and rest == set().union(*groups[2:])
    with pytest.raises(ValueError, match="leaves none of the"):
        reserved_cores(len(groups), 1)
    assert ranks_on_node(8) == 8 and ranks_on_node(None) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_on_node(8) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match=f"loop_cores={len(groups)}: .* leaves none of the .* keep fewer"):
        gpufeed.loader(dataset["tfrecord"]["paths"], batch_size=4, workers=1, loop_cores=len(groups))
    with pytest.raises(ConfigError, match="loop_cores=-1: must be 0"):
        gpufeed.loader(dataset["tfrecord"]["paths"], batch_size=4, workers=1, loop_cores=-1)


def test_workers_end_when_terminated_whatever_sigterm_handler_the_loop_has(dataset):
    """A forked worker keeps the training process's SIGTERM handler (a Ray driver's raises SystemExit); the
    workers give SIGTERM its default, so a worker the DataLoader terminates ends."""
    import signal
    import sys

    import psutil

    me = psutil.Process()
    before = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    try:
        known = {p.pid for p in me.children(recursive=True)}
        ld = gpufeed.loader(dataset["tfrecord"]["paths"], batch_size=4, workers=2)
        next(iter(ld))
        workers = [p for p in me.children(recursive=True) if p.pid not in known]
        assert len(workers) == 2
        for w in workers:
            caught = int(open(f"/proc/{w.pid}/status").read().split("SigCgt:")[1].split()[0], 16)
            assert not caught >> (signal.SIGTERM - 1) & 1  # no handler: the kernel's default, the process ends
        ld.close()
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_worker_sent_sigterm_while_it_starts_ends(dataset):
    """A SIGTERM that reaches a worker still in the fork's own hooks, where it has the loop's raising handler, is not
    lost there (Python ignores what a handler raises in those hooks, and the worker would go on): the workers fork
    with it held, so it ends each once it has SIGTERM's default, and the loop hears that they died."""
    import signal
    import sys
    import threading
    import time

    import psutil

    from forked import slow_child_start

    me = psutil.Process()
    known = {p.pid for p in me.children(recursive=True)}
    sent: list[int] = []
    stop = threading.Event()

    def terminate_each_new_worker():
        while not stop.is_set() and len(sent) < 2:
            for p in me.children(recursive=True):
                if p.pid not in known and p.pid not in sent:
                    os.kill(p.pid, signal.SIGTERM)
                    sent.append(p.pid)
            time.sleep(0.005)

    before = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    ld = gpufeed.loader(dataset["tfrecord"]["paths"], batch_size=4, workers=2)
    watcher = threading.Thread(target=terminate_each_new_worker, daemon=True)
    try:
        with slow_child_start(1.0):
            watcher.start()
            with pytest.raises(RuntimeError, match="DataLoader worker"):
                next(iter(ld))
        assert len(sent) == 2
        _, alive = psutil.wait_procs([psutil.Process(pid) for pid in sent if psutil.pid_exists(pid)], timeout=20)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]  # the second ends once its pause is over
    finally:
        stop.set()
        watcher.join()
        signal.signal(signal.SIGTERM, before)
        ld.close()


def test_workers_from_a_fork_server_started_before_a_tier_read_through_that_tier(dataset, tmp_path):
    """The GPU paths start their workers from a fork server, whose environment is the one it started with: a
    loader made inside an emulated tier hands the tier to its workers itself, so their reads are charged to it."""
    import multiprocessing

    from gpufeed.bench.emulate import Throttle
    from gpufeed.bench.tiers import get_profile
    from gpufeed.pipelines.loader import Loader

    ctx = multiprocessing.get_context("forkserver")
    ctx.Process(target=os.getpid).start()  # the server starts now, outside any tier
    with Throttle.emulate(get_profile("ultra").limits(500), accounting="requests", state_dir=tmp_path) as t:
        ld = Loader(dataset["recordio"]["paths"], batch_size=4, workers=2)
        ld._start_method = lambda: "forkserver"  # as the engines' paths start them
        t.reset_stats()  # what the loader read here itself (its first record) is not the workers'
        next(iter(ld))
        ld.close()
        assert t.stats()["requests"] > 0


def test_normalize_gives_nchw_float(dataset):
    x, _ = next(iter(gpufeed.loader(dataset["lmdb"]["paths"], batch_size=4, workers=0, normalize=True)))
    assert x.shape == (4, 3, 224, 224) and x.dtype == torch.float32 and -3 < float(x.mean()) < 3
    # The statistics are made once per device, not per batch: on a GPU, making them copies from pageable host
    # memory, which waits for the stream's queued work (the loop's previous step) before each batch.
    from gpufeed.pipelines.loader import IMAGENET_MEAN, imagenet_stats, normalise

    mean, std = imagenet_stats(x.device)
    assert imagenet_stats(x.device)[0] is mean and mean.flatten().tolist() == pytest.approx(IMAGENET_MEAN)
    raw = torch.full((1, 2, 2, 3), 128, dtype=torch.uint8, device=x.device)
    assert torch.allclose(normalise(raw), (raw.permute(0, 3, 1, 2).float() - mean) / std)
    assert mean.flatten().tolist() == pytest.approx(IMAGENET_MEAN)  # normalise left them as they were


@pytest.mark.parametrize("train", [True, False])
def test_gpu_crop_matches_the_cpu_path(dataset, train):
    """GpuCrop's batching by shape, roi_align crop, flips and NHWC output, run on CPU tensors: the same crops
    as CpuDecode up to interpolation (roi_align averages 2x2 samples, cv2 takes one). Needs torchvision (the
    `gpu` extra); scripts/gpu_decode.sh runs it on the GPU machine."""
    pytest.importorskip("torchvision.ops")
    from gpufeed.formats import get_format
    from gpufeed.pipelines.transforms import decode_image

    reader = get_format("recordio").reader(dataset["recordio"]["paths"][0])
    samples = [reader[i] for i in range(10)]
    images = [torch.from_numpy(decode_image(s.payload, s.key)).permute(2, 0, 1) for s in samples]
    out = G.GpuCrop("cpu", train, 64, seed=3).crop(images, [s.index for s in samples])
    # The crops the workers drew from the headers give the same pixels.
    crops = C.collate_encoded([C.EncodedBytes(train, 3)(s) for s in samples])[4]
    assert torch.equal(G.GpuCrop("cpu", train, 64, seed=3).crop(images, [s.index for s in samples], crops), out)
    want = np.stack([C.CpuDecode(train, 64, seed=3).pixels(s) for s in samples])
    assert out.shape == (10, 64, 64, 3) and out.dtype == torch.uint8
    diff = np.abs(out.numpy().astype(int) - want.astype(int)).mean(axis=(1, 2, 3))
    assert diff.max() < 12, diff  # a wrong box or a missed flip differs by tens
    # Images stored at the output size are used as they are in evaluation.
    small = [torch.from_numpy(np.ascontiguousarray(w)).permute(2, 0, 1) for w in want[:3]]
    if not train:
        assert torch.equal(G.GpuCrop("cpu", False, 64).crop(small, [0, 1, 2]), torch.from_numpy(want[:3]))


@pytest.mark.parametrize("train", [True, False])
def test_gpu_crop_batching_changes_no_pixel(dataset, train):
    """GpuCrop crops a batch's images by shape (one roi_align per shape, the groups in rows of one batch, put back
    in the samples' order at the end): each output equals cropping that image alone, whatever the order of the
    shapes in the batch, with flips, and with images stored at the output size beside others in evaluation."""
    pytest.importorskip("torchvision.ops")
    from gpufeed.formats import get_format
    from gpufeed.pipelines.transforms import decode_image

    reader = get_format("recordio").reader(dataset["recordio"]["paths"][0])
    decoded = [torch.from_numpy(decode_image(reader[i].payload, reader[i].key)).permute(2, 0, 1) for i in range(4)]
    at_size = torch.from_numpy(np.ascontiguousarray(C.CpuDecode(False, 64).pixels(reader[0]))).permute(2, 0, 1)
    # Shapes interleaved (a shape's second image comes after others'), one image at the output size.
    images = [decoded[0], decoded[1], decoded[0], at_size, decoded[2], decoded[1], decoded[3], at_size]
    indices = [11, 12, 13, 14, 15, 16, 17, 18]
    crop = G.GpuCrop("cpu", train, 64, seed=5)
    together = crop.crop(images, indices)
    alone = torch.cat([crop.crop([img], [i]) for img, i in zip(images, indices)])
    assert together.shape == (8, 64, 64, 3) and together.dtype == torch.uint8 and together.is_contiguous()
    assert torch.equal(together, alone)
    if train:  # (seed, index) drew some flips, which the per-image crops agree on
        assert any(C.crop_params([tuple(img.shape[1:])], [i], True, 5)[1][0] for img, i in zip(images, indices))


def test_hybrid_split_follows_the_shared_share(dataset):
    from gpufeed.formats import get_format

    reader = get_format("recordio").reader(dataset["recordio"]["paths"][0])
    share = multiprocessing.Value("d", 0.25, lock=False)
    split = C.HybridSplit(C.CpuDecode(True, 64), share)
    kinds = [split(reader[i])[0] for i in range(N)]
    assert abs(kinds.count("px") / N - 0.25) <= 0.05  # evenly spread by the golden-ratio sequence
    share.value = 0.0
    items = [split(reader[i]) for i in range(6)]
    assert {item[0] for item in items} == {"jpeg"}
    share.value = 0.5
    pixels, px_pos, flat, sizes, enc_pos, labels, indices, crops, cpu_s = C.collate_hybrid(
        [split(reader[i]) for i in range(8)])
    assert crops.shape == (len(enc_pos), C.CROP_COLUMNS) and 0 < float(cpu_s) < 5  # the workers' decode seconds
    assert pixels.shape[1:] == (64, 64, 3) and len(px_pos) + len(enc_pos) == 8 == len(labels)
    assert sorted(px_pos.tolist() + enc_pos.tolist()) == list(range(8)) and len(sizes) == len(enc_pos)
    assert indices.tolist() == enc_pos.tolist()  # the engines' images keep their sample indices
    # A whole batch made at once (the loader's way: the CPU images decoded straight into one tensor) packs the
    # same pixels, positions, bytes and crops; only the seconds differ.
    made = split.batch(8, (reader[i] for i in range(8)))
    apart = C.collate_hybrid([split(reader[i]) for i in range(8)])
    assert all(torch.equal(a, b) for a, b in zip(made[:-1], apart[:-1]))
    share.value = 0.0
    assert split.batch(4, (reader[i] for i in range(4)))[0] is None


def test_hybrid_split_comes_from_both_sides_measured_rates():
    """The CPU share settles where both sides finish their part of a batch at once: the workers' rate (16
    workers at 2 ms an image: 8,000/s) over the sum with the engines' (2 decoder threads, 512 images in 0.16 s
    each: 6,400/s), whatever the share the batches were made with; a batch with no CPU images leaves the workers'
    rate as it was, and the engines always keep a share."""
    share = multiprocessing.Value("d", 0.0, lock=False)
    rates = G.HybridRates(share, workers=16, decoders=2, cpu_rate=16 * L.CPU_WORKER_RATE, hw_rate=L.HW_RATE)
    assert share.value == pytest.approx(4800 / (4800 + 13000))

    def batch(cpu_images: int, size: int = 512):
        pos = torch.arange(cpu_images)
        return (None, pos, None, None, torch.arange(size - cpu_images), None, None, None,
                torch.tensor([cpu_images * 0.002], dtype=torch.float64))

    for lagging_share in [0.1, 0.9, 0.3, 0.7] * 10:  # batches made long before, with other shares
        n = int(512 * lagging_share)
        rates.timing(batch(n), (512 - n) / 6400 * 2)
    assert share.value == pytest.approx(8000 / (8000 + 6400), abs=0.01)
    rates.timing(batch(0), 512 / 6400 * 2)
    assert rates.cpu_rate == pytest.approx(8000, rel=0.01)
    rates.hw_rate = 1.0
    rates.timing(batch(512), 0.0)
    assert share.value == G.HybridRates.CAP


@pytest.mark.parametrize("decode", ["gpu", "hw", "hybrid"])
def test_gpu_paths_without_a_gpu_say_what_to_do_in_one_line(dataset, decode):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError) as err:
        gpufeed.loader(dataset["recordio"]["paths"], decode=decode)
    text = str(err.value)
    assert "\n" not in text and "pip install 'gpufeed[gpu]'" in text and "decode='cpu'" in text


def test_devices_are_resolved_to_a_named_gpu_or_the_cpu():
    # One rank per GPU: an index-less "cuda" must name the rank's GPU, which decoder threads would not inherit.
    assert G.resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert G.resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
        assert G.resolve_device(None).index == torch.cuda.current_device()
    else:
        assert G.resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize("kwargs, text", [({"decode": "nvdec"}, "decode='nvdec'"),
                                          ({"augment": "test"}, "augment='test'"),
                                          ({"batch_size": 0}, "batch_size"),
                                          ({"cpu_share": 0.5}, "cpu_share=0.5 splits batches for decode='hybrid'; "
                                                            "decode='auto' chose 'cpu' here"),
                                          ({"decode": "hybrid", "cpu_share": 1.5}, "cpu_share=1.5"),
                                          ({"worker_nice": 20}, "worker_nice=20: .* 0 .* to 19"),
                                          ({"run_ahead": -1}, "run_ahead=-1: 0 .* or more steps, or 'off'"),
                                          ({"run_ahead": "fast"}, "run_ahead='fast': 0 .* or 'off' .no limit")])
def test_bad_arguments(dataset, kwargs, text):
    with pytest.raises(ConfigError, match=text):
        gpufeed.loader(dataset["recordio"]["paths"], **kwargs)


def test_run_ahead_paces_the_loop_only_on_a_gpu(dataset):
    """``run_ahead``: on the CPU (nothing queued: each step runs as it is called) the batches are the same as
    without it; on a GPU, with 0, each batch comes after everything the loop queued before was done, and with 1
    the loop keeps one step queued at most."""
    import torch

    # The default: 0 where 4 ranks or more share the node and decode on their GPUs (as measured), else no limit;
    # "off" no limit.
    assert L.default_run_ahead(None, "hybrid", 4) == L.default_run_ahead(None, "hw", 8) == 0
    assert L.default_run_ahead(None, "hybrid", 1) is L.default_run_ahead(None, "cpu", 4) is None
    assert L.default_run_ahead(None, "hybrid", 2) is None
    assert L.default_run_ahead(L.NO_LIMIT, "hybrid", 4) is None and L.default_run_ahead(2, "cpu", 1) == 2
    paths = dataset["recordio"]["paths"]
    base = [y.tolist() for _, y in gpufeed.loader(paths, batch_size=8, workers=1, decode="cpu", device="cpu")]
    paced = gpufeed.loader(paths, batch_size=8, workers=1, decode="cpu", device="cpu", run_ahead=0)
    assert [y.tolist() for _, y in paced] == base and paced.run_ahead == 0 and paced.paced_s is None
    if not torch.cuda.is_available():
        return
    for steps in (0, 1):
        ld = gpufeed.loader(paths, batch_size=8, workers=1, decode="cpu", device="cuda", run_ahead=steps)
        stream, queued = torch.cuda.current_stream(), []
        for x, _ in ld:
            queued.append(stream.query())  # the step before this batch was done (0), or may still run (1)
            torch.cuda._sleep(50_000_000)  # a step that keeps the GPU busy ~20-50 ms
        assert all(queued) if steps == 0 else len(ld._pace.marks) <= 1
        assert ld.paced_s > 0
        torch.cuda.synchronize()


def test_paths_a_glob_over_an_output_also_matches_are_refused_naming_them(dataset, tmp_path):
    """A glob such as ``tfrecord/train-*`` also matches the DALI indexes beside the shards: named, not read
    as a damaged shard; the same for a file inside an LMDB, a folder that is no LMDB, and mixed formats."""
    import glob

    shard = dataset["tfrecord"]["paths"][0]
    with pytest.raises(ConfigError, match=r"\.idx is the index or list of a data file, not one"):
        gpufeed.loader(sorted(glob.glob(shard + "*")), batch_size=4)
    rec = dataset["recordio"]["paths"][0]
    with pytest.raises(ConfigError, match=r"\.idx is the index"):
        gpufeed.loader([rec, rec[:-4] + ".idx"], batch_size=4)
    env = dataset["lmdb"]["paths"][0]
    with pytest.raises(ConfigError, match=f"inside an LMDB; give the LMDB's folder, {env}"):
        gpufeed.loader([f"{env}/data.mdb"], batch_size=4)
    with pytest.raises(ConfigError, match="without data.mdb, so not an LMDB"):
        gpufeed.loader([str(tmp_path)], batch_size=4)
    with pytest.raises(ConfigError, match=r"mix formats \(recordio, tfrecord\)"):
        gpufeed.loader([rec, shard], batch_size=4)
    assert L.format_of([env]) == "lmdb" and L.format_of([shard]) == "tfrecord" and L.format_of([rec]) == "recordio"
    # The conversion's destination, or one format's folder in it, where data files are asked for (the loader
    # takes them: the next test): refused, naming the data files to give (each format names its own outputs).
    dst = os.path.dirname(os.path.dirname(rec))
    with pytest.raises(ConfigError) as e:
        L.format_of([dst])
    assert str(e.value) == (f"{dst} is a folder of gpufeed outputs (recordio: train; lmdb: train; tfrecord: train; "
                            f"webdataset: train), not one: give one format's data files of one split, e.g. the "
                            f"recordio train split's: {rec}")
    with pytest.raises(ConfigError, match=f"folder of gpufeed outputs .tfrecord: train., not one: .* split's: "
                                          f"{dataset['tfrecord']['paths'][0]}"):
        L.format_of([os.path.dirname(shard)])


def test_a_conversions_destination_stands_for_the_data_files_of_the_format_and_split_asked(dataset):
    """gpufeed.loader(DST, format=...) reads DST's data files of that format (its one split here); one format's
    folder alone needs nothing more; where the choice is open, or names nothing there, the error lists what is."""
    rec = dataset["recordio"]["paths"]
    dst = os.path.dirname(os.path.dirname(rec[0]))
    base = [y.tolist() for _, y in gpufeed.loader(rec, batch_size=8, workers=0, decode="cpu")]
    ld = gpufeed.loader(dst, format="recordio", batch_size=8, workers=0, decode="cpu")
    assert ld.format == "recordio" and [y.tolist() for _, y in ld] == base
    tf = gpufeed.loader(os.path.dirname(dataset["tfrecord"]["paths"][0]), split="train", batch_size=8, workers=0,
                        decode="cpu")
    assert tf.format == "tfrecord" and len(tf.dataset) == N
    with pytest.raises(ConfigError, match=r"ds is a folder of gpufeed outputs \(format='recordio', split='train'; "
                                          r"format='lmdb', .*\): pick one with format= and split="):
        gpufeed.loader(dst, batch_size=8)
    with pytest.raises(ConfigError, match=r"none is format='recordio', split='val'; pick one"):
        gpufeed.loader(dst, format="recordio", split="val", batch_size=8)
    with pytest.raises(ConfigError, match="split='train' picks a split of a conversion's destination"):
        gpufeed.loader(rec, split="train", batch_size=8)


def test_a_dropped_loader_stops_its_workers_at_once(dataset):
    """Nothing keeps a loader alive once the caller drops it (no reference cycle), so its DataLoader workers
    are gone right away, not at some later garbage collection: the bench ran minutes per run otherwise."""
    import gc
    import time

    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    ld = gpufeed.loader(dataset["tfrecord"]["paths"], batch_size=4, workers=2)
    next(iter(ld))
    assert len({p.pid for p in me.children(recursive=True)} - before) >= 2
    gc.disable()  # the workers must go by reference counting alone
    try:
        del ld
        deadline = time.monotonic() + 10
        while {p.pid for p in me.children(recursive=True)} - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not {p.pid for p in me.children(recursive=True) if p.is_running()} - before
    finally:
        gc.enable()


def test_nvimagecodec_log_lines_are_off_unless_the_user_sets_them(monkeypatch):
    """nvImageCodec prints ANSI-coloured lines on stderr (extensions the wheel lacks, each image the engines hand
    back, which the loader decodes another way and counts): quiet by default, the user's setting kept."""
    for preset, expected in ((None, "0"), ("3", "3")):
        if preset is None:
            monkeypatch.delenv("PYNVIMGCODEC_VERBOSITY", raising=False)
        else:
            monkeypatch.setenv("PYNVIMGCODEC_VERBOSITY", preset)
        try:
            G.import_nvimgcodec()
        except ConfigError:
            pass  # not installed here: the setting is made before the import is tried
        assert os.environ["PYNVIMGCODEC_VERBOSITY"] == expected


def test_decode_contention_refuses_unknown_variants_before_it_needs_a_gpu(tmp_path):
    from gpufeed.bench.experiments import decode_contention

    with pytest.raises(SystemExit, match="unknown nope"):
        decode_contention.main([str(tmp_path), "--variants", "base,nope"])


def test_image_pool_settings_need_the_nvidia_driver():
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has the NVIDIA driver")
    with pytest.raises(ConfigError, match="libcuda.so.1"):
        G.set_image_pool(torch.device("cpu"), keep_bytes=1)


def test_decode_auto_and_workers_per_rank_come_from_the_node():
    """Without a GPU auto is the CPU path; workers per rank are the rank's share of the cores, less one for the
    rank's own process where ranks share the node, at least one."""
    from gpufeed.machine import usable_cores

    assert L.choose_decode("cpu") == ("cpu", "no CUDA GPU")
    cores = usable_cores()
    # gpufeed.loader, the documented entry point, decodes where auto chooses unless told.
    import inspect

    assert inspect.signature(gpufeed.loader).parameters["decode"].default == L.AUTO
    assert L.default_workers() == max(1, min(L.MAX_DEFAULT_WORKERS, cores))
    assert L.default_workers(2) == max(1, min(L.MAX_DEFAULT_WORKERS, cores // 2 - 1))
    assert L.default_workers(cores * 4) == 1
    # Where auto takes the CPU path on a GPU node: training, each rank's default workers carrying it on a core
    # each (1 or 2 ranks of 64 cores' 32 and 31 workers; 3 ranks' 20 made too few decoding whole JPEGs, counted);
    # never inference, whose demand outruns the workers.
    for region in (False, True):
        assert L.cpu_carries(28, 1, cores=28, region=region) is True
        assert L.cpu_carries(32, 1, cores=64, augment="eval", region=region) is False
    assert [L.cpu_carries(min(32, 64 // r - 1), r, cores=64, region=False)
            for r in (1, 2, 3, 4)] == [True, True, False, False]
    assert L.cpu_carries(16, 1, cores=16, region=False) is False
    # Decoding each crop's box alone, 15 workers a rank carry one to four ranks' training (2 H200s on 32 cores,
    # 3 on 64: 0.897 against hybrid's 0.777, 4 on 64: 0.999 against 0.871, counted), not five or more (unmeasured).
    assert L.cpu_carries(15, 2, cores=32, region=False) is False
    if L.region_decode_on(None):
        assert [L.cpu_carries(min(32, 64 // r - 1), r, cores=64)
                for r in (1, 2, 3, 4)] == [True, True, True, True]
        assert L.cpu_carries(15, 2, cores=32) is True and L.cpu_carries(15, 2, cores=32, region=True) is True
        assert L.cpu_carries(15, 1, cores=16) is True and L.cpu_carries(15, 3, cores=48) is True
        assert L.cpu_carries(15, 4, cores=64) is True and L.cpu_carries(14, 2, cores=30) is False
        assert L.cpu_carries(15, 5, cores=80) is False and L.cpu_carries(15, 4, cores=64, region=False) is False
        assert L.hybrid_split(None, "train", 15, 2, cores=32) == L.ALONE_CPU_SHARE
        assert L.hybrid_split(None, "train", 15, 2, cores=32, region=False) == L.HYBRID_CPU_SHARE["train"]


def test_decode_auto_and_the_hybrid_split_count_the_ranks_on_this_node(dataset, monkeypatch):
    """The cores a rank gets are the node's over the ranks on the node (torchrun's LOCAL_WORLD_SIZE), not over
    the whole process group: eight ranks on eight nodes each have a node's cores. Needs a CUDA GPU (elsewhere the
    choice is the CPU path for want of one, checked above)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    paths = dataset["recordio"]["paths"]
    for local in (1, 4):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        ld = gpufeed.loader(paths, batch_size=8, rank=0, world_size=8, device="cuda")
        assert (ld.decode, ld.decode_reason) == L.choose_decode("cuda", local)
        ld = gpufeed.loader(paths, batch_size=8, augment="eval", rank=0, world_size=8, device="cuda")
        assert (ld.decode, ld.decode_reason) == L.choose_decode("cuda", local, "eval")
    try:
        L.import_nvimgcodec()
    except (ConfigError, ImportError):
        return
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    ld = gpufeed.loader(paths, batch_size=8, workers=28, decode="hybrid", rank=0, world_size=8, device="cuda")
    assert ld._share.value == L.hybrid_split(None, "train", 28, 1)


def test_loader_options_are_checked_once_for_every_caller():
    """The loader's rules live in LoaderOptions: gpufeed.loader and bench train both ask it, each in its own
    spelling; "auto" passes until the loader has chosen its path, then the rules hold for that path."""
    with pytest.raises(ConfigError, match=r"decode_threads=0: need at least 1"):
        L.LoaderOptions(decode_threads=0)
    with pytest.raises(ConfigError, match=r"--decode-threads 0: need at least 1"):
        L.LoaderOptions(decode_threads=0, spelling="cli")
    auto = L.LoaderOptions(augment="cifar", cpu_share=0.5)  # "auto": the path is not chosen yet
    with pytest.raises(ConfigError, match="cpu_share=0.5: .* decode='hybrid'"):
        dataclasses.replace(auto, decode="cpu")
    with pytest.raises(ConfigError, match="augment='cifar' reads stored pixels"):
        dataclasses.replace(auto, decode="hybrid")
    assert L.LoaderOptions(decode="hybrid", cpu_share=0.5).cpu_share == 0.5
    assert L.LoaderOptions(decode="hybrid", cpu_share=L.RATES).cpu_share == L.RATES
    with pytest.raises(ConfigError, match="cpu_share='half': .* or 'rates'"):
        L.LoaderOptions(decode="hybrid", cpu_share="half")


def test_hybrid_split_default_is_the_measured_share_for_the_task():
    """The hybrid path holds the CPU share measured best for its task where a rank has the workers those
    measurements had; with fewer, or when asked for ("rates"), the split follows both sides' measured rates."""
    assert L.hybrid_split(None, "train", 15, cores=64, region=False) == L.HYBRID_CPU_SHARE["train"] == 0.75
    assert L.hybrid_split(None, "eval", 15, ranks=4, cores=64) == L.HYBRID_CPU_SHARE["eval"] == 0.6
    assert L.hybrid_split(None, "train", L.FIXED_SHARE_MIN_WORKERS - 1, cores=64) == L.RATES
    assert L.hybrid_split(L.RATES, "train", 32) == L.RATES
    assert L.hybrid_split(0.3, "eval", 2) == 0.3
    # A training rank with the workers to carry every image, each on a core of its own: the CPU decodes them all,
    # however many ranks share the node (2 x 31 on 64 cores fed better so); not where the cores are too few for
    # the workers asked, nor with fewer workers decoding whole JPEGs (3 x 20), nor for inference; decoding each
    # crop's box alone, 3 x 20 and 4 x 15 too.
    assert L.hybrid_split(None, "train", L.CPU_ENOUGH_WORKERS, cores=64) == L.ALONE_CPU_SHARE == 1.0
    assert L.hybrid_split(None, "eval", 32, ranks=1, cores=32) == 0.6
    assert L.hybrid_split(None, "train", 31, ranks=2, cores=64) == 1.0
    assert L.hybrid_split(None, "train", 20, ranks=3, cores=64, region=False) == 0.75
    if L.region_decode_on(None):
        assert L.hybrid_split(None, "train", 20, ranks=3, cores=64) == 1.0
    assert L.hybrid_split(None, "train", 15, ranks=4, cores=64, region=False) == 0.75
    assert L.hybrid_split(None, "train", 20, ranks=4, cores=64, region=False) == 0.75  # 80 workers on 64 cores
    if L.region_decode_on(None):
        assert L.hybrid_split(None, "train", 15, ranks=4, cores=64) == 1.0
        assert L.hybrid_split(None, "train", 14, ranks=4, cores=64) == 0.75
    assert L.hybrid_split(None, "train", L.CPU_ENOUGH_WORKERS - 1, cores=64, region=False) == 0.75
    assert L.hybrid_split(0.5, "train", 32, ranks=1) == 0.5



def test_read_ahead_by_default_only_where_ranks_share_the_node():
    assert L.default_read_ahead(1) is False
    assert L.default_read_ahead(2) is True and L.default_read_ahead(4) is True
