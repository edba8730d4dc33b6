"""Synthetic data: the real layouts, byte-compatible CIFAR pickles, photo-like JPEGs, determinism, the CLI."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pickle
import pickletools
import re
import tarfile

import numpy as np
import pytest
import scipy.io
from PIL import Image

from gpufeed.pipelines import synth


def tree_digest(root) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def inet(tmp_path_factory):
    out = tmp_path_factory.mktemp("inet")
    summary = synth.synth_imagenet(str(out), classes=4, per_class=10, val_per_class=3, seed=11, layout="both")
    return out, summary


def test_imagenet_layout_devkit_and_names(inet):
    out, summary = inet
    wnids = summary["wnids"]
    assert all(re.fullmatch(r"n\d{8}", w) for w in wnids) and wnids == sorted(wnids)
    assert sorted(os.listdir(out / "train")) == wnids
    assert all(re.fullmatch(rf"{w}_\d+\.JPEG", f) for w in wnids for f in os.listdir(out / "train" / w))
    assert sorted(os.listdir(out / "val")) == [f"ILSVRC2012_val_{j:08d}.JPEG" for j in range(1, 13)]

    synsets = scipy.io.loadmat(out / "ILSVRC2012_devkit_t12/data/meta.mat", squeeze_me=True)["synsets"]
    assert synsets.dtype.names == ("ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children",
                                   "wordnet_height", "num_train_images")
    leaves = [(int(s["ILSVRC2012_ID"]), str(s["WNID"])) for s in synsets if int(s["num_children"]) == 0]
    assert sorted(i for i, _ in leaves) == [1, 2, 3, 4] and sorted(w for _, w in leaves) == wnids
    assert [w for _, w in sorted(leaves)] != wnids, "devkit IDs must not simply follow wnid order"
    assert any(int(s["num_children"]) > 0 for s in synsets)
    truth = (out / "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt").read_text().split()
    assert len(truth) == 12 and {int(t) for t in truth} == {1, 2, 3, 4}
    mapping = (out / "LOC_synset_mapping.txt").read_text().splitlines()
    assert [line.split()[0] for line in mapping] == wnids


def test_imagenet_archives_match_the_tree(inet):
    out, summary = inet
    with tarfile.open(out / "ILSVRC2012_img_train.tar") as outer:
        assert outer.getnames() == [f"{w}.tar" for w in summary["wnids"]]
        first = outer.getmembers()[0]
        with tarfile.open(fileobj=outer.extractfile(first)) as inner:
            member = inner.getmembers()[0]
            data = inner.extractfile(member).read()
    assert data == (out / "train" / summary["wnids"][0] / member.name).read_bytes()
    with tarfile.open(out / "ILSVRC2012_img_val.tar") as val:
        assert val.getnames() == sorted(os.listdir(out / "val"))
    with tarfile.open(out / "ILSVRC2012_devkit_t12.tar.gz") as devkit:
        assert "ILSVRC2012_devkit_t12/data/meta.mat" in devkit.getnames()


def test_imagenet_planted_bad_files_are_the_real_oddities(inet):
    out, summary = inet
    kinds = {kind: out / "train" / key for key, kind in summary["bad_files"].items()}
    assert set(kinds) == {"cmyk", "png", "truncated", "gray"}
    assert Image.open(kinds["cmyk"]).mode == "CMYK" and Image.open(kinds["cmyk"]).format == "JPEG"
    assert kinds["png"].name.endswith(".JPEG") and kinds["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(kinds["gray"]).mode == "L"
    truncated = kinds["truncated"].read_bytes()
    assert truncated[:2] == b"\xff\xd8" and not truncated.endswith(b"\xff\xd9")
    with pytest.raises(OSError):
        Image.open(io.BytesIO(truncated)).load()
    # What `gpufeed synth` and `gpufeed demo` print of them: which a conversion keeps, which it skips
    from gpufeed.pipelines.synth import describe_planted

    assert describe_planted(summary["bad_files"]) == (
        "4 awkward files planted: a CMYK JPEG, a PNG named .JPEG, a grayscale JPEG (converted); a truncated JPEG "
        "(skipped under --on-error skip)")
    assert describe_planted({}) == "no awkward files planted"


def test_imagenet_sizes_and_photo_like_compression(inet):
    out, _ = inet
    sizes = []
    for path in (out / "train").rglob("*.JPEG"):
        with Image.open(path) as im:
            sizes.append((im.size, path.stat().st_size))
    dims = [d for d, _ in sizes]
    assert any(max(d) >= 1600 for d in dims), "some large images"
    assert any(max(d) >= 2592 for d in dims), "a multi-megapixel one"
    assert sum(max(d) == 500 for d in dims) > len(dims) / 2, "mostly ~500 px photos"
    # A flat or smooth image would compress to a few KB; photos at 500x375, quality 90, are ~100 KB.
    typical = [n for d, n in sizes if d in ((500, 375), (375, 500))]
    assert typical and 60_000 < np.mean(typical) < 160_000
    img = synth.photo_like(np.random.default_rng(0), 375, 500)
    assert img.shape == (375, 500, 3) and img.dtype == np.uint8 and img.std() > 20


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        synth.synth_imagenet(str(tmp_path / name), classes=2, per_class=2, val_per_class=1, seed=seed,
                             layout="archives", bad_files=False)
        synth.synth_cifar10(str(tmp_path / name / "c10"), per_class=2, test_per_class=1, seed=seed)
        synth.synth_ptb(str(tmp_path / name / "ptb"), train_tokens=500, vocab=50, seed=seed)
    a, b, c = (tree_digest(tmp_path / n) for n in "abc")
    assert a == b
    same_for_any_seed = ("readme.html", "batches.meta", "batches.meta.txt")
    assert a.keys() == c.keys() and all(a[k] != c[k] for k in a if not k.endswith(same_for_any_seed))


def test_cifar_pickles_are_byte_compatible_with_the_official_files(tmp_path):
    synth.synth_cifar10(str(tmp_path), per_class=4, test_per_class=2, seed=1)
    raw = (tmp_path / "cifar-10-batches-py/data_batch_1").read_bytes()
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    globals_ = [arg for op, arg, _ in pickletools.genops(raw) if op.name == "GLOBAL"]
    # What Python 2's cPickle wrote: protocol 2, str opcodes, numpy.core, no Python 3 _codecs round trip.
    assert raw[:2] == b"\x80\x02" and {"BINSTRING", "SHORT_BINSTRING"} & ops and "BINBYTES" not in ops
    assert "numpy.core.multiarray _reconstruct" in globals_ and not any("_codecs" in g for g in globals_)
    with open(tmp_path / "cifar-10-batches-py/data_batch_1", "rb") as f:
        as_bytes = pickle.load(f, encoding="bytes")
    assert list(as_bytes) == [b"batch_label", b"labels", b"data", b"filenames"]
    assert as_bytes[b"data"].dtype == np.uint8 and as_bytes[b"data"].shape == (8, 3072)
    assert as_bytes[b"batch_label"] == b"training batch 1 of 5"
    with open(tmp_path / "cifar-10-batches-py/data_batch_1", "rb") as f:
        as_latin1 = pickle.load(f, encoding="latin1")  # torchvision's call
    assert np.array_equal(as_latin1["data"], as_bytes[b"data"]) and as_latin1["labels"] == as_bytes[b"labels"]
    with open(tmp_path / "cifar-10-batches-py/batches.meta", "rb") as f:
        meta = pickle.load(f, encoding="bytes")
    assert meta[b"label_names"][0] == b"airplane" and meta[b"num_vis"] == 3072
    binary = (tmp_path / "cifar-10-batches-bin/data_batch_1.bin").read_bytes()
    assert len(binary) == 8 * 3073
    assert binary[0] == as_bytes[b"labels"][0] and binary[1:3073] == as_bytes[b"data"][0].tobytes()
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz") as tar:
        assert "cifar-10-batches-py/test_batch" in tar.getnames()
        assert tar.extractfile("cifar-10-batches-py/data_batch_1").read() == raw


def test_cifar100_keys_and_binary_label_order(tmp_path):
    synth.synth_cifar100(str(tmp_path), per_class=1, test_per_class=1, seed=2, forms=("python", "binary"))
    with open(tmp_path / "cifar-100-python/train", "rb") as f:
        train = pickle.load(f, encoding="bytes")
    assert set(train) == {b"filenames", b"batch_label", b"fine_labels", b"coarse_labels", b"data"}
    with open(tmp_path / "cifar-100-python/meta", "rb") as f:
        meta = pickle.load(f, encoding="bytes")
    assert len(meta[b"fine_label_names"]) == 100 and len(meta[b"coarse_label_names"]) == 20
    recs = np.frombuffer((tmp_path / "cifar-100-binary/train.bin").read_bytes(), np.uint8).reshape(-1, 3074)
    assert recs[:, 0].tolist() == train[b"coarse_labels"] and recs[:, 1].tolist() == train[b"fine_labels"]
    assert not (tmp_path / "cifar-100-python.tar.gz").exists()


def test_ptb_text_looks_like_ptb(tmp_path):
    synth.synth_ptb(str(tmp_path), train_tokens=5000, vocab=300, seed=0)
    train = (tmp_path / "simple-examples/data/ptb.train.txt").read_text()
    lines = train.splitlines()
    assert all(line.startswith(" ") and line.endswith(" ") for line in lines)
    words = train.split()
    assert "<unk>" in words and "N" in words and len(words) == 5000
    counts = sorted((words.count(w) for w in set(words)), reverse=True)
    assert counts[0] > 20 * counts[len(counts) // 2], "a Zipf-like head"
    train_vocab = set(words)
    assert set((tmp_path / "simple-examples/data/ptb.valid.txt").read_text().split()) <= train_vocab
    with tarfile.open(tmp_path / "simple-examples.tgz") as tar:
        assert tar.getnames() == [f"./simple-examples/data/ptb.{s}.txt" for s in ("train", "valid", "test")]


def test_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    synth.add_arguments(parser)
    out = tmp_path / "inet"
    assert synth.run(parser.parse_args(["imagenet", str(out), "--classes", "2", "--per-class", "2",
                                        "--val-per-class", "1", "--layout", "archives", "--no-bad-files"])) == 0
    assert "wrote 6 images" in capsys.readouterr().out
    summary = json.loads((out / "synth.json").read_text())
    assert summary["bad_files"] == {} and (out / "ILSVRC2012_img_train.tar").exists() and not (out / "train").exists()
    assert synth.run(parser.parse_args(["cifar100", str(tmp_path / "c"), "--per-class", "1", "--forms", "binary"])) == 0
    assert sorted(os.listdir(tmp_path / "c")) == ["cifar-100-binary", "synth.json"]
    assert synth.run(parser.parse_args(["ptb", str(tmp_path / "p"), "--tokens", "300", "--vocab", "40"])) == 0


@pytest.mark.parametrize("dataset, name", [("imagenet", "ILSVRC2012_img_train.tar"),
                                           ("cifar10", "cifar-10-python.tar.gz"),
                                           ("ptb", "simple-examples.tgz")])
def test_synth_never_writes_over_a_users_dataset(tmp_path, dataset, name):
    """Synthetic data takes the real datasets' file names: a folder holding anything but an earlier synth output
    (its synth.json) is refused, and the user's file is untouched; an earlier synth output is written again."""
    from gpufeed.errors import ConfigError

    make = {"imagenet": lambda out: synth.synth_imagenet(out, classes=2, per_class=1, val_per_class=1,
                                                         layout="archives", bad_files=False),
            "cifar10": lambda out: synth.synth_cifar10(out, per_class=1, test_per_class=1, forms=("targz",)),
            "ptb": lambda out: synth.synth_ptb(out, train_tokens=200, vocab=20)}[dataset]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / name).write_bytes(b"the real dataset")
    with pytest.raises(ConfigError, match=f"{re.escape(str(mine))} holds {re.escape(name)} and no synth.json, so it "
                                          "is not an earlier gpufeed synth output"):
        make(str(mine))
    assert os.listdir(mine) == [name] and (mine / name).read_bytes() == b"the real dataset"
    ours = str(tmp_path / "ours")
    first = make(ours)
    assert make(ours) == first  # an earlier output of synth's own is written again, to the same bytes


def test_demo_refuses_a_source_folder_holding_a_users_files(tmp_path):
    import subprocess
    import sys

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "LOC_synset_mapping.txt").write_text("my classes\n")
    proc = subprocess.run([sys.executable, "-m", "gpufeed", "demo", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no synth.json, so it is not an earlier gpufeed synth output" in proc.stderr
    assert (tmp_path / "src" / "LOC_synset_mapping.txt").read_text() == "my classes\n"
    assert not os.path.exists(tmp_path / "out")
