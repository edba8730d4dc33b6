"""Conversion end to end on real files with a real local Ray: determinism, policies, outputs, verify."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from convert_fixtures import options, tree_bytes
from gpufeed.cli import COMMANDS, build_parser
from gpufeed.convert.engine import convert
from gpufeed.convert.options import ConvertOptions
from gpufeed.pipelines.image_options import ImageOptions
from gpufeed.convert.plan import plan_split
from gpufeed.convert.verify import verify
from gpufeed.errors import (ConfigError, CorruptRecordError, IncompleteOutputError, InputError, OutputError,
                            SourceNotFound)


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory, ray_local):
    """One conversion with 2 workers, shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("ref") / "out"
    summary = convert(options(src, out, workers=2))
    return out, summary


def test_plan_is_a_seeded_permutation_cut_into_contiguous_shards():
    keys = [f"k{i}" for i in range(103)]
    a = plan_split("train", keys, seed=3, shuffle=True, shards=None, shard_size=25)
    b = plan_split("train", keys, seed=3, shuffle=True, shards=None, shard_size=25)
    assert np.array_equal(a.order, b.order) and a.digest == b.digest
    assert sorted(a.order.tolist()) == list(range(103)) and a.order.tolist() != list(range(103))
    assert [(s.start, s.stop) for s in a.shards] == [(0, 25), (25, 51), (51, 77), (77, 103)]
    assert plan_split("val", keys, 3, True, None).order.tolist() != a.order.tolist()
    assert plan_split("train", keys, 3, False, 2).order.tolist() == list(range(103))
    # The digest a journal records (a resume compares it): each key in plan order followed by a NUL, as
    # every journal written so far spelled it; nothing for an empty split.
    spelled = "".join(f"{keys[i]}\0" for i in a.order.tolist()).encode()
    assert a.digest == hashlib.sha256(spelled).hexdigest()
    assert plan_split("train", [], 3, True, None).digest == hashlib.sha256(b"").hexdigest()


def test_options_name_the_valid_values():
    with pytest.raises(ConfigError, match="recordio, lmdb, tfrecord"):
        ConvertOptions("imagenet", "s", ("parquet",), "o")
    with pytest.raises(ConfigError, match="fail, skip"):
        ConvertOptions("imagenet", "s", ("lmdb",), "o", on_error="ignore")
    with pytest.raises(ConfigError, match="--encode pass"):
        ConvertOptions("imagenet", "s", ("lmdb",), "o", image=ImageOptions(encode="pass", resize=256, spelling="cli"))
    with pytest.raises(ConfigError, match="auto, pool, ray"):
        ConvertOptions("imagenet", "s", ("lmdb",), "o", executor="threads")
    with pytest.raises(ConfigError, match="--executor pool .* --address ray://h:10001"):
        ConvertOptions("imagenet", "s", ("lmdb",), "o", executor="pool", address="ray://h:10001")


def test_the_pool_converts_only_where_the_runtime_is_started_here():
    def opts(**kw):
        return ConvertOptions("imagenet", "s", ("lmdb",), "o", **kw)

    assert opts(local_start=True).pool_converts and opts(local_start=True, executor="pool").pool_converts
    assert not opts(local_start=True, executor="ray").pool_converts
    assert not opts(local_start=True, address="h:6379").pool_converts  # a cluster: every shard on Ray
    assert not opts().pool_converts  # the Python API starts no local processes


def test_help_explains_every_option_without_importing_ray():
    code = ("import sys; from gpufeed.cli import build_parser; p = build_parser(); "
            "assert 'ray' not in sys.modules and 'cv2' not in sys.modules, sorted(sys.modules); "
            "p.parse_args(['convert', '--help'])")
    text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for opt in ("--to", "--out", "--workers", "--split", "--resize", "--size", "--max-size", "--center-crop",
                "--encode", "--quality", "--gray", "--normalize", "--shards", "--shuffle", "--seed",
                "--on-error", "--address", "--executor", "--resume", "--dry-run"):
        assert opt in text, opt
    assert "(default: 95)" in text and "(default: fail)" in text


def test_a_subcommand_imports_only_its_own_module():
    code = ("import sys; from gpufeed.cli import build_parser; p = build_parser('convert'); "
            "assert not [m for m in sys.modules if m.startswith(('gpufeed.bench', 'gpufeed.pipelines.synth'))], "
            "sorted(sys.modules); p.parse_args(['convert', 'imagenet', 's', '--to', 'lmdb', '--out', 'o'])")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # The top level still lists every subcommand.
    top = subprocess.run([sys.executable, "-m", "gpufeed", "--help"], capture_output=True, text=True, check=True)
    for name in COMMANDS:
        assert name in top.stdout, name


def test_the_driver_imports_no_crc_package_until_a_crc_is_computed():
    """Importing crc32c reads every installed distribution's metadata (30-170 ms): the driver, which lists and
    commits but computes no CRC, starts without it; the formats import it on first use, with the same results."""
    code = ("import sys; import gpufeed.convert.engine; from gpufeed.formats import FORMATS, format_class; "
            "[format_class(f) for f in FORMATS]; assert 'crc32c' not in sys.modules; "
            "from gpufeed.formats import _crc; first = _crc.crc32c(b'123456789'); assert 'crc32c' in sys.modules; "
            "import crc32c; assert first == crc32c.crc32c(b'123456789') == 0xE3069283; "
            "assert _crc.crc32c is crc32c.crc32c and _crc.function() is crc32c.crc32c; "
            "assert _crc.crc32c(b'6789', _crc.crc32c(b'12345')) == first")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_the_command_ends_with_its_code_after_exit_handlers_and_flushed_output(tmp_path):
    """With Ray loaded the process skips the interpreter's teardown (``leave``): exit handlers still run, the
    buffered output still arrives, and the code is the command's."""
    marker = tmp_path / "handler-ran"
    code = ("import atexit, sys; import ray; "
            f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes')); "
            "from gpufeed.cli import leave; print('summary', end=''); sys.stderr.write('note'); leave(3)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "summary", "note")
    assert marker.read_text() == "yes"


def test_every_command_and_subcommand_prints_its_help():
    import argparse

    def walk(parser, path):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])

    seen = []
    for path, parser in walk(build_parser(), ["gpufeed"]):
        assert parser.format_help(), path  # a stray % in a help string raised here once (gpufeed bench --help)
        seen.append(" ".join(path))
    assert "gpufeed bench feed" in seen and "gpufeed convert" in seen


def test_same_bytes_with_one_and_two_workers(src, reference, tmp_path):
    ref_out, ref = reference
    one = convert(options(src, tmp_path / "one", workers=1))
    assert tree_bytes(tmp_path / "one") == tree_bytes(ref_out)
    assert one.samples == ref.samples
    assert ref.samples["train"]["shards"] > 2  # several fragments were assembled into one .rec


def test_outputs_verify_and_skipped_inputs_are_reported(src, reference):
    out, summary = reference
    report = verify(str(out), workers=1)
    written = summary.samples["train"]["written"]
    assert report.records[("train", "lmdb")] == report.records[("train", "tfrecord")] == written
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["skipped"] and any("truncated" in reason for _, reason in doc["skipped"])
    planned = summary.samples["train"]["planned"]
    assert written == planned - summary.samples["train"]["skipped"]
    assert (out / "recordio" / "train.rec").exists() and (out / "lmdb" / "train_lmdb" / "data.mdb").exists()
    assert sorted(os.listdir(out / "tfrecord"))[0] == "train-00000-of-00005"
    assert not (out / ".gpufeed").exists()
    assert (out / "classes.txt").read_text().count("\n") == 3


def test_skipped_input_leaves_its_index_unused_in_every_format(reference):
    from gpufeed.formats import get_format

    out, summary = reference
    lst = [line.split("\t") for line in (out / "recordio" / "train.lst").read_text().splitlines()]
    indices = [int(f[0]) for f in lst]
    assert indices == sorted(indices) and len(indices) == summary.samples["train"]["written"]
    assert max(indices) == summary.samples["train"]["planned"] - 1 or len(indices) < max(indices) + 1
    lmdb_indices = [s.index for s in get_format("lmdb").reader(str(out / "lmdb" / "train_lmdb"))]
    assert lmdb_indices == indices


def test_fail_policy_names_the_bad_file(src, tmp_path, ray_local):
    with pytest.raises(InputError) as err:
        convert(options(src, tmp_path / "o", on_error="fail", formats=("tfrecord",)))
    assert "truncated" in str(err.value) and ".JPEG" in str(err.value)
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_sharded_recordio_and_normalisation(src, tmp_path, ray_local):
    out = tmp_path / "o"
    convert(options(src, out, formats=("recordio",), shards=2, resize=None, size=(32, 32), normalize=True,
                    splits=("val",)))
    names = sorted(os.listdir(out / "recordio"))
    assert "val-00000-of-00002.rec" in names and "val-00001-of-00002.idx" in names
    stats = json.loads((out / "mean_std.json").read_text())
    assert 0 < stats["mean_r"] < 255 and (out / "mean.binaryproto").exists()
    verify(str(out))


def test_remote_like_destination_builds_lmdb_locally_and_copies_it(src, reference, tmp_path, ray_local):
    ref_out, _ = reference
    out = tmp_path / "remote"
    convert(options(src, f"local://{out}", workers=2))
    assert tree_bytes(out) == tree_bytes(ref_out)
    verify(f"local://{out}")
    with pytest.raises(OutputError, match="nosuchprotocol://x/out: cannot be written"):
        convert(options(src, "nosuchprotocol://x/out"))


def test_a_finished_output_with_other_options_is_replaced_only_with_overwrite(src, tmp_path, ray_local):
    out = tmp_path / "o"
    convert(options(src, out, formats=("tfrecord",), shards=3, splits=("val",)))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"other options \(shards: finished run 3, now 2\).*--overwrite"):
        convert(options(src, out, formats=("tfrecord",), shards=2, splits=("val",)))
    verify(str(out))  # refused before anything changed
    # Values as a user gives them: a list comma-separated, an option left out said so (not "None").
    with pytest.raises(ConfigError, match=r"other options \(splits: finished run val, now not given\)"):
        convert(options(src, out, formats=("tfrecord",), shards=3))
    convert(options(src, out, formats=("tfrecord",), shards=2, splits=("val",), overwrite=True))
    assert (out / "notes.txt").read_text() == "mine"  # not written by gpufeed: never touched
    names = sorted(n for n in os.listdir(out / "tfrecord") if not n.endswith(".idx"))
    assert names == ["val-00000-of-00002", "val-00001-of-00002"]
    verify(str(out))


def test_rerun_of_a_finished_conversion_does_nothing(src, reference):
    out, _ = reference
    again = convert(options(src, out))
    assert "already complete" in again.note


def test_dry_run_writes_nothing(src, tmp_path):
    summary = convert(options(src, tmp_path / "o", dry_run=True))
    assert summary.samples["train"]["planned"] == 24 and not (tmp_path / "o").exists()


def test_the_listing_is_left_out_of_the_collectors_passes_while_the_run_lasts(src, tmp_path):
    """After listing, the driver freezes what the collector tracks (the items live until the run ends and make
    no garbage), and convert() unfreezes it as it returns, also after an error."""
    import gc

    class Phases:
        frozen = []

        def phase(self, text):
            if text.startswith("listed"):
                self.frozen.append(gc.get_freeze_count())

        def __getattr__(self, name):
            return lambda *a, **k: None

    progress = Phases()
    convert(options(src, tmp_path / "o", dry_run=True), progress=progress)
    assert progress.frozen and progress.frozen[0] > 0 and gc.get_freeze_count() == 0
    with pytest.raises(ConfigError):
        convert(options(src, tmp_path / "o", dry_run=True, splits=("nosuch",)), progress=progress)
    assert gc.get_freeze_count() == 0
    # A program that froze objects of its own before calling convert() finds them frozen still, and none of ours.
    host = [[] for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        convert(options(src, tmp_path / "o", dry_run=True), progress=progress)
        # (frozen objects still die by their reference counts: the count may fall, and only falls)
        assert 0 < progress.frozen[-1] <= frozen and 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    del host


def test_verify_catches_a_flipped_byte(reference, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(reference[0], out)
    shard = out / "tfrecord" / "train-00001-of-00005"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(IncompleteOutputError, match="train-00001-of-00005: SHA-256 differs.*; delete it, then rerun the same gpufeed convert command"):
        verify(str(out))
    # With the manifest made to agree, the reader's own CRC check still finds it.
    doc = json.loads((out / "manifest.json").read_text())
    for f in doc["files"]:
        if f["path"] == "tfrecord/train-00001-of-00005":
            f["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (out / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptRecordError, match="train-00001-of-00005"):
        verify(str(out))
    (out / "manifest.json").unlink()
    with pytest.raises(IncompleteOutputError, match="did not finish"):
        verify(str(out))
    # A folder no conversion wrote into is not "a conversion that did not finish".
    (tmp_path / "photos").mkdir()
    with pytest.raises(SourceNotFound, match="photos: a gpufeed convert output .* not found; give the --out"):
        verify(str(tmp_path / "photos"))


def test_verify_checks_the_labels_a_list_file_gives_against_the_records(reference, tmp_path):
    """A file that lists the samples apart from the records (the .lst beside a .rec) must give each label as many
    samples as the records do: read through its format (Format.listed_labels), even where the manifest agrees
    with the file's bytes. A line that is not a list line names the file and the line."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(reference[0], out)
    lst = out / "recordio" / "train.lst"
    lines = lst.read_text().splitlines()
    index, label, name = lines[0].split("\t")
    other = next(ln.split("\t")[1] for ln in lines if ln.split("\t")[1] != label)

    def rewrite(text):  # the list, the sidecar's hash of it, and the manifest's of both, all made to agree
        lst.write_text(text)
        side = out / "recordio" / "train.rec.json"
        layout = json.loads(side.read_text())
        layout["sha256"]["lst"] = hashlib.sha256(text.encode()).hexdigest()
        side.write_text(json.dumps(layout))
        doc = json.loads((out / "manifest.json").read_text())
        for f in doc["files"]:
            if f["path"] in ("recordio/train.lst", "recordio/train.rec.json"):
                data = (out / f["path"]).read_bytes()
                f["sha256"], f["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
        (out / "manifest.json").write_text(json.dumps(doc))

    rewrite("\n".join([f"{index}\t{other}\t{name}", *lines[1:]]) + "\n")
    with pytest.raises(IncompleteOutputError, match=r"the train split's labels differ between \S+ and recordio \.lst"):
        verify(str(out), decode=False)
    for first in (f"{index} {label} {name}", f"{index}\tcat\t{name}"):
        rewrite("\n".join([first, *lines[1:]]) + "\n")
        with pytest.raises(CorruptRecordError, match=r"train\.lst.*line 1 is not index<TAB>label<TAB>path"):
            verify(str(out), decode=False)


def test_verify_lists_every_damaged_file_in_one_pass(reference, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(reference[0], out)
    for name in ("train-00001-of-00005", "train-00003-of-00005"):
        shard = out / "tfrecord" / name
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0x01
        shard.write_bytes(bytes(data))
    (out / "recordio" / "val.idx").unlink()
    for workers in (1, 2):
        with pytest.raises(IncompleteOutputError) as err:
            verify(str(out), workers=workers)
        text = str(err.value)
        assert text.startswith(f"{out}: 3 of ") and "files do not match manifest.json" in text
        assert "recordio/val.idx: missing" in text and text.count("SHA-256 differs") == 2


def test_verify_advice_mends_a_damaged_output_when_followed(src, reference, tmp_path):
    """A file damaged in place keeps its size, so a plain rerun finds the output complete, and a conversion
    never removes a file that changed since it wrote it (--no-resume stops naming it). verify's advice (delete
    it, then rerun the same command) converts it again, and the result is the reference's bytes."""
    import shutil

    from gpufeed.errors import DestinationError

    out = tmp_path / "copy"
    shutil.copytree(reference[0], out)
    shard = out / "tfrecord" / "train-00002-of-00005"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    assert "already complete" in convert(options(src, out)).note
    with pytest.raises(DestinationError, match="train-00002-of-00005: changed since gpufeed wrote it"):
        convert(options(src, out, resume=False))
    assert shard.read_bytes() == bytes(data)
    with pytest.raises(IncompleteOutputError, match="train-00002-of-00005: .*; delete it, then rerun the same "
                                                    "gpufeed convert command"):
        verify(str(out))
    shard.unlink()
    convert(options(src, out))
    verify(str(out))
    assert tree_bytes(out) == tree_bytes(reference[0])


def test_cifar_per_format_defaults_and_ptb_tokens(tmp_path, ray_local):
    from gpufeed.formats import get_format
    from gpufeed.pipelines.synth import synth_cifar10, synth_ptb

    synth_cifar10(str(tmp_path / "cifar"), per_class=4, test_per_class=1, forms=("python",))
    out = tmp_path / "cifar-out"
    convert(ConvertOptions("cifar10", str(tmp_path / "cifar"), ("lmdb", "recordio"), str(out), workers=2,
                           shard_size=15, normalize=True, progress=False))
    # What was checked is said: the PNGs decode (RecordIO), the raw Datums are whole tensors (LMDB).
    said = verify(str(out)).text()
    assert "; 50 images decode; 50 raw pixel records have the stored shape, dtype and finite values" in said
    sample = next(iter(get_format("recordio").reader(str(out / "recordio" / "train.rec"))))
    assert sample.kind == "encoded" and bytes(sample.payload).startswith(b"\x89PNG")  # RecordIO's CIFAR: PNG
    datum = next(iter(get_format("lmdb").reader(str(out / "lmdb" / "train_lmdb"))))
    assert datum.kind == "raw" and datum.payload.shape == (32, 32, 3)  # Caffe's: raw pixel Datums
    assert (out / "mean.binaryproto").exists()

    synth_ptb(str(tmp_path / "ptb"), train_tokens=2000, vocab=100)
    out = tmp_path / "ptb-out"
    convert(ConvertOptions("ptb", str(tmp_path / "ptb"), ("tfrecord", "lmdb"), str(out), workers=2,
                           shard_size=20, seq_len=10, progress=False))
    assert "images" not in verify(str(out)).text()  # token records: nothing is an image
    reader = get_format("lmdb").reader(str(out / "lmdb" / "train_lmdb"))
    first, second = reader[0], reader[1]
    assert first.kind == "tokens" and len(first.payload) == 11
    # Windows keep stream order (no shuffle for language models): each starts where the last ended.
    assert first.payload[-1] == second.payload[0]
    assert (out / "vocab.txt").exists()


def test_label_offset_gives_tensorflow_labels_in_tfrecord_only(src, tmp_path, ray_local):
    """--label-offset 1: TFRecord stores TensorFlow's 1..1000 convention; RecordIO and LMDB stay 0-based,
    and every reader gives the same 0-based class index back."""
    from gpufeed.formats import get_format
    from tfrecord import example_pb2

    out = tmp_path / "o"
    convert(options(src, out, formats=("tfrecord", "recordio"), splits=("val",), label_offset=1))
    shard = [p for p in sorted((out / "tfrecord").glob("val-*")) if not p.suffix][0]
    raw = next(iter(get_format("tfrecord").reader(str(shard)).iter_raw()))
    ex = example_pb2.Example()
    ex.ParseFromString(bytes(raw))
    stored = ex.features.feature["image/class/label"].int64_list.value[0]
    first = next(iter(get_format("tfrecord").reader(str(shard))))
    assert stored == first.label + 1
    rec = {s.index: s.label for s in get_format("recordio").reader(str(out / "recordio" / "val.rec"))}
    assert rec[first.index] == first.label
    verify(str(out))
    with pytest.raises(ConfigError, match="label-offset"):
        options(src, out, formats=("recordio",), label_offset=1)


@pytest.mark.parametrize("n, shard_size, shards", [
    (1204, None, 12),    # a small split still shared by several workers (it was one shard of 1,204)
    (50, None, 1),       # too few samples for shards of 100
    (50_000, None, 32),  # ImageNet val: ~1,250 a shard, a power of two
    (300_000, None, 256),  # 4 whole waves on 64 workers, where 240 shards made 3.75
    (1_281_167, None, 1024),  # TensorFlow's ImageNet layout: 1,024 train shards
    (20_000, None, 16),
    (1204, 1250, 1),     # a size the user gives is kept
])
def test_default_shards_come_from_the_split_alone(n, shard_size, shards):
    from gpufeed.convert.plan import default_shards, plan_split

    assert default_shards(n, shard_size) == shards
    assert len(plan_split("train", [str(i) for i in range(n)], 0, False, None, shard_size).shards) == shards


def test_a_tapered_plan_cuts_the_last_eighth_four_times_finer():
    """Where no shard is a file, the last shards are finer: the first 7/8 of the shards are those of the equal
    plan, the rest of the split is cut into four times as many; every position in one shard, in order."""
    from gpufeed.convert.plan import TAPER_MIN_SHARDS, plan_split, shard_bounds

    n = 300_000
    equal, tapered = shard_bounds(n, 1024), shard_bounds(n, 1024, taper=True)
    assert len(tapered) == 896 + 128 * 4
    assert tapered[:896] == equal[:896]
    assert [a for a, _ in tapered[1:]] == [b for _, b in tapered[:-1]] and (tapered[0][0], tapered[-1][1]) == (0, n)
    assert {b - a for a, b in tapered[896:]} == {73, 74}  # a quarter of ~293
    few = plan_split("train", [str(i) for i in range(5000)], 0, False, TAPER_MIN_SHARDS - 1, taper=True)
    assert [(sp.start, sp.stop) for sp in few.shards] == shard_bounds(5000, TAPER_MIN_SHARDS - 1)
    assert few.tapered_from is None
    # Recorded wherever the taper was applied, also where it leaves the count as it was (one sample a shard).
    assert plan_split("train", [str(i) for i in range(64)], 0, False, 64, taper=True).tapered_from == 64
    plan = plan_split("train", [str(i) for i in range(n)], 0, True, None, per_shard=312, taper=True)
    assert (len(plan.shards), plan.tapered_from, plan.shards[-1].count) == (1408, 1024, 1408)
    assert plan_split("train", [str(i) for i in range(n)], 0, True, None, per_shard=312).tapered_from is None


def test_a_second_split_joins_a_finished_destination(src, tmp_path, ray_local):
    """`--split train`, then `--split val` into the same --out: the second run adds its split, leaving the first's
    files as they are; the destination is then what one run of both splits writes, and verifies whole."""
    both = tmp_path / "both"
    convert(options(src, both, formats=("recordio", "tfrecord")))
    out = tmp_path / "o"
    convert(options(src, out, formats=("recordio", "tfrecord"), splits=("train",)))
    convert(options(src, out, formats=("recordio", "tfrecord"), splits=("val",)))
    assert tree_bytes(out) == tree_bytes(both)
    report = verify(str(out))
    assert {s for s, _ in report.records} == {"train", "val"}
    doc = json.loads((out / "manifest.json").read_text())
    assert set(doc["splits"]) == {"train", "val"} and set(doc["split_sources"]) == {"train", "val"}
    note = convert(options(src, out, formats=("recordio", "tfrecord"), splits=("train",))).note
    assert "already complete" in note


def test_idle_worker_seconds_split_into_ramp_middle_and_last_wave():
    """Where workers had no shard: two workers; one shard from 0 to 4, one from 1 to 3 (so one worker waits for
    its first second), one from 3 to 5 (the last to start: after 4 one worker has nothing left)."""
    from gpufeed.convert.engine import idle_worker_seconds

    events = [{"started": 0.0, "seconds": 4.0}, {"started": 1.0, "seconds": 2.0}, {"started": 3.0, "seconds": 2.0}]
    assert idle_worker_seconds(events, 2) == {"idle_worker_s_ramp": 1.0, "idle_worker_s_middle": 0.0,
                                              "idle_worker_s_last_wave": 1.0}
    # A gap between shards in the middle counts there; a resumed run's earlier shards (no timing) count nowhere.
    events = [{"started": 0.0, "seconds": 2.0}, {"started": 0.0, "seconds": 1.0}, {"started": 1.5, "seconds": 2.0},
              {"started": 2.0, "seconds": 1.0}, {"shard": 9}]
    assert idle_worker_seconds(events, 2) == {"idle_worker_s_ramp": 0.0, "idle_worker_s_middle": 0.5,
                                              "idle_worker_s_last_wave": 0.5}
    assert idle_worker_seconds([], 4) == {}


def test_shard_seconds_spread_says_how_ragged_the_last_wave_is():
    from gpufeed.convert.engine import shard_seconds_spread

    events = [{"shard": i, "started": 10.0 + i, "seconds": s, "cpu_seconds": s * 0.9}
              for i, s in enumerate((4.0, 4.2, 4.1, 4.3, 6.0, 4.0, 4.4, 4.1, 4.2, 4.5))]
    events[4]["run_queue_seconds"] = 1.5
    events.append({"shard": 3})  # resumed: no timing
    # and of the longest: which, when after the first shard's start, its CPU and its wait for a core
    assert shard_seconds_spread(events) == {"shard_s_p50": 4.2, "shard_s_p90": 6.0, "shard_s_max": 6.0,
                                            "shard_s_max_shard": 4, "shard_s_max_started": 4.0,
                                            "shard_s_max_cpu": 5.4, "shard_s_max_run_queue": 1.5}
    assert shard_seconds_spread([]) == {}


def test_work_is_cut_finer_where_no_shard_is_a_file_and_the_bytes_do_not_change(tmp_path, monkeypatch):
    """RecordIO alone (one .rec per split) is appended shard after shard: its default shards are a quarter of
    the usual size and its last ones finer still (a shorter last wave), and its bytes are those of the usual
    shards. With a format whose shards are files (TFRecord) or commits (LMDB), or shards the user sized, the
    usual equal shards."""
    from gpufeed.convert import plan as plan_mod
    from gpufeed.convert.options import ASSEMBLED_SAMPLES_PER_SHARD, SAMPLES_PER_SHARD

    def opts(formats, out, **kw):
        return ConvertOptions("synthetic", "cifar:3000", formats, str(tmp_path / out), workers=2, progress=False, **kw)

    assert opts(("recordio",), "a").default_shard_samples == ASSEMBLED_SAMPLES_PER_SHARD == SAMPLES_PER_SHARD // 4
    assert opts(("recordio",), "a").tapers
    for formats in (("recordio", "lmdb"), ("recordio", "tfrecord"), ("lmdb",)):
        assert opts(formats, "a").default_shard_samples == SAMPLES_PER_SHARD and not opts(formats, "a").tapers
    for given in ({"shards": 4}, {"shard_size": 100}, {"shard_bytes": 10 ** 6}):
        assert not opts(("recordio",), "a", **given).tapers  # shards the user sized are kept as asked
    fine = convert(opts(("recordio",), "fine", local_start=True, executor="pool"))
    coarse = convert(opts(("recordio",), "coarse", local_start=True, executor="pool", shard_size=SAMPLES_PER_SHARD))
    assert (fine.samples["train"]["shards"], coarse.samples["train"]["shards"]) == (16, 2)
    assert tree_bytes(tmp_path / "fine") == tree_bytes(tmp_path / "coarse")
    with monkeypatch.context() as m:  # a split of 16 shards tapered: 14 of them, then the rest in 8
        m.setattr(plan_mod, "TAPER_MIN_SHARDS", 16)
        tapered = convert(opts(("recordio",), "tapered", local_start=True, executor="pool"))
    assert tapered.samples["train"]["shards"] == 22
    assert tree_bytes(tmp_path / "tapered") == tree_bytes(tmp_path / "coarse")


def test_a_shard_line_is_synced_on_its_own_only_where_it_names_files_outside_the_spools(tmp_path):
    """A converted shard's journal line waits for the next commit's flush where it names only spools for the
    split outputs (lost with them in a crash of the machine: the shard is redone); one that names a file of its
    own in DST (a TFRecord shard) or statistics saved beside it is synced as it is written."""
    from gpufeed.convert import sinks
    from gpufeed.convert.engine import shard_line_durable

    spool_dir = str(tmp_path / "spools")
    spool = {"path": sinks.spool_path(spool_dir, "train", "recordio", 3), "role": "spool", "bytes": 10}
    lmdb = {"path": sinks.spool_path(spool_dir, "train", "lmdb", 3), "role": "spool", "bytes": 10}
    shard = {"path": str(tmp_path / "dst" / "tfrecord" / "train-00003-of-00008"), "role": "data", "bytes": 10}
    assert not shard_line_durable({"files": [spool, lmdb]}, spool_dir, has_stats=False)
    assert shard_line_durable({"files": [spool, lmdb]}, spool_dir, has_stats=True)
    assert shard_line_durable({"files": [spool, shard]}, spool_dir, has_stats=False)
    assert shard_line_durable({"files": [shard]}, spool_dir, has_stats=False)


def test_the_commit_window_narrows_where_memory_holds_the_spools_only_then(tmp_path):
    """The window bounds the shards whose spools exist at once: memory that holds spools for 2 shards a worker
    and not for 3 keeps them in memory at 2, rather than writing them to the disk at 3; where it holds neither,
    they go to the destination's state folder at 3 (this machine's own /dev/shm, sized by its free space)."""
    from gpufeed.convert.engine import MIN_WINDOW_PER_WORKER, WINDOW_PER_WORKER, memory_spools_and_window
    from gpufeed.convert.sinks import MEMORY_ROOT, memory_spool_dir, remove_memory_spools

    if not os.path.isdir(MEMORY_ROOT):
        pytest.skip(f"no {MEMORY_ROOT} here")
    fs = os.statvfs(MEMORY_ROOT)
    room = fs.f_bavail * fs.f_frsize
    out = str(tmp_path / "dst")
    workers, per_shard = 4, 100
    # Room for each sample's spool twice over: sized so that 2.5 shards a worker fill it.
    sample = int(room / (2 * 2.5 * workers * per_shard))
    try:
        assert memory_spools_and_window(out, workers, per_shard, 1, sample // 2) == (memory_spool_dir(out),
                                                                                     WINDOW_PER_WORKER)
        assert memory_spools_and_window(out, workers, per_shard, 1, sample) == (memory_spool_dir(out),
                                                                                MIN_WINDOW_PER_WORKER)
        assert memory_spools_and_window(out, workers, per_shard, 1, sample * 2) == (None, WINDOW_PER_WORKER)
    finally:
        remove_memory_spools(out)
