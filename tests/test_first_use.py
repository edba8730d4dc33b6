"""What a new user meets first: each ecosystem's default encoding, 3-channel pass-through, im2rec and Caffe list
files from the CLI, quick trials (--limit, --shard-bytes), advice that works when followed, honest summaries.

Every case runs the real CLI or engine on a real local Ray with real files; what the consumers themselves make
of the files is checked by scripts/interop.sh (mxnet, TensorFlow, Caffe's parser, DALI).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import cv2
import numpy as np
import pytest

from convert_fixtures import options, tree_bytes
from gpufeed.cli import main
from gpufeed.convert.engine import convert
from gpufeed.convert.options import ConvertOptions, parse_bytes
from gpufeed.pipelines.image_options import ImageOptions
from gpufeed.convert.progress import Progress, format_summary
from gpufeed.convert.verify import verify
from gpufeed.errors import ConfigError, SourceNotFound
from gpufeed.formats import FORMATS, get_format
from gpufeed.formats.lmdb import LMDBReader
from gpufeed.formats.recordio import RecordIOReader


def _manifest(out) -> dict:
    with open(os.path.join(out, "manifest.json")) as f:
        return json.load(f)


def _channels(data: bytes) -> int:
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    return 1 if img.ndim == 2 else img.shape[2]


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    from gpufeed.pipelines.synth import synth_cifar10

    root = str(tmp_path_factory.mktemp("cifar") / "cifar10")
    synth_cifar10(root, per_class=2, test_per_class=1, seed=3, forms=("python",))
    return root


def test_cifar_defaults_are_each_ecosystems_own(cifar, tmp_path, ray_local):
    """Without --encode: PNG in RecordIO (ImageRecordIter decodes it) and TFRecord (as TFDS stores CIFAR), raw
    pixel Datums in LMDB (as convert_cifar_data writes them); the same pixels in all three."""
    out = str(tmp_path / "out")
    convert(ConvertOptions(dataset="cifar10", src=cifar, formats=("lmdb", "recordio", "tfrecord"), out=out,
                           workers=2, progress=False, shuffle=False), Progress(False))
    assert _manifest(out)["output_options"]["encode"] == {"lmdb": "raw", "recordio": "png", "tfrecord": "png"}
    rec = RecordIOReader(os.path.join(out, "recordio", "test.rec"))
    tf_path = os.path.join(out, "tfrecord", "test-00000-of-00001")
    tf = get_format("tfrecord").reader(tf_path)
    with LMDBReader(os.path.join(out, "lmdb", "test_lmdb")) as db:
        datums = list(db)
    assert len(rec) == len(datums) == 10
    for i, datum in enumerate(datums):
        png = bytes(rec[i].payload)
        assert png.startswith(b"\x89PNG") and _channels(png) == 3
        stored = tf[i]
        assert stored.kind == "encoded" and bytes(stored.payload).startswith(b"\x89PNG")
        assert datum.kind == "raw"
        rgb = cv2.cvtColor(cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        assert np.array_equal(rgb, np.asarray(datum.payload)), i  # lossless: the same pixels everywhere


def test_cifar_encode_raw_still_applies_to_every_format(cifar, tmp_path, ray_local):
    out = str(tmp_path / "raw")
    convert(ConvertOptions(dataset="cifar10", src=cifar, formats=("recordio", "tfrecord"), out=out, workers=2,
                           image=ImageOptions(encode="raw"), progress=False), Progress(False))
    assert _manifest(out)["output_options"]["encode"] == "raw"
    assert get_format("tfrecord").reader(os.path.join(out, "tfrecord", "test-00000-of-00001"))[0].kind == "raw"


def test_pass_through_stores_every_image_as_3_channels_and_lists_the_re_encoded(src, tmp_path, ray_local):
    """RGB JPEGs keep their bytes; the grayscale and CMYK JPEGs and the PNG named .JPEG of ImageNet become RGB
    JPEGs, each listed with why, in the summary and the manifest."""
    out = str(tmp_path / "pass")
    summary = convert(options(src, out, resize=None, encode="pass", formats=("recordio",)), Progress(False))
    why = dict(summary.converted)
    assert sorted(why.values()) == sorted([
        "a grayscale JPEG: stored as an RGB JPEG (quality 95)", "a CMYK JPEG: stored as an RGB JPEG (quality 95)",
        "a PNG file, not a JPEG: stored as an RGB JPEG (quality 95)"])
    assert sorted(map(tuple, _manifest(out)["converted"])) == sorted(summary.converted)
    assert "re-encoded inputs (3)" in format_summary(summary)
    kept = 0
    for split in ("train", "val"):
        rec = RecordIOReader(os.path.join(out, "recordio", f"{split}.rec"))
        for i in range(len(rec)):
            sample = rec[i]
            data = bytes(sample.payload)
            assert data.startswith(b"\xff\xd8") and _channels(data) == 3, sample.key
            with open(os.path.join(src, split, sample.key), "rb") as f:
                original = f.read()
            if os.path.join(src, split, sample.key) not in why:
                assert data == original, sample.key
                kept += 1
    assert kept == summary.written - 3


@pytest.fixture
def list_files(src, tmp_path):
    """An im2rec .lst with two labels per line and a Caffe list, both relative to the train folder, kept
    elsewhere (as users keep them)."""
    train = os.path.join(src, "train")
    with open(os.path.join(src, "synth.json")) as f:
        bad = json.load(f)["bad_files"]
    names = sorted(os.path.relpath(os.path.join(d, n), train) for d, _, ns in os.walk(train) for n in ns)
    names = [n for n in names if n not in bad][:6]
    assert len(names) == 6
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "train.lst").write_text("".join(f"{i}\t{i % 3}\t{i % 2}\t{n}\n" for i, n in enumerate(names)))
    (lists / "val.txt").write_text("".join(f"{n} {i % 3}\n" for i, n in enumerate(names)))
    return train, str(lists), names


def test_im2rec_list_with_several_labels_from_the_cli(list_files, tmp_path, ray_local):
    train, lists, names = list_files
    out = str(tmp_path / "lst")
    rc = main(["convert", "folder", os.path.join(lists, "train.lst"), "--root", train, "--to", "recordio",
               "--out", out, "--workers", "2", "--no-progress", "--no-shuffle", "--on-error", "skip"])
    assert rc == 0
    rec = RecordIOReader(os.path.join(out, "recordio", "train.rec"))
    got = {rec[i].key: tuple(rec[i].label) for i in range(len(rec))}
    assert len(got) == _manifest(out)["splits"]["train"]["written"] == len(names)
    for i, n in enumerate(names):
        assert got[n] == (float(i % 3), float(i % 2))


def test_im2rec_layout_lists_and_outputs_side_by_side_keep_order_and_indexes(list_files, tmp_path, ray_local):
    """im2rec users keep train.lst beside the images and write the .rec next to them: --out under the list's
    folder is fine (its inputs are the lines it names); --no-shuffle keeps the list's order and its index
    column, which becomes each record's id, .idx key and .lst number as im2rec makes them."""
    train, lists, names = list_files
    shutil.copytree(train, os.path.join(lists, "imgs"))
    order = [names[i] for i in (4, 1, 5, 0, 3, 2)]  # not sorted
    ids = [40, 7, 13, 2, 99, 5]
    (open(os.path.join(lists, "pets_train.lst"), "w")
     .write("".join(f"{i}\t{k % 3}\timgs/{n}\n" for k, (i, n) in enumerate(zip(ids, order)))))
    out = os.path.join(lists, "o")
    assert main(["convert", "folder", os.path.join(lists, "pets_train.lst"), "--to", "recordio", "--out", out,
                 "--workers", "2", "--no-progress", "--no-shuffle"]) == 0
    rec = RecordIOReader(os.path.join(out, "recordio", "pets_train.rec"))
    assert [(rec[i].key, rec[i].index) for i in range(len(rec))] == [(f"imgs/{n}", i) for i, n in zip(ids, order)]
    idx = open(os.path.join(out, "recordio", "pets_train.idx")).read().splitlines()
    assert [int(line.split("\t")[0]) for line in idx] == ids
    lst = open(os.path.join(out, "recordio", "pets_train.lst")).read().splitlines()
    assert [int(line.split("\t")[0]) for line in lst] == ids
    # pets_val.lst into the same --out joins it, as im2rec writes val.rec beside train.rec: train untouched.
    (open(os.path.join(lists, "pets_val.lst"), "w").write(f"5\t1\timgs/{names[0]}\n8\t0\timgs/{names[1]}\n"))
    before = tree_bytes(out)
    val = ConvertOptions(dataset="folder", src=os.path.join(lists, "pets_val.lst"), formats=("recordio",), out=out,
                         workers=1, progress=False, shuffle=False)
    convert(val, Progress(False))
    after = tree_bytes(out)
    assert {k: v for k, v in after.items() if "pets_train" in k} == {k: v for k, v in before.items()
                                                                    if "pets_train" in k}
    report = verify(out)
    assert report.records[("pets_train", "recordio")] == 6 and report.records[("pets_val", "recordio")] == 2
    doc = _manifest(out)
    assert set(doc["splits"]) == {"pets_train", "pets_val"} and doc["classes"]["count"] == 3
    # Either command again: already complete, nothing rewritten.
    for src_list in ("pets_train.lst", "pets_val.lst"):
        again = convert(dataclasses.replace(val, src=os.path.join(lists, src_list)), Progress(False))
        assert "already complete" in again.note and tree_bytes(out) == after
    # A list that names a file inside --out is refused, naming it.
    inside = os.path.join(lists, "o2")
    shutil.copytree(os.path.join(lists, "imgs"), os.path.join(inside, "imgs"))
    (open(os.path.join(lists, "bad.lst", ), "w").write(f"0\t0\to2/imgs/{names[0]}\n"))
    with pytest.raises(ConfigError, match=f"o2/imgs/{names[0]}, an input .*bad.lst lists, is inside the destination"):
        convert(ConvertOptions(dataset="folder", src=os.path.join(lists, "bad.lst"), formats=("recordio",),
                               out=inside, workers=1, progress=False), Progress(False))


def test_caffe_list_from_the_cli_root_defaults_to_the_lists_folder(list_files, tmp_path, ray_local, capsys):
    train, lists, names = list_files
    out = str(tmp_path / "caffe")
    assert main(["convert", "folder", os.path.join(lists, "val.txt"), "--root", train, "--to", "lmdb", "--out", out,
                 "--workers", "2", "--no-progress", "--on-error", "skip"]) == 0
    assert os.path.isdir(os.path.join(out, "lmdb", "val_lmdb"))
    # Without --root the paths start at the list's own folder, where the images are not: said once, with the fix.
    with pytest.raises(SourceNotFound, match="--root, now .*lists"):
        convert(ConvertOptions(dataset="folder", src=os.path.join(lists, "val.txt"), formats=("lmdb",),
                               out=str(tmp_path / "x"), workers=2, progress=False), Progress(False))
    shutil.copytree(train, os.path.join(lists, "imgs"))
    for name in ("val.txt",):
        text = open(os.path.join(lists, name)).read()
        with open(os.path.join(lists, name), "w") as f:
            f.write("".join(f"imgs/{line}\n" for line in text.splitlines()))
    out2 = str(tmp_path / "caffe2")
    assert main(["convert", "folder", os.path.join(lists, "val.txt"), "--to", "lmdb", "--out", out2,
                 "--workers", "2", "--no-progress", "--on-error", "skip"]) == 0


@pytest.mark.parametrize("dataset, src_kind, extra, text", [
    ("imagenet", "list", [], "read by the folder dataset"),
    ("folder", "dir", ["--root", "."], "SRC is not a list file"),
])
def test_list_file_misuse_is_refused_with_the_fix(list_files, tmp_path, dataset, src_kind, extra, text, capsys):
    train, lists, _ = list_files
    src_arg = os.path.join(lists, "val.txt") if src_kind == "list" else train
    rc = main(["convert", dataset, src_arg, "--to", "lmdb", "--out", str(tmp_path / "o"), *extra])
    assert rc == 2 and text in capsys.readouterr().err


@pytest.mark.parametrize("how", ["process substitution", "FIFO"])
def test_a_list_given_as_a_pipe_is_refused_naming_it_and_the_fix(list_files, tmp_path, how, capsys):
    """`convert folder <(grep ... train.lst) --root IMGS`: the shell gives /dev/fd/N, a pipe; it was taken for a
    folder that is missing ("the image folder not found") or, with --root, for no list file."""
    train, lists, _ = list_files
    text = open(os.path.join(lists, "val.txt"), "rb").read()
    if how == "FIFO":
        src = str(tmp_path / "val.lst")
        os.mkfifo(src)
        fds = None
    else:
        fds = os.pipe()
        src = f"/dev/fd/{fds[0]}"
        os.write(fds[1], text)
        os.close(fds[1])
    try:
        rc = main(["convert", "folder", src, "--root", train, "--to", "lmdb", "--out", str(tmp_path / "o")])
    finally:
        if fds is not None:
            os.close(fds[0])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (
        f"gpufeed: error: SRC {src} is a FIFO (named pipe), not a file or folder: a source is read again by each "
        "rerun that resumes a run, and a list file's name names its split (train.lst converts to train), so save "
        "it to a file and give that")
    assert not os.path.exists(tmp_path / "o")


def test_the_archives_datasets_ship_as_are_a_src_as_the_readme_types_them(tmp_path, ray_local, capsys):
    """`convert cifar10 cifar-10-python.tar.gz ...` and `convert ptb simple-examples.tgz ...`: an archive given
    as SRC is the dataset (not a list file); one of PTB's text files names the folder to give instead."""
    from gpufeed.pipelines.synth import synth_cifar10, synth_ptb

    synth_cifar10(str(tmp_path / "c10"), per_class=1, test_per_class=1, forms=("targz",))
    synth_ptb(str(tmp_path / "ptb"))
    address = ["--address", ray_local.get_runtime_context().gcs_address, "--no-progress"]
    assert main(["convert", "cifar10", str(tmp_path / "c10" / "cifar-10-python.tar.gz"), "--to", "lmdb",
                 "--out", str(tmp_path / "c10o"), *address]) == 0
    assert _manifest(tmp_path / "c10o")["splits"]["train"]["written"] == 10
    assert main(["convert", "ptb", str(tmp_path / "ptb" / "simple-examples.tgz"), "--to", "tfrecord",
                 "--out", str(tmp_path / "ptbo"), *address]) == 0
    assert _manifest(tmp_path / "ptbo")["splits"]["train"]["written"] > 0
    capsys.readouterr()
    text = tmp_path / "ptb" / "simple-examples" / "data" / "ptb.train.txt"
    assert main(["convert", "ptb", str(text), "--to", "tfrecord", "--out", str(tmp_path / "x")]) == 2
    assert "is one of Penn Treebank's files; point SRC at the folder" in capsys.readouterr().err


def test_limit_and_shard_bytes(src, tmp_path, ray_local):
    """--limit converts a seeded sample of N inputs per split (the same one every time); --shard-bytes cuts
    each split into shards of about that many input bytes."""
    out = str(tmp_path / "lim")
    summary = convert(options(src, out, formats=("tfrecord",), limit=7, shard_bytes=250_000), Progress(False))
    assert summary.samples["train"]["planned"] == 7 and summary.samples["val"]["planned"] == 6  # val has 6
    reader = get_format("tfrecord").reader
    inputs = [os.path.join(src, "train", reader(p)[i].key) for p in _shards(out, "train")
              for i in range(len(reader(p)))]
    inputs += [origin for origin, _ in summary.skipped if "/train/" in origin]
    assert len(inputs) == 7
    total = sum(os.path.getsize(p) for p in inputs)
    assert summary.samples["train"]["shards"] == max(1, round(total / 250_000)) > 1
    again = convert(options(src, str(tmp_path / "lim2"), formats=("tfrecord",), limit=7, shard_bytes=250_000),
                    Progress(False))
    assert again.samples == summary.samples and again.skipped == summary.skipped  # the same seeded sample


def _shards(out, split) -> list[str]:
    d = os.path.join(out, "tfrecord")
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.startswith(split + "-") and "." not in n)


@pytest.mark.parametrize("text, value", [("256MB", 256_000_000), ("1GiB", 2**30), ("500k", 500_000), ("42", 42),
                                         ("1.5 GB", 1_500_000_000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text, "--shard-bytes") == value


def test_bad_sizes_and_limits_are_refused():
    with pytest.raises(ConfigError, match="like 256MB"):
        parse_bytes("5XB", "--shard-bytes")
    with pytest.raises(ConfigError, match="--limit"):
        ConvertOptions(dataset="imagenet", src="/nonexistent", formats=("lmdb",), out="/tmp/o", limit=0)


def test_on_error_does_not_block_a_resume_and_other_changes_quote_the_command(src, tmp_path, ray_local, capsys):
    """After 'skip it with --on-error skip' the rerun with that option goes on from the journal; an option that
    changes the bytes of finished shards is refused with the exact command that starts over, which works."""
    out = str(tmp_path / "resume")
    args = ["convert", "imagenet", src, "--to", "recordio", "--out", out, "--workers", "2", "--resize", "40",
            "--shard-size", "5", "--no-progress"]
    assert main(args) == 2  # the synthetic ImageNet holds a truncated JPEG
    err = capsys.readouterr().err
    assert "--on-error skip" in err
    assert main(args + ["--on-error", "skip"]) == 0
    capsys.readouterr()
    shutil.rmtree(out)  # start again: a partial output whose journal holds the first options
    assert main(args) == 2
    capsys.readouterr()
    changed = args + ["--on-error", "skip", "--quality", "80"]
    assert main(changed) == 2
    err = capsys.readouterr().err
    assert "quality: journal 95, now 80" in err
    command = err.rsplit("start over with these: ", 1)[1].strip()
    assert command.startswith("gpufeed convert imagenet ") and command.endswith("--no-resume")
    import shlex

    words = shlex.split(command)
    assert main(words[1:]) == 0


def test_max_pixels_is_an_option_and_the_bomb_advice_names_it(tmp_path, ray_local, capsys):
    from gpufeed.pipelines.synth import synth_jpeg

    folder = tmp_path / "imgs" / "cls"
    folder.mkdir(parents=True)
    (folder / "big.jpg").write_bytes(synth_jpeg(np.random.default_rng(0), 300, 300))
    args = ["convert", "folder", str(tmp_path / "imgs"), "--to", "tfrecord", "--workers", "1", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "a"), "--max-pixels", "1000"]) == 2
    assert "raise gpufeed convert's --max-pixels" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "b"), "--max-pixels", "100000"]) == 0


def test_text_datasets_count_records_and_dry_runs_say_what_they_would_do(tmp_path, ray_local):
    from gpufeed.pipelines.synth import synth_ptb

    ptb = str(tmp_path / "ptb")
    synth_ptb(ptb, train_tokens=3000, seed=1)
    o = ConvertOptions(dataset="ptb", src=ptb, formats=("tfrecord",), out=str(tmp_path / "o"), workers=1,
                       progress=False)
    dry = format_summary(convert(dataclasses.replace(o, dry_run=True), Progress(False)))
    assert "nothing was written" in dry and "0 of" not in dry and " records in 1 shard" in dry
    text = format_summary(convert(o, Progress(False)))
    assert "records/s" in text and "images" not in text
    # Tokens that fill no window were never planned: listed apart from each split's "0 skipped", not under it.
    assert "; 0 skipped" in text and "skipped inputs" not in text
    assert "left out while listing (3), in no count above:" in text and "do not fill a window" in text


def test_the_summarys_verify_command_works_as_printed_for_a_path_with_a_space(tmp_path, ray_local):
    """The command a summary gives quotes the destination, so it runs pasted into a shell as it is."""
    import shlex

    from gpufeed.pipelines.synth import synth_ptb

    ptb = str(tmp_path / "ptb")
    synth_ptb(ptb, train_tokens=2000, seed=2)
    out = str(tmp_path / "my outputs")
    text = format_summary(convert(ConvertOptions(dataset="ptb", src=ptb, formats=("tfrecord",), out=out, workers=1,
                                                 progress=False), Progress(False)))
    command = text.split("check it with `")[1].split("`")[0]
    assert command == f"gpufeed verify '{out}'"
    assert main(shlex.split(command)[1:]) == 0


def test_phases_said_at_once_by_two_threads_stay_two_lines():
    """Each split output's committing thread says its phase ("finishing the train lmdb output"): two at once were
    seen run into one line and an empty one, as a print writes its text and its newline apart."""
    import io
    import threading
    import time

    from gpufeed.convert.progress import Progress

    class Log(io.StringIO):
        def write(self, text):
            n = super().write(text)
            time.sleep(0.001)  # another thread's write may come between this one and the next
            return n

    log = Log()
    p = Progress(True, log)
    said = [f"finishing the train {fmt} output" for fmt in ("recordio", "lmdb")]
    threads = [threading.Thread(target=lambda t=t: [p.phase(t) for _ in range(20)]) for t in said]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(log.getvalue().splitlines())) == sorted(f"{t} ..." for t in said)


def test_progress_is_plain_lines_in_a_log_and_a_bar_on_a_terminal():
    """A log (not a terminal) gets a line per phase and per interval, no carriage returns; a terminal the bar."""
    import io

    from gpufeed.convert.progress import Progress

    early = io.StringIO()
    p = Progress(True, early, log_interval=0)
    p.start(100, 0)
    p.update(24, 1_000)  # a burst of finished shards in the first second: no "about 0 s left" guess
    assert "left" not in early.getvalue() and "img/s since converting began" in early.getvalue()
    log = io.StringIO()
    p = Progress(True, log, log_interval=0, eta_after_s=0)
    p.phase("listing /data")
    p.start(100, 0)
    p.update(40, 4_000_000)
    p.phase("starting Ray")
    p.update(60, 6_000_000)
    p.phase("finishing the train lmdb output")
    p.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[:2] == ["listing /data ...", "converting: 100 img"]
    assert lines[2].startswith("converting: 40 of 100 img (40%), ") and " left" in lines[2]
    assert lines[3].startswith("starting Ray (40 of 100 img (40%)")
    assert lines[-1].startswith("finishing the train lmdb output (100 of 100 img (100%)")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    p = Progress(True, term)
    p.start(100, 0)
    p.update(100, 1)
    p.close()
    assert "\r" in term.getvalue() and "100/100" in term.getvalue()


def test_the_readme_main_job_gpufeed_demo(tmp_path, ray_local, capsys):
    """`gpufeed demo` (the README's first command, small): synthesises ImageNet's real layout with its awkward
    files, converts to every format, verifies; what it prints is what happened."""
    out = tmp_path / "demo"
    assert main(["demo", str(out), "--classes", "4", "--per-class", "4", "--workers", "2"]) == 0
    text = capsys.readouterr().out
    assert ("4 awkward files planted: a CMYK JPEG, a PNG named .JPEG, a grayscale JPEG (converted); a truncated "
            "JPEG (skipped under --on-error skip)") in text
    assert "train: 15 of 16 images written" in text
    assert "(recordio 15, lmdb 15, tfrecord 15, webdataset 15); 1 skipped" in text
    assert "val: 4 of 4 images written" in text
    assert "truncated JPEG" in text.split("skipped inputs (1):", 1)[1]
    assert "OK:" in text and "records read back: train/lmdb 15, train/recordio 15, train/tfrecord 15" in text
    for fmt in FORMATS:
        assert (out / "out" / fmt).is_dir()


@pytest.mark.parametrize("dataset", ["imagenet", "folder", "cifar10", "ptb"])
def test_a_src_that_does_not_exist_is_said_so(tmp_path, dataset, capsys):
    from gpufeed.cli import main

    missing = tmp_path / "no-such-dataset"
    assert main(["convert", dataset, str(missing), "--to", "tfrecord", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"gpufeed: error: {missing}: does not exist; check the path: SRC "
                                                    "is the dataset as shipped, a folder or an archive")


def test_a_run_that_writes_no_mean_image_says_why_in_its_summary(src, tmp_path, ray_local):
    """--normalize with images of different sizes (--resize keeps the aspect) writes mean_std.json and no
    mean.binaryproto, which Caffe needs at the data's size: the summary says so, not only manifest.json."""
    o = ConvertOptions(dataset="imagenet", src=src, formats=("lmdb",), out=str(tmp_path / "o"), workers=1,
                       progress=False, image=ImageOptions(resize=48, encode=None), normalize=True, limit=6,
                       splits=("train",), on_error="skip")
    text = format_summary(convert(o, Progress(False)))
    assert "no mean.binaryproto: images differ in size; Caffe needs a mean image" in text
    assert not os.path.exists(tmp_path / "o" / "mean.binaryproto")


def test_a_split_whose_every_input_was_skipped_ends_the_command_with_an_error(src, tmp_path, ray_local, capsys):
    """--on-error skip over inputs none of which converts (here: a folder of text files, then of truncated JPEGs
    beside good ones in another split) writes complete, empty outputs; the command says which splits hold nothing,
    the first reason, and ends with status 1, so a script does not train on nothing."""
    text = tmp_path / "text"
    for cls in ("a", "b"):
        (text / "train" / cls).mkdir(parents=True)
        (text / "train" / cls / "notes.txt").write_text("not an image")
    assert main(["convert", "folder", str(text), "--to", "recordio", "--out", str(tmp_path / "o1"), "--workers", "1",
                 "--on-error", "skip", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "gpufeed: error: no images of train were written: every input was skipped or left out while listing" in err
    assert f"the first: {text / 'train' / 'a' / 'notes.txt'}: is not an image file" in err
    mixed = tmp_path / "mixed"
    good = cv2.imencode(".jpg", np.full((8, 8, 3), 90, np.uint8))[1].tobytes()
    for split, data in (("train", good), ("val", good[:40])):
        for cls in ("a", "b"):
            (mixed / split / cls).mkdir(parents=True)
            (mixed / split / cls / "x.jpg").write_bytes(data)
    assert main(["convert", "folder", str(mixed), "--to", "recordio", "--out", str(tmp_path / "o2"), "--workers", "1",
                 "--on-error", "skip", "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert "train: 2 of 2 images written" in out and "val: 0 of 2 images written" in out
    assert "gpufeed: error: no images of val were written" in err and "val/a/x.jpg: " in err
    assert verify(str(tmp_path / "o2")).records[("val", "recordio")] == 0  # complete, and empty
    # Good inputs: status 0, as ever.
    assert main(["convert", "folder", str(mixed / "train"), "--to", "recordio", "--out", str(tmp_path / "o3"),
                 "--workers", "1", "--no-progress"]) == 0
