"""Where a conversion's shards run: local processes (:class:`_LocalStart`), Ray tasks (:class:`Tasks`), and
Ray itself, started or joined on a thread while the driver lists (:class:`RayStart`).

The driver hands :class:`Tasks` its shard jobs and takes back one finished shard at a time. At most
``--workers`` run at once; a shard whose worker dies on every retry is bisected with probe tasks down to the
one input that kills the worker. Every failure reaches the driver as one gpufeed error (:func:`_unwrap`), and
a Ray cluster whose head stops answering ends the run with a line that says how to resume
(:class:`_ClusterWatch`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections import deque

from gpufeed.convert import forkserver
from gpufeed.convert.options import ConvertOptions
from gpufeed.convert.plan import ShardPlan
from gpufeed.convert.worker import probe_items, run_shard, warm_worker
from gpufeed.errors import ConfigError, GpufeedError, InputError, OutputError


def ray_initialized() -> bool:
    """Whether this process already runs Ray, without importing it (~0.5-1 s, which the driver spends on
    the thread that starts Ray, not before it lists)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _open_ray(options: ConvertOptions):
    """Connect to Ray: reuse a runtime already initialised in this process, else start or join one.
    Returns ``(ray, started_here)``."""
    import logging

    if options.address:
        _token_auth_if_available()  # before Ray is imported: its core reads the mode once
    import ray

    if ray.is_initialized():
        return ray, False
    env = forkserver.worker_env()
    try:
        if options.address:
            # A cluster's workers are started by raylets on other machines: only runtime_env reaches them.
            ray.init(address=options.address, logging_level=logging.ERROR, log_to_driver=False,
                     runtime_env={"env_vars": env})
        else:
            # A runtime of our own inherits this process's environment (raylet, then workers). A job-level
            # runtime_env here would cost ~1.5 s: Ray could not use the workers it prestarts.
            os.environ.update(env)
            # address="local": a new runtime even when `ray start` left a cluster address behind in /tmp/ray
            # or RAY_ADDRESS, which ray.init would otherwise join (and refuse num_cpus for).
            ray.init(address="local", num_cpus=options.workers, include_dashboard=False,
                     logging_level=logging.ERROR, log_to_driver=False, object_store_memory=512 << 20)
    except ConnectionError as e:
        if _auth_refused(e):
            raise ConfigError(f"the Ray cluster at {options.address} refused this client's authentication token "
                              "(token authentication is on by default for `ray start` clusters); copy the "
                              "cluster's token to ~/.ray/auth_token here or set RAY_AUTH_TOKEN (`ray "
                              "get-auth-token` on the head node prints it)") from e
        raise ConfigError(f"cannot reach the Ray cluster at {options.address} ({e}); start it with "
                          "`ray start --head` or check --address") from e
    return ray, True


#: Seconds a cluster's head may take to accept a connection before ``--address`` is called unreachable (Ray
#: itself retries for minutes, printing only its own "Failed to connect to GCS" lines).
CONNECT_TIMEOUT_S = 10.0
#: Seconds a local pool's process has to end after SIGTERM on a stop before it is killed.
KILL_GRACE_S = 2.0


def check_reachable(address: str) -> None:
    """Refuse an ``--address`` whose head accepts no connection, in seconds and in one line that says how to
    start one; and ``ray://`` without Ray's client installed. ``auto`` is resolved as Ray resolves it."""
    import socket

    if address.startswith("ray://"):
        try:
            import grpc  # noqa: F401  (what ray[client] adds)
        except ImportError:
            raise ConfigError(f"--address {address} connects through Ray Client, which is not installed here: "
                              "pip install 'ray[client]', or give the head's GCS address host:6379 (or auto "
                              "on a node of the cluster)") from None
        hostport, head = address[len("ray://"):], "ray start --head --ray-client-server-port=PORT"
    elif address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            hostport = canonicalize_bootstrap_address("auto")
        except Exception:
            return  # Ray says what it finds (or does not) itself
        if not hostport:
            raise ConfigError("--address auto: no Ray cluster runs on this machine (none in RAY_ADDRESS or "
                              "/tmp/ray); start one with `ray start --head`, or give its address")
        head = "ray start --head"
    else:
        hostport, head = address, "ray start --head --port=PORT"
    host, _, port = hostport.rpartition(":")
    try:
        port = int(port.split("/")[0])
    except ValueError:
        raise ConfigError(f"--address {address} is not host:port, ray://host:port or auto") from None
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        why = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e)).lower()
        raise ConfigError(f"--address {address}: no Ray cluster answers at {host}:{port} ({why}); start its head "
                          f"there with `{head.replace('PORT', str(port))}`, or check --address") from None


def _token_auth_if_available() -> None:
    """Send the Ray authentication token when one is at hand. A ``ray start`` cluster turns token
    authentication on by default, while a client joining it sends no token unless RAY_AUTH_MODE says
    ``token``: the join then fails with a GCS error. A client sending a token to a cluster without
    authentication still joins, so the mode is set wherever a token exists (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, or ``ray start``'s ~/.ray/auth_token) and the user has not chosen a mode."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
        os.environ["RAY_AUTH_MODE"] = "token"


def _auth_refused(err: BaseException) -> bool:
    """Whether Ray's failure to join was the cluster refusing the token (or its absence)."""
    seen = 0
    while err is not None and seen < 8:
        if "AuthenticationError" in type(err).__name__ or "InvalidAuthToken" in str(err):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _unwrap(err, sp: ShardPlan, items: list, retries: int, remote: bool = False) -> BaseException:
    """Turn what Ray raised for a shard into one clear gpufeed error (never a Ray traceback). ``remote``: the
    destination is an fsspec URL (then, and only then, a failure writing it may be its URL or network's)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        if isinstance(cause, GpufeedError):
            return cause
        if isinstance(cause, OSError):
            return OutputError(f"{getattr(cause, 'filename', None) or sp.id}: {cause.strerror or cause}; free "
                               "space or fix access to the destination, then rerun the same command to resume")
        first = items[0].origin if items else "?"
        check = "check the destination's URL, credentials and network, then " if remote else ""
        return GpufeedError(f"shard {sp.id} (inputs {first} ...) failed with {type(cause).__name__}: {cause}; "
                            f"{check}rerun the same command to resume (if it fails the same way again, please "
                            "report it with this line)")
    first = items[0].origin if items else "?"
    last = items[-1].origin if items else "?"
    return InputError(first, f"shard {sp.id} (inputs {first} .. {last}) crashed its Ray worker "
                             f"{retries + 1} times ({type(err).__name__}) and no single input crashes it alone",
                      "check the workers' memory and the Ray logs, then rerun the same command to resume")


def _crashed(err) -> bool:
    """Ray reports a dead worker (no exception of the task's own to carry)."""
    return not isinstance(getattr(err, "cause", None), BaseException)


#: Niceness the local processes add to their own: the driver's commit thread, which copies every shard into
#: a split's ordered output (a single ``.rec``, an LMDB) and so sets the pace of the run, gets a core the moment
#: it needs one, where 64 workers on 64 cores otherwise kept it waiting.
WORKER_NICE = 10


def queued_ahead(workers: int) -> int:
    """Shards handed to the local processes beyond one each. They wait, pickled, in the pool's queue, so a
    process that finishes a shard takes the next one at once, instead of idling while the driver hears of the
    finish and submits another: ~15 ms a shard at 64 workers, 14-55 worker-seconds in a 21 s run (session 19).
    Any process takes any waiting shard, so the last wave ends as it would without them."""
    return max(1, workers // 8)


class _LocalStart:
    """Shards converted by local processes: from the moment the plan exists, not once the local Ray runtime
    has started (~4-7 s on an idle 16-core machine, 13-22 s beside 16 busy processes).

    The processes come from a fork server that has imported the worker side already (each starts in milliseconds)
    and run :func:`run_shard` itself: the same bytes as a Ray worker writes, journalled and committed alike.
    With ``--executor ray`` nothing is submitted here once Ray is up, and the pool ends when its last shard is
    back; with ``pool`` (the default) it converts every shard, and Ray is started only if one fails. A shard's
    own gpufeed error (a bad input under ``--on-error fail``, a full disk) ends the run as Ray would end it,
    with that error; any other failure (a crashed process breaking the pool) hands the shard back to Ray, whose
    retries, bisection and error messages then deal with it as with any other shard, and Ray takes the rest
    of the run."""

    def __init__(self, workers: int, fn):
        import concurrent.futures

        self.fn = fn
        # Its server may be running already: the command line starts it first thing (forkserver.start).
        ctx = forkserver.context()
        try:
            started = ctx.Barrier(workers)  # every process waits at it in its warm-up task: all are started
        except (OSError, ImportError):  # no POSIX semaphores here: processes start as shards need them
            started = None
        self.pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx,
                                                           initializer=forkserver.worker_init,
                                                           initargs=(os.getpid(), WORKER_NICE, started))
        self.futures: dict = {}  # future -> job
        self.usable = True
        self.shards = 0  # finished here
        self.warming: list = []  # the warm-up tasks' futures (each gives its process's id and ready time)
        # Started while the driver lists: the fork server imports OpenCV and the formats, processes fork.
        threading.Thread(target=self._warm, args=(workers,), name="gpufeed-local-warm", daemon=True).start()

    def _warm(self, workers: int) -> None:
        try:
            for _ in range(workers):
                self.warming.append(self.pool.submit(warm_worker))
        except (RuntimeError, AttributeError):
            pass  # closed already (the run needed no workers)

    def started_at(self) -> float | None:
        """When the last of the pool's processes was ready (``time.time()``), once every warm-up task is done;
        None before, or where one failed or none ran."""
        warming = list(self.warming)
        if not warming or not all(f.done() and not f.cancelled() and f.exception() is None for f in warming):
            return None
        return max(f.result()[1] for f in warming)

    def submit(self, job, items) -> bool:
        """Start ``job`` here; false (and unusable from now on) where the pool cannot take it: a process of
        it died before its future said so (the pool is broken then), or it was closed."""
        if not self.usable or self.pool is None:
            return False
        try:
            future = self.pool.submit(self.fn, job, items)
        except RuntimeError:  # BrokenProcessPool, or "cannot schedule new futures after shutdown"
            self.usable = False
            return False
        self.futures[future] = job
        return True

    def done(self, timeout: float | None):
        """One future finished within ``timeout`` seconds, ``(future, job)``, or ``None``."""
        import concurrent.futures

        if not self.futures:
            return None
        finished, _ = concurrent.futures.wait(list(self.futures), timeout=timeout,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
        if not finished:
            return None
        future = min(finished, key=lambda f: self.futures[f].plan.start)  # any order would do; this one is fixed
        return future, self.futures.pop(future)

    def close(self, kill: bool = False) -> None:
        """End the pool (again: a no-op): after its last shard, or ``kill`` at once (a stop, or an error
        elsewhere; no shard is waited for, its files are atomic and unjournalled).

        A kill still ends the pool's processes and its manager thread before it returns: an executor shut down
        without waiting keeps its thread, which the interpreter's exit hook then wakes through a pipe that may
        be closed by then ("Exception ignored ... Bad file descriptor" on a stopped command's stderr)."""
        self.usable = False
        if self.pool is None:
            return
        pool, self.pool = self.pool, None
        if kill:
            procs = list((getattr(pool, "_processes", None) or {}).values())
            for proc in procs:
                proc.terminate()
            deadline = time.monotonic() + KILL_GRACE_S  # one grace for them all
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            self.futures.clear()
        pool.shutdown(wait=True, cancel_futures=True)


class Tasks:
    """Shard tasks: at most ``workers`` running (and :func:`queued_ahead` more waiting in the local processes'
    queue), more only while ``admit(in flight)`` allows.

    ``ray_ready(block)`` gives the Ray module once its runtime is up (``None`` while it starts and ``block``
    is false); until then shards run in ``local`` (a :class:`_LocalStart`), when given, and for the whole run
    where ``options.pool_converts``: Ray then takes only the shards the local processes fail (asking
    ``ray_ready`` for it starts it).

    A shard whose worker dies on every retry is bisected with probe tasks (no retries) down to the one
    input that kills the worker: ``--on-error fail`` stops naming it, ``skip`` reruns the shard without it.
    """

    def __init__(self, ray_ready, fn, options, items_of, admit=None, local: _LocalStart | None = None):
        self.ray_ready, self.fn, self.ray = ray_ready, fn, None
        self.local = local
        # The pool converts for the whole run (ConvertOptions.pool_converts), Ray only what it fails.
        self.pool_converts = local is not None and options.pool_converts
        self.retries = options.task_retries
        self.remote = "://" in options.out and not options.out.startswith("file://")
        self.workers = options.workers
        self.on_error = options.on_error
        self.items_of = items_of  # ShardPlan -> its items
        self.admit = admit or (lambda inflight: True)
        self.pending = deque()
        self.inflight = {}
        self.ahead = queued_ahead(self.workers) if local is not None else 0
        #: Seconds during which a worker was free and shards were waiting, but the commit window (``admit``)
        #: held them back: the split sinks' commits falling behind the workers.
        self.held_s = 0.0
        self._held_since = None

    def _ray(self, block: bool):
        if self.ray is None:
            ray = self.ray_ready(block)
            if ray is None:
                return None
            self.ray = ray
            self.task = ray.remote(self.fn).options(num_cpus=1, max_retries=self.retries, retry_exceptions=False)
            self.probe = ray.remote(probe_items).options(num_cpus=1, max_retries=0, retry_exceptions=False)
            if self.local is not None and not self.pool_converts:
                self.local.usable = False  # Ray takes every shard from now on
        return self.ray

    def _local_inflight(self) -> int:
        return len(self.local.futures) if self.local is not None else 0

    def __bool__(self) -> bool:
        return bool(self.pending or self.inflight or self._local_inflight())

    def submit(self) -> None:
        while self.pending:
            running = len(self.inflight) + self._local_inflight()
            local = self.local is not None and self.local.usable
            if running >= self.workers + (self.ahead if local else 0):
                return
            if running and not self.admit(running):
                if self._held_since is None and running < self.workers:  # a process free, not just the queue
                    self._held_since = time.perf_counter()
                return
            if self._held_since is not None:
                self.held_s += time.perf_counter() - self._held_since
                self._held_since = None
            job = self.pending[0]
            if self.local is not None and (self.pool_converts or self._ray(block=False) is None):
                if self.local.submit(job, self.items_of(job.plan)):
                    self.pending.popleft()
                    continue
            if self._ray(block=False) is None or running >= self.workers:
                return  # next() waits for Ray, or for a task of it to end (the job stays first in line)
            self.pending.popleft()
            self.inflight[self.task.remote(job, self.items_of(job.plan))] = job

    def _local_result(self, timeout: float):
        """A shard finished locally ``(job, result)``, or ``None``; a failure goes back to the queue for Ray."""
        got = self.local.done(timeout)
        if got is None:
            return None
        future, job = got
        error = future.exception()
        if isinstance(error, GpufeedError):
            # The shard's own error (a bad input under --on-error fail, a full disk): Ray would end the run
            # with this same error (_unwrap), so it ends here, without starting Ray to be told it again.
            raise error
        if error is not None:
            # A dead process (the pool is broken then) or an unexpected error: from here on Ray takes every
            # shard, and its retries, bisection and messages deal with this one as with any other.
            self.local.usable = False
            self.pending.appendleft(job)
            return None
        self.local.shards += 1
        result = future.result()
        result["ran"] = "local"  # for the timeline's split of the workers' time (Ray's results say nothing)
        return job, result

    def next(self):
        """Wait for the next finished shard: ``(job, result)``. Raises one gpufeed error on failure."""
        while True:
            self.submit()
            if self._local_inflight():
                # Poll: Ray may come up (and take the next shards) while the local ones run.
                got = self._local_result(0 if self.inflight else 0.05)
                if got is not None:
                    return got
                if not self.inflight:
                    continue
            elif not self.inflight:
                self._ray(block=True)
                continue
            ready, _ = self.ray.wait(list(self.inflight), num_returns=1,
                                     timeout=0.05 if self._local_inflight() else None)
            if not ready:
                continue
            ref = ready[0]
            job = self.inflight.pop(ref)
            try:
                return job, self.ray.get(ref)
            except Exception as e:  # Ray wraps what the task raised, or reports a dead worker
                items = self.items_of(job.plan)
                if not _crashed(e):
                    raise _unwrap(e, job.plan, items, self.retries, self.remote) from None
                found = self._bisect(job, items)
                if found is None:
                    raise _unwrap(e, job.plan, items, self.retries, self.remote) from None
                index, item = found
                if self.on_error == "fail":
                    raise InputError(item.origin, f"this input crashes the worker (shard {job.plan.id} failed "
                                                  f"{self.retries + 1} times; bisecting its inputs isolated it)",
                                     "skip it with --on-error skip, or remove it, then rerun the same command "
                                     "to resume") from None
                self.pending.appendleft(dataclasses.replace(job, exclude=(*job.exclude, index)))

    def _bisect(self, job, items):
        sp = job.plan
        pairs = [(i, it) for i, it in zip(range(sp.start, sp.stop), items) if i not in job.exclude]
        while len(pairs) > 1:
            half = len(pairs) // 2
            # A crash that needs a specific input is in the first half or else in the second; the last
            # input is confirmed on its own, so a crash that needs several inputs together is not blamed on one.
            pairs = pairs[:half] if self._crashes(job, pairs[:half]) else pairs[half:]
        return pairs[0] if pairs and self._crashes(job, pairs) else None

    def _crashes(self, job, pairs) -> bool:
        try:
            self.ray.get(self.probe.remote(job, pairs))
        except Exception as e:
            return _crashed(e)
        return False

    def cancel(self) -> None:
        """Stop waiting for the tasks in flight, and stop the local processes. Not ``ray.cancel``: a reply
        racing a cancellation aborts Ray's core in this process ("Tried to complete task that was not pending", Ray 2.60), where a Ctrl-C
        promises a clean stop. Ray ends the workers when this driver shuts its runtime down or leaves the
        cluster; a task that finishes first writes only atomic files nobody journalled, which the next run
        redoes (same bytes) or removes."""
        self.inflight.clear()
        self.pending.clear()
        if self.local is not None:
            self.local.close(kill=True)


#: Seconds Ray's control store (GCS) may stay unreachable before a run says the cluster is lost and stops
#: (Ray by itself waits 60 s, then ends the process with a line of its own).
CLUSTER_LOST_S = float(os.environ.get("GPUFEED_CLUSTER_LOST_S", 15))
#: The exit status of a run that lost its Ray cluster (2 is a bad input or option, 130 Ctrl-C).
EXIT_CLUSTER_LOST = 3


class _ClusterWatch:
    """Notices that the Ray cluster's head stopped answering (its GCS port refuses or times out for
    :data:`CLUSTER_LOST_S`) and ends the run with one line that says so and that rerunning resumes: every
    finished shard is already journalled, so nothing else needs saving."""

    def __init__(self, gcs_address: str, where: str):
        self.address, self.where = gcs_address, where
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpufeed-cluster-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import socket
        import sys

        host, _, port = self.address.rpartition(":")
        down_since = None
        while not self._stop.wait(1.0):
            try:
                socket.create_connection((host, int(port)), timeout=2).close()
                down_since = None
                continue
            except OSError:
                down_since = down_since or time.monotonic()
            if time.monotonic() - down_since >= CLUSTER_LOST_S:
                print(f"gpufeed: lost {self.where} (its head at {self.address} stopped answering for "
                      f"{CLUSTER_LOST_S:.0f} s); every finished shard is journalled: rerun the same command to "
                      "resume once the cluster is back", file=sys.stderr, flush=True)
                os._exit(EXIT_CLUSTER_LOST)

    def stop(self) -> None:
        self._stop.set()


def _stop_ray(ray) -> None:
    """Shut down a runtime started here. Its autoscaler monitor, which a single-machine runtime does not use,
    ignores Ray's polite SIGTERM until a 1 s timeout ends it (Ray 2.x): it is stopped outright first, so
    the run ends ~1 s sooner. Should Ray's internals change, the plain shutdown still runs."""
    try:
        ray._private.worker._global_node.kill_monitor(check_alive=False)
    except Exception:
        pass
    ray.shutdown()


class RayStart:
    """Ray started (or joined) in a thread, so its seconds of start-up overlap the driver's work (joining a
    cluster: from the start; a runtime of our own: once the driver has listed); :meth:`get` waits for it.
    The thread lives until :meth:`shutdown`: the processes Ray starts (GCS, raylet) die with the thread that
    started them. A run that turns out to need no
    workers (already complete) shuts down what it started. When the runtime is started here, ``local`` is a
    :class:`_LocalStart` warming up at the same time, which converts the first shards until Ray is up, or
    every shard it can (``options.pool_converts``): Ray is then begun only when a shard needs it (one the
    pool failed), and a run that needs none never starts it."""

    def __init__(self, options: ConvertOptions):
        self.options = options
        self._result = None
        self._error = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._watch = None
        # A runtime started here takes seconds: shards run in local processes meanwhile. Joining a cluster
        # (or a runtime this process has already) is quick, and the cluster is the point.
        self.local = (_LocalStart(options.workers, run_shard)
                      if options.local_start and not options.address and not ray_initialized() else None)
        if options.address and not ray_initialized():
            check_reachable(options.address)  # before the destination is touched: one line, in seconds
        self._thread = threading.Thread(target=self._run, name="gpufeed-ray", daemon=True)
        if self.local is None:
            self._thread.start()
        # else: :meth:`begin`, once the driver has listed. Importing and starting Ray is Python work that
        # holds the GIL the listing needs (120,000 files listed in 1.45 s beside it, 0.6-1.1 s alone), and
        # the local processes convert until Ray is up anyway.

    def begin(self) -> None:
        """Start Ray now, if it is not started yet."""
        if not self._thread.is_alive() and not self._ready.is_set():
            self._thread.start()

    def _run(self) -> None:
        try:
            self._result = _open_ray(self.options)
            ray, started = self._result
            if started:  # a runtime of our own: its workers are ours to warm up
                warm = ray.remote(warm_worker).options(num_cpus=1, max_retries=0)
                self._warm = [warm.remote() for _ in range(self.options.workers)]
        except BaseException as e:  # handed to the caller of get()
            self._error = e
        finally:
            self._ready.set()
        self._stop.wait()
        if self._result is not None and self._result[1]:
            _stop_ray(self._result[0])

    def ready(self) -> bool:
        """Whether :meth:`get` would return (or raise) at once."""
        return self._ready.is_set()

    def get(self, progress=None):
        """``(ray, started_here)``, once Ray is up."""
        self.begin()
        if not self._ready.is_set() and progress is not None:
            progress.phase("starting Ray" if not self.options.address else f"joining Ray at {self.options.address}")
        self._ready.wait()
        if self._error is not None:
            raise self._error
        if self._watch is None:
            ray = self._result[0]
            where = f"the Ray cluster at {self.options.address}" if self.options.address else "the local Ray runtime"
            self._watch = _ClusterWatch(ray.get_runtime_context().gcs_address, where)
        return self._result

    def stop(self) -> None:
        """Let Ray go down on its thread (~1-1.5 s: its processes are stopped one after another) while the
        driver finishes the outputs; :meth:`shutdown` waits for it."""
        if self.local is not None:
            self.local.close(kill=bool(self.local.futures))
        if not self._thread.is_alive() and not self._ready.is_set():
            self._ready.set()  # never begun (the run ended before it listed): nothing to stop
            return
        if self.options.address and not self._ready.is_set():
            # Still joining a cluster: nothing of it runs here to stop, and the join is not waited for (an
            # address that stopped answering would hold the run's end); the thread leaves once it is done.
            self._stop.set()
            return
        self._ready.wait()
        if self._watch is not None:
            self._watch.stop()  # before Ray goes down on purpose
            self._watch = None
        self._stop.set()

    def shutdown(self) -> None:
        self.stop()
        if self._thread.is_alive() and self._ready.is_set():
            self._thread.join()


def cap_workers(options: ConvertOptions, cpus: int, where: str, progress) -> ConvertOptions:
    """At most one worker per CPU that Ray can schedule: more would only queue (a cluster) or make the
    workers fight over cores (a local runtime told it has more CPUs than the machine)."""
    if options.workers <= cpus:
        return options
    if progress is not None:
        progress.warn(f"--workers {options.workers} is more than the {cpus} CPUs {where}; using {cpus}")
    return dataclasses.replace(options, workers=cpus)
