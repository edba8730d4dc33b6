"""What the user running gpufeed may not read (no permission): in the source, a class folder, a folder inside one,
the class list, the train tar, the source folder itself; in a conversion's output, a file, a format's folder, the
manifest; and a data file a benchmark reads. Each is an error naming it and saying what to do, never a traceback;
under ``--on-error skip`` a class folder that cannot be listed is left out and listed, and the rest converted. As
root (which reads everything), the commands run without the capabilities that let root read what it may not."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pytest
from test_archive_safety import make_tar, member

JPEG = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb004300080606070605080707070909080a0c140d0c0b0b0c1912130f141d1a1f1e1d"
    "1a1c1c20242e2720222c231c1c2837292c30313434341f27393d38323c2e333432ffc0000b080001000101011100ffc4001f000001050101"
    "0101010100000000000000000102030405060708090a0bffc400b5100002010303020403050504040000017d010203000411051221314106"
    "13516107227114328191a1082342b1c11552d1f02433627282090a161718191a25262728292a3435363738393a434445464748494a535455"
    "565758595a636465666768696a737475767778797a838485868788898a92939495969798999aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7b8b9ba"
    "c2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae1e2e3e4e5e6e7e8e9eaf1f2f3f4f5f6f7f8f9faffda0008010100003f00fbd3ffd9")
CLASSES = [f"n{c:02d}" for c in range(10)]  # more than a task of folders: the conversion's processes walk them


DROP = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps", "-dac_override,-dac_read_search",
        "--"]


def unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None or subprocess.run([*DROP, "true"], capture_output=True).returncode:
        pytest.skip("root reads every file, and setpriv (util-linux), which drops that, is not installed or not "
                    "allowed here")
    return DROP


def gpufeed(*args, privileged: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([*([] if privileged else unprivileged()), sys.executable, "-m", "gpufeed", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def convert(src, out, *extra, privileged: bool = False) -> subprocess.CompletedProcess:
    return gpufeed("convert", "imagenet", src, "--to", "recordio,tfrecord", "--out", out, "--workers", "2",
                   "--no-progress", *extra, privileged=privileged)


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "src"
    for wnid in CLASSES:
        (root / "train" / wnid).mkdir(parents=True)
        for i in range(2):
            (root / "train" / wnid / f"{wnid}_{i}.JPEG").write_bytes(JPEG)
    (root / "LOC_synset_mapping.txt").write_text("".join(f"{w} class {w}\n" for w in CLASSES))
    yield root
    for dirpath, dirs, _ in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), 0o755)


def test_a_class_folder_that_cannot_be_listed(tree, tmp_path):
    os.chmod(tree / "train" / "n03", 0)
    failed = convert(tree, tmp_path / "a")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1] == (
        f"gpufeed: error: {tree}/train/n03: is a folder that cannot be listed (Permission denied); make it readable "
        "by the user running gpufeed (chmod, chown), or leave it out with --on-error skip")
    skipped = convert(tree, tmp_path / "b", "--on-error", "skip")
    assert skipped.returncode == 0, skipped.stderr
    assert f"{tree}/train/n03: is a folder that cannot be listed (Permission denied)" in skipped.stdout
    assert "train: 18 of 18 images written" in skipped.stdout


def test_a_folder_inside_a_class_folder_leaves_the_class_out_under_skip(tree, tmp_path):
    sub = tree / "train" / "n05" / "more"
    sub.mkdir()
    (sub / "x.JPEG").write_bytes(JPEG)
    os.chmod(sub, 0)
    skipped = convert(tree, tmp_path / "b", "--on-error", "skip")
    assert skipped.returncode == 0, skipped.stderr
    assert (f"{sub}: is a folder that cannot be listed (Permission denied); inside {tree}/train/n05, all of which is "
            "left out with it") in skipped.stdout
    assert "train: 18 of 18 images written" in skipped.stdout


def test_a_class_list_that_cannot_be_read(tree, tmp_path):
    os.chmod(tree / "LOC_synset_mapping.txt", 0)
    failed = convert(tree, tmp_path / "a", "--on-error", "skip")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1] == (
        f"gpufeed: error: {tree}/LOC_synset_mapping.txt: cannot be read (Permission denied); make it readable by the "
        "user running gpufeed (chmod, chown), or remove it from the source")


def test_a_train_tar_that_cannot_be_read(tmp_path):
    root = tmp_path / "tars"
    root.mkdir()
    inner = io.BytesIO()
    make_tar(inner, [member("n00_0.JPEG", JPEG)])
    make_tar(root / "ILSVRC2012_img_train.tar", [member("n00.tar", inner.getvalue())])
    os.chmod(root / "ILSVRC2012_img_train.tar", 0)
    failed = convert(root, tmp_path / "a")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1] == (
        f"gpufeed: error: {root}/ILSVRC2012_img_train.tar: cannot be read (Permission denied); make it readable by "
        "the user running gpufeed (chmod, chown), or remove it from the source")


def test_a_source_folder_that_cannot_be_searched_is_named_not_the_file_looked_for_in_it(tree, tmp_path):
    os.chmod(tree, 0o644)  # its names can be listed, nothing in it reached
    try:
        failed = convert(tree, tmp_path / "a")
    finally:
        os.chmod(tree, 0o755)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1].startswith(
        f"gpufeed: error: {tree}: is a folder that cannot be searched (Permission denied); make it readable")


def last_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.stderr.strip().splitlines()[-1]


def test_an_output_that_cannot_be_read(tree, tmp_path):
    out = tmp_path / "out"
    assert convert(tree, out, privileged=True).returncode == 0
    os.chmod(out / "recordio" / "train.rec", 0)
    assert last_line(gpufeed("verify", out)) == (
        f"gpufeed: error: {out}/recordio/train.rec: cannot be read (Permission denied); make it readable by the user "
        "running gpufeed (chmod, chown), then verify again")
    # A benchmark reading it: one line naming it too (whatever command meets a file it may not use).
    assert last_line(gpufeed("bench", "read", out, "--formats", "recordio", "--samples", "8", "--repeats", "1",
                             "--results", tmp_path / "r.jsonl")) == (
        f"gpufeed: error: {out}/recordio/train.rec: Permission denied: the user running gpufeed may not use it; "
        "change its permissions (chmod, chown), or run as a user who may")
    os.chmod(out / "recordio" / "train.rec", 0o644)
    os.chmod(out / "tfrecord", 0)
    try:
        done = gpufeed("verify", out)
    finally:
        os.chmod(out / "tfrecord", 0o755)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    shards = len([f for f in os.listdir(out / "tfrecord")])
    assert done.stderr.splitlines()[0].startswith(f"gpufeed: error: {out}: {shards} of ")
    assert "files cannot be read; make them readable by the user running gpufeed (chmod, chown)" in done.stderr
    before = {p: p.stat().st_size for p in out.rglob("*") if p.is_file()}
    os.chmod(out / "manifest.json", 0)
    assert last_line(gpufeed("clean", out)).startswith(f"gpufeed: error: {out}: ")
    for done in (gpufeed("verify", out), convert(tree, out)):
        assert last_line(done) == (f"gpufeed: error: {out}/manifest.json: cannot be read (Permission denied); make "
                                   "it readable by the user running gpufeed (chmod, chown), then run the command again")
    # Nothing the finished conversion wrote was removed or changed by the runs that could not read its manifest.
    os.chmod(out / "manifest.json", 0o644)
    assert {p: p.stat().st_size for p in out.rglob("*") if p.is_file() and ".gpufeed" not in p.parts} == {
        p: n for p, n in before.items() if ".gpufeed" not in p.parts}
    assert gpufeed("verify", out).returncode == 0
