"""A destination is gpufeed's alone: a conversion removes or overwrites only what its own manifest or journal
proves it wrote there, and treats a manifest or journal found in the destination as untrusted input.

Every case runs a real conversion (or the command line in a child process) into a real folder holding a user's
files, and checks those files byte for byte afterwards.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from convert_fixtures import StopAfter, cli, cli_args, options, tree_bytes, wait_for_shards
from gpufeed.convert.engine import convert
from gpufeed.convert.verify import verify
from gpufeed.errors import ConfigError, DestinationError, IncompleteOutputError, UnsafeManifestError

VAL = dict(splits=("val",), formats=("tfrecord", "recordio"))


@pytest.fixture
def finished(src, tmp_path, ray_local):
    """A finished conversion of the val split, and a victim folder beside it holding a user's files."""
    out = tmp_path / "out"
    convert(options(src, out, **VAL))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "b.txt").write_bytes(b"a user's file")
    (tmp_path / "victim.txt").write_bytes(b"another user's file")
    return out


def _edit_manifest(out, change):
    doc = json.loads((out / "manifest.json").read_text())
    change(doc)
    (out / "manifest.json").write_text(json.dumps(doc))


def _list_outside(doc, tmp_path, size=None):
    first = doc["files"][0]
    doc["files"].append(dict(first, path=str(tmp_path / "victim.txt"), bytes=size or first["bytes"]))
    doc["files"].append(dict(first, path="../victim/b.txt", bytes=size or first["bytes"]))


def test_overwrite_never_deletes_what_a_manifest_lists_outside_the_destination(src, finished, tmp_path):
    _edit_manifest(finished, lambda doc: _list_outside(doc, tmp_path))
    before = tree_bytes(finished)
    with pytest.raises(UnsafeManifestError, match=f"manifest.json: lists '{tmp_path}/victim.txt', which is not a "
                                                  "plain path inside the destination.*move it away"):
        convert(options(src, finished, overwrite=True, quality=90, **VAL))
    assert (tmp_path / "victim.txt").read_bytes() == b"another user's file"
    assert (tmp_path / "victim" / "b.txt").read_bytes() == b"a user's file"
    assert tree_bytes(finished) == before  # nothing of the destination went either


def test_a_rerun_never_deletes_a_listed_file_outside_the_destination_or_its_folder(src, finished, tmp_path):
    """The "wrong size" entry made the rerun convert again, deleting it and then its emptied folder."""
    def outside_only(doc):
        doc["files"] = [f for f in doc["files"]] + [dict(doc["files"][0], path="../victim/b.txt", bytes=1)]

    _edit_manifest(finished, outside_only)
    with pytest.raises(UnsafeManifestError, match="lists '../victim/b.txt', which is not a plain path"):
        convert(options(src, finished, **VAL))
    assert (tmp_path / "victim" / "b.txt").read_bytes() == b"a user's file"
    with pytest.raises(UnsafeManifestError, match="../victim/b.txt"):
        verify(str(finished))


def test_a_listed_name_that_leads_outside_through_a_symlink_is_refused(src, finished, tmp_path):
    shard = next(p for p in (finished / "tfrecord").iterdir() if p.name.startswith("val-") and "." not in p.name)
    shard.unlink()
    shard.symlink_to(tmp_path / "victim.txt")
    for run in (lambda: convert(options(src, finished, resume=False, **VAL)), lambda: verify(str(finished))):
        with pytest.raises(UnsafeManifestError, match=f"{shard.name}', which resolves to {tmp_path}/victim.txt, "
                                                      "outside the destination"):
            run()
    assert (tmp_path / "victim.txt").read_bytes() == b"another user's file"


def test_a_listed_name_no_format_writes_is_refused(src, finished):
    (finished / "notes.txt").write_bytes(b"mine")
    _edit_manifest(finished, lambda doc: doc["files"].append(dict(doc["files"][0], path="notes.txt", bytes=4)))
    with pytest.raises(UnsafeManifestError, match="lists 'notes.txt', which is no name gpufeed writes there"):
        convert(options(src, finished, resume=False, **VAL))
    assert (finished / "notes.txt").read_bytes() == b"mine"


def _user_files(out):
    files = {"tfrecord/train-00000-of-00004": b"my shard", "tfrecord/train-00000-of-00004.idx": b"0 8\n",
             "recordio/train.rec": b"my rec", "lmdb/train_lmdb/data.mdb": b"my lmdb", "classes.txt": b"0\tcat\n"}
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    return files


def test_a_fresh_run_overwrites_and_deletes_no_file_it_did_not_write(src, tmp_path, ray_local):
    out = tmp_path / "out"
    mine = _user_files(out)
    with pytest.raises(DestinationError) as err:
        convert(options(src, out, splits=("train",)))
    text = str(err.value)
    assert text.startswith(f"{out}: holds 5 files at names this conversion writes that gpufeed cannot prove it "
                           "wrote, so it removes or overwrites nothing")
    for rel in mine:
        assert f"\n  {rel}: not listed by this destination's manifest.json or conversion journal" in text
    assert tree_bytes(out) == mine
    # Moved away, as the message says: the run goes ahead.
    for rel in mine:
        (out / rel).unlink()
    convert(options(src, out, splits=("train",)))
    verify(str(out))


def test_overwrite_removes_only_what_the_old_manifest_proves(src, finished, tmp_path):
    """A user's shard that the old manifest does not list, at a name the new run's split writes, stops it
    before anything of the old output goes."""
    stray = finished / "tfrecord" / "val-00099-of-00100"
    stray.write_bytes(b"my shard")
    before = tree_bytes(finished)
    with pytest.raises(DestinationError, match="tfrecord/val-00099-of-00100: not listed"):
        convert(options(src, finished, overwrite=True, quality=90, **VAL))
    assert tree_bytes(finished) == before
    stray.unlink()
    convert(options(src, finished, overwrite=True, quality=90, **VAL))
    verify(str(finished))


def test_the_same_command_line_refuses_a_users_files_with_one_line(src, tmp_path, address):
    out = tmp_path / "out"
    _user_files(out)
    proc = cli(cli_args(src, str(out), "--split", "train"), address)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err.decode()
    assert err.decode().startswith(f"gpufeed: error: {out}: holds 5 files at names this conversion writes")


def test_a_memory_destination_that_dies_with_the_process_is_refused(src, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpufeed", "convert", "imagenet", src, "--to", "tfrecord",
                           "--out", "memory://x", "--no-progress"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "check it with gpufeed verify" not in proc.stdout
    assert proc.stderr.strip() == ("gpufeed: error: --out memory://x: a memory:// filesystem lives only as long as "
                                   "this process, so the output would be lost when the command ends; give a folder "
                                   "or a URL of storage that keeps it")


def test_verify_never_opens_what_a_manifest_points_outside_or_a_special_file(finished, tmp_path):
    _edit_manifest(finished, lambda doc: doc["files"].append(dict(doc["files"][0], path="/dev/zero")))
    t0 = time.monotonic()
    with pytest.raises(UnsafeManifestError, match="lists '/dev/zero', which is not a plain path"):
        verify(str(finished))
    _edit_manifest(finished, lambda doc: doc["files"].pop())
    shard = next(p for p in (finished / "tfrecord").iterdir() if "." not in p.name)
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(IncompleteOutputError, match=f"{shard.name}: a FIFO \\(named pipe\\), not a file gpufeed wrote"):
        verify(str(finished))
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("content", ["[1, 2, 3]", '{"manifest_version": 1, "files": [1, 2]}',
                                     '{"manifest_version": 1, "files": {}}'])
def test_verify_of_a_manifest_that_is_not_gpufeeds_is_one_error(finished, content):
    (finished / "manifest.json").write_text(content)
    with pytest.raises((IncompleteOutputError, UnsafeManifestError), match="manifest.json: .*move it away"):
        verify(str(finished))


@pytest.mark.parametrize("kind", ["symlink to /dev/zero", "FIFO", "300 MB file"])
def test_a_manifest_that_is_no_file_gpufeed_writes_is_neither_read_nor_overwritten(finished, src, kind):
    """``DST/manifest.json`` a link to ``/dev/zero`` (read without end), a FIFO (a wait without end) or a file
    larger than any manifest: ``verify`` and ``convert`` say so at once, without opening or reading it."""
    import signal

    target = finished / "manifest.json"
    target.unlink()
    if kind == "FIFO":
        os.mkfifo(target)
    elif kind == "300 MB file":
        with open(target, "wb") as f:
            f.truncate(300 << 20)
    else:
        target.symlink_to("/dev/zero")
    says = {"FIFO": "a FIFO (named pipe), which gpufeed never writes", "300 MB file": "314572800 bytes, more than a gpufeed manifest",
            "symlink to /dev/zero": "a symlink, which gpufeed never writes"}[kind]
    signal.alarm(30)  # a hang fails the test instead of the suite
    try:
        with pytest.raises(IncompleteOutputError, match=f"manifest.json: {re.escape(says)}.*move it away"):
            verify(str(finished))
        with pytest.raises(ConfigError, match="manifest.json was not written by gpufeed, which would overwrite it"):
            convert(options(src, finished, **VAL))
    finally:
        signal.alarm(0)
    assert os.path.lexists(target)


def test_verify_of_a_file_says_to_give_the_folder(finished):
    proc = subprocess.run([sys.executable, "-m", "gpufeed", "verify", str(finished / "classes.txt")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "classes.txt is a file; gpufeed verify checks the folder a gpufeed convert run wrote" in proc.stderr


def test_a_state_folder_that_is_not_gpufeeds_is_neither_used_nor_removed(src, tmp_path, ray_local):
    out = tmp_path / "out"
    (out / ".gpufeed").mkdir(parents=True)
    (out / ".gpufeed" / "notes").write_bytes(b"mine")
    with pytest.raises(DestinationError, match=r"\.gpufeed: a folder that holds no gpufeed conversion journal"):
        convert(options(src, out, **VAL))
    assert (out / ".gpufeed" / "notes").read_bytes() == b"mine"


@pytest.mark.parametrize("kind", ["symlink outside", "file", "symlink to nothing", "FIFO"])
def test_a_format_folder_that_would_lead_outside_or_is_no_folder_stops_the_run_first(src, tmp_path, ray_local, kind):
    """``DST/recordio`` linked to a folder elsewhere would have the run write there, and every later run and
    ``gpufeed verify`` refuse the manifest listing those files: the run stops before writing anything, naming it.
    A file, a link to nothing or a FIFO there is no folder to write in. Nothing is written or removed anywhere."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_bytes(b"a user's file")
    folder = out / "recordio"
    if kind == "symlink outside":
        folder.symlink_to(elsewhere)
        says = f"{folder}: a symlink to {elsewhere}, outside the destination, where gpufeed writes its recordio output"
    elif kind == "file":
        folder.write_bytes(b"a user's file")
        says = f"{folder}: a file, where gpufeed writes its recordio output folder; move it away"
    elif kind == "symlink to nothing":
        folder.symlink_to(out / "missing")
        says = f"{folder}: a symlink to nothing, where gpufeed writes its recordio output folder"
    else:
        os.mkfifo(folder)
        says = f"{folder}: a FIFO (named pipe), where gpufeed writes its recordio output folder"
    before = sorted(os.listdir(out)), tree_bytes(elsewhere)
    with pytest.raises(DestinationError) as err:
        convert(options(src, out, **VAL))
    assert str(err.value).startswith(says), str(err.value)
    assert (sorted(os.listdir(out)), tree_bytes(elsewhere)) == before


def test_a_format_folder_linked_inside_the_destination_is_written_and_verifies(src, tmp_path, ray_local):
    out = tmp_path / "out"
    (out / "disk2" / "rec").mkdir(parents=True)
    (out / "recordio").symlink_to(out / "disk2" / "rec")
    convert(options(src, out, **VAL))
    assert os.path.exists(out / "disk2" / "rec" / "val.rec")
    verify(str(out))


def _stopped(src, out) -> None:
    with pytest.raises(KeyboardInterrupt):
        convert(options(src, out, formats=("recordio",), workers=1), StopAfter(2))
    assert os.path.exists(out / ".gpufeed" / "partial" / "train.lst")


@pytest.mark.parametrize("plant", ["partial linked to a user's file", "partial hard-linked to a user's file",
                                   "journal linked to a user's file", "a FIFO in the state", "lock linked outside",
                                   "lock a FIFO"])
def test_a_state_entry_that_leads_outside_stops_the_run_before_it_is_read_or_written(src, tmp_path, ray_local, plant):
    """gpufeed makes only folders and files of one link in ``DST/.gpufeed`` (and the lock file beside it): a
    symlink, a hard link or a FIFO planted there would have a resume cut, overwrite or append to a file outside
    DST (a partial ``.lst`` linked to a user's file was cut and overwritten), create one (a lock linked to a
    missing path), or hang reading. The run stops naming it; the user's file is untouched, nothing is created."""
    out = tmp_path / "out"
    _stopped(src, out)
    victim = tmp_path / "thesis.txt"
    victim.write_bytes(b"a user's file\n" * 1000)
    state = out / ".gpufeed"
    if plant.startswith("partial"):
        at = state / "partial" / "train.lst"
        at.unlink()
        (at.hardlink_to if "hard" in plant else at.symlink_to)(victim)
        what = "file with 2 links (hard-linked elsewhere)" if "hard" in plant else "symlink"
        says = f"{at}: a {what}, inside gpufeed's conversion state"
    elif plant.startswith("journal"):
        at = state / "journal.jsonl"
        victim.write_bytes(at.read_bytes()[:-1])  # a copy of the journal, its last line torn: a resume would cut it
        at.unlink()
        at.symlink_to(victim)
        says = f"{at}: a symlink, inside gpufeed's conversion state"
    elif plant == "a FIFO in the state":
        at = state / "partial" / "notes"
        os.mkfifo(at)
        says = f"{at}: a FIFO (named pipe), inside gpufeed's conversion state"
    else:
        at = out / ".gpufeed.lock"
        if plant == "lock a FIFO":
            os.mkfifo(at)
            says = f"{at}: a FIFO (named pipe), where gpufeed keeps the destination's lock"
        else:
            at.symlink_to(tmp_path / "created")
            says = f"{at}: a symlink, where gpufeed keeps the destination's lock"
    kept = victim.read_bytes()
    with pytest.raises(DestinationError) as err:
        convert(options(src, out, formats=("recordio",), workers=1))
    assert str(err.value).startswith(says), str(err.value)
    assert victim.read_bytes() == kept and not os.path.lexists(tmp_path / "created")
    # The advice works: the entry moved away and a fresh start (the journal: the state folder moved away, and a
    # rerun), and a whole output.
    fresh = False
    if plant.startswith("journal"):
        assert f"move {state} away (its journal is not gpufeed's), then rerun" in str(err.value)
        state.rename(tmp_path / "moved")
    elif plant.startswith("lock"):
        assert str(err.value).endswith("move it away, or choose another destination")
        at.unlink()  # and the stopped run resumes
    else:
        assert str(err.value).endswith("move it away, then start over: the same command with --no-resume")
        at.unlink()
        fresh = True
    convert(options(src, out, formats=("recordio",), workers=1, resume=not fresh))
    verify(str(out))


def test_no_resume_after_a_kill_clears_what_the_killed_run_wrote(src, tmp_path, address):
    """A run killed mid-way, then started over: what the journal proves (finished shards, by digest) and what
    its plan reserved (a shard renamed before it was journalled) goes, and the new run completes."""
    import signal

    ref = tmp_path / "ref"
    convert(options(src, ref, workers=1, shard_size=2))
    out = str(tmp_path / "out")
    args = cli_args(src, out, "--workers", "1", "--shard-size", "2")
    proc = cli(args, address)
    wait_for_shards(proc, out, 3)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    code = cli([*args, "--no-resume"], address)
    _, err = code.communicate(timeout=120)
    assert code.returncode == 0, err.decode()
    assert tree_bytes(out) == tree_bytes(ref)
