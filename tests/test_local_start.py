"""Shards converted by local processes (scheduler._LocalStart): every shard (``--executor pool``, Ray started
only for a shard they fail), or those before a fresh local Ray runtime is up (``--executor ray``).

Every other conversion test joins the session's Ray runtime, which is up already, so nothing runs locally
there; these runs start their own runtime in a child process (``gpufeed convert`` without ``--address``),
as users do. Output must be the same bytes as the session runtime writes, and a crash in a local process
must end as it does on Ray: the input found by bisection and skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from convert_fixtures import cli, cli_args, options, tree_bytes
from gpufeed.convert.engine import convert
from gpufeed.convert.faults import TEST_FAULTS_ENV
from gpufeed.convert.worker import CRASH_REASON
from gpufeed.convert.verify import verify


def _manifest(out) -> dict:
    with open(os.path.join(out, "manifest.json")) as f:
        return json.load(f)


def _run(args, **kw):
    proc = cli(args, **kw)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    return stdout.decode(), stderr.decode()


def test_shards_run_locally_give_the_same_bytes_and_start_no_ray(src, ray_local, tmp_path):
    ref = tmp_path / "ref"
    convert(options(src, ref))  # the session's runtime: every shard on Ray
    out = str(tmp_path / "out")
    ray_tmp = tempfile.mkdtemp(prefix="gf-ray-", dir="/tmp")  # where a Ray started by the run would live
    stdout, stderr = _run(cli_args(src, out), env={**os.environ, "RAY_TMPDIR": ray_tmp})
    # No shard failed, so no Ray runtime was started for one.
    assert not os.listdir(ray_tmp) and "ray_ready" not in _manifest(out)["timings"]["timeline"]
    shutil.rmtree(ray_tmp, ignore_errors=True)
    timeline = _manifest(out)["timings"]["timeline"]
    # --executor pool (the default): the local processes convert every shard, Ray none.
    shards = sum(p["shards"] for p in _manifest(out)["splits"].values())
    assert timeline["shards_converted_locally"] == timeline["local_shards"] == shards, timeline
    # When the last local process was ready (its warm-up done), on the run's clock.
    assert 0 < timeline["local_processes_started"] <= timeline["shards_done"], timeline
    assert "ray_shards" not in timeline and "shards_converted_before_ray" not in timeline
    # The driver's appends to the split outputs and, on the syncing threads beside them, the waits for the
    # .rec's fsyncs (LMDB syncs as it writes), the writeback handed to the kernel and the journal's writes.
    assert timeline["driver_commit_s"] > 0 and timeline["driver_commit_sync_s"] > 0, timeline
    assert timeline["driver_commit_writeback_s"] >= 0 and timeline["driver_commit_journal_s"] > 0, timeline
    # And the appending threads' own CPU time within them (the copies; waits excluded).
    assert 0 < timeline["driver_commit_cpu_s"] <= timeline["driver_commit_s"] + 0.01, timeline
    # And the part they waited for a core.
    off_core = timeline["driver_commit_s"] - timeline["driver_commit_cpu_s"]
    assert 0 <= timeline["driver_commit_run_queue_s"] <= off_core + 0.01, timeline
    # The driver's CPU: the main thread's, within every thread's (the commits' among them).
    assert 0 < timeline["driver_main_cpu_s"] <= timeline["driver_cpu_s"], timeline
    assert timeline["driver_main_cpu_s"] + timeline["driver_commit_cpu_s"] <= timeline["driver_cpu_s"] + 0.05
    assert tree_bytes(out) == tree_bytes(ref)
    verify(out)
    assert "\x1b[" not in stderr + stdout  # no raw (coloured) Ray lines


def _processes_naming(text: str) -> list[str]:
    """Command lines of this machine's processes that contain ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd[:200]}")
    return found


def test_shards_split_between_local_processes_and_ray_are_all_there(src, ray_local, tmp_path):
    """Slow inputs keep the local processes busy until Ray is up, so shards finish on both sides, often
    several at once: every shard is journalled and committed once, and the bytes are the reference's. The
    runtime the run started is gone when it exits (its monitor, stopped outright, included)."""
    ref = tmp_path / "ref"
    convert(options(src, ref, shard_size=1))
    out = str(tmp_path / "out")
    ray_tmp = tempfile.mkdtemp(prefix="gf-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, TEST_FAULTS_ENV: json.dumps({"delay_s": 0.5}), "RAY_TMPDIR": ray_tmp}
    _run(cli_args(src, out, "--shard-size", "1", "--executor", "ray"), env=env)
    assert tree_bytes(out) == tree_bytes(ref)
    verify(out)
    assert _manifest(out)["timings"]["timeline"].get("ray_ready"), "Ray never came up: nothing was shut down"
    deadline = time.time() + 10  # processes SIGKILLed a moment ago may still be being reaped
    while (left := _processes_naming(ray_tmp)) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, left
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_local_process_crash_hands_the_shard_to_ray_which_finds_the_input(src, ray_local, tmp_path):
    from gpufeed.pipelines import open_source

    bad = open_source("imagenet", src).items("train")[3].origin
    env = {**os.environ, TEST_FAULTS_ENV: json.dumps({"crash_on": bad})}
    out = str(tmp_path / "out")
    _run(cli_args(src, out, "--split", "train", "--task-retries", "1"), env=env)
    ref = tmp_path / "ref"
    convert(options(src, ref, splits=("train",)))
    got, want = _manifest(out), _manifest(ref)
    assert sorted(map(tuple, got["skipped"])) == sorted([*map(tuple, want["skipped"]), (bad, CRASH_REASON)])
    assert got["splits"]["train"]["written"] == want["splits"]["train"]["written"] - 1
    verify(out)


def _die(job, items):
    os._exit(3)


def test_a_pool_broken_before_its_failure_is_read_hands_every_later_shard_to_ray():
    """A local process dies, and the driver submits again before it has read that shard's failure: the pool
    is broken by then, so the shards wait for Ray, in order, instead of the submit raising out of the run."""
    import concurrent.futures
    from types import SimpleNamespace

    from gpufeed.convert.scheduler import Tasks, _LocalStart

    def job(start):
        return SimpleNamespace(plan=SimpleNamespace(start=start))

    local = _LocalStart(2, _die)
    try:
        assert local.submit(job(0), [])
        concurrent.futures.wait(list(local.futures))  # broken now; nobody asked done() yet
        opts = SimpleNamespace(task_retries=0, workers=2, on_error="fail", pool_converts=True, out="/tmp/out")
        tasks = Tasks(lambda block: None, _die, opts, lambda plan: [], local=local)
        later = [job(1), job(2)]
        tasks.pending.extend(later)
        tasks.submit()
        assert list(tasks.pending) == later and not local.usable
        assert tasks._local_result(5) is None  # the dead one's failure: back to the front of the line
        assert [j.plan.start for j in tasks.pending] == [0, 1, 2]
    finally:
        local.close(kill=True)
    assert not local.submit(job(3), [])  # closed: refused, not raised


def _short(job, items):
    time.sleep(0.2)
    return {"start": job.plan.start}


def test_the_local_processes_have_their_next_shards_waiting_so_none_idles_between_shards():
    """Beyond one shard a process, queued_ahead(workers) more wait in the pool's queue: a process that finishes
    takes the next at once. Never more: the commit window and the last wave count on it. Every shard still comes back."""
    from types import SimpleNamespace

    from gpufeed.convert.scheduler import Tasks, _LocalStart, queued_ahead

    assert queued_ahead(2) == 1 and queued_ahead(64) == 8
    local = _LocalStart(2, _short)
    try:
        opts = SimpleNamespace(task_retries=0, workers=2, on_error="fail", pool_converts=True, out="/tmp/out")
        tasks = Tasks(lambda block: None, _short, opts, lambda plan: [], local=local)
        tasks.pending.extend(SimpleNamespace(plan=SimpleNamespace(start=i)) for i in range(6))
        tasks.submit()
        assert len(local.futures) == 3 and len(tasks.pending) == 3
        done = []
        while tasks:
            job, result = tasks.next()
            assert len(local.futures) <= 3
            done.append(result["start"])
        assert sorted(done) == list(range(6))
    finally:
        local.close()


def test_a_bad_input_under_fail_ends_the_run_from_the_pool_without_starting_ray(src, tmp_path):
    """A local shard's own error (a truncated JPEG under --on-error fail) is the error Ray would end the run
    with: it ends the run at once, naming the input, and no Ray runtime is started to be told it again."""
    out = str(tmp_path / "out")
    ray_tmp = tempfile.mkdtemp(prefix="gf-ray-", dir="/tmp")
    args = [a for a in cli_args(src, out) if a not in ("--on-error", "skip")] + ["--on-error", "fail"]
    proc = cli(args, env={**os.environ, "RAY_TMPDIR": ray_tmp})
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode != 0
    text = stderr.decode()
    assert "truncated" in text and ".JPEG" in text and "Traceback" not in text, text[-2000:]
    assert not os.listdir(ray_tmp)
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    shutil.rmtree(ray_tmp, ignore_errors=True)


def _sleep(job, items):
    time.sleep(60)


def _sleep_ignoring_sigterm(job, items):
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def test_a_stop_ends_the_pools_processes_and_its_thread_before_it_returns():
    """close(kill=True) mid-shard: every process of the pool is gone and so is the executor's manager thread, which
    the interpreter's exit hook would otherwise wake through a pipe closed by then (a stopped command's stderr
    got "Exception ignored ... Bad file descriptor"). A process that ignores SIGTERM is killed."""
    import concurrent.futures.process
    import threading
    from types import SimpleNamespace

    from gpufeed.convert.scheduler import KILL_GRACE_S, _LocalStart

    for fn in (_sleep, _sleep_ignoring_sigterm):
        local = _LocalStart(2, fn)
        assert local.submit(SimpleNamespace(plan=SimpleNamespace(start=0)), [])
        procs = []
        deadline = time.time() + 30
        while time.time() < deadline and not procs:  # the shard has started in a process of the pool
            procs = [p for p in (local.pool._processes or {}).values() if p.is_alive()]
            time.sleep(0.1)
        time.sleep(0.5)
        started = time.monotonic()
        local.close(kill=True)
        assert time.monotonic() - started < KILL_GRACE_S + 10
        assert procs and not any(p.is_alive() for p in procs)
        assert not [t for t in threading.enumerate()
                    if isinstance(t, concurrent.futures.process._ExecutorManagerThread)]


def test_the_local_processes_run_below_the_driver_so_its_commits_get_a_core():
    """The pool's processes add WORKER_NICE to the driver's niceness: the driver's commit thread, which copies every
    shard into the split's ordered output, then gets a core when it needs one (32 workers on 32 cores kept it
    waiting 3.9-4.1 s of a 12-14 s commit; results/convert-node-h200x2.txt, session 19)."""
    import concurrent.futures

    from gpufeed.convert.scheduler import WORKER_NICE, _LocalStart

    local = _LocalStart(1, os.getpriority)
    try:
        assert local.submit(os.PRIO_PROCESS, 0)  # the job and its items: getpriority's two arguments
        (future,) = concurrent.futures.wait(list(local.futures)).done
        assert future.result() == min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)
    finally:
        local.close()


def test_every_local_process_is_started_while_the_driver_lists():
    """A pool starts a process for a task only where none is idle, and a warm-up task is over in microseconds:
    each warm-up task now waits for the pool's other processes, so the warm-up starts every one of them (before,
    64 warm-up tasks started 19 processes, and the driver forked the rest as it handed out its first shards)."""
    import concurrent.futures

    from gpufeed.convert.scheduler import _LocalStart

    made = time.time()
    local = _LocalStart(6, os.getpid)
    try:
        deadline = time.monotonic() + 60
        while len(local.warming) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        done, _ = concurrent.futures.wait(local.warming, timeout=60)
        assert len({f.result()[0] for f in done}) == 6  # six warm-up tasks, six processes
        # When the last was ready: after the pool was made, and no later than now.
        assert made <= local.started_at() <= time.time()
    finally:
        local.close()


_SERVER_SCRIPT = """
import multiprocessing, os
if __name__ == "__main__":
    import marker_at_exit  # this process's own exit handler: runs as usual
    import gpufeed.convert.forkserver  # imported by a driver, it changes nothing about the driver's exit
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["marker_at_exit", "gpufeed.convert.forkserver"])
    with ctx.Pool(1) as pool:
        print(pool.apply(os.getpid), os.getpid(), pool.apply(os.getppid), flush=True)
"""


def test_the_fork_server_leaves_without_tearing_its_interpreter_down_once_the_driver_is_gone(tmp_path):
    """The fork server holds the driver's stdout and stderr, so a reader of them (``| tee``, a benchmark's pipe)
    waits for it after the driver has exited: it leaves by ``os._exit`` once its output is flushed, which skips
    the exit handlers registered before it (here a preloaded module's marker); the driver's own exit, which
    imported the same module, runs them as usual."""
    import subprocess
    import sys

    helpers = tmp_path / "helpers"
    helpers.mkdir()
    (helpers / "marker_at_exit.py").write_text(
        "import atexit, os\n"
        f"open(os.path.join({str(tmp_path)!r}, f'imported-{{os.getpid()}}'), 'w').close()\n"
        f"atexit.register(lambda: open(os.path.join({str(tmp_path)!r}, f'exited-{{os.getpid()}}'), 'w').close())\n")
    path = os.pathsep.join(filter(None, [str(helpers), os.environ.get("PYTHONPATH")]))  # the server's too
    proc = subprocess.run([sys.executable, "-c", _SERVER_SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr
    driver, server = int(proc.stdout.split()[1]), int(proc.stdout.split()[2])
    # communicate() returned: every holder of the pipes has gone, the server included
    assert sorted(p.name for p in tmp_path.glob("imported-*")) == sorted([f"imported-{driver}", f"imported-{server}"])
    assert sorted(p.name for p in tmp_path.glob("exited-*")) == [f"exited-{driver}"]
