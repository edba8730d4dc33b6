"""The PyTorch datasets over real outputs of every format, through a real DataLoader with worker processes."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys

import pytest

from gpufeed.errors import ConfigError
from gpufeed.formats import FORMATS, get_format
from gpufeed.formats.base import Sample

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from gpufeed.formats.torch import IterableDataset, MapDataset  # noqa: E402


def _output_name(fmt: str, stem: str) -> str:
    return {"lmdb": f"{stem}_lmdb", "recordio": f"{stem}.rec", "tfrecord": stem, "webdataset": f"{stem}.tar"}[fmt]


def _format(name):
    try:
        return get_format(name)
    except ImportError:
        pytest.skip(f"gpufeed.formats.{name} is not in this tree yet")


def make_outputs(tmp_path, fmt_name, counts):
    """One output per count; labels encode the global record number so tests can check coverage."""
    fmt = _format(fmt_name)
    paths, g = [], 0
    for j, n in enumerate(counts):
        path = str(tmp_path / _output_name(fmt_name, f"part{j}"))
        with fmt.writer(path) as w:
            for i in range(n):
                w.write(Sample(f"c/{g}.jpg", g, b"\xff\xd8\xff" + bytes([g % 256]) * 50, "encoded", i))
                g += 1
        paths.append(path)
    return paths, g


def label_of(sample):
    return int(sample.labels[0])


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_map_dataset_with_workers(tmp_path, fmt_name):
    paths, total = make_outputs(tmp_path, fmt_name, [23, 17])
    ds = MapDataset(fmt_name, paths, transform=label_of)
    assert len(ds) == total and ds[24] == 24 and ds[-1] == total - 1
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0))
    seen = torch.cat(list(loader)).tolist()
    assert sorted(seen) == list(range(total))


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_a_batch_is_read_ahead_across_outputs_and_ranks(tmp_path, fmt_name):
    """A DataLoader fetches each batch through __getitems__ (every record's read started first): the same
    samples, in the same order, as one __getitem__ per index, with read-ahead on or off, over several outputs
    and a rank's share."""
    paths, total = make_outputs(tmp_path, fmt_name, [23, 17])
    for rank in (0, 1):
        ds = MapDataset(fmt_name, paths, transform=label_of, rank=rank, world_size=2, read_ahead=True)
        off = MapDataset(fmt_name, paths, transform=label_of, rank=rank, world_size=2)
        order = [7, 0, 19, 3, -1, 11, 12]
        assert ds.__getitems__(order) == off.__getitems__(order) == [ds[i] for i in order]
        batches = [DataLoader(d, batch_size=6, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(4))
                   for d in (ds, off)]
        assert [b.tolist() for b in batches[0]] == [b.tolist() for b in batches[1]]
    with pytest.raises(IndexError):
        ds.__getitems__([0, total])


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_iterable_dataset_splits_over_workers(tmp_path, fmt_name):
    paths, total = make_outputs(tmp_path, fmt_name, [21])
    loader = DataLoader(IterableDataset(fmt_name, paths, transform=label_of), batch_size=None, num_workers=2)
    assert sorted(loader) == list(range(total))


def test_map_dataset_ranks_are_disjoint_and_cover(tmp_path):
    """Each rank's share is in file order, the shares disjoint and together every record; the same share in a
    worker process (pickled) as where it was made."""
    paths, total = make_outputs(tmp_path, "lmdb", [10, 11])
    made = [MapDataset("lmdb", paths, transform=label_of, rank=r, world_size=3) for r in range(3)]
    shares = [[ds[i] for i in range(len(ds))] for ds in made]
    assert [len(s) for s in shares] == [7, 7, 7]
    assert sorted(sum(shares, [])) == list(range(total))
    assert all(s == sorted(s) for s in shares)
    again = pickle.loads(pickle.dumps(made[1]))
    assert [again[i] for i in range(len(again))] == shares[1]
    even = [MapDataset("lmdb", paths, transform=label_of, rank=r, world_size=4, even=True) for r in range(4)]
    assert [len(ds) for ds in even] == [5, 5, 5, 5]
    assert len({ds[i] for ds in even for i in range(5)}) == 20
    single = MapDataset("lmdb", paths, transform=label_of)
    assert [single[i] for i in range(total)] == list(range(total))
    with pytest.raises(IndexError):
        MapDataset("lmdb", paths, rank=0, world_size=4, even=True)[5]
    with pytest.raises(ConfigError):
        MapDataset("lmdb", paths, rank=4, world_size=4)


def test_ranks_share_records_laid_out_with_a_period_evenly():
    """Each round of w consecutive records dealt with a drawn turn: every 50th record costly (a large photo), each
    of 2, 3, 4 or 8 ranks gets its share of them, where dealing r, r + w, ... gave them all to the odd ranks of 2
    and 4. The shares are disjoint, cover every record (the short last round too, or with even none of it), run in
    file order and are the same every time."""
    from gpufeed.formats.torch import RankShare

    def records(share):
        return [share[i] for i in range(len(share))]

    total = 100_003
    for world in (1, 2, 3, 4, 8):
        shares = [records(RankShare(total, r, world)) for r in range(world)]
        assert sorted(sum(shares, [])) == list(range(total))
        assert all(s == sorted(s) for s in shares)
        costly = [sum(1 for g in s if g % 50 == 49) for s in shares]
        assert max(abs(c - total / 50 / world) for c in costly) < 0.2 * total / 50 / world, (world, costly)
        assert records(RankShare(total, world - 1, world)) == shares[-1]  # the same deal every time
        even = [records(RankShare(total, r, world, even=True)) for r in range(world)]
        assert [len(s) for s in even] == [total // world] * world
        assert sorted(sum(even, [])) == list(range(total // world * world))
    assert records(RankShare(5, 0, 1)) == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        RankShare(10, 0, 4, even=True)[2]


def test_iterable_dataset_ranks_times_workers(tmp_path):
    """2 ranks x 2 workers: by record over one file, by whole file over five."""
    for counts in ([13], [3, 4, 2, 5, 1]):
        sub = tmp_path / f"n{len(counts)}"
        sub.mkdir()
        paths, total = make_outputs(sub, "lmdb", counts)
        seen = []
        for rank in range(2):
            ds = IterableDataset("lmdb", paths, transform=label_of, rank=rank, world_size=2)
            part = list(DataLoader(ds, batch_size=None, num_workers=2))
            assert part
            seen += part
        assert sorted(seen) == list(range(total))


@pytest.mark.parametrize("indexed", [True, False])
def test_iterable_dataset_ranks_share_records_laid_out_with_a_period_evenly(tmp_path, indexed):
    """Every 50th record costly: each of 4 ranks streams its share of them, whether its reader seeks (an index)
    or scans and skips (a .rec without its .idx); dealt k, k + n, ... ranks 1 and 3 had them all."""
    paths, total = make_outputs(tmp_path, "recordio", [4000])
    if not indexed:
        os.remove(paths[0][:-len(".rec")] + ".idx")
    shares = [list(IterableDataset("recordio", paths, transform=label_of, rank=r, world_size=4)) for r in range(4)]
    assert sorted(sum(shares, [])) == list(range(total))
    assert all(s == sorted(s) for s in shares)
    costly = [sum(1 for g in s if g % 50 == 49) for s in shares]
    assert all(8 <= c <= 32 for c in costly), costly  # 20 each on average


def test_default_rank_comes_from_torch_distributed(tmp_path):
    import torch.distributed as dist

    paths, total = make_outputs(tmp_path, "lmdb", [9])
    assert len(MapDataset("lmdb", paths)) == total
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ds = MapDataset("lmdb", paths, transform=label_of)
        assert (ds.rank, ds.world_size, len(ds)) == (0, 1, total)
    finally:
        dist.destroy_process_group()


def test_importing_formats_does_not_import_torch():
    code = ("import sys, gpufeed.formats, gpufeed.formats.lmdb, gpufeed.formats.torch; "
            "gpufeed.formats.get_format('lmdb'); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_samples_without_transform_and_pickled_dataset(tmp_path):
    import pickle

    paths, total = make_outputs(tmp_path, "lmdb", [5])
    ds = pickle.loads(pickle.dumps(MapDataset("lmdb", paths)))
    sample = ds[2]
    assert isinstance(sample, Sample) and sample.key == "c/2.jpg"
    batches = list(DataLoader(ds, batch_size=2, num_workers=2, collate_fn=list,
                              multiprocessing_context="spawn"))
    assert [s.key for b in batches for s in b] == [f"c/{i}.jpg" for i in range(total)]
    assert importlib.import_module("gpufeed.formats.torch").MapDataset is MapDataset


@pytest.mark.parametrize("dataset", ["map", "iterable"])
def test_a_damaged_record_read_in_a_worker_reaches_the_caller_as_one_gpufeed_error(tmp_path, dataset):
    """torch rebuilds a worker's exception from its text; gpufeed's errors arrive as a WorkerError naming the
    original type, file and record (not a bare RuntimeError holding the worker's traceback)."""
    from gpufeed.errors import CorruptRecordError, GpufeedError, WorkerError

    paths, _ = make_outputs(tmp_path, "tfrecord", [6])
    data = bytearray(open(paths[0], "rb").read())
    data[20] ^= 0x01  # the first record's payload, after its 12-byte header
    open(paths[0], "wb").write(bytes(data))
    ds = (MapDataset if dataset == "map" else IterableDataset)("tfrecord", paths, transform=label_of)
    with pytest.raises(WorkerError) as err:
        list(DataLoader(ds, batch_size=2, num_workers=1))
    assert isinstance(err.value, GpufeedError)
    assert str(err.value).startswith(f"CorruptRecordError: {paths[0]}: record 0") and "\n" not in str(err.value)
    with pytest.raises(CorruptRecordError):  # in the caller's own process the error is unchanged
        list(DataLoader(ds, batch_size=2, num_workers=0))
