"""Shared fixtures. One local Ray runtime serves the whole test session (starting one costs seconds)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray runtime with 2 CPUs, started once per session and shut down at the end.

    Code under test that calls ``ray.init`` itself must notice ``ray.is_initialized()`` and reuse it.
    """
    import ray

    if not ray.is_initialized():
        # address="local": a new runtime, never one a `ray start` elsewhere left its address behind for.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 * 1024 * 1024,
                 runtime_env={"env_vars": {"PYTHONHASHSEED": "0"}})
    yield ray
    ray.shutdown()


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)


def pytest_configure(config):
    import tempfile

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # The session's own user cache (children inherit it): what a remote destination's run keeps there, and what a
    # run says of the states it finds there, then depend on the tests alone, never on this user's own runs.
    os.environ["XDG_CACHE_HOME"] = config._gpufeed_cache = tempfile.mkdtemp(prefix="gpufeed-tests-cache-")


def pytest_unconfigure(config):
    import shutil

    if getattr(config, "_gpufeed_cache", None):
        shutil.rmtree(config._gpufeed_cache, ignore_errors=True)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny synthetic ImageNet tree (convert_fixtures.synth_source), one per test module."""
    from convert_fixtures import synth_source

    return synth_source(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def address(ray_local):
    """The session's Ray runtime, for a CLI run in a child process to join (--address)."""
    return ray_local.get_runtime_context().gcs_address
