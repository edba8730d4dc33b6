"""``gpufeed clean DST``: a stopped conversion given up removes what it wrote and its state, only that: never a
file it cannot prove it wrote, never while a run holds the destination, never a finished conversion's file."""

from __future__ import annotations

import os

import pytest

from convert_fixtures import SHARD_SIZE, cli, options, tree_bytes
from gpufeed.cli import main
from gpufeed.convert.clean import clean
from gpufeed.convert.engine import convert
from gpufeed.convert.verify import verify
from gpufeed.errors import ConfigError, DestinationError

FORMATS = ("lmdb", "recordio", "tfrecord")


def _stop(src, out: str, split: str, formats=FORMATS, journal: str | None = None, shards: int = 2) -> str:
    """The command line converting ``split`` (as ``options`` does) into ``out``, its shard 0 stalled, stopped with
    SIGTERM once ``shards`` others are journalled (in ``journal``: the destination's own by default). Its local
    processes end with it, so nothing writes after the stop. Returns what it said."""
    import json
    import signal
    import time

    from gpufeed.convert.faults import TEST_FAULTS_ENV

    env = dict(os.environ, **{TEST_FAULTS_ENV: json.dumps({"stall_shard": [0, 30]})})
    proc = cli(["imagenet", src, "--to", ",".join(formats), "--out", out, "--workers", "2", "--resize", "48",
                "--on-error", "skip", "--shard-size", str(SHARD_SIZE), "--split", split], env=env)
    journal = journal or os.path.join(out, ".gpufeed", "journal.jsonl")
    deadline = time.time() + 90
    while proc.poll() is None and time.time() < deadline:
        try:
            with open(journal, "rb") as f:
                if f.read().count(b'"event":"shard"') >= shards:
                    break
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    return err.decode()


def _files(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names}


def test_a_stopped_run_given_up_leaves_only_the_users_files_and_says_what_it_removed(src, tmp_path, capsys):
    from gpufeed.convert.progress import size_text
    from gpufeed.convert.sinks import memory_spool_dir

    out = tmp_path / "out"
    opts = options(src, out, formats=(*FORMATS, "webdataset"), splits=("train",))
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    said = _stop(src, str(out), "train", opts.formats)
    state = out / ".gpufeed"
    warning = [line for line in said.splitlines() if "of the conversion's state" in line]
    assert warning == [f"warning: {size_text(sum(p.stat().st_size for p in state.rglob('*') if p.is_file()))} of "
                       f"the conversion's state (its journal and the split outputs assembled so far) stays in {state} "
                       f"for the rerun, which resumes from it; to give the run up instead: gpufeed clean {out}"]
    (out / "tfrecord" / "README").write_text("mine too")  # not a name gpufeed writes
    # What a worker killed mid-shard leaves (a run stopped this way removes its own; a killed one cannot).
    (out / "tfrecord" / ".train-00004-of-00005.tmp-0123abcd").write_bytes(b"half a shard")
    (out / ".manifest.json.tmp-89abcdef").write_bytes(b"{")  # a run killed as it wrote its manifest
    written = {f for f in _files(out) if not f.startswith(".gpufeed/")} - {"notes.txt", "tfrecord/README"}
    assert any(f.startswith("tfrecord/train-") for f in written)

    # A file it wrote, changed since: nothing is removed, and the file is named.
    shard = next(out / f for f in sorted(written) if f.startswith("tfrecord/train-") and not f.endswith(".idx"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    before = _files(out)
    with pytest.raises(DestinationError, match=rf"(?s)run gpufeed clean again.*\n  {shard.relative_to(out)}: "
                                               "changed since gpufeed wrote it"):
        clean(str(out))
    assert _files(out) == before
    shard.write_bytes(data)

    # Never while a run holds the destination.
    from gpufeed.convert.state import DestinationLock, state_dir_for

    lock = DestinationLock.acquire(state_dir_for(str(out)), str(out))
    try:
        with pytest.raises(ConfigError, match="another gpufeed convert is writing this destination"):
            clean(str(out))
    finally:
        lock.release()

    assert main(["clean", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"{out}: removed the unfinished conversion: {len(written)} files (") and said.rstrip(
        ).endswith("Nothing else there was changed."), said
    assert _files(out) == {"notes.txt", "tfrecord/README"}
    assert not os.path.exists(memory_spool_dir(str(out))) and not os.path.exists(f"{state}.lock")
    with pytest.raises(ConfigError, match="holds no conversion that was stopped or killed"):
        clean(str(out))
    with pytest.raises(ConfigError, match="not found; give the destination"):
        clean(str(tmp_path / "nothing"))
    # The destination takes a fresh run, to the bytes of one that never stopped.
    ref = tmp_path / "ref"
    convert(options(src, ref, formats=opts.formats, splits=("train",)))
    (out / "tfrecord" / "README").unlink()
    (out / ".classes.txt.tmp-0123abcd").write_bytes(b"0\t")  # a run removes these too
    convert(opts)
    got = tree_bytes(out)
    assert got.pop("notes.txt") == b"mine" and got == tree_bytes(ref)


def test_a_remote_destinations_state_in_the_user_cache_is_named_and_removed(src, tmp_path, monkeypatch, capsys):
    """A remote destination keeps its journal and the split outputs it assembles under ~/.cache/gpufeed: the stop
    names that folder and its size, and clean removes it with the shards and spools the run wrote to DST."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from gpufeed.convert.state import state_dir_for

    out = tmp_path / "remote"
    url = f"local://{out}"
    state = state_dir_for(url)
    said = _stop(src, url, "train", journal=os.path.join(state, "journal.jsonl"))
    assert state.startswith(str(tmp_path / "cache" / "gpufeed")) and os.listdir(state)
    assert f"stays in {state} for the rerun, which resumes from it; to give the run up instead: gpufeed clean {url}" \
        in said
    assert any(f.startswith("tfrecord/") for f in _files(out)) and any(f.startswith(".gpufeed/spool/") for f in
                                                                       _files(out))
    # Out of sight, and freed by no sweep: the next run of any other destination names it.
    from gpufeed.convert.progress import Progress, size_text

    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(state) for n in names)
    convert(options(src, tmp_path / "other", splits=("val",)), Progress(enabled=False))
    assert (f"warning: 1 conversion to a remote destination, stopped or killed, keeps {size_text(size)} of state in "
            f"{os.path.dirname(state)}: {url} ({size_text(size)}); rerun its command to finish it, or give it up: "
            f"gpufeed clean {url}") in capsys.readouterr().err.splitlines()
    done = clean(url)
    assert done.files > 0 and done.spool_bytes > 0 and done.state == state
    assert _files(out) == set() and not os.path.exists(state) and not os.path.exists(out / ".gpufeed")
    convert(options(src, tmp_path / "another", splits=("val",)), Progress(enabled=False))
    assert "stopped or killed" not in capsys.readouterr().err


def test_a_stopped_join_given_up_puts_the_finished_conversion_back_as_it_was(src, tmp_path):
    """A run adding the train split to a finished val conversion removes its manifest while under way; given up,
    the manifest is written back and the val files, class list among them, are as they were."""
    out = tmp_path / "out"
    convert(options(src, out, splits=("val",)))
    before = tree_bytes(out)
    manifest = (out / "manifest.json").read_bytes()
    _stop(src, str(out), "train")
    assert not (out / "manifest.json").exists() and (out / "classes.txt").exists()
    assert any(f.startswith("tfrecord/train-") for f in _files(out))  # what the join wrote, for clean to remove
    # A class list that is not the finished conversion's (as a join's end rewrites it): nothing is removed.
    classes = (out / "classes.txt").read_bytes()
    (out / "classes.txt").write_bytes(classes + b"3\textra\n")
    left = _files(out)
    with pytest.raises(ConfigError, match=r"classes.txt \(.*\) no longer holds what that conversion wrote .* "
                                          "nothing was removed: finish the run instead"):
        clean(str(out))
    assert _files(out) == left
    (out / "classes.txt").write_bytes(classes)
    done = clean(str(out))
    assert done.restored == len(before)
    assert (out / "manifest.json").read_bytes() == manifest and tree_bytes(out) == before
    verify(str(out))


def test_nothing_outside_the_destination_is_touched_whatever_its_folders_or_journal_say(src, tmp_path):
    """A journal is input and a format's folder may be a link: clean removes nothing outside DST. A recordio run
    stopped before its end has journalled only spools, so its reserved names (train.rec ...) are all it would
    remove in DST/recordio."""
    import json

    from gpufeed.errors import GpufeedError

    out = tmp_path / "out"
    _stop(src, str(out), "train", formats=("recordio",))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "train.rec").write_bytes(b"a user's own")
    # DST/recordio a link to a folder elsewhere holding a file at a name the plan reserved: refused, before anything.
    if (out / "recordio").exists():
        (out / "recordio").rmdir()
    (out / "recordio").symlink_to(elsewhere)
    before = _files(out)
    with pytest.raises(DestinationError, match=f"a symlink to {elsewhere}, outside the destination"):
        clean(str(out))
    assert (elsewhere / "train.rec").read_bytes() == b"a user's own" and _files(out) == before
    (out / "recordio").unlink()
    # A journal naming a "format" that leads out of DST, or a file outside it.
    journal = out / ".gpufeed" / "journal.jsonl"
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    start["options"]["formats"] = ["recordio", "../elsewhere"]
    journal.write_text("".join(json.dumps(e) + "\n" for e in events))
    with pytest.raises(GpufeedError, match="unknown format '../elsewhere'"):
        clean(str(out))
    start["options"]["formats"] = ["recordio"]
    shard = next(e for e in events if e["event"] == "shard")
    shard["files"][0]["path"] = str(elsewhere / "train.rec")
    journal.write_text("".join(json.dumps(e) + "\n" for e in events))
    clean(str(out))
    assert (elsewhere / "train.rec").read_bytes() == b"a user's own" and sorted(os.listdir(elsewhere)) == ["train.rec"]
    assert _files(out) == set()


def test_a_run_waits_out_a_look_at_its_lock_and_not_a_run_holding_it(tmp_path):
    """Another run's look at a destination's lock (to tell a stopped run from a live one) holds it for an instant:
    a run starting then waits for it; a lock held by a run is still refused, after LOCK_PATIENCE_S."""
    import fcntl
    import threading
    import time

    from gpufeed.convert.state import LOCK_PATIENCE_S, DestinationLock, state_dir_for

    out = str(tmp_path / "out")
    state = state_dir_for(out)
    os.makedirs(out)
    with open(state + ".lock", "a+b") as look:
        fcntl.flock(look, fcntl.LOCK_EX)
        threading.Timer(0.1, lambda: fcntl.flock(look, fcntl.LOCK_UN)).start()
        DestinationLock.acquire(state, out).release()
    held = DestinationLock.acquire(state, out)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="another gpufeed convert is writing this destination"):
            DestinationLock.acquire(state, out)
        assert time.monotonic() - t0 >= LOCK_PATIENCE_S
    finally:
        held.release()
