"""Faults during conversion: the driver killed, a worker killed, a full disk, a node lost.

Each ends in either a finished conversion or a clear error; the output never passes ``gpufeed verify``
before it is complete, and rerunning the same command finishes it with the same bytes as a run that was
never interrupted.
"""

from __future__ import annotations

import os
import re
import shutil
import resource
import signal
import subprocess
import threading
import time

import psutil
import pytest

from convert_fixtures import cli, cli_args, journal_shards, options, tree_bytes, wait_for_shards
from forked import slow_child_start
from gpufeed.convert.engine import convert
from gpufeed.convert.progress import Progress
from gpufeed.convert.verify import verify
from gpufeed.errors import IncompleteOutputError


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(), err.decode()


def _start_and_kill(args, address, out, after: int, sig=signal.SIGKILL):
    """Start the CLI and signal it once it has journalled ``after`` more shards than the journal held before
    (counting from zero would signal a resumed run at once, while Python is still starting up)."""
    target = journal_shards(out) + after
    proc = cli(args, address)
    wait_for_shards(proc, out, target)
    assert proc.poll() is None, _finish(proc)
    proc.send_signal(sig)
    return _finish(proc)


def test_driver_killed_mid_run_resumes_to_identical_bytes(src, address, tmp_path):
    ref = tmp_path / "ref"
    convert(options(src, ref, workers=1, shard_size=2))
    out = str(tmp_path / "out")
    args = cli_args(src, out, "--workers", "1", "--shard-size", "2")
    # Killed early; interrupted later in the resumed run: two points of the same job.
    _start_and_kill(args, address, out, after=1)
    with pytest.raises(IncompleteOutputError):
        verify(out)
    # Other options must not mix with the partial output: the difference is shown.
    code, _, err = _finish(cli([*args, "--quality", "90"], address))
    assert code == 2 and "quality: journal 95, now 90" in err and "--no-resume" in err
    # Ctrl-C later in the resumed run: a clean stop that says how to resume.
    code, _, err = _start_and_kill(args, address, out, after=2, sig=signal.SIGINT)
    assert code == 130 and "rerun the same command to resume" in err and "Traceback" not in err, (code, err)
    with pytest.raises(IncompleteOutputError):
        verify(out)
    code, stdout, err = _finish(cli(args, address))
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(ref)
    verify(out)


def test_spools_of_a_local_run_stay_in_memory_and_a_killed_run_resumes_from_them(src, tmp_path):
    """Every worker on this machine: the split sinks' spools go to a memory folder of this destination's (never
    written back to the disk), which a killed run leaves for its rerun and a finished one removes."""
    from gpufeed.convert.sinks import memory_spool_dir

    ref = tmp_path / "ref"
    convert(options(src, ref, workers=1, shard_size=2))
    out = str(tmp_path / "out")
    args = cli_args(src, out, "--workers", "1", "--shard-size", "2")
    _start_and_kill(args, None, out, after=1)
    assert os.path.isdir(memory_spool_dir(out)) and not os.path.exists(os.path.join(out, ".gpufeed", "spool"))
    code, _, err = _finish(cli(args))
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(ref)
    assert not os.path.exists(memory_spool_dir(out)) and not os.path.exists(memory_spool_dir(ref))
    # Killed again, then started afresh: --no-resume drops what the killed run left in memory too.
    _start_and_kill([*args, "--no-resume"], None, out, after=1)
    code, _, err = _finish(cli([*args, "--no-resume"]))
    assert code == 0 and tree_bytes(out) == tree_bytes(ref), err
    assert not os.path.exists(memory_spool_dir(out))


def test_a_run_killed_between_an_append_and_its_journal_line_redoes_those_shards(src, tmp_path):
    """The appending thread drops a shard's spool once appended; the syncing thread journals the commit after
    the fsync. Killed between the two, the journal holds the shard as converted but not committed, and its spool
    is gone: the rerun cuts the partial outputs back to the last journalled commit and converts those shards
    again, to the same bytes; killed again once it has, the journal holds those shards twice, and the next
    rerun still resumes (it once failed comparing the two events)."""
    import json

    ref = tmp_path / "ref"
    convert(options(src, ref, workers=1, shard_size=2))
    out = str(tmp_path / "out")
    args = cli_args(src, out, "--workers", "1", "--shard-size", "2")
    _start_and_kill(args, None, out, after=3)
    journal = os.path.join(out, ".gpufeed", "journal.jsonl")
    with open(journal, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    commits = [i for i, line in enumerate(lines) if json.loads(line)["event"] == "commit"]
    assert commits, "the killed run committed nothing; kill it later"
    # The last commit line of each sink taken out: what a kill before the syncing thread journalled it leaves
    # (its spool already removed by the appending thread, which the kill above did too).
    last = {}
    for i in commits:
        last[json.loads(lines[i])["sink"]] = i
    with open(journal, "wb") as f:
        f.writelines(line for i, line in enumerate(lines) if i not in last.values())
    from gpufeed.convert.sinks import memory_spool_dir, spool_path

    for i in last.values():
        e = json.loads(lines[i])
        assert not os.path.exists(spool_path(memory_spool_dir(out), e["split"], e["sink"], e["shard"]))
    def journalled_twice() -> bool:
        with open(journal, "rb") as f:
            shards = [(e["split"], e["shard"]) for e in map(json.loads, f) if e["event"] == "shard"]
        return len(shards) > len(set(shards))

    # Killed once it has journalled a shard again (whichever shards it converts first).
    proc = cli(args)
    deadline = time.time() + 120
    while not journalled_twice() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None and journalled_twice(), _finish(proc)
    proc.send_signal(signal.SIGKILL)
    _finish(proc)
    code, _, err = _finish(cli(args))
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(ref)
    verify(out)


@pytest.mark.parametrize("kind", ["symlink", "open folder"])
def test_a_memory_spool_path_gpufeed_did_not_make_is_neither_used_nor_removed(tmp_path, kind):
    """Only a private folder of this user's at the spool path is gpufeed's: a symlink there (to anything) or a
    folder others may write is not spooled into and not removed."""
    from gpufeed.convert.sinks import memory_spool_dir, memory_spools, remove_memory_spools

    out = str(tmp_path / "dst")
    path = memory_spool_dir(out)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("user data")
    try:
        if kind == "symlink":
            os.symlink(mine, path)
        else:
            os.mkdir(path, 0o755)
            os.chmod(path, 0o755)
            shutil.move(str(mine / "keep.txt"), os.path.join(path, "keep.txt"))
        assert memory_spools(out, 1) is None
        remove_memory_spools(out)
        kept = mine / "keep.txt" if kind == "symlink" else os.path.join(path, "keep.txt")
        assert open(kept).read() == "user data"
    finally:
        if os.path.islink(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
    assert memory_spools(out, 1) == path and os.path.isdir(path)  # made afresh: gpufeed's own, and removed
    remove_memory_spools(out)
    assert not os.path.exists(path)


def _temporaries(out) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(out) for n in names if ".tmp-" in n]


def _lock_free(folder: str) -> bool:
    """A memory spool folder there, whose lock no process holds."""
    import fcntl

    from gpufeed.convert.sinks import OWNER

    with open(os.path.join(folder, OWNER), "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True


def _hold_spools(out: str):
    """A process that makes ``out``'s memory spool folder and holds it, as a live run does."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; from gpufeed.convert.sinks import "
                             "memory_spools; print(memory_spools(sys.argv[1], 1), flush=True); time.sleep(600)", out],
                            stdout=subprocess.PIPE, text=True)
    held = proc.stdout.readline().strip()
    assert held, "the holder made no memory spool folder"
    return proc, held


def test_a_sweep_removes_the_memory_spools_no_live_run_holds_and_nothing_else(tmp_path):
    """Spool folders of runs killed outright (their lock free) go, and what was in them is counted; a live
    run's, the one given to keep, a folder without a lock changed within the hour (an older gpufeed's run, or
    one being made), and a folder that is not a private one of this user's stay."""
    from gpufeed.convert import sinks

    if not os.path.isdir(sinks.MEMORY_ROOT):
        pytest.skip(f"no {sinks.MEMORY_ROOT} here")
    sinks.sweep_memory_spools()  # what this machine had abandoned before: the counts below are this test's
    outs = {k: str(tmp_path / k) for k in ("killed", "live", "keep", "old", "new", "open", "removing")}
    paths = {k: sinks.memory_spool_dir(v) for k, v in outs.items()}
    live = None
    try:
        for k in ("killed", "keep"):  # made and locked by a run that is gone
            gone, held = _hold_spools(outs[k])
            assert held == paths[k]
            gone.kill()
            gone.wait()
        live, held = _hold_spools(outs["live"])
        with open(os.path.join(paths["killed"], "train-recordio-00003.rec"), "wb") as f:
            f.write(bytes(5000))
        for k in ("old", "new"):  # an older gpufeed's: no lock file
            os.mkdir(paths[k], 0o700)
        os.utime(paths["old"], (time.time() - 2 * sinks.UNOWNED_STALE_S,) * 2)
        os.mkdir(paths["open"], 0o755)
        os.chmod(paths["open"], 0o755)
        os.utime(paths["open"], (time.time() - 2 * sinks.UNOWNED_STALE_S,) * 2)
        removing = paths["removing"] + ".removing-1"  # a sweep stopped halfway
        os.mkdir(removing, 0o700)
        removed, size = sinks.sweep_memory_spools(keep=outs["keep"])
        assert removed == 3 and size == 5000, (removed, size)
        gone = {k for k, p in paths.items() if not os.path.exists(p)}
        assert gone == {"killed", "old", "removing"} and not os.path.exists(removing), gone
        assert sinks.sweep_memory_spools(keep=outs["keep"]) == (0, 0)
        # The live run's folder is still its own: it goes when that run ends.
        live.kill()
        live.wait()
        live = None
        assert sinks.sweep_memory_spools(keep=outs["keep"]) == (1, 0) and not os.path.exists(paths["live"])
    finally:
        if live is not None:
            live.kill()
        for p in paths.values():
            shutil.rmtree(p, ignore_errors=True)


def test_a_run_frees_the_memory_spools_a_killed_run_of_another_destination_left(src, tmp_path):
    """Killed outright, a run cannot free its memory spools; the next run, of any destination, does and says
    so, and the killed run's rerun converts those shards again, to the same bytes."""
    import io

    from gpufeed.convert.sinks import memory_spool_dir

    ref = tmp_path / "ref"
    convert(options(src, ref, workers=1, shard_size=2))
    out = str(tmp_path / "out")
    args = cli_args(src, out, "--workers", "1", "--shard-size", "2")
    _start_and_kill(args, None, out, after=1)
    assert os.path.isdir(memory_spool_dir(out))
    said = io.StringIO()
    convert(options(src, tmp_path / "other", workers=1, shard_size=2), Progress(file=said))
    assert not os.path.exists(memory_spool_dir(out))
    assert re.search(r"removed \d+ spool folders? that unfinished gpufeed runs left in /dev/shm \(\d+\.\d MB of memory\)",
                     said.getvalue()), said.getvalue()
    code, _, err = _finish(cli(args))
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(ref)


def _kill_one_worker_running(name: str, stop: threading.Event, killed: list) -> None:
    """SIGKILL the first Ray worker of this test session seen running task ``name``."""
    me = psutil.Process()
    while not stop.is_set() and not killed:
        for p in me.children(recursive=True):
            try:
                if any(name in part for part in p.cmdline()):
                    p.send_signal(signal.SIGKILL)
                    killed.append(p.pid)
                    return
            except psutil.Error:
                continue
        time.sleep(0.005)


def test_worker_killed_mid_task_is_retried(src, ray_local, tmp_path):
    ref = tmp_path / "ref"
    convert(options(src, ref, workers=2))
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_one_worker_running, args=("run_shard", stop, killed))
    watcher.start()
    try:
        convert(options(src, tmp_path / "out", workers=2))
    finally:
        stop.set()
        watcher.join()
    assert killed, "no worker was caught running a shard"
    assert tree_bytes(tmp_path / "out") == tree_bytes(ref)


def _kill_every_worker_running(name: str, stop: threading.Event, killed: list) -> None:
    me = psutil.Process()
    while not stop.is_set():
        for p in me.children(recursive=True):
            try:
                if p.pid not in killed and any(name in part for part in p.cmdline()):
                    p.send_signal(signal.SIGKILL)
                    killed.append(p.pid)
            except psutil.Error:
                continue
        time.sleep(0.005)


def test_task_that_keeps_crashing_its_worker_names_its_inputs(src, ray_local, tmp_path):
    from gpufeed.errors import InputError

    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_every_worker_running, args=("run_shard", stop, killed))
    watcher.start()
    try:
        with pytest.raises(InputError) as err:
            convert(options(src, tmp_path / "out", workers=1, formats=("tfrecord",), shard_size=100,
                            splits=("val",), task_retries=1))
    finally:
        stop.set()
        watcher.join()
    assert len(killed) == 2  # the task and its one retry; the bisection's probes do not crash
    assert "crashed its Ray worker 2 times" in str(err.value) and "no single input" in str(err.value)
    assert "val/" in str(err.value)


def _limit_file_size(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("where", ["cluster", "local"])
def test_disk_full_stops_with_a_clear_error_and_resumes(src, tmp_path, request, where):
    """A write the disk refuses stops the run with one line naming the output, the limit it hit and the fix; a
    local run leaves no temporary file beside the outputs (a cluster's task still running may yet write one, which
    the rerun removes), and its memory spools stay for the rerun, their lock free (a sweep may take them); the
    rerun finishes to the same bytes."""
    from gpufeed.convert.sinks import memory_spool_dir

    address = request.getfixturevalue("address") if where == "cluster" else None
    ref = tmp_path / "ref"
    convert(options(src, ref, workers=2))
    out = str(tmp_path / "out")
    # RLIMIT_FSIZE makes every write past the limit fail (EFBIG) in the driver, where the ordered sinks
    # (LMDB, single .rec) write, and in local processes: the same path a full disk (ENOSPC) takes.
    code, _, err = _finish(cli(cli_args(src, out), address, preexec_fn=_limit_file_size(24 << 10)))
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("gpufeed: error: ") and "Traceback" not in err, err
    assert "`ulimit -f` is 24): raise the limit" in last and "rerun the same command to resume" in last, last
    if where == "local":
        assert _temporaries(out) == [] and _lock_free(memory_spool_dir(out))
    with pytest.raises(IncompleteOutputError):
        verify(out)
    code, _, err = _finish(cli(cli_args(src, out), address))
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(ref)


def test_two_node_cluster_finishes_when_a_node_dies(src, ray_local, tmp_path):
    """Two emulated nodes; one is killed while shards run on it; the other finishes the job."""
    from ray.cluster_utils import Cluster

    ref = tmp_path / "ref"
    convert(options(src, ref, workers=2, shard_size=2))
    # One Ray runtime at a time: the session's runtime makes way for the cluster, then comes back.
    init_args = dict(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=512 << 20,
                     runtime_env={"env_vars": {"PYTHONHASHSEED": "0"}})
    ray_local.shutdown()
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 0, "object_store_memory": 256 << 20})
    try:
        nodes = [cluster.add_node(num_cpus=1, object_store_memory=128 << 20) for _ in range(2)]
        cluster.wait_for_nodes()
        out = str(tmp_path / "out")
        removed = []

        def kill_node():
            deadline = time.time() + 120
            while journal_shards(out) < 4 and time.time() < deadline:
                time.sleep(0.01)
            cluster.remove_node(nodes[1], allow_graceful=False)
            removed.append(True)

        killer = threading.Thread(target=kill_node)
        killer.start()
        convert(options(src, out, workers=2, shard_size=2))
        killer.join()
        assert removed
        assert tree_bytes(out) == tree_bytes(ref)
    finally:
        ray_local.shutdown()
        cluster.shutdown()
        ray_local.init(**init_args)


# -- faults inside the workers and at the destination --------------------------------------------------------

def _val(src, out, **kw):
    return options(src, out, formats=("tfrecord",), splits=("val",), **kw)


def test_disk_full_inside_a_worker_names_the_shard_and_resumes(src, ray_local, tmp_path, monkeypatch):
    import json

    from gpufeed.convert.faults import TEST_FAULTS_ENV
    from gpufeed.errors import OutputError

    ref = tmp_path / "ref"
    convert(_val(src, ref, shard_size=3))
    out = tmp_path / "out"
    # A file size limit set inside the Ray worker while it writes a shard: writes past it fail with EFBIG,
    # the path a full disk (ENOSPC) takes.
    monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps({"fsize": 2048}))
    with pytest.raises(OutputError) as err:
        convert(_val(src, out, shard_size=3))
    text = str(err.value)
    assert "tfrecord/val-0000" in text and "File too large" in text and "rerun the same command" in text
    assert ".tmp-" not in text  # the output's name, not its temporary one
    with pytest.raises(IncompleteOutputError):
        verify(str(out))
    monkeypatch.delenv(TEST_FAULTS_ENV)
    convert(_val(src, out, shard_size=3))
    assert tree_bytes(out) == tree_bytes(ref)
    verify(str(out))


def test_destination_gone_mid_run_stops_clearly_and_resumes(src, ray_local, tmp_path, monkeypatch):
    from gpufeed.errors import OutputError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the journal of a remote destination
    ref = tmp_path / "ref"
    convert(_val(src, ref, shard_size=1, workers=1))
    out = tmp_path / "remote"

    class ReplaceDestinationWithAFile(Progress):
        """After the first shard, the destination directory disappears and a file takes its place."""

        def update(self, samples, nbytes):
            if out.is_dir():
                # A rename is atomic, where removing the tree would race with the worker writing into it.
                out.rename(tmp_path / "gone")
                out.write_bytes(b"not a directory")

    with pytest.raises(OutputError) as err:
        convert(_val(src, f"local://{out}", shard_size=1, workers=1), ReplaceDestinationWithAFile(enabled=False))
    text = str(err.value)
    assert f"{out}/tfrecord/val-0000" in text and "rerun the same command" in text
    out.unlink()
    convert(_val(src, f"local://{out}", shard_size=1, workers=1))
    assert tree_bytes(out) == tree_bytes(ref)
    verify(f"local://{out}")


def test_the_input_that_crashes_its_worker_is_found_and_skipped(src, ray_local, tmp_path, monkeypatch):
    import json

    from gpufeed.convert.faults import TEST_FAULTS_ENV
    from gpufeed.convert.worker import CRASH_REASON
    from gpufeed.convert.plan import plan_split
    from gpufeed.errors import InputError
    from gpufeed.pipelines import open_source

    items = open_source("imagenet", src).items("val")
    # The val split is one shard; the last input in its shuffled order crashes the worker, so the
    # bisection's probes of first halves pass and only the final confirmation crashes (each crash costs a
    # worker start).
    plan = plan_split("val", [it.key for it in items], 0, True, None, shard_size=len(items))
    bad = items[plan.order[-1]].origin
    monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps({"crash_on": bad}))
    opts = dict(shard_size=len(items), workers=1, task_retries=1)
    with pytest.raises(InputError) as err:
        convert(_val(src, tmp_path / "fail", on_error="fail", **opts))
    assert err.value.path == bad
    assert "crashes the worker" in str(err.value) and "--on-error skip" in str(err.value)
    summary = convert(_val(src, tmp_path / "skip", **opts))
    assert summary.skipped == [(bad, CRASH_REASON)]
    assert summary.samples["val"]["written"] == len(items) - 1
    verify(str(tmp_path / "skip"))


def test_losing_the_ray_head_says_so_and_a_rerun_resumes(src, ray_local, tmp_path):
    """The cluster's head (its GCS) dies mid-run: the run ends within seconds saying the cluster was lost
    and that rerunning resumes; the rerun, on a cluster that is back, finishes with the same bytes."""
    from ray.cluster_utils import Cluster

    from gpufeed.convert.scheduler import EXIT_CLUSTER_LOST

    ref = tmp_path / "ref"
    convert(options(src, ref, workers=1, shard_size=1))
    out = str(tmp_path / "out")
    args = cli_args(src, out, "--workers", "1", "--shard-size", "1")
    # Not connected from this process: a lost head would end this process too.
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1})
    try:
        address = cluster.address
        from gpufeed.convert.faults import TEST_FAULTS_ENV

        # Each input takes 0.1 s longer: the run is still busy when its head is gone.
        proc = cli(args, address, env={**os.environ, "GPUFEED_CLUSTER_LOST_S": "0",
                                       TEST_FAULTS_ENV: '{"delay_s": 0.1}'})
        deadline = time.time() + 120
        while journal_shards(out) < 1 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, _finish(proc)
        proc.send_signal(signal.SIGSTOP)
        cluster.head_node.kill_gcs_server()
        proc.send_signal(signal.SIGCONT)
        code, _, err = _finish(proc, timeout=90)
        assert code == EXIT_CLUSTER_LOST, err
        assert "lost the Ray cluster at" in err and "rerun the same command to resume" in err
    finally:
        cluster.shutdown()
    code, _, err = _finish(cli(args, ray_local.get_runtime_context().gcs_address))
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(ref)


def _local_run(src, out, *extra):
    """The command line converting in local processes (the default executor), each input 0.3 s slower so the
    run is busy when the test signals it."""
    import json

    from gpufeed.convert.faults import TEST_FAULTS_ENV

    env = dict(os.environ, **{TEST_FAULTS_ENV: json.dumps({"delay_s": 0.3})})
    return cli(cli_args(src, out, "--workers", "2", "--shard-size", "2", *extra), env=env)


def _busy(proc, out):
    wait_for_shards(proc, out, 1, timeout=60)
    assert proc.poll() is None, _finish(proc)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 3  # the fork server, its processes (and the resource tracker)
    return children


def _gone(children, within=20.0) -> list:
    """The processes among ``children`` still running after ``within`` seconds."""
    deadline = time.time() + within
    alive = children
    while alive and time.time() < deadline:
        alive = [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return [(c.pid, c.cmdline()) for c in alive]


def test_a_driver_killed_outright_takes_its_local_processes_with_it(src, tmp_path):
    """kill -9 of the driver: its fork server and local processes end too, and a pipe they inherited (`| tee`)
    reaches its end, instead of ~200 MB of processes waiting forever on a queue nobody writes."""
    out = str(tmp_path / "out")
    proc = _local_run(src, out)
    children = _busy(proc, out)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=20)  # EOF on its stdout and stderr: nothing holds them any more
    assert _gone(children) == []


def test_main_called_from_python_leaves_the_callers_sigterm_handler(tmp_path):
    """gpufeed's command line turns SIGTERM into Terminated while a command runs; called from Python (a test, a
    notebook) it puts the caller's handler back, so processes the caller forks later do not inherit it."""
    from gpufeed.cli import main

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(["verify", str(tmp_path / "nothing")]) == 2
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def _sigterm_caught(pid: int) -> bool:
    caught = int(open(f"/proc/{pid}/status").read().split("SigCgt:")[1].split()[0], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _pid(_):
    return os.getpid()


def _mark(value: str) -> None:
    os.environ["GPUFEED_TEST_POOL"] = value


def _marked(_) -> str | None:
    return os.environ.get("GPUFEED_TEST_POOL")


def test_the_pools_the_benchmarks_fork_end_when_terminated(tmp_path):
    """bench read, bench feed and the CPU decode ceiling fork their pools with fork_pool: under a handler that
    raises (a Ray driver's SystemExit) each worker has SIGTERM at its default, so terminate() ends it, and the
    pool's own initializer still runs."""
    import sys

    from gpufeed.machine import fork_pool

    before = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    try:
        pool = fork_pool(2, initializer=_mark, initargs=("1",))
        pids = set(pool.map(_pid, range(8), chunksize=1))
        assert pids and not any(_sigterm_caught(p) for p in pids)
        assert set(pool.map(_marked, range(4))) == {"1"}
        pool.terminate()
        pool.join()
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    finally:
        signal.signal(signal.SIGTERM, before)


def _default_then_wait() -> None:
    from gpufeed.machine import default_sigterm

    default_sigterm()
    time.sleep(60)


def test_a_pool_terminated_while_its_workers_start_ends_them_all():
    """terminate() right after fork_pool, each worker still in the fork's own hooks with this process's handler
    (which raises SystemExit): that handler would run where Python ignores what it raises, and the worker would go
    on to wait for good on the queue's lock that terminate() holds. SIGTERM is held until the worker has its
    default, so each ends and terminate() returns."""
    import sys

    from gpufeed.machine import fork_pool

    before = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    with slow_child_start():
        pool = fork_pool(2)
    procs = list(pool._pool)
    done = threading.Event()
    try:
        threading.Thread(target=lambda: (pool.terminate(), done.set()), daemon=True).start()
        ended = done.wait(30)
        alive = [p.pid for p in procs if p.is_alive()]
        assert ended and not alive, f"workers {alive} outlived terminate()"
    finally:
        signal.signal(signal.SIGTERM, before)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # so that the terminating thread can finish
        done.wait(30)


def test_a_process_started_under_sigterm_held_ends_on_a_sigterm_sent_while_it_starts():
    """A benchmark's own processes (bench feed's ranks, the decode processes beside a training step) are started
    under sigterm_held and give SIGTERM its default first: a SIGTERM sent while one is still in the fork's hooks,
    with this process's raising handler, ends it once it has its default, instead of being lost there."""
    import multiprocessing
    import sys

    from gpufeed.machine import sigterm_held

    before = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    p = multiprocessing.get_context("fork").Process(target=_default_then_wait, daemon=True)
    try:
        with slow_child_start(), sigterm_held():
            p.start()
        p.terminate()
        p.join(30)
        assert not p.is_alive() and p.exitcode == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before)
        if p.is_alive():
            p.kill()
            p.join()


def test_sigterm_stops_like_ctrl_c(src, tmp_path):
    ref = tmp_path / "ref"
    convert(options(src, ref, workers=1, shard_size=2))
    out = str(tmp_path / "out")
    proc = _local_run(src, out)
    children = _busy(proc, out)
    proc.send_signal(signal.SIGTERM)
    code, _, err = _finish(proc, timeout=30)
    # (and warnings: what the conversion's state holds, tests/test_clean.py; where shards converted out of order
    # were left waiting in memory, the test below)
    said = [line for line in err.strip().splitlines() if not line.startswith("warning: ")]
    assert code == 143 and said == ["gpufeed: terminated (SIGTERM); rerun the same command to resume"], err
    assert _gone(children) == []
    from gpufeed.convert.sinks import memory_spool_dir

    assert _temporaries(out) == [] and _lock_free(memory_spool_dir(out))
    code, _, err = _finish(_local_run(src, out))
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(ref)


def test_a_stopped_run_says_what_memory_its_kept_spools_hold_and_its_advice_frees_it(src, tmp_path):
    """Shard 0 stalled, later shards converted and journalled wait in memory for it to be appended before them:
    a SIGTERM then leaves them for the rerun, and the run says how much memory they hold and how to free it
    without one. Following that advice, the rerun converts them again, to the same bytes."""
    import json

    from gpufeed.convert.faults import TEST_FAULTS_ENV
    from gpufeed.convert.progress import size_text
    from gpufeed.convert.sinks import memory_spool_dir

    ref = tmp_path / "ref"
    convert(options(src, ref, workers=1, shard_size=2))
    out = str(tmp_path / "out")
    env = dict(os.environ, **{TEST_FAULTS_ENV: json.dumps({"stall_shard": [0, 30]})})
    proc = cli(cli_args(src, out, "--workers", "2", "--shard-size", "2"), env=env)
    wait_for_shards(proc, out, 2, timeout=60)
    assert proc.poll() is None, _finish(proc)
    proc.send_signal(signal.SIGTERM)
    code, _, err = _finish(proc, timeout=30)
    assert code == 143, err
    folder = memory_spool_dir(out)
    kept = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    warning = [line for line in err.splitlines() if line.startswith("warning: ") and "in memory" in line]
    assert warning == [f"warning: {size_text(kept)} of converted shards stay in memory in {folder} for the rerun, "
                       "which takes them instead of converting them again; to free that memory without a rerun: "
                       f"rm -r {folder}"], err
    assert kept > 0 and err.splitlines()[-1] == "gpufeed: terminated (SIGTERM); rerun the same command to resume"
    subprocess.run(["rm", "-r", folder], check=True)
    code, _, err = _finish(cli(cli_args(src, out, "--workers", "2", "--shard-size", "2")))
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(ref)


def test_a_join_killed_midway_keeps_the_earlier_split_and_its_rerun_finishes_both(src, tmp_path):
    """A run adding --split val to a destination holding train, killed: train's files stay (the journal keeps
    the manifest that proves them), and the rerun writes a manifest of both splits."""
    ref = tmp_path / "ref"
    convert(options(src, ref, workers=1, shard_size=2))
    out = str(tmp_path / "out")
    code, _, err = _finish(cli(cli_args(src, out, "--workers", "1", "--shard-size", "2", "--split", "train")))
    assert code == 0, err
    args = cli_args(src, out, "--workers", "1", "--shard-size", "2", "--split", "val")
    _start_and_kill(args, None, out, after=1)
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    code, _, err = _finish(cli(args))
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(ref)
    verify(out)
    # Killed again, then rerun afresh (--no-resume): the journal still holds what val joins, so train stays listed.
    out2 = str(tmp_path / "out2")
    assert _finish(cli(cli_args(src, out2, "--workers", "1", "--shard-size", "2", "--split", "train")))[0] == 0
    args2 = cli_args(src, out2, "--workers", "1", "--shard-size", "2", "--split", "val")
    _start_and_kill(args2, None, out2, after=1)
    code, _, err = _finish(cli([*args2, "--no-resume"]))
    assert code == 0, err
    assert tree_bytes(out2) == tree_bytes(ref)
    verify(out2)


def test_the_resource_tracker_adds_no_lines_after_a_stopped_run():
    """multiprocessing's resource tracker, started by the command line's process, prints nothing of its own
    at the end: a semaphore it cleans up after a stop is its bookkeeping, not something to tell the user."""
    import subprocess
    import sys

    code = ("from gpufeed.cli import quiet_helpers; quiet_helpers()\n"
            "from multiprocessing import resource_tracker\n"
            "resource_tracker.register('/mp-gpufeed-test-none', 'semaphore')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # Without it the same script would print the tracker's two warnings (what a stopped run printed).
    plain = subprocess.run([sys.executable, "-c", code.split("\n", 1)[1]], capture_output=True, text=True, timeout=60)
    assert "leaked semaphore" in plain.stderr
