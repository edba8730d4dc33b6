"""Joining a Ray cluster that `ray start --head` started (``--address``): since Ray 2.5x such a cluster turns
token authentication on by default, and a client that sends no token is refused."""

from __future__ import annotations

import os
import subprocess
import sys

from convert_fixtures import cli_args
from gpufeed.bench.experiments.convert_node import ray_cluster
from gpufeed.convert.verify import verify


def _convert(args, env):
    return subprocess.run([sys.executable, "-m", "gpufeed", "convert", *args, "--no-progress"], capture_output=True,
                          text=True, env=env, timeout=300)


def test_convert_joins_a_ray_start_cluster_and_names_a_refused_token(src, tmp_path):
    # The child's environment as a user's shell has it: no auth mode chosen (this session's own Ray sets one).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    with ray_cluster(1) as address:
        out = str(tmp_path / "out")
        done = _convert([*cli_args(src, out, "--workers", "1"), "--address", address], env)
        assert done.returncode == 0, done.stderr[-3000:]
        verify(out)
        # A token the cluster does not know: one line that says so and how to fix it, not "cannot reach".
        wrong = _convert([*cli_args(src, str(tmp_path / "other"), "--workers", "1"), "--address", address],
                         {**env, "RAY_AUTH_TOKEN": "x" * 32})
    assert wrong.returncode != 0
    last = wrong.stderr.strip().splitlines()[-1]
    assert last.startswith("gpufeed: error: the Ray cluster at") and "authentication token" in last
    assert "RAY_AUTH_TOKEN" in last and "Traceback" not in wrong.stderr
