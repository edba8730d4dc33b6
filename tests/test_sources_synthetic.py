"""The synthetic source: `gpufeed convert synthetic KIND:N[:SEED]`, and the benchmark datasets made with it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from convert_fixtures import tree_bytes
from gpufeed.cli import main
from gpufeed.convert.options import ConvertOptions
from gpufeed.errors import ConfigError
from gpufeed.formats import get_format
from gpufeed.pipelines import open_source
from gpufeed.pipelines.base import SynthRef, read_item
from gpufeed.pipelines.sources_synthetic import LARGE_EVERY, geometry, is_large, parse_spec


def test_items_are_made_from_kind_seed_and_index_alone():
    src = open_source("synthetic", "imagenet:60:3")
    items = src.items("train")
    assert src.splits() == ["train"] and src.modality == "image" and len(src.classes().names) == 1000
    assert [it.key for it in items] == sorted(it.key for it in items)  # keys sort in index order
    assert items[7].label == 7 and items[7].ref == SynthRef("imagenet", 3, 7)
    data = read_item(items[7])
    assert data[:2] == b"\xff\xd8" and data == read_item(open_source("synthetic", "imagenet:8:3").items("train")[7])
    assert data != read_item(open_source("synthetic", "imagenet:8").items("train")[7])  # another seed
    large = read_item(items[next(i for i in range(60) if is_large(i))])
    assert len(large) > 3 * len(data)  # ImageNet's tail of large photos
    pixels = read_item(open_source("synthetic", "cifar:3").items("train")[2])
    assert pixels.shape == (32, 32, 3) and pixels.dtype == np.uint8
    ptb = open_source("synthetic", "ptb:4")
    tokens = read_item(ptb.items("train")[0])
    assert ptb.modality == "text" and tokens.dtype == np.int32 and tokens.shape == (36,) and len(ptb.classes().names) == 10_000


def test_the_large_photos_fall_evenly_on_the_ranks_of_any_count():
    """One photo in each 50 is large, at a place drawn for that 50, and photos face either way as drawn: the ranks
    a loader deals every w-th record (2, 3, 4 or 8 of them) get their share of the large photos and of each
    orientation. (At every 50th index, always odd, 2 and 4 ranks gave their odd ranks all of them.)"""
    n = 100_000
    large = [i for i in range(n) if is_large(i)]
    assert [i // LARGE_EVERY for i in large] == list(range(n // LARGE_EVERY))  # one in each 50
    for ranks in (2, 3, 4, 8):
        share = [sum(1 for i in large if i % ranks == r) for r in range(ranks)]
        assert max(abs(s - len(large) / ranks) for s in share) < 0.2 * len(large) / ranks, (ranks, share)
        tall = [sum(1 for i in range(r, 20_000, ranks) if geometry(i)[0] > geometry(i)[1]) for r in range(ranks)]
        assert all(abs(t / (20_000 / ranks) - 0.5) < 0.05 for t in tall), (ranks, tall)
    assert {geometry(i) for i in large} == {(1200, 1600), (1600, 1200)}


@pytest.mark.parametrize("spec", ["imagenet", "imagenet:0", "mnist:10", "imagenet:ten", "imagenet:10:x"])
def test_a_bad_spec_says_how_to_write_one(spec):
    with pytest.raises(ConfigError, match="is not KIND:N\\[:SEED\\] .* write it like imagenet:2000"):
        parse_spec(spec)


def test_convert_synthetic_writes_every_format_verifies_and_resumes_to_the_same_bytes(tmp_path, capsys):
    out = str(tmp_path / "o")
    argv = ["convert", "synthetic", "imagenet:40", "--to", "recordio,lmdb,tfrecord,webdataset", "--resize", "64",
            "--no-progress"]
    assert main([*argv, "--out", out, "--workers", "2"]) == 0
    assert "40 of 40 images written" in capsys.readouterr().out
    assert main(["verify", out]) == 0
    first = tree_bytes(out)
    again = str(tmp_path / "again")
    assert main([*argv, "--out", again, "--workers", "1"]) == 0
    assert tree_bytes(again) == first  # deterministic whatever the workers
    # The same command again, from another directory: the same conversion (SRC names no place), already done.
    capsys.readouterr()
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert main([*argv, "--out", out, "--workers", "2"]) == 0
    finally:
        os.chdir(cwd)
    assert "already complete" in capsys.readouterr().out and tree_bytes(out) == first
    capsys.readouterr()
    assert main(["convert", "synthetic", "imagenet", "--to", "lmdb", "--out", str(tmp_path / "x")]) == 2
    assert "synthetic SRC 'imagenet' is not KIND:N" in capsys.readouterr().err
    # A text kind takes no image options, as Penn Treebank does not.
    assert main(["convert", "synthetic", "ptb:40", "--to", "lmdb", "--out", str(tmp_path / "p"), "--resize", "8"]) == 2
    assert "--resize transform images; Penn Treebank is text" in capsys.readouterr().err
    # Windows keep their order by default, as Penn Treebank's do; images are shuffled.
    assert not ConvertOptions("synthetic", "ptb:40", ("lmdb",), str(tmp_path / "p")).effective_shuffle
    assert ConvertOptions("synthetic", "cifar:40", ("lmdb",), str(tmp_path / "c")).effective_shuffle


def test_bench_datasets_are_what_convert_writes(tmp_path):
    """bench dataset runs the conversion engine on the synthetic source: its files are byte for byte those of
    `gpufeed convert synthetic` with the same options, records in index order."""
    from gpufeed.bench.dataset import build_dataset, load_dataset_info

    ds = str(tmp_path / "ds")
    info = build_dataset(ds, ["recordio", "tfrecord"], n=30, resize=48, workers=2, seed=5, shards=2)
    assert info == load_dataset_info(ds) and info["n"] == 30 and info["store"] == "--resize 48"
    out = str(tmp_path / "conv")
    assert main(["convert", "synthetic", "imagenet:30:5", "--to", "recordio,tfrecord", "--out", out, "--resize",
                 "48", "--quality", "95", "--shards", "2", "--no-shuffle", "--workers", "1", "--no-progress"]) == 0
    mine = {k: v for k, v in tree_bytes(ds).items() if not k.endswith(".json")}
    assert mine == {k: v for k, v in tree_bytes(out).items() if not k.endswith(".json")}
    rec = get_format("recordio").reader(info["formats"]["recordio"]["paths"][0])
    assert [s.labels[0] for s in list(rec)[:5]] == [0, 1, 2, 3, 4]


def test_bench_dataset_refuses_a_users_file_naming_its_own_argument(tmp_path, capsys):
    """A DST holding a file bench dataset would write, which no gpufeed manifest lists, is left as it is; the
    error names the file and says to choose another destination (bench dataset's DST is an argument, not
    convert's --out)."""
    ds = tmp_path / "ds"
    (ds / "recordio").mkdir(parents=True)
    (ds / "recordio" / "train.rec").write_bytes(b"a user's file")
    before = tree_bytes(str(ds))
    assert main(["bench", "dataset", str(ds), "-n", "8", "--formats", "recordio", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "recordio/train.rec: not listed by this destination's manifest.json" in err
    assert "choose another destination" in err and "--out" not in err
    assert tree_bytes(str(ds)) == before
