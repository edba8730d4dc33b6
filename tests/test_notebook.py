"""notebooks/storage_tiers.ipynb runs top to bottom on a small results file, so it cannot rot."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "storage_tiers.ipynb")
GPU_RESULTS = os.path.join(ROOT, "results", "gpu-h200.jsonl")


def test_notebook_executes_on_a_small_results_file(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # A slice of the committed H200 run: synthetic baselines, formats, an emulated tier, a read row.
    with open(GPU_RESULTS) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    keep = [r for r in rows if r["bench"] == "read" or r["params"].get("task") == "train"][:12]
    keep += [r for r in rows if r["bench"] == "read"]
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in keep))
    monkeypatch.setenv("GPUFEED_RESULTS", str(small))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"{len(keep)} rows from {small}" in text
    html = "\n".join(o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {}))
    assert "ResNet-50 train on NVIDIA H200" in html and "Published finding vs these results" in html
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3


def test_notebook_runs_from_any_directory_on_the_committed_results(tmp_path):
    """As a user runs it headless (nbconvert), from a directory that is not notebooks/, with no results file
    named: it finds the committed runs, conversion rows included."""
    import subprocess
    import sys

    pytest.importorskip("nbconvert")
    env = {k: v for k, v in os.environ.items() if k != "GPUFEED_RESULTS"}
    subprocess.run([sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute", "--output-dir",
                    str(tmp_path), "--ExecutePreprocessor.timeout=300", NOTEBOOK],
                   cwd=tmp_path, env=env, check=True, capture_output=True)
    with open(tmp_path / "storage_tiers.ipynb") as f:
        nb = json.load(f)
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"])
    assert "gpu-h200.jsonl" in text and "convert-tiers-h100.jsonl" in text and "'convert'" in text
