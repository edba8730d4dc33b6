"""CIFAR-10/100 sources: pickles, binaries, tar.gz in place, memory://, and pickles that try to run code."""

from __future__ import annotations

import io
import os
import pickle
import tarfile

import numpy as np
import pytest

from gpufeed.errors import InputError, UnsafePickleError
from gpufeed.pipelines import open_source, safe_pickle
from gpufeed.pipelines.synth import synth_cifar10, synth_cifar100


@pytest.fixture(scope="module")
def c10(tmp_path_factory):
    out = tmp_path_factory.mktemp("c10")
    synth_cifar10(str(out), per_class=3, test_per_class=1, seed=3)
    return out


@pytest.fixture(scope="module")
def c100(tmp_path_factory):
    out = tmp_path_factory.mktemp("c100")
    synth_cifar100(str(out), per_class=1, test_per_class=1, seed=3)
    return out


def snapshot(src):
    return {split: [(it.key, it.label, it.meta.get("coarse_label"), it.ref.data.tobytes()) for it in src.items(split)]
            for split in src.splits()}


@pytest.mark.parametrize("sub", ["", "cifar-10-batches-py", "cifar-10-batches-bin", "cifar-10-python.tar.gz",
                                 "cifar-10-binary.tar.gz"])
def test_cifar10_every_form_gives_the_same_items(c10, sub):
    src = open_source("cifar10", str(c10 / sub) if sub else str(c10))
    assert snapshot(src) == snapshot(open_source("cifar10", str(c10 / "cifar-10-batches-py")))
    assert src.splits() == ["test", "train"]
    assert src.classes().names[:2] == ["airplane", "automobile"]
    assert [it.key for it in src.items("train")][:2] == ["data_batch_1/00000", "data_batch_1/00001"]
    assert len(src.items("train")) == 30 and len(src.items("test")) == 10


def test_cifar10_pixels_are_hwc_from_the_planes(c10):
    with open(c10 / "cifar-10-batches-py/data_batch_2", "rb") as f:
        batch = pickle.load(f, encoding="latin1")  # torchvision's way: our own synthetic file, not untrusted
    item = next(it for it in open_source("cifar10", str(c10)).items("train") if it.key == "data_batch_2/00004")
    img = item.ref.data
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8 and img.flags.c_contiguous
    row = batch["data"][4]
    y, x = 5, 17
    assert tuple(img[y, x]) == (row[y * 32 + x], row[1024 + y * 32 + x], row[2048 + y * 32 + x])
    assert item.label == batch["labels"][4]
    assert item.meta["filename"] == batch["filenames"][4]


@pytest.mark.parametrize("sub", ["cifar-100-python", "cifar-100-binary", "cifar-100-python.tar.gz",
                                 "cifar-100-binary.tar.gz"])
def test_cifar100_fine_and_coarse_labels(c100, sub):
    src = open_source("cifar100", str(c100 / sub))
    assert snapshot(src) == snapshot(open_source("cifar100", str(c100)))
    classes = src.classes()
    assert len(classes.names) == 100 and len(classes.coarse_names) == 20
    with open(c100 / "cifar-100-python/train", "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    items = src.items("train")
    assert [it.key for it in items][:1] == ["train/00000"]
    assert [it.label for it in items] == batch[b"fine_labels"]
    assert [it.meta["coarse_label"] for it in items] == batch[b"coarse_labels"]


def test_memory_filesystem_tar_gz(c10):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/cifar/cifar-10-python.tar.gz", (c10 / "cifar-10-python.tar.gz").read_bytes())
    assert snapshot(open_source("cifar10", "memory://cifar")) == snapshot(open_source("cifar10", str(c10)))


class Payload:
    """Unpickling this runs ``os.system``: what a hostile dataset file would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, protocol):
    marker = tmp_path / "pwned"
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": Payload(marker)}, protocol=protocol))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a"]}, protocol=2))
    with pytest.raises(UnsafePickleError, match=r"data_batch_1: wants to load (posix|os)\.system"):
        open_source("cifar10", str(tmp_path)).items("train")
    assert not marker.exists()
    # Other ways in: builtins.eval, a global hidden behind a container, an object's __setstate__.
    for evil in (pickle.dumps([1, (eval, ("1+1",))]), b"cbuiltins\neval\n(S'1'\ntR.",
                 b"\x80\x02cnumpy\nload\nq\x00."):
        with pytest.raises(UnsafePickleError):
            safe_pickle.load(evil, "evil.pkl")


def test_safe_pickle_reads_numpy_arrays_from_any_era():
    arr = np.arange(12, dtype=np.uint8).reshape(3, 4)
    for protocol in (2, 4, 5):  # numpy 2 names numpy._core; protocol 5 uses _frombuffer
        back = safe_pickle.load(pickle.dumps({b"data": arr, "labels": [1, 2], "x": {1.5, None}}, protocol), "p")
        assert np.array_equal(back[b"data"], arr) and back["labels"] == [1, 2]
    with pytest.raises(InputError, match="not a readable pickle"):
        safe_pickle.load(pickle.dumps(arr)[:-10], "cut.pkl")


def test_truncated_binary_and_missing_files_are_clear_errors(tmp_path, c10):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    (folder / "data_batch_1.bin").write_bytes((c10 / "cifar-10-batches-bin/data_batch_1.bin").read_bytes()[:-5])
    (folder / "batches.meta.txt").write_bytes((c10 / "cifar-10-batches-bin/batches.meta.txt").read_bytes())
    with pytest.raises(InputError, match="not a whole number of 3073-byte records"):
        open_source("cifar10", str(tmp_path)).splits()
    with pytest.raises(FileNotFoundError, match="nothing: does not exist; check the path"):
        open_source("cifar10", str(tmp_path / "cifar-10-batches-bin" / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="cifar-10-python.tar.gz"):  # there, but not CIFAR: what it needs
        open_source("cifar10", str(tmp_path / "empty"))


def test_labels_outside_the_class_list_follow_the_policy(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batch = {b"batch_label": b"x", b"labels": [1, 12], b"data": np.zeros((2, 3072), np.uint8),
             b"filenames": [b"a.png", b"b.png"]}
    (folder / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=2))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [str(i).encode() for i in range(10)]}))
    # One of the five train batches: allowed explicitly, and listed as missing.
    with pytest.raises(InputError, match=r"data_batch_1\[1\]: has label 12"):
        open_source("cifar10", str(tmp_path), allow_incomplete=True).items("train")
    src = open_source("cifar10", str(tmp_path), on_error="skip", allow_incomplete=True)
    assert [it.key for it in src.items("train")] == ["data_batch_1/00000"]
    reasons = [s.reason for s in src.skipped()]
    assert len(reasons) == 2 and reasons[0].startswith("missing data_batch_2, data_batch_3") and "label 12" in reasons[1]


def test_unsafe_member_in_tar_gz_is_skipped_or_fails(tmp_path, c10):
    with tarfile.open(c10 / "cifar-10-python.tar.gz") as src, tarfile.open(tmp_path / "cifar-10-python.tar.gz",
                                                                           "w:gz") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m))
        evil = tarfile.TarInfo("../../evil")
        evil.size = 4
        dst.addfile(evil, io.BytesIO(b"evil"))
    with pytest.raises(InputError, match="climbs out"):
        open_source("cifar10", str(tmp_path)).items("train")
    src = open_source("cifar10", str(tmp_path), on_error="skip")
    assert len(src.items("train")) == 30 and "climbs out" in src.skipped()[0].reason
    assert not (tmp_path.parent / "evil").exists()
