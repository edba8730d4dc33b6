"""Never mix, never hang: concurrent runs, changed inputs, finished outputs, special files, damaged sources.

Each case runs the real engine (a real local Ray, real files, real processes) and checks the promise: a
clear error naming the file and the fix, exit code 2 from the CLI, nothing lost, nothing silently mixed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import pathlib
import shutil
import signal
import time

import pytest

from convert_fixtures import StopAfter, cli, cli_args, options, tree_bytes, wait_for_shards
from gpufeed.convert.engine import convert
from gpufeed.convert.progress import Progress
from gpufeed.convert.verify import verify
from gpufeed.errors import ConfigError, InputError, SourceNotFound


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_second_run_into_the_same_destination_is_refused_before_it_deletes_anything(src, address, tmp_path):
    out = str(tmp_path / "out")
    args = cli_args(src, out, "--workers", "1", "--shard-size", "1")
    first = cli(args, address)
    wait_for_shards(first, out, 1)
    assert first.poll() is None, first.communicate()
    first.send_signal(signal.SIGSTOP)  # mid-run, holding the destination (as a slow run would)
    deadline = time.time() + 30
    while _state(first.pid) != "T" and time.time() < deadline:  # stopped, not just signalled
        time.sleep(0.01)
    try:
        journal = open(os.path.join(out, ".gpufeed", "journal.jsonl"), "rb").read()
        for extra in ([], ["--no-resume"], ["--overwrite"]):
            second = cli([*args, *extra], address)
            _, err = second.communicate(timeout=120)
            assert second.returncode == 2, err.decode()
            assert "another gpufeed convert is writing this destination" in err.decode()
            with open(os.path.join(out, ".gpufeed", "journal.jsonl"), "rb") as f:
                assert f.read() == journal  # nothing deleted, nothing written
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err.decode()
    verify(out)
    assert not os.path.exists(out + "/.gpufeed.lock")  # the lock file goes with the run


def _shard_inputs(out, opts, split):
    """The inputs of each shard of ``split``, split by whether the journal in ``out`` has it converted:
    ``(converted, not converted)``, lists of items (the plan recomputed as the engine makes it)."""
    from gpufeed.convert.plan import plan_split
    from gpufeed.pipelines import open_source

    items = open_source(opts.dataset, opts.source_root, **opts.source_options()).items(split)
    plan = plan_split(split, [it.key for it in items], opts.seed, opts.effective_shuffle, None, opts.shard_size)
    with open(os.path.join(out, ".gpufeed", "journal.jsonl")) as f:
        events = [json.loads(line) for line in f]
    done = {e["shard"] for e in events if e["event"] == "shard" and e["split"] == split}
    shards = [[items[i] for i in plan.order[sp.start:sp.stop]] for sp in plan.shards]
    return ([it for k, sh in enumerate(shards) if k in done for it in sh],
            [it for k, sh in enumerate(shards) if k not in done for it in sh])


def test_a_replaced_input_is_noticed_on_resume_and_named(src, tmp_path):
    source = tmp_path / "imagenet"
    shutil.copytree(src, source)
    out = tmp_path / "out"
    opts = options(source, out, workers=1, splits=("train",), shard_size=2)
    with pytest.raises(KeyboardInterrupt):
        convert(opts, StopAfter(2))
    converted, _ = _shard_inputs(out, opts, "train")
    victim = pathlib.Path(converted[0].ref.url)
    other = next(p for p in sorted((source / "train").rglob("*.JPEG")) if p != victim)
    victim.write_bytes(other.read_bytes())  # same name, other bytes
    with pytest.raises(ConfigError, match=r"inputs of the train split changed since this conversion started \(a "
                                          r"file replaced, or a label changed\) in 1 converted shard\(s\): "
                                          r"train-\d+: inputs .*--no-resume") as err:
        convert(opts)
    shard_inputs = str(err.value).split(": inputs ")[1].split(";")[0]
    assert victim.name in shard_inputs or " .. " in shard_inputs  # the shard's first and last input
    convert(options(source, out, workers=1, splits=("train",), shard_size=2, resume=False))
    verify(str(out))


def test_a_resume_keeps_the_shards_its_conversion_was_planned_in(src, tmp_path, monkeypatch):
    """A conversion started by a gpufeed whose default shard count differs (here: shards of 2 samples) resumes,
    with the same options, in the shards it was planned in: the output is byte for byte what that gpufeed
    makes in one run."""
    from gpufeed.convert import plan as plan_mod

    out = tmp_path / "out"
    opts = options(src, out, workers=1, splits=("train",), formats=("tfrecord", "recordio"), shard_size=None)
    with monkeypatch.context() as m:  # the earlier default
        m.setattr(plan_mod, "MIN_SHARD_SAMPLES", 2)
        with pytest.raises(KeyboardInterrupt):
            convert(opts, StopAfter(2))
    planned = next(json.loads(line)["shards"] for line in open(out / ".gpufeed" / "journal.jsonl")
                   if json.loads(line)["event"] == "plan")
    assert planned > 2 and plan_mod.default_shards(len(options_items(opts))) != planned
    convert(opts)
    verify(str(out))
    fresh = tmp_path / "fresh"
    with monkeypatch.context() as m:  # the whole conversion, uninterrupted, by the earlier default
        m.setattr(plan_mod, "MIN_SHARD_SAMPLES", 2)
        convert(dataclasses.replace(opts, out=str(fresh)))
    assert tree_bytes(out) == tree_bytes(fresh)


@pytest.mark.parametrize("first, then", [(10 ** 9, 4), (4, 10 ** 9)], ids=["equal-then-tapering", "tapered-then-not"])
def test_a_resume_keeps_the_taper_its_conversion_was_planned_with(src, tmp_path, monkeypatch, first, then):
    """A RecordIO conversion started with equal shards (a gpufeed from before the taper) resumes in those by a
    gpufeed that tapers, and one started tapered resumes tapered where the split would now not be: the journal's
    plan says which, and the output is byte for byte one uninterrupted run's."""
    from gpufeed.convert import plan as plan_mod

    out = tmp_path / "out"
    opts = options(src, out, workers=1, splits=("train",), formats=("recordio",), shard_size=None)
    with monkeypatch.context() as m:
        m.setattr(plan_mod, "MIN_SHARD_SAMPLES", 1)
        m.setattr(plan_mod, "TAPER_MIN_SHARDS", first)
        with pytest.raises(KeyboardInterrupt):
            convert(opts, StopAfter(2))
        plan = next(e for e in map(json.loads, open(out / ".gpufeed" / "journal.jsonl")) if e["event"] == "plan")
        m.setattr(plan_mod, "TAPER_MIN_SHARDS", then)
        resumed = convert(opts)
    assert ("tapered_from" in plan) == (first == 4)
    assert resumed.samples["train"]["shards"] == plan["shards"]
    verify(str(out))
    fresh = tmp_path / "fresh"
    convert(options(src, fresh, workers=1, splits=("train",), formats=("recordio",), shard_size=1))
    assert tree_bytes(out) == tree_bytes(fresh)


def test_a_journal_an_older_gpufeed_started_resumes_with_equal_shards_and_a_newer_ones_is_refused(src, tmp_path,
                                                                                                   monkeypatch):
    """A version 3 journal (before the taper) that planned nothing yet: its splits are cut into equal shards, as
    the gpufeed that started it reads them, and the output is one uninterrupted run's. A journal of a version this
    gpufeed does not know is refused with both versions named, the destination left as it was."""
    from gpufeed.convert import plan as plan_mod
    from gpufeed.convert.state import JOURNAL, JOURNAL_VERSION, state_dir_for

    def started_by(version, out):
        opts = options(src, out, workers=1, splits=("train",), formats=("recordio",), shard_size=None)
        os.makedirs(state_dir_for(str(out)))
        with open(os.path.join(state_dir_for(str(out)), JOURNAL), "w") as f:
            f.write(json.dumps({"event": "start", "version": version, "options": opts.output_key()}) + "\n")
        return opts

    opts = started_by(3, tmp_path / "out")
    with monkeypatch.context() as m:
        m.setattr(plan_mod, "MIN_SHARD_SAMPLES", 1)
        m.setattr(plan_mod, "TAPER_MIN_SHARDS", 4)
        assert plan_mod.plan_split("train", [str(i) for i in range(24)], 0, True, 16, taper=True).tapered_from == 16
        summary = convert(opts)
    assert summary.samples["train"]["shards"] == 16  # equal shards: tapered, this split makes 17
    verify(str(tmp_path / "out"))
    fresh = tmp_path / "fresh"
    convert(options(src, fresh, workers=1, splits=("train",), formats=("recordio",), shard_size=1))
    assert tree_bytes(tmp_path / "out") == tree_bytes(fresh)

    opts = started_by(JOURNAL_VERSION + 1, tmp_path / "newer")
    journal = (tmp_path / "newer" / ".gpufeed" / JOURNAL).read_bytes()
    with pytest.raises(ConfigError, match=f"journal version {JOURNAL_VERSION + 1}, now {JOURNAL_VERSION}"):
        convert(opts)
    assert (tmp_path / "newer" / ".gpufeed" / JOURNAL).read_bytes() == journal


def options_items(opts):
    from gpufeed.pipelines import open_source

    return open_source(opts.dataset, opts.src).items("train")


def test_an_input_replaced_before_its_shard_converts_is_taken_as_it_is_now(src, tmp_path):
    """Only converted shards bind a resume to their inputs: one not converted yet reads its files then."""
    source = tmp_path / "imagenet"
    shutil.copytree(src, source)
    out = tmp_path / "out"
    opts = options(source, out, workers=1, splits=("train",), shard_size=2, formats=("tfrecord",))
    with pytest.raises(KeyboardInterrupt):
        convert(opts, StopAfter(2))
    _, pending = _shard_inputs(out, opts, "train")
    victim = pathlib.Path(pending[0].ref.url)
    other = next(p for p in sorted((source / "train").rglob("*.JPEG")) if p != victim)
    victim.write_bytes(other.read_bytes())
    convert(opts)
    verify(str(out))
    fresh = tmp_path / "fresh"
    convert(options(source, fresh, workers=1, splits=("train",), shard_size=2, formats=("tfrecord",)))
    assert tree_bytes(out) == tree_bytes(fresh)  # the resumed output is that of the inputs as they are now


def test_a_changed_label_is_noticed_on_resume(tmp_path, ray_local):
    from gpufeed.pipelines.synth import synth_imagenet

    source = tmp_path / "imagenet"
    synth_imagenet(str(source), classes=3, per_class=2, val_per_class=3, seed=3, layout="tree", bad_files=False)
    out = tmp_path / "out"
    opts = options(source, out, workers=1, splits=("val",), shard_size=2)
    with pytest.raises(KeyboardInterrupt):
        convert(opts, StopAfter(1))
    converted, _ = _shard_inputs(out, opts, "val")
    truth = next(source.rglob("ILSVRC2012_validation_ground_truth.txt"))
    lines = truth.read_text().splitlines()
    # Ground truth line k is the label of ILSVRC2012_val_{k+1:08d}.JPEG.
    k = int(pathlib.Path(converted[0].ref.url).stem.rsplit("_", 1)[1]) - 1
    lines[k] = "1" if lines[k] != "1" else "2"
    truth.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="a label changed"):
        convert(opts)


def test_a_manifest_gpufeed_did_not_write_is_never_overwritten(src, tmp_path, ray_local):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"model": "mine"}))
    for extra in ({}, {"overwrite": True}, {"resume": False}):
        with pytest.raises(ConfigError, match="manifest.json was not written by gpufeed"):
            convert(options(src, out, splits=("val",), **extra))
    assert json.loads((out / "manifest.json").read_text()) == {"model": "mine"}


def test_a_finished_output_that_lost_a_file_is_converted_again(src, tmp_path, ray_local):
    out = tmp_path / "out"
    convert(options(src, out, splits=("val",), formats=("tfrecord",)))
    before = tree_bytes(out)
    lost = sorted((out / "tfrecord").iterdir())[0]
    lost.unlink()
    again = convert(options(src, out, splits=("val",), formats=("tfrecord",)))
    assert "already complete" not in again.note
    assert tree_bytes(out) == before
    verify(str(out))


@pytest.fixture
def special_folder(tmp_path, src):
    """An image folder whose class holds a good JPEG and every kind of input that must not be read."""
    root = tmp_path / "folder"
    cat = root / "cat"
    cat.mkdir(parents=True)
    jpeg = sorted((pathlib.Path(src) / "train").rglob("*.JPEG"))[0]
    shutil.copy(jpeg, cat / "good.JPEG")
    os.mkfifo(cat / "fifo.JPEG")
    (cat / "zero.JPEG").symlink_to("/dev/zero")
    (cat / "dangling.JPEG").symlink_to(tmp_path / "nowhere.JPEG")
    (cat / "loop1.JPEG").symlink_to(cat / "loop2.JPEG")
    (cat / "loop2.JPEG").symlink_to(cat / "loop1.JPEG")
    return root


def test_special_inputs_are_input_errors_skipped_and_listed(special_folder, tmp_path, ray_local):
    out = tmp_path / "out"
    summary = convert(options(special_folder, out, dataset="folder", formats=("recordio",), workers=1))
    assert summary.samples["train"]["written"] == 1
    reasons = {os.path.basename(origin): reason for origin, reason in summary.skipped}
    assert "FIFO" in reasons["fifo.JPEG"] and "character device" in reasons["zero.JPEG"]
    assert "link to nothing" in reasons["dangling.JPEG"]
    assert "symbolic links" in reasons["loop1.JPEG"] and "symbolic links" in reasons["loop2.JPEG"]
    # A reason is what is wrong: the summary names the input beside it, and the fix (--on-error skip) is taken.
    assert not any("JPEG" in r or "--on-error" in r for r in reasons.values()), reasons
    verify(str(out))


@pytest.mark.parametrize("name,error,text", [("fifo.JPEG", InputError, "is a FIFO"),
                                              ("zero.JPEG", InputError, "is a character device"),
                                              ("dangling.JPEG", SourceNotFound, "link to nothing")])
def test_a_special_input_stops_a_run_naming_it_and_the_fix(special_folder, tmp_path, ray_local, name, error, text):
    cat = special_folder / "cat"
    for other in cat.iterdir():
        if other.name not in (name, "good.JPEG"):
            other.unlink()
    with pytest.raises(error, match=rf"{name}: .*{text}.*--on-error skip"):
        convert(options(special_folder, tmp_path / "out", dataset="folder", formats=("tfrecord",), workers=1,
                        on_error="fail"))


def test_an_input_deleted_mid_run_is_an_input_error(src, tmp_path, ray_local):
    source = tmp_path / "imagenet"
    shutil.copytree(src, source)
    victim = sorted((source / "val").rglob("*.JPEG"))[-1]

    class DeleteAfterFirstShard(Progress):
        def update(self, samples, nbytes):
            if victim.exists():
                victim.unlink()

    summary = convert(options(source, tmp_path / "out", splits=("val",), workers=1, shard_size=1,
                              shuffle=False), DeleteAfterFirstShard(enabled=False))
    assert any(o == str(victim) and "not found" in r for o, r in summary.skipped), summary.skipped


def test_incomplete_cifar_is_an_error_unless_allowed(tmp_path, ray_local):
    from gpufeed.pipelines.synth import synth_cifar10

    src = tmp_path / "c"
    synth_cifar10(str(src), per_class=2, test_per_class=1, forms=("python",))  # 4 images per train batch
    batch = next(src.rglob("data_batch_5"))
    batch.unlink()
    base = dict(dataset="cifar10", formats=("tfrecord",), workers=1)
    with pytest.raises(SourceNotFound, match=r"data_batch_5 \(the cifar10 train split has 5 batch files; 4 are here"):
        convert(options(src, tmp_path / "o1", **base))
    summary = convert(options(src, tmp_path / "o2", allow_incomplete=True, **base))
    assert summary.samples["train"]["written"] == 16
    assert any("missing data_batch_5" in reason for _, reason in summary.skipped)


def test_a_read_only_destination_is_an_output_error_naming_it(src, tmp_path, ray_local):
    import subprocess

    out = tmp_path / "ro"
    out.mkdir()
    convert(options(src, out, splits=("val",), formats=("tfrecord",)))
    if subprocess.run(["mount", "--bind", "-o", "ro", str(out), str(out)], capture_output=True).returncode:
        pytest.skip("this machine does not allow a read-only bind mount here")
    try:
        from gpufeed.errors import OutputError

        with pytest.raises(OutputError, match=r"ro/\.gpufeed\.lock: cannot create .*Read-only file system.*"
                                              r"ro is writable, or choose another destination"):
            convert(options(src, out, splits=("val",), formats=("tfrecord",), resume=False))
        verify(str(out))  # the finished output is still whole
    finally:
        subprocess.run(["umount", str(out)], check=True)


def _edited_in_place_after_a_stop(src, tmp_path, strict: bool):
    """A run of a copy of ``src`` stopped after two shards, then one input of a converted shard edited in place:
    the same inode, size and (``os.utime``) modification time. Returns the run's options."""
    source = tmp_path / "imagenet"
    shutil.copytree(src, source)
    opts = options(source, tmp_path / "out", workers=1, splits=("train",), shard_size=2, strict=strict)
    with pytest.raises(KeyboardInterrupt):
        convert(opts, StopAfter(2))
    converted, _ = _shard_inputs(tmp_path / "out", opts, "train")
    victim = pathlib.Path(converted[-1].ref.url)
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # inside the JPEG's entropy-coded data, before its end marker
    time.sleep(0.01)
    with open(victim, "r+b") as f:  # in place: same inode and size
        f.write(data)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same modification time
    now = victim.stat()
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    return opts


def test_strict_notices_an_edit_that_keeps_size_mtime_and_inode(src, tmp_path, ray_local):
    opts = _edited_in_place_after_a_stop(src, tmp_path, strict=True)
    with pytest.raises(ConfigError, match="this conversion started with --strict"):
        convert(dataclasses.replace(opts, strict=False))
    with pytest.raises(ConfigError, match=r"inputs of the train split changed .* in 1 converted shard\(s\)"):
        convert(opts)


def test_an_edit_that_keeps_size_mtime_and_inode_is_noticed_without_strict(src, tmp_path, ray_local):
    """The change time moves on any write, whatever the writer does to the modification time."""
    opts = _edited_in_place_after_a_stop(src, tmp_path, strict=False)
    with pytest.raises(ConfigError, match=r"inputs of the train split changed .* in 1 converted shard\(s\)"):
        convert(opts)


def test_remote_inputs_are_identified_by_their_listing(tmp_path):
    """A remote (fsspec) file's identity comes from its directory's listing: one request per directory."""
    import fsspec

    from gpufeed.convert.identity import identities
    from gpufeed.pipelines.base import FileRef, Item

    fs = fsspec.filesystem("memory")
    fs.pipe({"/gpufeed-test-remote/a/1.JPEG": b"one", "/gpufeed-test-remote/a/2.JPEG": b"two"})
    items = [Item(f"a/{i}.JPEG", 0, FileRef(f"memory://gpufeed-test-remote/a/{i}.JPEG")) for i in (1, 2)]
    before = identities(items)
    assert all(b"size=" in x for x in before)
    fs.pipe({"/gpufeed-test-remote/a/2.JPEG": b"two, longer"})
    after = identities(items)
    assert after[0] == before[0] and after[1] != before[1]
    fs.rm("/gpufeed-test-remote", recursive=True)


def test_arguments_that_cannot_apply_are_refused(src, tmp_path):
    from gpufeed.convert.options import ConvertOptions
    from gpufeed.pipelines.image_options import ImageOptions

    with pytest.raises(ConfigError, match="--out .* is inside the source"):
        options(src, os.path.join(src, "out"))
    with pytest.raises(ConfigError, match="--resize transform images; Penn Treebank is text"):
        ConvertOptions(dataset="ptb", src=str(tmp_path), formats=("tfrecord",), out=str(tmp_path / "o"),
                       image=ImageOptions(resize=256, encode=None))


class Started(Progress):
    """Records how many samples a run found already done when it started."""

    def __init__(self):
        super().__init__(enabled=False)
        self.already = None

    def start(self, total, already, unit="img"):
        super().start(total, already, unit)
        self.already = already


def test_the_same_source_spelled_otherwise_resumes_and_finds_its_finished_output(src, tmp_path, monkeypatch,
                                                                                  ray_local):
    """Relative or absolute, through a symlink, with a trailing slash: one source, one destination; a resume
    goes on (not "a partial conversion made with other options") and a rerun finds the output complete."""
    monkeypatch.chdir(tmp_path)
    os.symlink(src, tmp_path / "data")
    with pytest.raises(KeyboardInterrupt):
        convert(options("data/", "out"), StopAfter(2))
    resumed = Started()
    convert(options(os.path.realpath(src), tmp_path / "out"), resumed)
    assert resumed.already > 0
    verify(str(tmp_path / "out"))
    again = convert(options(str(tmp_path / "data"), "./out/"))
    assert "already complete" in again.note
    # A manifest from before paths were kept canonical names them as typed, and the destination too.
    doc = json.loads((tmp_path / "out" / "manifest.json").read_text())
    doc["output_options"].update(src="data/", out="out")
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(doc))
    assert "already complete" in convert(options(os.path.realpath(src), tmp_path / "out")).note


def test_a_destination_that_is_a_file_or_under_one_is_refused_naming_it(src, tmp_path, ray_local):
    from gpufeed.errors import OutputError

    taken = tmp_path / "taken"
    taken.write_bytes(b"a user's file")
    with pytest.raises(ConfigError, match=f"--out {taken} is a file; the destination is a folder"):
        options(src, str(taken))
    with pytest.raises(OutputError, match=f"{taken}/out: cannot be created \\(Not a directory\\); choose another destination"):
        convert(options(src, str(taken / "out")))
    assert taken.read_bytes() == b"a user's file"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=re.escape(f"--out {fifo} is a FIFO (named pipe); the destination is a folder")):
        options(src, str(fifo))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_fresh_run_clears_what_its_journal_proves_and_refuses_the_rest(tmp_path, where):
    """Files and directories (an LMDB) alike, on a local destination or an fsspec URL: what a journal or
    manifest proves gpufeed wrote at the names a fresh run writes is removed; anything else there stops the
    run naming it, before anything is removed; other splits' files and other names are never touched."""
    import hashlib
    import uuid

    import fsspec

    from gpufeed import io
    from gpufeed.convert.destination import Evidence, clear, in_the_way
    from gpufeed.errors import DestinationError

    out = str(tmp_path / "out") if where == "local" else f"memory://clear-{uuid.uuid4().hex[:8]}/out"
    fs, root = fsspec.core.url_to_fs(out)
    names = {"tfrecord": ["train-00000-of-00002", ".train-00001-of-00002.tmp-1a2b3c4d", "val-00000-of-00001",
                          "notes.txt"],
             "lmdb": ["train_lmdb/data.mdb", ".val_lmdb.tmp-0badc0de/data.mdb", "val_lmdb/data.mdb"]}
    for fmt, files in names.items():
        for name in files:
            fs.makedirs(f"{root}/{fmt}/{name}".rsplit("/", 1)[0], exist_ok=True)
            fs.pipe(f"{root}/{fmt}/{name}", b"x")

    def left(fmt):
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in io.listdir(io.join(out, fmt)))

    way = in_the_way(out, ("tfrecord", "lmdb", "recordio"), ["train"], top_level=False)
    assert way == ["lmdb/train_lmdb", "tfrecord/.train-00001-of-00002.tmp-1a2b3c4d", "tfrecord/train-00000-of-00002"]
    proof = {"bytes": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    evidence = Evidence(out, digests={"tfrecord/train-00000-of-00002": proof})
    with pytest.raises(DestinationError, match="holds 1 file .*\n  lmdb/train_lmdb/data.mdb: not listed"):
        clear(out, way, evidence)
    assert left("tfrecord") == sorted(names["tfrecord"]) and "train_lmdb" in left("lmdb")
    evidence.digests["lmdb/train_lmdb/data.mdb"] = proof
    clear(out, way, evidence)
    assert left("tfrecord") == ["notes.txt", "val-00000-of-00001"]
    assert left("lmdb") == [".val_lmdb.tmp-0badc0de", "val_lmdb"]


def test_temporaries_that_vanish_while_a_resume_clears_them_are_no_error(tmp_path):
    """A task of a stopped run may still finish (rename its temporary) while the resumed run clears the
    temporaries it listed: the resume goes on."""
    import threading

    from gpufeed.convert.manifest import remove_temporaries
    from gpufeed.formats.naming import temp_name

    d = tmp_path / "out" / "tfrecord"
    d.mkdir(parents=True)
    for _ in range(20):
        temps = [temp_name(str(d / f"train-{i:05d}")) for i in range(300)]
        for t in temps:
            open(t, "wb").close()

        def finish_them():
            for i, t in enumerate(temps):
                try:
                    os.replace(t, str(d / f"train-{i:05d}"))
                except FileNotFoundError:
                    pass  # cleared first

        thread = threading.Thread(target=finish_them)
        thread.start()
        remove_temporaries(str(tmp_path / "out"), ("tfrecord",))
        thread.join()
        assert not [n for n in os.listdir(d) if ".tmp-" in n]


@pytest.mark.parametrize("which", ["classes.txt", "mean_std.json", "mean.binaryproto", "manifest.json"])
def test_small_outputs_replace_a_link_at_their_name_and_never_write_through_it(tmp_path, which):
    """The class list, the statistics and the manifest are written under a new temporary name and renamed into
    place: a symlink found at the name (to a user's file) is replaced, the file it names left as it was."""
    import numpy as np

    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.pipelines.base import ClassInfo
    from gpufeed.pipelines.sources import write_class_list
    from gpufeed.pipelines.transforms import ChannelStats, write_stats

    users = tmp_path / "users-file"
    users.write_bytes(b"mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / which).symlink_to(users)
    if which == "classes.txt":
        write_class_list(ClassInfo(names=["a", "b"]), str(out))
    elif which == "manifest.json":
        manifest_mod.save(str(out), {"files": []})
    else:
        stats = ChannelStats()
        stats.update(np.full((4, 4, 3), 7, np.uint8))
        write_stats(stats, str(out))
    assert users.read_bytes() == b"mine"
    assert not (out / which).is_symlink() and (out / which).stat().st_size > 0
    assert sorted(p.name for p in out.iterdir() if ".tmp-" in p.name) == []
