"""Small inputs that must not make big allocations, and mistakes that must end in one line naming the problem
and the fix (never a traceback, a hang, or advice that does not apply).

Each case is a real file (PNG, tar, pickle, list file) or a real command line in a child process.
"""

from __future__ import annotations

import io
import os
import re
import pathlib
import pickle
import shutil
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

from convert_fixtures import options
from gpufeed.convert.engine import convert
from gpufeed.errors import ConfigError, InputError, OutputError, UnsafePickleError
from gpufeed.machine import free_port


def gpufeed(*args, timeout=60):
    """The command line in a child process: ``(exit status, stdout, stderr)``."""
    proc = subprocess.run([sys.executable, "-m", "gpufeed", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def _one_error_line(code, err):
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("gpufeed: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err  # after progress lines, if any
    return errors[0]


# -- --address -------------------------------------------------------------------------------------------

def test_an_address_nobody_answers_is_one_line_in_seconds_and_dst_is_untouched(src, tmp_path):
    port = free_port()
    t0 = time.monotonic()
    code, _, err = gpufeed("convert", "imagenet", src, "--to", "tfrecord", "--out", tmp_path / "out",
                           "--address", f"127.0.0.1:{port}", "--no-progress")
    assert time.monotonic() - t0 < 30
    line = _one_error_line(code, err)
    assert line == (f"gpufeed: error: --address 127.0.0.1:{port}: no Ray cluster answers at 127.0.0.1:{port} "
                    f"(connection refused); start its head there with `ray start --head --port={port}`, or check "
                    "--address")
    assert not (tmp_path / "out").exists()


def test_ray_client_without_its_package_says_what_to_install(src, tmp_path):
    try:
        import grpc  # noqa: F401
        pytest.skip("Ray's client is installed here")
    except ImportError:
        pass
    code, _, err = gpufeed("convert", "imagenet", src, "--to", "tfrecord", "--out", tmp_path / "out",
                           "--address", "ray://127.0.0.1:10001", "--no-progress")
    assert "pip install 'ray[client]'" in _one_error_line(code, err)


def test_a_url_whose_filesystem_is_not_installed_says_what_to_install(src, tmp_path):
    pytest.importorskip("fsspec")
    try:
        import aiohttp  # noqa: F401
        pytest.skip("fsspec's HTTP filesystem is installed here")
    except ImportError:
        pass
    for args in (("http://example.invalid/imagenet", "--out", tmp_path / "out"),
                 (src, "--out", "http://example.invalid/out")):
        code, _, err = gpufeed("convert", "imagenet", args[0], "--to", "tfrecord", *args[1:], "--no-progress")
        line = _one_error_line(code, err)
        assert "http:// URLs needs a package that is not installed" in line and "pip install" in line


# -- stored sizes ---------------------------------------------------------------------------------------

@pytest.fixture
def thin_pngs(tmp_path):
    """A 20000x1 PNG (a few hundred bytes) and a 65535x1 one beside an ordinary image."""
    import cv2

    root = tmp_path / "thin" / "cat"
    root.mkdir(parents=True)
    cv2.imwrite(str(root / "wide.png"), np.zeros((1, 20000, 3), np.uint8))
    cv2.imwrite(str(root / "w65535.png"), np.zeros((1, 65535, 3), np.uint8))
    cv2.imwrite(str(root / "ok.png"), np.full((30, 40, 3), 128, np.uint8))
    assert (root / "wide.png").stat().st_size < 1000
    return root.parent


def test_a_tiny_image_that_would_be_stored_huge_is_an_input_error_before_any_allocation(thin_pngs, tmp_path,
                                                                                          ray_local):
    summary = convert(options(thin_pngs, tmp_path / "out", dataset="folder", formats=("recordio",), resize=256,
                              workers=1))
    reasons = dict(summary.skipped)
    assert summary.samples["train"]["written"] == 1
    assert reasons[str(thin_pngs / "cat" / "wide.png")] == ("would be stored as 5120000x256 = 1310720000 pixels, "
                                                            "over the limit of 89478485 (--max-pixels)")
    with pytest.raises(InputError, match="wide.png: would be stored as 5120000x256 .* cap the longer side with "
                                         "--max-size"):
        convert(options(thin_pngs, tmp_path / "fail", dataset="folder", formats=("recordio",), resize=256,
                        workers=1, on_error="fail"))


def test_a_side_no_jpeg_holds_is_an_input_error_and_opencv_prints_nothing(thin_pngs, tmp_path):
    code, out, err = gpufeed("convert", "folder", thin_pngs, "--to", "recordio", "--out", tmp_path / "out",
                             "--on-error", "skip", "--workers", "1", "--no-progress")
    assert code == 0, err
    assert "w65535.png: would be stored as 65535x1, a side over 65500 pixels, the most a JPEG holds" in out
    assert "[ERROR" not in err + out


@pytest.mark.parametrize("args, text", [
    (("--resize", "100000"), "--resize 100000 is over 65500 pixels"),
    (("--size", "100000x100000"), "--size 100000x100000 is over 65500 pixels"),
    (("--size", "10000x10000"), "--size 10000x10000 makes images of at least 100000000 pixels, over the 89478485 "
                                "that --max-pixels allows"),
    (("--resize", "10000"), "--resize 10000 makes images of at least 100000000 pixels"),
    (("--max-size", "70000"), "--max-size 70000 is over 65500 pixels"),
    (("--seed", "-1"), "--seed must be a whole number 0 or more, not -1"),
    (("--store-dtype", "float32", "--mean", "nan", "--std", "1"), "--mean must be finite numbers, not nan"),
    (("--store-dtype", "float16", "--mean", "0", "--std", "1e-9"),
     "--mean 0 with --std 1e-09 stores pixel values up to 2.55e+11, beyond float16's 65504; use a larger --std or "
     "--store-dtype float32"),
])
def test_absurd_options_are_refused_when_parsed(src, tmp_path, args, text):
    code, _, err = gpufeed("convert", "imagenet", src, "--to", "lmdb", "--out", tmp_path / "out", *args,
                           "--no-progress")
    assert text in _one_error_line(code, err)
    assert not (tmp_path / "out").exists()


def test_statistics_that_cannot_normalise_are_refused_before_anything_is_written(tmp_path, ray_local):
    """Images of one flat colour have std 0: no float storage can hold (pixel - mean) / 0."""
    import cv2

    root = tmp_path / "flat" / "cat"
    root.mkdir(parents=True)
    for i in range(3):
        cv2.imwrite(str(root / f"{i}.png"), np.full((8, 8, 3), 77, np.uint8))
    with pytest.raises(ConfigError, match="the train split's statistics cannot normalise its pixels .*give --mean "
                                          "and --std"):
        convert(options(root.parent, tmp_path / "out", dataset="folder", formats=("lmdb",), resize=None,
                        normalize=True, store_dtype="float16", workers=1))


# -- archives, pickles, lists -----------------------------------------------------------------------------

def test_a_small_ptb_archive_inflating_to_hundreds_of_megabytes_is_refused_unread(tmp_path):
    from gpufeed.pipelines.sources_ptb import ARCHIVE_DIR

    archive = tmp_path / "simple-examples.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, size in (("ptb.train.txt", 300 << 20), ("ptb.valid.txt", 10), ("ptb.test.txt", 10)):
            info = tarfile.TarInfo(f"{ARCHIVE_DIR}/{name}")
            info.size = size
            tar.addfile(info, _Zeros(size))
    assert archive.stat().st_size < 1 << 20
    t0 = time.monotonic()
    code, _, err = gpufeed("convert", "ptb", archive, "--to", "tfrecord", "--out", tmp_path / "out", "--dry-run")
    assert time.monotonic() - t0 < 30
    line = _one_error_line(code, err)
    assert "ptb.train.txt: holds more than 32 MiB of text, the most gpufeed reads of one Penn Treebank file" in line


class _Zeros(io.RawIOBase):
    """``size`` bytes of spaces, produced as tarfile reads them."""

    def __init__(self, size):
        self.left = size

    def readable(self):
        return True

    def readinto(self, b):
        n = min(len(b), self.left)
        b[:n] = b" " * n
        self.left -= n
        return n


def test_a_ptb_text_file_over_the_limit_is_refused_unread(tmp_path):
    from gpufeed.pipelines.sources_ptb import FILES, MAX_TEXT_BYTES

    ptb = tmp_path / "ptb"
    ptb.mkdir()
    for split, name in FILES.items():
        (ptb / name).write_bytes(b"a b\n" * (MAX_TEXT_BYTES // 4 + 1 if split == "train" else 2))
    code, _, err = gpufeed("convert", "ptb", ptb, "--to", "tfrecord", "--out", tmp_path / "out", "--dry-run")
    assert "ptb.train.txt: holds more than 32 MiB of text" in _one_error_line(code, err)


@pytest.mark.parametrize("payload, what", [
    (b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x7f\x85R.", "an empty bytearray of 2130706432 bytes"),
    (b"\x80\x02cnumpy\nndarray\nJ\x00\x00\x00\x7f\x85R.", "an array of 17045651456 bytes"),
    (b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ\x00\x00\x00\x7f\x85C\x01b\x87R.",
     "an empty array of 2130706432 bytes"),
])
def test_a_tiny_pickle_asking_for_gigabytes_is_refused_before_allocating(payload, what):
    import resource

    from gpufeed.pipelines import safe_pickle

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(UnsafePickleError, match=f"is a {len(payload)}-byte pickle asking for {what}"):
        safe_pickle.load(payload, "data_batch_1")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: under 100 MiB more
    real = {b"data": np.arange(3072 * 4, dtype=np.uint8).reshape(4, 3072), b"labels": [1, 2, 3, 4]}
    for protocol in (2, 5):  # the real batches (protocol 2, from Python 2) and a numpy 2 one still load
        assert safe_pickle.load(pickle.dumps(real, protocol=protocol), "x")[b"data"].shape == (4, 3072)


def test_list_labels_beyond_any_class_list_or_not_finite_are_label_errors(src, tmp_path, ray_local):
    images = sorted(pathlib.Path(src, "train").rglob("*.JPEG"))[:4]
    root = tmp_path / "imgs"
    root.mkdir()
    lines = []
    for i, (img, label) in enumerate(zip(images, ("0", "16000000", "inf", "1"))):
        shutil.copy(img, root / img.name)
        lines.append(f"{i}\t{label}\t{img.name}")
    (root / "train.lst").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    summary = convert(options(str(root / "train.lst"), out, dataset="folder", formats=("recordio",),
                              workers=1))
    assert summary.samples["train"]["written"] == 2
    reasons = [reason for origin, reason in summary.skipped]
    assert len(reasons) == 2 and all("with an integer label 0..999999" in r for r in reasons)
    assert (out / "classes.txt").read_text() == "0\t0\n1\t1\n"


# -- outputs ---------------------------------------------------------------------------------------------

def test_a_flipped_byte_in_an_lmdb_page_list_is_a_corrupt_record_error(src, tmp_path, ray_local):
    from gpufeed.errors import CorruptRecordError
    from gpufeed.formats import get_format

    out = tmp_path / "out"
    convert(options(src, out, splits=("val",), formats=("lmdb",)))
    pages = out / "lmdb" / "val_lmdb" / "gpufeed.pages"
    data = bytearray(pages.read_bytes())
    data[7] ^= 0xFF  # the top byte of the first page number
    pages.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match="gpufeed.pages: record 0 at byte 0: lists page .*, which "
                                                 "data.mdb .* does not hold; the file is damaged: delete it"):
        get_format("lmdb").reader(str(out / "lmdb" / "val_lmdb"))[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_destination_too_small_for_an_lmdb_is_an_output_error_naming_it(src, tmp_path, ray_local):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(OutputError, match=f"{small}/out/lmdb/val_lmdb: cannot be written \\(No space left on "
                                              f"device\\); {small} \\(tmpfs, memory\\) is full: free space there"):
            convert(options(src, small / "out", splits=("val",), formats=("lmdb",)))
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=True)


def test_a_record_no_format_can_hold_is_skipped_naming_the_input_and_no_remote_url(tmp_path, ray_local):
    """Labels a Caffe Datum cannot hold (several floats into an int32 label): the input is named, --on-error
    applies, and nothing says to check a remote URL for a local destination."""
    import cv2

    root = tmp_path / "imgs"
    root.mkdir()
    cv2.imwrite(str(root / "a.png"), np.full((8, 8, 3), 9, np.uint8))
    cv2.imwrite(str(root / "b.png"), np.full((8, 8, 3), 9, np.uint8))
    (root / "train.lst").write_text("0\t0\ta.png\n1\t1.5\t2.5\tb.png\n")
    summary = convert(options(str(root / "train.lst"), tmp_path / "out", dataset="folder", formats=("lmdb",),
                              workers=1, resize=None))
    assert summary.samples["train"]["written"] == 1
    (origin, reason), = summary.skipped
    assert origin.endswith("b.png") and "remote" not in reason


def test_any_other_failure_converting_one_input_is_an_error_of_that_input():
    """A decoder's or encoder's own exception (here a real one from OpenCV) becomes an input error naming the
    input, so --on-error applies to it; gpufeed's own errors stay what they are."""
    import cv2

    from gpufeed.convert.worker import _input_error
    from gpufeed.errors import OutputError
    from gpufeed.pipelines.base import FileRef, Item

    item = Item("cat/x.png", 0, FileRef("/data/cat/x.png"))
    try:
        cv2.resize(np.zeros((0, 0, 3), np.uint8), (4, 4))
    except cv2.error as e:
        found = _input_error(e, item)
    assert isinstance(found, InputError) and found.path == "/data/cat/x.png"
    assert found.reason.startswith("could not be converted (error: ") and "--on-error skip" in str(found)
    full = OutputError("/out/x: cannot be written (No space left on device)")
    assert _input_error(full, item) is full


def _special_at(path, kind: str) -> str:
    """What a dataset file's name holds instead of the file: a FIFO, a link to a device, a link to nothing."""
    if os.path.lexists(path):
        os.remove(path)
    if kind == "FIFO":
        os.mkfifo(path)
        return "is a FIFO (named pipe), where the dataset's file of that name goes"
    if kind == "device":
        os.symlink("/dev/null", path)
        return "is a character device, where the dataset's file of that name goes"
    os.symlink(str(path) + ".missing", path)
    return "is a link to nothing, where the dataset's file of that name goes"


@pytest.mark.parametrize("kind", ["FIFO", "device", "link to nothing"])
@pytest.mark.parametrize("dataset, name", [("imagenet", "ILSVRC2012_img_val.tar"),
                                           ("imagenet", "LOC_synset_mapping.txt"),
                                           ("ptb", "ptb.valid.txt"), ("cifar10", "data_batch_2")])
def test_a_dataset_file_that_is_no_file_is_named_not_left_out(tmp_path, dataset, name, kind):
    """A file a source looks for or reads by name, present as something that cannot be read: an error naming it,
    never a split or class list left out without a word (a FIFO at ILSVRC2012_img_val.tar converted train alone),
    nor a wait without end (a FIFO among CIFAR's batches)."""
    from gpufeed.errors import InputError
    from gpufeed.pipelines import open_source
    from gpufeed.pipelines.synth import synth_imagenet

    if dataset == "imagenet":
        synth_imagenet(str(tmp_path), classes=2, per_class=2, val_per_class=1, layout="archives", bad_files=False)
        if name == "LOC_synset_mapping.txt":  # the class list then comes from it alone
            os.remove(tmp_path / "ILSVRC2012_devkit_t12.tar.gz")
    elif dataset == "cifar10":
        from gpufeed.pipelines.synth import synth_cifar10

        synth_cifar10(str(tmp_path), per_class=2, test_per_class=1, forms=("python",))
        tmp_path = tmp_path / "cifar-10-batches-py"
    else:
        for split in ("train", "valid", "test"):
            (tmp_path / f"ptb.{split}.txt").write_text(" the cat sat \n")
    says = _special_at(tmp_path / name, kind)
    with pytest.raises(InputError, match=f"{re.escape(str(tmp_path / name))}: {re.escape(says)}"):
        source = open_source(dataset, str(tmp_path))
        for split in source.splits():
            source.items(split)
